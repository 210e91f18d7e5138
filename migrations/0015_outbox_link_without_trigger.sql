-- The outbox's link to its operation is kept by the statements that write it, not by a foreign
-- key (docs/design.md, section 10).
--
-- The key's check ran a trigger query per inserted event (a lookup of the operation with a
-- KEY SHARE lock, about a fifth more CPU per outbox insert here) that repeated what the insert
-- already knew: a completion inserts its events in the transaction whose UPDATE of the same
-- operations returned their ids, and holds their row locks until it commits; an answer carries
-- the id of the row its key was found at. What the key did on delete (`ON DELETE SET NULL`) the
-- tombstone retention does in the statement that deletes the operations.
ALTER TABLE result_outbox DROP CONSTRAINT result_outbox_operation_id_fkey;
