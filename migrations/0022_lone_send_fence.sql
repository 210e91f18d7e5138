-- The send fence of a lone send (a batch of one: every send at light load) as a function, so
-- that its plan is made once per connection and always finds the row by primary key.
--
-- The batch's fence joins its ids from arrays and is planned at each run, for the batch and
-- the table it meets; for one row that planning (with the parse and the statement's
-- description) is most of the fence's cost. A prepared statement is planned for its
-- parameters five times, then Postgres keeps a generic plan until the table's next analysis;
-- made while the table was young and analysed (a page or two), that plan is a sequential scan,
-- and it would read the whole grown table for every send. `enable_seqscan = off` holds for the
-- planning done inside the function, so its kept plan is the primary key's whatever the size
-- the table had when it was made.
--
-- The same rule as the batch statement (worker/src/ledger/claim.rs, `fence_sends`): the row is
-- still `dispatching` at this fence, leased by this worker, the lease live; the lease is renewed
-- past the request's timeout, the row marked sent, and the request deadline kept or set. One
-- row (the deadline, NULL without one) when the fence passed, none when it did not.
CREATE FUNCTION fence_lone_send(p_id bigint, p_fence bigint, p_timeout float8, p_owner text,
                                p_lease float8, p_deadline float8)
RETURNS SETOF timestamptz
LANGUAGE plpgsql
SET enable_seqscan = off
AS $$
BEGIN
    RETURN QUERY
    UPDATE operations o
       SET lease_until = now() + make_interval(secs => p_timeout + p_lease),
           unsent_fence = NULL,
           send_deadline = CASE
               WHEN p_deadline IS NULL OR (o.send_deadline IS NULL AND o.attempts > 1)
                   THEN NULL
               ELSE greatest(o.send_deadline, now() + make_interval(secs => p_deadline)) END
     WHERE o.id = p_id AND o.fence = p_fence AND (o.state = 'dispatching') IS TRUE
       AND o.lease_owner = p_owner AND o.lease_until > now()
    RETURNING CASE WHEN p_deadline IS NOT NULL
        THEN coalesce(o.send_deadline, now() + make_interval(secs => p_deadline)) END;
END
$$;
