-- History also records the attempt count and the scheduled next attempt of every change, so
-- the retry schedule a worker computed is auditable (and testable) after the fact.
ALTER TABLE operation_history ADD COLUMN attempts integer;
ALTER TABLE operation_history ADD COLUMN next_attempt_at timestamptz;

CREATE OR REPLACE FUNCTION operations_history() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        INSERT INTO operation_history (operation_id, from_state, to_state, fence, actor, evidence,
                                       attempts, next_attempt_at)
        VALUES (NEW.id, NULL, NEW.state, NEW.fence, NEW.changed_by, NEW.evidence,
                NEW.attempts, NEW.next_attempt_at);
    ELSIF NEW.state IS DISTINCT FROM OLD.state OR NEW.fence IS DISTINCT FROM OLD.fence
          OR NEW.evidence IS DISTINCT FROM OLD.evidence THEN
        INSERT INTO operation_history (operation_id, from_state, to_state, fence, actor, evidence,
                                       attempts, next_attempt_at)
        VALUES (NEW.id, OLD.state, NEW.state, NEW.fence, NEW.changed_by, NEW.evidence,
                NEW.attempts, NEW.next_attempt_at);
    END IF;
    RETURN NULL;
END $$;
