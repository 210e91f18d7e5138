-- The operator console (docs/console.md): bulk jobs, the audit of dead-letter actions, and the
-- workers' heartbeats. None of these tables is written on the intent path.

-- A bulk recheck or fail of every operation a filter matched when the job was created. The
-- matched operations are copied into bulk_job_items (at most `cap`), so the job does exactly
-- that set whatever arrives later; each item goes through the operator action's own guarded
-- statement with the request id `bulk:<job id>:<operation id>`, so a resumed job repeats nothing.
-- The job is owned by one worker at a time (`owner`, `lease_until`, renewed as it works); a
-- running job whose lease lapsed is taken over by another worker's console.
CREATE TABLE bulk_jobs (
    id           bigserial   PRIMARY KEY,
    -- The creating form's request id: submitting it twice creates one job.
    request_id   text        NOT NULL UNIQUE,
    action       text        NOT NULL CHECK (action IN ('recheck', 'fail')),
    -- The console filter the job was created from (shown on its page).
    filter       jsonb       NOT NULL,
    operator     text        NOT NULL,
    -- The reason (recheck) or the evidence (fail) every item is given.
    reason       text        NOT NULL,
    cap          integer     NOT NULL CHECK (cap > 0),
    total        integer     NOT NULL DEFAULT 0,
    done         integer     NOT NULL DEFAULT 0,
    skipped      integer     NOT NULL DEFAULT 0,
    refused      integer     NOT NULL DEFAULT 0,
    status       text        NOT NULL DEFAULT 'running'
                 CHECK (status IN ('running', 'finished', 'cancelled', 'abandoned')),
    owner        text,
    lease_until  timestamptz,
    -- How many times a worker took the job (1 at creation); past a bound it is abandoned.
    claims       integer     NOT NULL DEFAULT 1,
    last_error   text,
    created_at   timestamptz NOT NULL DEFAULT now(),
    updated_at   timestamptz NOT NULL DEFAULT now(),
    finished_at  timestamptz
);
-- Workers look for running jobs whose owner's lease lapsed.
CREATE INDEX bulk_jobs_running ON bulk_jobs (lease_until) WHERE status = 'running';

CREATE TABLE bulk_job_items (
    job_id       bigint NOT NULL REFERENCES bulk_jobs (id) ON DELETE CASCADE,
    -- No foreign key: retention may delete the operation's tombstone while the job is kept.
    operation_id bigint NOT NULL,
    outcome      text   CHECK (outcome IN ('done', 'skipped', 'refused')),
    detail       text,
    PRIMARY KEY (job_id, operation_id)
);

-- Every republish or discard of a dead letter, keyed by the request id the console form or
-- `worker ops dead-letters` gave it, so repeating a step finds its row instead of acting again.
CREATE TABLE dead_letter_actions (
    request_id     text        PRIMARY KEY,
    action         text        NOT NULL CHECK (action IN ('republish', 'discard')),
    -- The console's id of the message: a digest of its message id, routing key and body.
    dead_letter_id text        NOT NULL,
    message_id     text,
    reason         text,
    tenant         text,
    original_user  text,
    operator       text        NOT NULL,
    note           text        NOT NULL,
    -- started: being done (or interrupted: repeating the request finishes it); done;
    -- not_found: no such message was in the queue.
    status         text        NOT NULL CHECK (status IN ('started', 'done', 'not_found')),
    created_at     timestamptz NOT NULL DEFAULT now(),
    finished_at    timestamptz
);
CREATE INDEX dead_letter_actions_created ON dead_letter_actions (created_at);

-- What each worker last said about itself (every few seconds), for the console's overview:
-- which workers are running and whether they are ready.
CREATE TABLE worker_heartbeats (
    worker_id   text        PRIMARY KEY,
    ready       boolean     NOT NULL,
    reasons     text        NOT NULL DEFAULT '',
    started_at  timestamptz NOT NULL,
    seen_at     timestamptz NOT NULL DEFAULT now()
);
