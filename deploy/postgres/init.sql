-- Run once by the postgres container on an empty data directory (docker-compose.yml).
-- The reference downstream keeps its business data in its own database, apart from the ledger:
-- the fault tests count its mutations there, never in the worker's tables.
CREATE DATABASE downstream;
-- The demo agent's own database: its business rows and its intent_outbox (publisher migrate).
CREATE DATABASE agent;
-- The Grafana dashboard's read-only view of the ledger (its "Held operations" table): the role
-- is created here, its column grants on `operations` by the compose service `ledger-reader` once
-- `worker migrate` has created the table.
CREATE ROLE ledger_reader LOGIN PASSWORD 'ledger-reader-demo';
