-- Room on each page for every later version of a row (docs/design.md, section 10).
--
-- An operation is written three times: inserted, its send fence, its completion. An outbox row
-- twice: inserted, marked published. When the new version fits on the old one's page, Postgres
-- logs only the bytes that changed (prefix and suffix compression) and, for the send fence, takes
-- no index entry at all (a HOT update). When it does not fit, the whole row is logged again on
-- another page, with a lock record for the old one, and every index takes a new entry.
--
-- With fillfactor 80 a page filled with fresh operations (about 500 bytes each) had room for
-- three or four new versions, so most send fences and every completion moved to another page.
-- Measured by the cost benchmark (docs/benchmarks.md, "Cost per intent"): every send fence is
-- now HOT, completions and outbox marks stay on their page, and WAL per intent falls from about
-- 3,850 to 2,770 bytes. The price is disk: an operations page holds about a third as many rows
-- when they are written, and the retention sweeps and vacuum reuse the room afterwards.
--
-- Only pages written from now on are laid out this way; an existing ledger is not rewritten
-- (the lock this takes does not block reads or writes).
ALTER TABLE operations SET (fillfactor = 30);
ALTER TABLE result_outbox SET (fillfactor = 50);
