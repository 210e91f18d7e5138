-- A worker's own completion events are recorded as published by a watermark, not by a mark on
-- each row (docs/design.md, sections 2 and 10).
--
-- The completion batcher of one worker commits one batch at a time, so the events it inserts for
-- its own relay take increasing ids in commit order, and the relay receives them in that order.
-- Such a run of events is an epoch: one row here. When the relay has the broker's confirm for
-- every event of the epoch up to id N, it records N as the epoch's `through_id` (at most every
-- half second, not once per event). An outbox row of an epoch is published when its id is at
-- most the epoch's `through_id`, or once the epoch row is gone: an epoch is retired (deleted)
-- only in the same transaction that gives every row above its `through_id` back to the outbox
-- (`relay_epoch` set to NULL, then published and marked one by one like any other event).
--
-- An epoch is retired when nothing has advanced it for the relay hold (its worker died, or its
-- relay has been stalled that long). A worker whose hand-off to its relay broke (an event not
-- handed, a commit whose reply was lost, an event that waited too long) starts a new epoch, so
-- no watermark ever passes an event its relay did not see confirmed. A batch inserts into an
-- epoch only under a KEY SHARE lock of its row, which the retirement's row lock (SKIP LOCKED)
-- never waits for: an epoch in use is not retired, and one retired is not written to again.
CREATE TABLE relay_epochs (
    id           bigserial   PRIMARY KEY,
    worker_id    text        NOT NULL,
    -- Every row of this epoch with an id at most this is published. Starts at the largest outbox
    -- id when the epoch began, below every row the epoch will hold.
    through_id   bigint      NOT NULL,
    started_at   timestamptz NOT NULL DEFAULT now(),
    advanced_at  timestamptz NOT NULL DEFAULT now()
);

ALTER TABLE result_outbox ADD COLUMN relay_epoch bigint;

-- The relays' claims read unpublished rows that no epoch covers; an epoch's rows never enter
-- this index unless they are given back.
DROP INDEX result_outbox_unpublished;
CREATE INDEX result_outbox_unpublished ON result_outbox (id)
    WHERE published_at IS NULL AND relay_epoch IS NULL;

-- Retention deletes rows published through a watermark by age; appended in created_at order.
CREATE INDEX result_outbox_created ON result_outbox USING brin (created_at);

-- Every result event with whether it was published (by its own mark or by its epoch's
-- watermark). `published_at` is the time of the row's own mark; NULL for rows published through
-- a watermark.
CREATE VIEW result_events AS
SELECT r.id, r.event_id, r.operation_id, r.routing_key, r.status, r.payload, r.created_at,
       r.relay_owner, r.relay_until, r.relay_epoch, r.published_at, r.traceparent, r.tracestate,
       (r.published_at IS NOT NULL
        OR (r.relay_epoch IS NOT NULL
            AND NOT EXISTS (SELECT 1 FROM relay_epochs e
                            WHERE e.id = r.relay_epoch AND r.id > e.through_id))) AS published
FROM result_outbox r;
