-- The W3C trace context an intent was enqueued in, sent by the relay as the message's
-- `traceparent` and `tracestate` headers (NULL: the intent carries none).
--
-- Nullable columns without defaults: adding them rewrites nothing, a relay of the earlier
-- version keeps working beside this one (it publishes without them), and an application that
-- inserts rows with plain SQL need not name them. IF NOT EXISTS keeps the DDL idempotent, so
-- an application may also put it in its own migrations.

ALTER TABLE intent_outbox
    ADD COLUMN IF NOT EXISTS traceparent text,
    ADD COLUMN IF NOT EXISTS tracestate  text;
