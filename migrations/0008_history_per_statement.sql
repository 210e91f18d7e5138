-- History written once per statement instead of once per row (issue 11).
--
-- Every batch statement of the worker (the admitting insert, the completion update) changes
-- up to a few hundred rows; a row-level trigger ran one PL/pgSQL call and one single-row INSERT
-- per row. Statement-level triggers read the statement's transition tables and append the same
-- rows, with the same columns and the same rule (an insert, or a change of state, fence or
-- evidence), in one INSERT ... SELECT ordered by operation id. Measured per 200-row statement:
-- see README "Measurements" (issue 11, third round).
--
-- `at` keeps DEFAULT clock_timestamp(): the time the statement's history is written, right
-- after its rows changed and before its transaction commits.

CREATE FUNCTION operations_history_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO operation_history (operation_id, from_state, to_state, fence, actor, evidence,
                                   attempts, next_attempt_at)
    SELECT n.id, NULL, n.state, n.fence, n.changed_by, n.evidence, n.attempts, n.next_attempt_at
    FROM inserted_rows n
    ORDER BY n.id;
    RETURN NULL;
END $$;

CREATE FUNCTION operations_history_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO operation_history (operation_id, from_state, to_state, fence, actor, evidence,
                                   attempts, next_attempt_at)
    SELECT n.id, o.state, n.state, n.fence, n.changed_by, n.evidence, n.attempts,
           n.next_attempt_at
    FROM new_rows n JOIN old_rows o ON o.id = n.id
    WHERE n.state IS DISTINCT FROM o.state OR n.fence IS DISTINCT FROM o.fence
       OR n.evidence IS DISTINCT FROM o.evidence
    ORDER BY n.id;
    RETURN NULL;
END $$;

DROP TRIGGER operations_history_insert ON operations;
DROP TRIGGER operations_history_change ON operations;
CREATE TRIGGER operations_history_insert AFTER INSERT ON operations
    REFERENCING NEW TABLE AS inserted_rows
    FOR EACH STATEMENT EXECUTE FUNCTION operations_history_inserted();
CREATE TRIGGER operations_history_change AFTER UPDATE ON operations
    REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
    FOR EACH STATEMENT EXECUTE FUNCTION operations_history_changed();
DROP FUNCTION operations_history();
