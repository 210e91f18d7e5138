-- Fewer index entries per intent (docs/design.md, section 10). Every index on `operations`
-- takes an entry when a row is inserted and another when a completion rewrites it (a state
-- change is never a HOT update: `state` is in the unresolved index's predicate).
--
-- 1. operations_first_dispatch served the first retry budget, which counted first attempts per
--    tool; the token bucket (migration 0006) reads nothing of it. Two entries per intent, unused.
DROP INDEX operations_first_dispatch;

-- 2. One index for unresolved rows. The gauges read it by state and tool; the operator listing
--    (by id, by age) reads the same few rows through it and sorts them: unresolved rows are the
--    in-flight ones plus what waits for recovery or a person, never the table.
DROP INDEX operations_unresolved_created;
DROP INDEX operations_unresolved_id;

-- 3. Finished rows: the private-data sweep keeps operations_unswept (finished, not yet swept);
--    tombstones are deleted a year later in batches, which a block-range index serves at no
--    cost per row written (finished_at grows with the table's append order).
DROP INDEX operations_finished;
CREATE INDEX operations_finished ON operations USING brin (finished_at);

-- 4. Published events are deleted by age for retention, in batches: a block-range index on
--    published_at serves that as well, and the relay's mark no longer writes a btree entry for it.
DROP INDEX result_outbox_published;
CREATE INDEX result_outbox_published ON result_outbox USING brin (published_at);

-- 5. Vacuum the hot tables sooner than the default 20 % of dead rows: every completion leaves
--    a dead version of its operation, every published event one of its outbox row. Reclaimed
--    space on the same page is what keeps the send fence a HOT update (fillfactor 80).
ALTER TABLE operations SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);
ALTER TABLE result_outbox SET (autovacuum_vacuum_scale_factor = 0.05, autovacuum_analyze_scale_factor = 0.05);
