-- Retry throttling as a token bucket per tool, shared by all workers (gRPC's retry throttling):
-- a retry or replay may be sent only while the tool's tokens exceed half the capacity and costs
-- one token when sent; it earns the token back plus `ratio` only if it succeeds. A first
-- attempt that fails costs one token, one that succeeds earns `ratio`, and time refills
-- `floor_per_minute`. Tokens are stored as of `updated_at`; the time refill is applied by each
-- statement that touches the row. Replaces the sliding-window log in retry_spend, whose
-- give-back on success let failed retries go uncounted (retry_spend is no longer written).
CREATE TABLE retry_tokens (
    tool       text             PRIMARY KEY,
    tokens     double precision NOT NULL CHECK (tokens >= 0),
    updated_at timestamptz      NOT NULL DEFAULT now()
);
