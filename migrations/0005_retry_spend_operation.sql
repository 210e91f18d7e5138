-- A retry's spending is tied to its operation, so the budget can give it back when the
-- operation succeeds: the budget bounds retries against a downstream that keeps failing, and a
-- recovered downstream drains deferred retries without waiting for the floor.
ALTER TABLE retry_spend ADD COLUMN operation_id bigint;
CREATE INDEX retry_spend_operation ON retry_spend (operation_id) WHERE operation_id IS NOT NULL;
