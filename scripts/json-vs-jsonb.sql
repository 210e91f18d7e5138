-- What storing a downstream's documents as `json` (kept as sent) instead of `jsonb` costs per
-- intent, and how long migration 0018 (receipts, result events and operator responses retyped
-- to `json`) takes per million rows (docs/benchmarks.md, "Documents kept as sent").
--
--   psql -h 127.0.0.1 -U postgres -X -q -f scripts/json-vs-jsonb.sql \
--        [-v rows=100000] [-v runs=5] [-v migration_rows=1000000] [-v db=json_vs_jsonb_scratch]
--
-- Run it from anywhere (the migrations are found beside this file). It needs a superuser
-- (CREATE DATABASE, CHECKPOINT, reading /proc/<backend>/stat for CPU time) and a Postgres on
-- this machine; it creates the scratch database `db` (dropped first if a broken run left it),
-- applies the ledger's migrations 0001-0017 there, and drops it at the end. About 7 minutes
-- with the defaults on 2 cores. psql reads this file as it goes: do not edit it during a run.
--
-- Per intent, in tables made as the migrations make them (LIKE operations / result_outbox: the
-- same columns, constraints and indexes, fillfactor 30 / 50), with the document columns as
-- each variant has them:
--   jsonb       before 0018 (Postgres re-encodes the document, and refuses one holding U+0000)
--   json        after 0018 (the text kept as sent, checked to be JSON)
--   jsonb+text  the other way to keep the bytes: the jsonb column and a text copy beside it
-- Each round (`runs` of them) of a variant inserts `rows` claimed operations (untimed), then
-- times, each as one statement over all rows (the backend's CPU time from /proc, the wall
-- clock, WAL bytes):
--   complete    the completion: UPDATE ... SET state = 'succeeded', receipt = $receipt::type
--               (a receipt of about 300 bytes shaped like the reference downstream's)
--   event       the result event: INSERT INTO the outbox ... $payload::type (about 700 bytes,
--               the receipt inside, shaped like the worker's events)
--   read        every event's payload read back as text, ten times (the status API, a relay's
--               claim)
-- and, after VACUUM FULL, both tables' total size (indexes included) per row. The order of the
-- variants rotates from round to round, and each figure is also printed as a ratio to jsonb in
-- the same round: on a shared machine compare those, and CPU rather than wall time.
--
-- Migration 0018: `migration_rows` finished operations (each with its receipt), as many
-- published result events and one operator response per thousand operations in the real
-- tables, then the migration file itself, each statement timed.
\set ON_ERROR_STOP on
\if :{?rows}
\else
\set rows 100000
\endif
\if :{?runs}
\else
\set runs 5
\endif
\if :{?migration_rows}
\else
\set migration_rows 1000000
\endif
\if :{?db}
\else
\set db json_vs_jsonb_scratch
\endif

SELECT current_database() AS home_db \gset
DROP DATABASE IF EXISTS :"db";
CREATE DATABASE :"db";
\c :"db"
SET client_min_messages = warning;

-- The ledger as the worker's migrations leave it before 0018.
\ir ../migrations/0001_ledger.sql
\ir ../migrations/0002_retry_budget_and_poison_guard.sql
\ir ../migrations/0003_operator_requests.sql
\ir ../migrations/0004_history_schedule.sql
\ir ../migrations/0005_retry_spend_operation.sql
\ir ../migrations/0006_retry_tokens.sql
\ir ../migrations/0007_send_marker_hot_fence.sql
\ir ../migrations/0008_history_per_statement.sql
\ir ../migrations/0009_trace_context.sql
\ir ../migrations/0010_operator_console.sql
\ir ../migrations/0011_history_of_left_versions.sql
\ir ../migrations/0012_fewer_index_entries.sql
\ir ../migrations/0013_room_for_hot_updates.sql
\ir ../migrations/0014_published_watermark.sql
\ir ../migrations/0015_outbox_link_without_trigger.sql
\ir ../migrations/0016_console_spent_ids.sql
\ir ../migrations/0017_accepted_operations.sql

-- One receipt and one result event per intent, as the worker and the reference downstream write
-- them (serde_json: no spaces), each different.
CREATE FUNCTION bench_receipt(i bigint) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT format('{"receipt_id":"rcpt-%s","idempotency_key":"north-shop:refund-%s","mode":"replay",'
                  '"resource":"refunds","arguments":{"order":"order-%s","amount_cents":%s,'
                  '"currency":"USD","reason":"damaged in transit","customer":"cus-%s"},'
                  '"created_at":"2026-12-06T07:%s:%s.%s+00:00"}',
                  i, lpad(i::text, 9, '0'), i, 100 + i % 90000, lpad((i * 7919 % 1000000)::text, 10, '0'),
                  lpad((i / 60 % 60)::text, 2, '0'), lpad((i % 60)::text, 2, '0'),
                  lpad((i * 104729 % 1000000000)::text, 9, '0'))
$$;
CREATE FUNCTION bench_event(i bigint) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT format('{"tenant":"north-shop","action_id":"refund-%s","tool":"refund","status":"succeeded",'
                  '"receipt":%s,"next_action":null,"attempts":1,"message":"The refund succeeded.",'
                  '"fingerprint":"%s","event_id":"%s","occurred_at":"2026-12-06T07:%s:%s.%sZ",'
                  '"verified_by":"dispatch","remote_id":"rcpt-%s"}',
                  lpad(i::text, 9, '0'), bench_receipt(i), md5(i::text) || md5((i + 1)::text),
                  md5((-i)::text)::uuid, lpad((i / 60 % 60)::text, 2, '0'),
                  lpad((i % 60)::text, 2, '0'), lpad((i % 1000)::text, 3, '0'), i)
$$;

CREATE TABLE bench_src AS
SELECT i AS id, 'refund-' || lpad(i::text, 9, '0') AS action_id, bench_receipt(i) AS receipt,
       'rcpt-' || i AS receipt_id, bench_event(i) AS payload
FROM generate_series(1, :rows) i;
ALTER TABLE bench_src ADD PRIMARY KEY (id);
VACUUM ANALYZE bench_src;
SELECT :rows AS rows, round(avg(octet_length(receipt))) AS receipt_bytes,
       round(avg(octet_length(payload))) AS event_bytes
FROM bench_src;

CREATE TABLE bench_results (
    run int, variant text, phase text, seconds float8, cpu_seconds float8, wal_bytes numeric,
    bytes numeric, PRIMARY KEY (run, variant, phase)
);

-- CPU time (user + system) of this backend so far, from /proc (10 ms ticks): on a shared machine
-- it moves far less than the wall clock.
CREATE FUNCTION bench_cpu() RETURNS float8 LANGUAGE sql VOLATILE AS $$
    SELECT (f[12]::float8 + f[13]::float8) / 100
    FROM (SELECT string_to_array(split_part(pg_read_file('/proc/' || pg_backend_pid() || '/stat'),
                                            ') ', 2), ' ') AS f) s
$$;

-- The column type of a variant (jsonb+text: jsonb and a text copy).
CREATE FUNCTION bench_type(variant text) RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE variant WHEN 'json' THEN 'json' ELSE 'jsonb' END
$$;

-- Fresh tables for one variant, and its operations inserted claimed (untimed).
CREATE PROCEDURE bench_prepare(variant text) LANGUAGE plpgsql AS $$
BEGIN
    DROP TABLE IF EXISTS bench_ops, bench_outbox;
    CREATE TABLE bench_ops (LIKE operations INCLUDING ALL) WITH (fillfactor = 30);
    CREATE TABLE bench_outbox (LIKE result_outbox INCLUDING ALL) WITH (fillfactor = 50);
    EXECUTE format('ALTER TABLE bench_ops ALTER COLUMN receipt TYPE %s', bench_type(variant));
    EXECUTE format('ALTER TABLE bench_outbox ALTER COLUMN payload TYPE %s', bench_type(variant));
    IF variant = 'jsonb+text' THEN
        ALTER TABLE bench_ops ADD COLUMN receipt_text text;
        ALTER TABLE bench_outbox ADD COLUMN payload_text text;
    END IF;
    INSERT INTO bench_ops (id, tenant, action_id, tool, fingerprint, arguments, state, fence,
                           lease_owner, lease_until, attempts, first_dispatch_at, changed_by,
                           created_by, unsent_fence)
    SELECT s.id, 'north-shop', s.action_id, 'refund', md5(s.action_id) || md5(s.receipt_id),
           format('{"amount_cents":%s,"currency":"USD","order":"order-%s"}', 100 + s.id % 90000, s.id),
           'dispatching', 1, 'w-1', now() + interval '30 seconds', 1, now(), 'w-1', 'w-1', NULL
    FROM bench_src s;
END $$;

-- One timed statement of one run: seconds, the backend's CPU seconds and WAL bytes.
CREATE PROCEDURE bench_time(run int, variant text, phase text) LANGUAGE plpgsql AS $$
DECLARE
    t text := bench_type(variant);
    sql text;
    t0 timestamptz;
    c0 float8;
    w0 pg_lsn;
BEGIN
    sql := CASE phase
        WHEN 'complete' THEN format(
            'UPDATE bench_ops o SET state = ''succeeded'', receipt = s.receipt::%s%s,
                    receipt_id = s.receipt_id, evidence = ''receipt '' || s.receipt_id,
                    lease_owner = NULL, lease_until = NULL, last_reported = ''succeeded'',
                    verified_by = ''dispatch'', finished_at = now()
             FROM bench_src s WHERE o.id = s.id',
            t, CASE WHEN variant = 'jsonb+text' THEN ', receipt_text = s.receipt' ELSE '' END)
        WHEN 'event' THEN format(
            'INSERT INTO bench_outbox (operation_id, routing_key, status, payload%s)
             SELECT s.id, ''north-shop'', ''succeeded'', s.payload::%s%s FROM bench_src s',
            CASE WHEN variant = 'jsonb+text' THEN ', payload_text' ELSE '' END, t,
            CASE WHEN variant = 'jsonb+text' THEN ', s.payload' ELSE '' END)
        -- Ten times over, for the 10 ms resolution of the CPU clock.
        WHEN 'read' THEN format('SELECT sum(octet_length(%s)) FROM bench_outbox, generate_series(1, 10)',
            CASE WHEN variant = 'jsonb+text' THEN 'payload_text' ELSE 'payload::text' END)
    END;
    w0 := pg_current_wal_insert_lsn();
    c0 := bench_cpu();
    t0 := clock_timestamp();
    EXECUTE sql;
    INSERT INTO bench_results
    VALUES (run, variant, phase, extract(epoch FROM clock_timestamp() - t0), bench_cpu() - c0,
            pg_current_wal_insert_lsn() - w0, NULL);
END $$;

-- Sizes after VACUUM FULL: both tables with their indexes, and the documents' own bytes.
CREATE PROCEDURE bench_size(run int, variant text) LANGUAGE plpgsql AS $$
DECLARE
    doc numeric;
BEGIN
    IF variant = 'jsonb+text' THEN
        SELECT avg(pg_column_size(receipt) + pg_column_size(receipt_text)) INTO doc FROM bench_ops;
    ELSE
        SELECT avg(pg_column_size(receipt)) INTO doc FROM bench_ops;
    END IF;
    INSERT INTO bench_results VALUES (run, variant, 'receipt_column', NULL, NULL, NULL, doc);
    IF variant = 'jsonb+text' THEN
        SELECT avg(pg_column_size(payload) + pg_column_size(payload_text)) INTO doc FROM bench_outbox;
    ELSE
        SELECT avg(pg_column_size(payload)) INTO doc FROM bench_outbox;
    END IF;
    INSERT INTO bench_results VALUES (run, variant, 'payload_column', NULL, NULL, NULL, doc);
    INSERT INTO bench_results
    VALUES (run, variant, 'tables', NULL, NULL, NULL,
            pg_total_relation_size('bench_ops') + pg_total_relation_size('bench_outbox'));
END $$;

-- The runs: each variant in turn, the order rotated from run to run.
SELECT s.stmt
FROM generate_series(1, :runs) r,
     LATERAL (SELECT v, o FROM unnest(ARRAY['jsonb', 'json', 'jsonb+text']) WITH ORDINALITY u(v, o)) v,
     LATERAL (VALUES
        (1, format('CALL bench_prepare(%L)', v.v)),
        (2, 'VACUUM ANALYZE bench_ops'),
        (3, 'CHECKPOINT'),
        (4, format('CALL bench_time(%s, %L, ''complete'')', r, v.v)),
        (5, format('CALL bench_time(%s, %L, ''event'')', r, v.v)),
        (6, format('CALL bench_time(%s, %L, ''read'')', r, v.v)),
        (7, 'VACUUM FULL bench_ops'),
        (8, 'VACUUM FULL bench_outbox'),
        (9, format('CALL bench_size(%s, %L)', r, v.v))
     ) s(step, stmt)
ORDER BY r, (v.o + r - 2) % 3, s.step
\gexec

\echo
\echo 'Per intent (one completion + one result event), each run: the backend CPU and wall µs per'
\echo 'intent, WAL bytes per intent, and each as a ratio to jsonb in the same run; reading a payload'
\echo 'back as text (CPU µs); both tables (indexes included) per intent after VACUUM FULL; the'
\echo 'documents'' own bytes (pg_column_size).'
CREATE VIEW bench_per_intent AS
WITH t AS (
    SELECT run, variant,
           sum(cpu_seconds) FILTER (WHERE phase IN ('complete', 'event')) * 1e6 / :rows AS cpu_us,
           sum(seconds) FILTER (WHERE phase IN ('complete', 'event')) * 1e6 / :rows AS wall_us,
           sum(cpu_seconds) FILTER (WHERE phase = 'read') * 1e6 / :rows / 10 AS read_us,
           sum(wal_bytes) FILTER (WHERE phase IN ('complete', 'event')) / :rows AS wal,
           sum(bytes) FILTER (WHERE phase = 'tables') / :rows AS size,
           sum(bytes) FILTER (WHERE phase = 'receipt_column') AS receipt_col,
           sum(bytes) FILTER (WHERE phase = 'payload_column') AS payload_col
    FROM bench_results GROUP BY run, variant
)
SELECT t.*, t.cpu_us / b.cpu_us AS cpu_ratio, t.cpu_us - b.cpu_us AS cpu_us_more,
       t.wall_us / b.wall_us AS wall_ratio, t.read_us / b.read_us AS read_ratio,
       t.wal / b.wal AS wal_ratio, t.size / b.size AS size_ratio
FROM t JOIN t b ON b.run = t.run AND b.variant = 'jsonb';

SELECT run, variant,
       round(cpu_us::numeric, 1) AS cpu_us, round(cpu_ratio::numeric, 3) AS cpu_ratio,
       round(cpu_us_more::numeric, 1) AS cpu_us_more,
       round(wall_us::numeric, 1) AS wall_us, round(wall_ratio::numeric, 3) AS wall_ratio,
       round(read_us::numeric, 2) AS read_us, round(read_ratio::numeric, 3) AS read_ratio,
       round(wal) AS wal_bytes, round(wal_ratio, 3) AS wal_ratio,
       round(size) AS table_bytes, round(size_ratio, 3) AS size_ratio,
       round(receipt_col) AS receipt_col_bytes, round(payload_col) AS payload_col_bytes
FROM bench_per_intent ORDER BY run, variant;

\echo 'Over the runs (min–max, median):'
SELECT variant,
       round(min(cpu_us)::numeric, 1) || '–' || round(max(cpu_us)::numeric, 1) AS cpu_us,
       round(min(cpu_ratio)::numeric, 3) || '–' || round(max(cpu_ratio)::numeric, 3)
           || ' (' || round((percentile_cont(0.5) WITHIN GROUP (ORDER BY cpu_ratio))::numeric, 3) || ')' AS cpu_ratio,
       round(min(cpu_us_more)::numeric, 1) || '–' || round(max(cpu_us_more)::numeric, 1)
           || ' (' || round((percentile_cont(0.5) WITHIN GROUP (ORDER BY cpu_us_more))::numeric, 1) || ')' AS cpu_us_more,
       round(min(wall_ratio)::numeric, 3) || '–' || round(max(wall_ratio)::numeric, 3)
           || ' (' || round((percentile_cont(0.5) WITHIN GROUP (ORDER BY wall_ratio))::numeric, 3) || ')' AS wall_ratio,
       round(min(read_ratio)::numeric, 3) || '–' || round(max(read_ratio)::numeric, 3) AS read_ratio,
       round(min(wal)) || '–' || round(max(wal)) AS wal_bytes,
       round(min(wal_ratio), 3) || '–' || round(max(wal_ratio), 3) AS wal_ratio,
       round(min(size)) || '–' || round(max(size)) AS table_bytes,
       round(min(size_ratio), 3) || '–' || round(max(size_ratio), 3) AS size_ratio
FROM bench_per_intent GROUP BY variant ORDER BY variant;

DROP TABLE bench_ops, bench_outbox;

-- Migration 0018 on a filled ledger: finished operations, one published event each, and an
-- operator response per thousand operations.
\echo
\echo 'Filling the ledger for migration 0018 (untimed):' :migration_rows 'operations and events'
INSERT INTO operations (id, tenant, action_id, tool, fingerprint, arguments, call_id, state, fence,
                        attempts, first_dispatch_at, receipt, receipt_id, evidence, changed_by,
                        last_reported, created_at, updated_at, state_since, finished_at,
                        created_by, verified_by, traceparent)
SELECT i, 'north-shop', 'refund-' || lpad(i::text, 9, '0'), 'refund', md5(i::text) || md5((i + 1)::text),
       format('{"amount_cents":%s,"currency":"USD","order":"order-%s"}', 100 + i % 90000, i),
       'call-' || i, 'succeeded', 1, 1, now(), bench_receipt(i)::jsonb, 'rcpt-' || i, 'receipt rcpt-' || i,
       'w-1', 'succeeded', now(), now(), now(), now(), 'w-1', 'dispatch',
       '00-' || md5(i::text) || '-' || left(md5((-i)::text), 16) || '-01'
FROM generate_series(1, :migration_rows) i;
SELECT setval('operations_id_seq', :migration_rows) AS ignored \gset
INSERT INTO result_outbox (operation_id, routing_key, status, payload, created_at, published_at)
SELECT i, 'north-shop', 'succeeded', bench_event(i)::jsonb, now(), now()
FROM generate_series(1, :migration_rows) i;
INSERT INTO operator_requests (request_id, operation_id, action, operator, reason, response)
SELECT 'req-' || i, i, 'resolve', 'alice', 'checked with the PSP',
       jsonb_build_object('operation', jsonb_build_object('id', i, 'state', 'succeeded',
                          'receipt', bench_receipt(i)::jsonb))
FROM generate_series(1, :migration_rows, 1000) i;
VACUUM ANALYZE operations;
VACUUM ANALYZE result_outbox;
VACUUM ANALYZE operator_requests;
CHECKPOINT;
SELECT pg_size_pretty(pg_total_relation_size('operations')) AS operations,
       pg_size_pretty(pg_total_relation_size('result_outbox')) AS result_outbox;

\echo 'Migration 0018, each statement timed (in order: the clock read, operations, operator_requests,'
\echo 'DROP VIEW result_events, result_outbox, CREATE VIEW result_events):'
\timing on
SELECT clock_timestamp() AS migration_t0 \gset
\ir ../migrations/0018_documents_as_sent.sql
\timing off
SELECT round(extract(epoch FROM clock_timestamp() - :'migration_t0'::timestamptz)::numeric, 1) AS migration_seconds,
       round((extract(epoch FROM clock_timestamp() - :'migration_t0'::timestamptz)
              * 1e6 / :migration_rows)::numeric, 1) AS seconds_per_million_operations
\gset
\echo 'migration 0018:' :migration_seconds 's for' :migration_rows 'operations and as many events;' :seconds_per_million_operations 's per million'
SELECT pg_size_pretty(pg_total_relation_size('operations')) AS operations_after,
       pg_size_pretty(pg_total_relation_size('result_outbox')) AS result_outbox_after;

\c :"home_db"
DROP DATABASE :"db";
