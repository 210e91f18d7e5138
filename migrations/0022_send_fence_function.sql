-- The send fence (worker/src/ledger/claim.rs, `fence_sends`) as a function, so that its plan is
-- made once per connection instead of at each run, and is one that finds each row by primary key
-- whatever the table's size when it was made.
--
-- As a statement sent by the worker, the fence was parsed, described and planned for every
-- batch (a batch of one is every send at light load), and planning was most of its cost. A
-- prepared statement is planned for its parameters five times, then Postgres keeps a generic
-- plan until the table's next analysis; made while the table was young and analysed (a page or
-- two), that plan is a sequential scan (or a join that reads all of the primary key), and it
-- would read the whole grown table for every batch. The settings below hold for the planning
-- done inside the function: one generic plan, made at the first call on each connection and
-- kept (left to choose, Postgres would plan for each call's arrays, whose length it can see),
-- that walks the batch's ids and finds each row through the primary key. The state predicate
-- is written so that no index can serve it (a bitmap scan through the unresolved index would
-- visit every page of every row unresolved since the last vacuum).
--
-- Each row passes only if it is still `dispatching` at the batch's fence for it, leased by
-- `p_owner`, the lease live on the database clock; it is then marked sent (`unsent_fence`
-- cleared), its lease renewed past the request's timeout, and its request deadline kept or set
-- (never lowered; a row once sent without one keeps none). One row per send that passed.
CREATE FUNCTION fence_sends(p_ids bigint[], p_fences bigint[], p_timeouts float8[],
                            p_owner text, p_lease float8, p_deadlines float8[])
RETURNS TABLE (sent_id bigint, sent_fence bigint, sent_deadline timestamptz)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
BEGIN
    RETURN QUERY
    UPDATE operations o
       SET lease_until = now() + make_interval(secs => i.timeout + p_lease),
           unsent_fence = NULL,
           send_deadline = CASE
               WHEN i.deadline IS NULL OR (o.send_deadline IS NULL AND o.attempts > 1)
                   THEN NULL
               ELSE greatest(o.send_deadline, now() + make_interval(secs => i.deadline)) END
      FROM unnest(p_ids, p_fences, p_timeouts, p_deadlines) AS i(id, fence, timeout, deadline)
     WHERE o.id = i.id AND o.fence = i.fence AND (o.state = 'dispatching') IS TRUE
       AND o.lease_owner = p_owner AND o.lease_until > now()
    RETURNING o.id, o.fence, CASE WHEN i.deadline IS NOT NULL
        THEN coalesce(o.send_deadline, now() + make_interval(secs => i.deadline)) END;
END
$$;
