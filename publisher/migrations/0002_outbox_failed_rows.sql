-- Rows that can never be published (their key <tenant>:<action_id> is over the 255 bytes of an
-- AMQP message_id, their body is not an intent the worker's decoder accepts, or the body's
-- tenant/action_id differ from the row's columns) are marked failed with the reason and skipped
-- by `publisher relay`, so one bad row cannot stop the rows behind it. One idempotent statement,
-- like 0001: an application may put this exact text in its own migrations.
ALTER TABLE intent_outbox
    ADD COLUMN IF NOT EXISTS failed_at timestamptz,  -- set once; the relay never claims it again
    ADD COLUMN IF NOT EXISTS failure   text;         -- why, in words (never the body)
