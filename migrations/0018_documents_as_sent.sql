-- A downstream's documents are stored exactly as they were sent (docs/design.md, section 4):
-- `json` keeps its input text verbatim, where `jsonb` re-encodes it (member order, spacing,
-- number spelling) and refuses a string holding U+0000, which JSON allows. A receipt holding
-- one could not be stored, so the action that succeeded was held instead.
--
-- The receipt and the result events that carry it (the agent is told the receipt) change
-- type; the acceptance of a long-running operation was created as `json`. Nothing queries
-- inside these documents with jsonb operators. Rows written before keep jsonb's re-encoding.
-- Both tables are rewritten once, under an exclusive lock, by `worker migrate` (CHANGELOG.md
-- says how long that takes).
ALTER TABLE operations ALTER COLUMN receipt TYPE json USING receipt::json;
-- An operator action's stored response shows the operation, its receipt included.
ALTER TABLE operator_requests ALTER COLUMN response TYPE json USING response::json;

DROP VIEW result_events;
ALTER TABLE result_outbox ALTER COLUMN payload TYPE json USING payload::json;
-- As before (0014), over the retyped column.
CREATE VIEW result_events AS
SELECT r.id, r.event_id, r.operation_id, r.routing_key, r.status, r.payload, r.created_at,
       r.relay_owner, r.relay_until, r.relay_epoch, r.published_at, r.traceparent, r.tracestate,
       (r.published_at IS NOT NULL
        OR (r.relay_epoch IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM relay_epochs e
                            WHERE e.id = r.relay_epoch AND r.id > e.through_id))) AS published
FROM result_outbox r;
