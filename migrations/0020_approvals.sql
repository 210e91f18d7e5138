-- Approval before dispatch (docs/contract.md, "Approval"): a tool may ask that a person approve
-- the exact intent (its fingerprint) before it is sent. Such an intent is recorded in the new
-- state `awaiting_approval`, never dispatched from it; the last approval needed makes it
-- `prepared` and due (the recovery scheduler claims it under a fence, as any first dispatch), a
-- rejection or the end of the wait makes it `failed`. Neither of those was ever sent.
--
-- approvals_needed  how many distinct people must approve (the tool's `approvals` when the
--                   intent was recorded; a later change of the tools file does not move it)
-- approved_by       who approved so far, in order; an approver appears at most once
-- While awaiting, next_attempt_at is the end of the wait (`approval_ttl_secs` after recording).
ALTER TABLE operations
    ADD COLUMN approvals_needed smallint,
    ADD COLUMN approved_by text[];

ALTER TABLE operations DROP CONSTRAINT operations_state_check;
ALTER TABLE operations ADD CONSTRAINT operations_state_check
    CHECK (state IN ('prepared', 'dispatching', 'retry_wait', 'unknown', 'held', 'accepted',
                     'awaiting_approval', 'succeeded', 'failed'));

-- Awaiting rows are unresolved (aged, listed, alerted on); their expiry is found by its time.
DROP INDEX operations_unresolved;
CREATE INDEX operations_unresolved ON operations (state, tool, created_at)
    WHERE state IN ('dispatching', 'retry_wait', 'unknown', 'held', 'accepted',
                    'awaiting_approval');
CREATE INDEX operations_approval_expiry ON operations (next_attempt_at)
    WHERE state = 'awaiting_approval';

-- Approvals and rejections are operator requests like the others (idempotent by request id).
ALTER TABLE operator_requests DROP CONSTRAINT operator_requests_action_check;
ALTER TABLE operator_requests ADD CONSTRAINT operator_requests_action_check
    CHECK (action IN ('resolve', 'fail', 'recheck', 'approve', 'reject'));
