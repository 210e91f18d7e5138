-- Compensation (docs/contract.md, "Compensation"): undoing an action is an action of its own,
-- with its own key, attempts, recovery and receipt, linked to the original, which keeps its
-- `succeeded` state and receipt.
--
-- compensates        on a compensation: the action_id (same tenant) of the original it undoes;
--                    kept by retention, so a tombstone still shows the link
-- compensation_told  on a compensation that succeeded: when the original's agent was told
--                    (a `succeeded` event about the original naming `compensated_by`)
ALTER TABLE operations
    ADD COLUMN compensates text,
    ADD COLUMN compensation_told timestamptz;

-- At most one live compensation per original: another is refused until that one is proven
-- not applied (`failed`). Also how an original finds its compensations.
CREATE UNIQUE INDEX operations_live_compensation ON operations (tenant, compensates)
    WHERE compensates IS NOT NULL AND state <> 'failed';
CREATE INDEX operations_compensations ON operations (tenant, compensates)
    WHERE compensates IS NOT NULL;
-- Succeeded compensations whose original's agent has not been told yet.
CREATE INDEX operations_compensation_untold ON operations (id)
    WHERE compensates IS NOT NULL AND state = 'succeeded' AND compensation_told IS NULL;
