// One test world against the real services, as clients/python/tests/conftest.py builds it: a
// fresh Postgres database, unique exchange and queue names, the reference downstream and a real
// worker binary, all removed afterwards.
import { type ChildProcess, spawn } from "node:child_process";
import { randomUUID } from "node:crypto";
import { mkdtempSync, rmSync, writeFileSync } from "node:fs";
import { createServer } from "node:net";
import { tmpdir } from "node:os";
import path from "node:path";
import amqp from "amqplib";
import pg from "pg";
import { binary } from "./paths.js";

export const PG_ADMIN =
  process.env.TEST_DATABASE_URL ?? "postgres://postgres@127.0.0.1:5432/postgres";
export const AMQP_URL = process.env.TEST_AMQP_URL ?? "amqp://guest:guest@127.0.0.1:5672/%2f";

/** `PG_ADMIN` naming database `name`: its user, hosts and parameters (`sslmode`, ...) kept. */
export function databaseUrl(name: string): string {
  const scheme = PG_ADMIN.indexOf("://") + 3;
  const rest = PG_ADMIN.slice(scheme);
  const end = rest.search(/[/?#]/);
  const authority = end < 0 ? rest : rest.slice(0, end);
  const tail = end < 0 ? "" : rest.slice(end);
  const query = tail.search(/[?#]/);
  const suffix = query < 0 ? "" : tail.slice(query);
  return `${PG_ADMIN.slice(0, scheme)}${authority}/${name}${suffix}`;
}

export class Child {
  readonly lines: string[] = [];
  readonly proc: ChildProcess;
  constructor(
    readonly name: string,
    args: string[],
    env: Record<string, string>,
  ) {
    const [cmd, ...rest] = args;
    this.proc = spawn(cmd as string, rest, { env, stdio: ["ignore", "pipe", "pipe"] });
    let partial = "";
    const take = (chunk: Buffer): void => {
      const parts = (partial + chunk.toString()).split("\n");
      partial = parts.pop() ?? "";
      this.lines.push(...parts);
      if (process.env.E2E_LOG) for (const l of parts) console.log(`[${name}] ${l}`);
    };
    this.proc.stdout?.on("data", take);
    this.proc.stderr?.on("data", take);
  }

  async waitForLine(needle: string, timeoutMs = 30_000): Promise<string> {
    const deadline = Date.now() + timeoutMs;
    while (Date.now() < deadline) {
      const found = this.lines.find((l) => l.includes(needle));
      if (found !== undefined) return found;
      if (this.proc.exitCode !== null) break;
      await new Promise((r) => setTimeout(r, 50));
    }
    throw new Error(`${this.name} did not print ${needle}:\n${this.lines.join("\n")}`);
  }

  async stop(): Promise<void> {
    if (this.proc.exitCode !== null || this.proc.signalCode !== null) return;
    const exited = new Promise<void>((r) => this.proc.once("exit", () => r()));
    this.proc.kill("SIGKILL");
    await exited;
  }
}

export function freePort(): Promise<number> {
  return new Promise((resolve, reject) => {
    const server = createServer();
    server.once("error", reject);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      const port = typeof address === "object" && address !== null ? address.port : 0;
      server.close(() => resolve(port));
    });
  });
}

const TOOLS = `[tools.refund]
url = "{base}/replay/refunds"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
{common}
[tools.reversal]
url = "{base}/replay/reversals"
recovery = "replay"
replay_window_secs = 3600
replay_safety_margin_secs = 60
compensation_for = ["refund"]
{common}
[tools.deploy]
url = "{base}/none/deploys"
recovery = "none"
{common}
`;
const COMMON = `receipt_id = "/receipt_id"
receipt_match = { "/idempotency_key" = "{tenant}:{action_id}" }
timeout_ms = 2000
recovery_attempts = 3
retry = { initial_delay_ms = 100, max_delay_ms = 1000 }
`;

/** Runs `work` on a connection of its own to `url` (the admin database by default). */
export async function admin<T>(work: (c: pg.Client) => Promise<T>, url = PG_ADMIN): Promise<T> {
  const client = new pg.Client({ connectionString: url });
  await client.connect();
  try {
    return await work(client);
  } finally {
    await client.end();
  }
}

export class World {
  readonly id = randomUUID().replaceAll("-", "").slice(0, 12);
  readonly dbName = `ts_${this.id}`;
  readonly dbUrl = databaseUrl(this.dbName);
  readonly prefix = `ts${this.id}`;
  readonly intentsExchange = `${this.prefix}.intents`;
  readonly resultsExchange = `${this.prefix}.results`;
  readonly intentsQueue = `${this.prefix}.intents`;
  readonly deadLetterExchange = `${this.prefix}.dlx`;
  readonly deadLetterQueue = `${this.prefix}.dead`;
  readonly tenant = "north-shop";
  readonly tenantToken = `tenant-token-${this.id}`;
  readonly dir = mkdtempSync(path.join(tmpdir(), "intent-ts-"));
  readonly children: Child[] = [];
  adminUrl = "";
  downstreamUrl = "";

  static async start(): Promise<World> {
    const w = new World();
    try {
      await w.#start();
    } catch (e) {
      await w.stop();
      throw e;
    }
    return w;
  }

  async #start(): Promise<void> {
    await admin((c) => c.query(`CREATE DATABASE "${this.dbName}"`));
    const basePath = process.env.PATH ?? "";
    const downstream = new Child("downstream", [binary("reference-downstream")], {
      PATH: basePath,
      DOWNSTREAM_DATABASE_URL: this.dbUrl,
      DOWNSTREAM_SCHEMA: "downstream",
      DOWNSTREAM_ADDR: "127.0.0.1:0",
      RUST_LOG: "warn",
    });
    this.children.push(downstream);
    const line = await downstream.waitForLine("reference-downstream listening on", 20_000);
    this.downstreamUrl = `http://127.0.0.1:${line.slice(line.lastIndexOf(":") + 1).trim()}`;
    const toolsFile = path.join(this.dir, "tools.toml");
    writeFileSync(
      toolsFile,
      TOOLS.replaceAll("{base}", this.downstreamUrl).replaceAll("{common}", COMMON),
    );
    const adminPort = await freePort();
    this.adminUrl = `http://127.0.0.1:${adminPort}`;
    const worker = new Child("worker", [binary("worker"), "run"], {
      PATH: basePath,
      RUST_LOG: "info,lapin=warn,sqlx=warn",
      DATABASE_URL: this.dbUrl,
      AMQP_URL,
      WORKER_TOOLS: toolsFile,
      WORKER_ID: `ts-worker-${this.id}`,
      WORKER_LEASE_SECS: "3",
      WORKER_RECOVERY_INTERVAL_MS: "200",
      INTENTS_EXCHANGE: this.intentsExchange,
      WORKER_INTENTS_QUEUE: this.intentsQueue,
      RESULTS_EXCHANGE: this.resultsExchange,
      WORKER_DEAD_LETTER_EXCHANGE: this.deadLetterExchange,
      WORKER_DEAD_LETTER_QUEUE: this.deadLetterQueue,
      WORKER_SHUTDOWN_GRACE_SECS: "5",
      WORKER_ADMIN_ADDR: `127.0.0.1:${adminPort}`,
      WORKER_ADMIN_TOKEN: `admin-token-${this.id}`,
      WORKER_TENANT_TOKENS: `${this.tenant}=${this.tenantToken}`,
      METRICS_ADDR: "off",
      WORKER_DB_POOL_SIZE: "3",
    });
    this.children.push(worker);
    await worker.waitForLine("consuming intents", 30_000);
  }

  /** Writes the downstream really applied for an idempotency key (its own table). */
  async mutations(key: string): Promise<number> {
    return admin(async (c) => {
      const r = await c.query(
        "SELECT count(*)::int AS n FROM downstream.mutations WHERE idem_key = $1",
        [key],
      );
      return (r.rows[0] as { n: number }).n;
    }, this.dbUrl);
  }

  /** Runs `publisher <args>` against this world; resolves with its output when it exits. */
  spawnPublisher(args: string[], env: Record<string, string> = {}): Child {
    const child = new Child(`publisher ${args[0]}`, [binary("publisher"), ...args], {
      PATH: process.env.PATH ?? "",
      RUST_LOG: "info,lapin=warn,sqlx=warn",
      AMQP_URL,
      PUBLISHER_DATABASE_URL: this.dbUrl,
      INTENTS_EXCHANGE: this.intentsExchange,
      PUBLISHER_LEASE: "2s",
      PUBLISHER_IDLE_POLL: "20ms",
      PUBLISHER_METRICS_ADDR: "off",
      ...env,
    });
    this.children.push(child);
    return child;
  }

  log(): string {
    return this.children.map((c) => c.lines.map((l) => `[${c.name}] ${l}`).join("\n")).join("\n");
  }

  async stop(): Promise<void> {
    for (const child of [...this.children].reverse()) await child.stop();
    try {
      const connection = await amqp.connect(AMQP_URL);
      connection.on("error", () => {});
      for (const queue of [this.intentsQueue, this.deadLetterQueue]) {
        const ch = await connection.createChannel();
        ch.on("error", () => {});
        await ch.deleteQueue(queue).catch(() => {});
      }
      for (const exchange of [
        this.intentsExchange,
        this.resultsExchange,
        this.deadLetterExchange,
      ]) {
        const ch = await connection.createChannel();
        ch.on("error", () => {});
        await ch.deleteExchange(exchange).catch(() => {});
      }
      await connection.close();
    } catch {
      // best effort
    }
    await admin((c) => c.query(`DROP DATABASE IF EXISTS "${this.dbName}" WITH (FORCE)`)).catch(
      () => {},
    );
    rmSync(this.dir, { recursive: true, force: true });
  }
}
