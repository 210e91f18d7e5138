-- Throughput (issue 11) without weaker guarantees.
--
-- 1. `unsent_fence`: set to the new fence by every claim that authorises a write (the consumer's
--    insert, its claim of a `prepared` row, the scheduler's start of a dispatch) and cleared by
--    the send fence, the only way to a send. A `dispatching` row whose lease ran out with
--    `unsent_fence = fence` never sent anything under that claim, so it goes back to `prepared` /
--    `retry_wait` instead of `unknown`: a crash between the claim and the send no longer costs an
--    honest-but-needless `held`. NULL or another fence counts as "may have been sent": rows
--    dispatching while this migration runs, and claims by a worker of an earlier version during a
--    rolling upgrade (it neither sets nor clears the column, and its claim moved the fence), are
--    expired to `unknown` as before.
ALTER TABLE operations ADD COLUMN unsent_fence bigint;

-- 2. The send fence renews `lease_until` on a row that stays `dispatching`. With an index on
--    `lease_until` every fence wrote a new version into all of the row's indexes (a non-HOT
--    update); without it, and with room left on each page, the fence is a HOT update touching no
--    index. Lease expiry finds `dispatching` rows through operations_unresolved (state first):
--    they are only the in-flight ones, bounded by the workers' prefetch.
DROP INDEX operations_lease;
ALTER TABLE operations SET (fillfactor = 80);

-- 3. History is appended only when state, fence or evidence change (operations_history() checks
--    that itself). Saying so in the trigger's WHEN lets Postgres skip the AFTER-row event, and
--    the PL/pgSQL call, for updates that change none of them (the send fence, lease renewals)
--    instead of queueing one per row only for the function to do nothing.
DROP TRIGGER operations_history ON operations;
CREATE TRIGGER operations_history_insert AFTER INSERT ON operations
    FOR EACH ROW EXECUTE FUNCTION operations_history();
CREATE TRIGGER operations_history_change AFTER UPDATE ON operations
    FOR EACH ROW
    WHEN (OLD.state IS DISTINCT FROM NEW.state OR OLD.fence IS DISTINCT FROM NEW.fence
          OR OLD.evidence IS DISTINCT FROM NEW.evidence)
    EXECUTE FUNCTION operations_history();
