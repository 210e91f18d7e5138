-- Long-running downstream operations (docs/recovery.md, "Long-running operations"): a write the
-- downstream acknowledged with an operation id (202 Accepted) and finishes later. The row waits
-- in the new state `accepted` while the worker polls the tool's status URL, read only, until the
-- documented completion criteria are seen, a documented failure is, or the deadline passes.
--
-- remote_id      the downstream's operation id, from the acceptance (a later acceptance must
--                name the same one: another is held as a conflict)
-- acceptance     the acceptance answer as the downstream sent it
-- poll_deadline  accepted_at + the tool's poll.deadline_secs: past it without an answer, held
-- verified_by    how the final answer (or the acceptance) is known: dispatch, replay, lookup,
--                poll, late_receipt, or operator:<name>; the completion report's source
ALTER TABLE operations
    ADD COLUMN remote_id text,
    ADD COLUMN acceptance json,
    ADD COLUMN poll_deadline timestamptz,
    ADD COLUMN verified_by text;

ALTER TABLE operations DROP CONSTRAINT operations_state_check;
ALTER TABLE operations ADD CONSTRAINT operations_state_check
    CHECK (state IN ('prepared', 'dispatching', 'retry_wait', 'unknown', 'held', 'accepted',
                     'succeeded', 'failed'));

-- Accepted rows are due work (their next poll) and unresolved (aged, listed, alerted on).
DROP INDEX operations_due;
CREATE INDEX operations_due ON operations (next_attempt_at)
    WHERE state IN ('prepared', 'retry_wait', 'unknown', 'accepted');
DROP INDEX operations_unresolved;
CREATE INDEX operations_unresolved ON operations (state, tool, created_at)
    WHERE state IN ('dispatching', 'retry_wait', 'unknown', 'held', 'accepted');

-- A completion callback names the operation by the downstream's id: found per tool.
CREATE INDEX operations_remote ON operations (tool, remote_id) WHERE remote_id IS NOT NULL;
