-- The receipts of a completion batch (worker/src/ledger/complete.rs, `succeed_many`) as a
-- function, for the reason the send fence is one (0022): its plan is made once per connection
-- instead of at each run, and it is one that finds each row by primary key whatever the table's
-- size when it was made. Sent as a statement, it was parsed and planned for every batch of
-- receipts, and planning was about half its cost at moderate rates. The settings below hold for
-- the planning done inside the function, as in 0022: one generic plan, made at the first call on
-- each connection and kept, that walks the batch's ids through the primary key. The state
-- predicate is written so that no index can serve it (a bitmap scan through an index of
-- unresolved rows would visit every page of every row unresolved since the last vacuum).
--
-- `prev` locks the rows in id order (no deadlock between batches of two workers), keeps what the
-- agent was told before, which decides the event, and carries each row's input: the arrays are
-- unnested once, each element finding its row by id. A row still unresolved becomes
-- `succeeded` with its receipt; `verified_by` is the receipt's source, except a dispatch's
-- answer arriving for a row no longer `dispatching` (its lease ran out meanwhile), which is a
-- late receipt. One row per receipt recorded: the row as it now is and what was reported before.
CREATE FUNCTION succeed_receipts(p_ids bigint[], p_worker text, p_evidences text[],
                                 p_receipts text[], p_receipt_ids text[], p_sources text[])
RETURNS TABLE (op operations, prev_reported text)
LANGUAGE plpgsql
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
BEGIN
    RETURN QUERY
    WITH prev AS (
        SELECT o.id, o.last_reported, i.evidence, i.receipt, i.receipt_id, i.by
          FROM unnest(p_ids, p_evidences, p_receipts, p_receipt_ids, p_sources)
               AS i(id, evidence, receipt, receipt_id, by)
          JOIN operations o ON o.id = i.id
         ORDER BY o.id
           FOR UPDATE OF o
    )
    UPDATE operations o
       SET state = 'succeeded', receipt = prev.receipt::json, receipt_id = prev.receipt_id,
           evidence = prev.evidence, changed_by = p_worker, lease_owner = NULL,
           lease_until = NULL, next_attempt_at = NULL, last_reported = 'succeeded',
           updated_at = now(), state_since = now(), finished_at = now(),
           verified_by = CASE WHEN prev.by = 'dispatch' AND o.state <> 'dispatching'
                              THEN 'late_receipt' ELSE prev.by END
      FROM prev
     WHERE o.id = prev.id
       AND (o.state IN ('dispatching', 'unknown', 'held', 'retry_wait', 'accepted')) IS TRUE
    RETURNING o, prev.last_reported;
END
$$;
