/**
 * The agent-side transactional outbox: {@link enqueue} inserts a validated intent into
 * `intent_outbox` inside the caller's own transaction (a `pg` client), so the intent exists if
 * and only if the agent's own write commits; `publisher relay` publishes the rows. The table is
 * the one `publisher migrate` creates.
 */
import { type Intent, validateIntent } from "./intent.js";
import { currentTraceHeaders, type TraceContext, traceHeaders } from "./trace.js";

/** What {@link enqueue} needs of a Postgres client: `pg`'s `PoolClient` and `Client` fit. */
export interface Queryable {
  query(
    text: string,
    values?: unknown[],
  ): Promise<{ rows: Array<Record<string, unknown>> } | object>;
}

/** The same DDL as `publisher migrate` (publisher/migrations 0001 to 0003). */
export const OUTBOX_DDL = `CREATE TABLE IF NOT EXISTS intent_outbox (
    id              bigserial   PRIMARY KEY,
    tenant          text        NOT NULL,
    action_id       text        NOT NULL,
    body            text        NOT NULL,
    created_at      timestamptz NOT NULL DEFAULT now(),
    next_attempt_at timestamptz NOT NULL DEFAULT now(),
    attempts        integer     NOT NULL DEFAULT 0,
    last_error      text,
    sent_at         timestamptz
);
CREATE INDEX IF NOT EXISTS intent_outbox_due ON intent_outbox (next_attempt_at, id) WHERE sent_at IS NULL;
ALTER TABLE intent_outbox
    ADD COLUMN IF NOT EXISTS failed_at timestamptz,
    ADD COLUMN IF NOT EXISTS failure   text;
ALTER TABLE intent_outbox
    ADD COLUMN IF NOT EXISTS traceparent text,
    ADD COLUMN IF NOT EXISTS tracestate  text;
`;

const INSERT =
  "INSERT INTO intent_outbox (tenant, action_id, body, traceparent, tracestate) VALUES ($1, $2, $3, $4, $5) RETURNING id";

/** Creates `intent_outbox` if it does not exist (idempotent). */
export async function createOutbox(client: Queryable): Promise<void> {
  await client.query(OUTBOX_DDL);
}

/** Validates `intent` as the worker will and inserts it in `client`'s current transaction;
 * returns the row id (as a string: a bigserial). Nothing is published until that transaction
 * commits and a relay picks the row up. Throws InvalidIntentError (nothing inserted). */
export async function enqueue(
  client: Queryable,
  intent: Intent,
  trace: TraceContext = {},
): Promise<string> {
  const explicit = traceHeaders(trace); // a tracestate alone is refused before anything else
  const { intent: decoded, body } = validateIntent(intent);
  const headers = await currentTraceHeaders(explicit);
  const result = await client.query(INSERT, [
    decoded.tenant,
    decoded.action_id,
    new TextDecoder().decode(body),
    headers.traceparent ?? null,
    headers.tracestate ?? null,
  ]);
  const rows = "rows" in result ? (result.rows as Array<Record<string, unknown>>) : [];
  const id = rows[0]?.id;
  if (id === undefined || id === null) throw new Error("intent_outbox insert returned no id");
  return String(id);
}
