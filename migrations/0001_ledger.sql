-- The operations ledger: one row per logical action (tenant, action_id). The unique key, not
-- application code, makes the claim single-winner; every state change is a conditional UPDATE
-- checked against state and fence; a trigger appends each change to operation_history.

CREATE TABLE operations (
    id                 bigserial PRIMARY KEY,
    tenant             text        NOT NULL,
    action_id          text        NOT NULL,
    tool               text        NOT NULL,
    -- SHA-256 of the canonical JSON of {tool, arguments}; a different one under the same key is
    -- an intent conflict.
    fingerprint        text        NOT NULL,
    -- The canonical JSON sent as the request body, byte for byte the same on every attempt.
    -- NULL once the retention sweeper removed private data (the tombstone keeps the key).
    arguments          text,
    call_id            text,
    reply_to           text,
    state              text        NOT NULL DEFAULT 'prepared'
        CHECK (state IN ('prepared', 'dispatching', 'retry_wait', 'unknown', 'held', 'succeeded', 'failed')),
    -- Incremented by every claim (dispatch or recovery); a stale owner's write never matches.
    fence              bigint      NOT NULL DEFAULT 0,
    lease_owner        text,
    lease_until        timestamptz,
    -- Write requests authorised (first dispatch, retries, replays).
    attempts           integer     NOT NULL DEFAULT 0,
    -- Recovery rounds spent on an unknown outcome (lookups and replays).
    recovery_attempts  integer     NOT NULL DEFAULT 0,
    next_attempt_at    timestamptz,
    first_dispatch_at  timestamptz,
    -- first_dispatch_at + the tool's replay window (replay tools only): the protection deadline.
    replay_deadline    timestamptz,
    receipt            jsonb,
    receipt_id         text,
    -- Last evidence: an HTTP status and body excerpt, an error, an operator's note.
    evidence           text,
    -- Who made the last change (worker id or "operator:<name>"), copied into history by trigger.
    changed_by         text        NOT NULL DEFAULT 'unknown',
    -- The status most recently put in the result outbox, so every intent gets one answer and a
    -- pending answer is followed by the truth without repeating itself.
    last_reported      text,
    created_at         timestamptz NOT NULL DEFAULT now(),
    updated_at         timestamptz NOT NULL DEFAULT now(),
    -- When the row entered its current state (the unresolved-age gauge counts from created_at).
    state_since        timestamptz NOT NULL DEFAULT now(),
    finished_at        timestamptz,
    swept_at           timestamptz,
    CONSTRAINT operations_key UNIQUE (tenant, action_id),
    CONSTRAINT succeeded_has_receipt CHECK (state <> 'succeeded' OR receipt IS NOT NULL OR swept_at IS NOT NULL)
);

-- Due work for the scheduler: prepared rows left by a crash, retries, recoveries.
CREATE INDEX operations_due ON operations (next_attempt_at)
    WHERE state IN ('prepared', 'retry_wait', 'unknown');
-- Leases to expire.
CREATE INDEX operations_lease ON operations (lease_until) WHERE state = 'dispatching';
-- Oldest unresolved age per tool and state: the partial index holds only unresolved rows, so the
-- gauge stays cheap however many finished rows the table has.
CREATE INDEX operations_unresolved ON operations (state, tool, created_at)
    WHERE state IN ('dispatching', 'retry_wait', 'unknown', 'held');
-- Operator listing of unresolved work by age.
CREATE INDEX operations_unresolved_created ON operations (created_at)
    WHERE state IN ('dispatching', 'retry_wait', 'unknown', 'held');
-- Retention sweeps.
CREATE INDEX operations_finished ON operations (finished_at) WHERE finished_at IS NOT NULL;

CREATE TABLE operation_history (
    id            bigserial   PRIMARY KEY,
    operation_id  bigint      NOT NULL REFERENCES operations (id) ON DELETE CASCADE,
    at            timestamptz NOT NULL DEFAULT clock_timestamp(),
    from_state    text,
    to_state      text        NOT NULL,
    fence         bigint      NOT NULL,
    actor         text        NOT NULL,
    evidence      text
);
CREATE INDEX operation_history_op ON operation_history (operation_id, id);

CREATE FUNCTION operations_touch() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.updated_at := now();
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        NEW.state_since := now();
        IF NEW.state IN ('succeeded', 'failed') THEN
            NEW.finished_at := now();
        END IF;
    END IF;
    RETURN NEW;
END $$;
CREATE TRIGGER operations_touch BEFORE UPDATE ON operations
    FOR EACH ROW EXECUTE FUNCTION operations_touch();

-- History is written by the database for every insert and every change of state or fence, so no
-- code path can forget it.
CREATE FUNCTION operations_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO operation_history (operation_id, from_state, to_state, fence, actor, evidence)
        VALUES (NEW.id, NULL, NEW.state, NEW.fence, NEW.changed_by, NEW.evidence);
    ELSIF NEW.state IS DISTINCT FROM OLD.state OR NEW.fence IS DISTINCT FROM OLD.fence
          OR NEW.evidence IS DISTINCT FROM OLD.evidence THEN
        INSERT INTO operation_history (operation_id, from_state, to_state, fence, actor, evidence)
        VALUES (NEW.id, OLD.state, NEW.state, NEW.fence, NEW.changed_by, NEW.evidence);
    END IF;
    RETURN NULL;
END $$;
CREATE TRIGGER operations_history AFTER INSERT OR UPDATE ON operations
    FOR EACH ROW EXECUTE FUNCTION operations_history();

CREATE FUNCTION operation_history_append_only() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'operation_history is append-only';
END $$;
CREATE TRIGGER operation_history_append_only BEFORE UPDATE ON operation_history
    FOR EACH ROW EXECUTE FUNCTION operation_history_append_only();

-- Result events, written in the same transaction as the state change that caused them and
-- published by the relay with publisher confirms.
CREATE TABLE result_outbox (
    id            bigserial   PRIMARY KEY,
    event_id      uuid        NOT NULL UNIQUE DEFAULT gen_random_uuid(),
    operation_id  bigint      REFERENCES operations (id) ON DELETE SET NULL,
    routing_key   text        NOT NULL,
    status        text        NOT NULL,
    payload       jsonb       NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    relay_owner   text,
    relay_until   timestamptz,
    published_at  timestamptz
);
CREATE INDEX result_outbox_unpublished ON result_outbox (id) WHERE published_at IS NULL;
CREATE INDEX result_outbox_published ON result_outbox (published_at) WHERE published_at IS NOT NULL;
