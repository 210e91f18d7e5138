-- Shared retry budget: every retry (a write that is not a first attempt) is logged per tool;
-- a retry may run only while retries in the sliding window stay below ratio x first attempts
-- (counted from operations.first_dispatch_at) plus a floor. All workers see the same budget.
CREATE TABLE retry_spend (
    id    bigserial   PRIMARY KEY,
    tool  text        NOT NULL,
    at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX retry_spend_tool_at ON retry_spend (tool, at);
CREATE INDEX operations_first_dispatch ON operations (tool, first_dispatch_at)
    WHERE first_dispatch_at IS NOT NULL;

-- Poison guard independent of the broker's delivery counting (RabbitMQ 4.3 no longer counts a
-- consumer crash toward x-delivery-limit): each redelivered message is counted here, by body
-- hash, before it is processed; past the delivery limit it is dead-lettered instead.
CREATE TABLE intake_redeliveries (
    body_sha   text        PRIMARY KEY,
    deliveries integer     NOT NULL,
    last_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX intake_redeliveries_last_at ON intake_redeliveries (last_at);
