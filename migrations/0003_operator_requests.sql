-- Operator actions (resolve, fail, recheck) are idempotent by a request id the operator (or
-- their tooling) chooses: the first request with an id is recorded here in the same transaction
-- as the state change it made, with the response it got; a retry with the same id gets the
-- same response and changes nothing. The row goes with its operation (retention tombstones).
CREATE TABLE operator_requests (
    request_id    text        PRIMARY KEY,
    operation_id  bigint      NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    action        text        NOT NULL CHECK (action IN ('resolve', 'fail', 'recheck')),
    operator      text        NOT NULL,
    reason        text        NOT NULL,
    response      jsonb,
    created_at    timestamptz NOT NULL DEFAULT now()
);
-- Cascading deletes of tombstones find their requests by index.
CREATE INDEX operator_requests_operation ON operator_requests (operation_id);

-- Deleting a tombstone sets result_outbox.operation_id to NULL (ON DELETE SET NULL); without an
-- index every deleted operation would scan the outbox.
CREATE INDEX result_outbox_operation ON result_outbox (operation_id) WHERE operation_id IS NOT NULL;

-- The retention sweeper's first pass reads only finished rows whose private data is still
-- there, oldest first, so swept tombstones (kept for a long time) are never rescanned.
CREATE INDEX operations_unswept ON operations (finished_at)
    WHERE finished_at IS NOT NULL AND swept_at IS NULL;

-- The operator listing pages through unresolved rows by id; this partial index holds only
-- them, so a page costs the same however many finished rows the table has.
CREATE INDEX operations_unresolved_id ON operations (id)
    WHERE state IN ('dispatching', 'retry_wait', 'unknown', 'held');
