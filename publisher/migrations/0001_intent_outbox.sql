-- The agent-side intent outbox (a contract: any language may INSERT (tenant, action_id, body)
-- in its own transaction; `publisher relay` publishes the rows). Idempotent on purpose: an
-- application may also create the table from its own migrations with this exact text.
CREATE TABLE IF NOT EXISTS intent_outbox (
    id              bigserial   PRIMARY KEY,
    tenant          text        NOT NULL,
    action_id       text        NOT NULL,
    body            text        NOT NULL,  -- the intent JSON exactly as it will be published
    created_at      timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),  -- also the relay's claim lease
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    sent_at         timestamptz
);
CREATE INDEX IF NOT EXISTS intent_outbox_due ON intent_outbox (next_attempt_at, id) WHERE sent_at IS NULL;
