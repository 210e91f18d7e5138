-- Run once by the postgres container on an empty data directory (docker-compose.yml).
-- The reference downstream keeps its business data in its own database, apart from the ledger:
-- the fault tests count its mutations there, never in the worker's tables.
CREATE DATABASE downstream;
-- The demo agent's own database: its business rows and its intent_outbox (publisher migrate).
CREATE DATABASE agent;
