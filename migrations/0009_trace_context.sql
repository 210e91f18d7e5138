-- The W3C trace context of the intent that created an operation, and of the span that decided
-- each result event.
--
-- operations.traceparent / tracestate: as the creating intent carried them (NULL when it
-- carried none or a malformed one). A recovery round, an operator action or a lease expiry
-- hours later links its span to this context; the status API returns its trace id.
--
-- result_outbox.traceparent / tracestate: the context the relay sends in the event's AMQP
-- headers: the span that decided the event when spans are exported, else the intent's own.
--
-- Nullable columns without defaults: adding them rewrites nothing, and a worker of the earlier
-- version keeps working beside this one (it leaves them NULL).

ALTER TABLE operations ADD COLUMN traceparent text, ADD COLUMN tracestate text;
ALTER TABLE result_outbox ADD COLUMN traceparent text, ADD COLUMN tracestate text;
