-- History keeps what the operation row no longer shows, so an action that goes straight from
-- its claim to its outcome writes no history row at all (docs/design.md, section 10).
--
-- The row itself always shows its current version: state, fence, evidence, who made it
-- (changed_by), when (updated_at), attempts and schedule. A row born claimed (the consumer's
-- insert: dispatching at fence 1, by `created_by`, at `created_at`) also shows its first version.
-- So for such a row the log keeps only the versions it has left since, each written when it is
-- left (the statement's OLD row); the timeline is the first version, the log and the current
-- version, put together by the view `operation_history`, which reads exactly as the table it
-- replaces did (same columns and order; `from_state` is the previous entry's `to_state`). A happy
-- path (claimed, then succeeded) leaves its first version and is now in its last: nothing logged.
--
-- Rows without `created_by` (everything recorded before this migration, rows born `prepared`,
-- and rows a worker of an earlier version inserts during a rolling upgrade) keep the complete
-- log as before: their insert and every version they enter are logged, and the view shows the
-- log alone.
--
-- `updated_at` now means "entered its current version": the touch trigger runs only for a change
-- of state, fence or evidence, as the history triggers do. The send fence and lease renewals
-- change none of them: no trigger call and no new `updated_at` for them.

ALTER TABLE operations ADD COLUMN created_by text;

ALTER TABLE operation_history RENAME TO operation_history_log;
ALTER INDEX operation_history_op RENAME TO operation_history_log_op;
ALTER TABLE operation_history_log RENAME CONSTRAINT operation_history_pkey TO operation_history_log_pkey;
-- Entries of born-claimed rows are written with the time their version began.
ALTER TABLE operation_history_log ALTER COLUMN at SET DEFAULT clock_timestamp();

CREATE VIEW operation_history AS
SELECT e.id, e.operation_id, e.at,
       lag(e.to_state) OVER (PARTITION BY e.operation_id ORDER BY e.id) AS from_state,
       e.to_state, e.fence, e.actor, e.evidence, e.attempts, e.next_attempt_at
FROM (
    SELECT l.id, l.operation_id, l.at, l.to_state, l.fence, l.actor, l.evidence, l.attempts,
           l.next_attempt_at
    FROM operation_history_log l
    UNION ALL
    -- The first version of a row born claimed: never logged, always known.
    SELECT 0, o.id, o.created_at, 'dispatching', 1, o.created_by, NULL, 1, NULL
    FROM operations o
    WHERE o.created_by IS NOT NULL
    UNION ALL
    -- Its current version, once it has left the first.
    SELECT 9223372036854775807, o.id, o.updated_at, o.state, o.fence, o.changed_by, o.evidence,
           o.attempts, o.next_attempt_at
    FROM operations o
    WHERE o.created_by IS NOT NULL
      AND NOT (o.state = 'dispatching' AND o.fence = 1 AND o.evidence IS NULL)
) e;

-- The history and touch triggers become row triggers with WHEN conditions that the executor
-- checks without calling PL/pgSQL and without capturing transition tables: on the hot path (the
-- consumer's insert, the send fence, a claimed row reaching its outcome) none of them runs.
DROP TRIGGER operations_history_insert ON operations;
DROP TRIGGER operations_history_change ON operations;
DROP FUNCTION operations_history_inserted();
DROP FUNCTION operations_history_changed();

CREATE FUNCTION operations_history_log_insert() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO operation_history_log (operation_id, from_state, to_state, fence, actor, evidence,
                                       attempts, next_attempt_at)
    VALUES (NEW.id, NULL, NEW.state, NEW.fence, NEW.changed_by, NEW.evidence, NEW.attempts,
            NEW.next_attempt_at);
    RETURN NULL;
END $$;

CREATE FUNCTION operations_history_log_change() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.created_by IS NULL THEN
        -- A complete log: the version entered.
        INSERT INTO operation_history_log (operation_id, from_state, to_state, fence, actor,
                                           evidence, attempts, next_attempt_at)
        VALUES (NEW.id, OLD.state, NEW.state, NEW.fence, NEW.changed_by, NEW.evidence,
                NEW.attempts, NEW.next_attempt_at);
    ELSE
        -- Born claimed: the version left (never the first one: see the trigger's WHEN).
        INSERT INTO operation_history_log (operation_id, at, from_state, to_state, fence, actor,
                                           evidence, attempts, next_attempt_at)
        VALUES (OLD.id, OLD.updated_at, NULL, OLD.state, OLD.fence, OLD.changed_by,
                OLD.evidence, OLD.attempts, OLD.next_attempt_at);
    END IF;
    RETURN NULL;
END $$;

CREATE TRIGGER operations_history_insert AFTER INSERT ON operations
    FOR EACH ROW
    WHEN (NEW.created_by IS NULL)
    EXECUTE FUNCTION operations_history_log_insert();
CREATE TRIGGER operations_history_change AFTER UPDATE ON operations
    FOR EACH ROW
    WHEN ((NEW.state IS DISTINCT FROM OLD.state OR NEW.fence IS DISTINCT FROM OLD.fence
           OR NEW.evidence IS DISTINCT FROM OLD.evidence)
          AND NOT (NEW.created_by IS NOT NULL AND OLD.state = 'dispatching' AND OLD.fence = 1
                   AND OLD.evidence IS NULL))
    EXECUTE FUNCTION operations_history_log_change();

-- The touch trigger (updated_at, state_since, finished_at) only for a change that matters and
-- only when the statement did not set `updated_at` itself (the completion of a batch does).
DROP TRIGGER operations_touch ON operations;
CREATE TRIGGER operations_touch BEFORE UPDATE ON operations
    FOR EACH ROW
    WHEN ((NEW.state IS DISTINCT FROM OLD.state OR NEW.fence IS DISTINCT FROM OLD.fence
           OR NEW.evidence IS DISTINCT FROM OLD.evidence)
          AND NEW.updated_at IS NOT DISTINCT FROM OLD.updated_at)
    EXECUTE FUNCTION operations_touch();
