-- Console ids that may be used no more (docs/console.md): a sign-in form's nonce once it was
-- submitted (a form is single-use), and a session id once its session signed out. Every worker
-- checks a session cookie and a sign-in form against this table, so signing out on one worker
-- ends the session on all of them. A row is kept until its id would have expired anyway; the
-- retention sweeper deletes it then.
CREATE TABLE console_spent_ids (
    -- SHA-256 of the id (hex), never the id itself.
    id          text        PRIMARY KEY,
    kind        text        NOT NULL CHECK (kind IN ('login_form', 'session')),
    spent_at    timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL
);
CREATE INDEX console_spent_ids_expiry ON console_spent_ids (expires_at);
