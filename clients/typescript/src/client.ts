/**
 * The AMQP side of an agent: publish intents (persistent, mandatory, publisher confirms, the
 * worker's own validation first) and wait for one action's answer on a results queue that only
 * this agent's events are routed to (`<tenant>.@.<reply_to>`), with the worker's status API as
 * the fallback for answers the queue missed.
 */
import { randomUUID } from "node:crypto";
import amqp from "amqplib";
import {
  ClientError,
  NoAnswerError,
  PublishError,
  PublishInDoubtError,
  StatusApiError,
  TopologyMissingError,
} from "./errors.js";
import { fingerprint } from "./fingerprint.js";
import { decodeIntent, type Intent, validateIntent } from "./intent.js";
import {
  answersIntent,
  InvalidResultEventError,
  isFinal,
  parseResultEvent,
  type ResultEvent,
} from "./result.js";
import { resultRoutingKey } from "./routing.js";
import { inPublishSpan, type TraceContext, traceHeaders } from "./trace.js";

const ANSWERS_KEPT = 10_000;
const EVENT_IDS_KEPT = 50_000;
const EVENTS_PER_ACTION = 16;

/** Options of {@link IntentClient.connect}. */
export interface ConnectOptions {
  /** This agent's name in result routing keys (default: `agent-<random>`). */
  readonly replyTo?: string;
  /** Default `intents`. */
  readonly intentsExchange?: string;
  /** Default `results`. */
  readonly resultsExchange?: string;
  /** The worker's status API base URL (enables the fallback of waits). */
  readonly statusUrl?: string;
  /** A tenant token of the status API. */
  readonly statusToken?: string;
  /** `true` (default): the AMQP user_id is the URL's user; a string: that value; `false`: none. */
  readonly userId?: boolean | string;
  /** Also bind the plain `<tenant>` key (workers that route every result by tenant). */
  readonly bindTenant?: boolean;
  /** Per-node connect timeout (default 10 s). */
  readonly connectTimeoutMs?: number;
}

/** Options of {@link IntentClient.publish}. */
export interface PublishOptions extends TraceContext {
  /** Bound on the confirm (default 30 s); past it, {@link PublishInDoubtError}. */
  readonly timeoutMs?: number;
}

/** Options of {@link IntentClient.waitFor}. */
export interface WaitOptions {
  /** Only answers to the intent with this fingerprint count (and `expired`). */
  readonly fingerprint?: string;
  /** Default 30 s. */
  readonly timeoutMs?: number;
  /** How often the status API is asked, when configured (default 2 s). */
  readonly pollIntervalMs?: number;
}

/** Options of {@link IntentClient.sendAndWait}. */
export interface SendAndWaitOptions extends TraceContext {
  readonly timeoutMs?: number;
  readonly pollIntervalMs?: number;
}

/** Options of {@link IntentClient.follow}. */
export interface FollowOptions {
  readonly fingerprint?: string;
  /** Ends the iteration when aborted. */
  readonly signal?: AbortSignal;
}

/** One URL, a comma-separated list, or one URL per cluster node. */
function urlList(urls: string | readonly string[]): string[] {
  const items = typeof urls === "string" ? urls.split(",") : [...urls];
  const out = items.map((u) => u.trim()).filter((u) => u.length > 0);
  if (out.length === 0) throw new TypeError("no AMQP URL given");
  return out;
}

function shuffled<T>(items: readonly T[]): T[] {
  const out = [...items];
  for (let i = out.length - 1; i > 0; i--) {
    const j = Math.floor(Math.random() * (i + 1));
    [out[i], out[j]] = [out[j] as T, out[i] as T];
  }
  return out;
}

async function withTimeout<T>(work: Promise<T>, ms: number, onTimeout: () => Error): Promise<T> {
  let timer: NodeJS.Timeout | undefined;
  try {
    return await Promise.race([
      work,
      new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(onTimeout()), ms);
      }),
    ]);
  } finally {
    clearTimeout(timer);
  }
}

function describe(e: unknown): string {
  return e instanceof Error ? e.message : String(e);
}

/** One connection and its channels. */
interface Link {
  readonly model: amqp.ChannelModel;
  readonly publish: amqp.ConfirmChannel;
  readonly results: amqp.Channel;
  readonly queue: string;
}

/** Connects to the first node (in a random order) that accepts, checks the worker's exchanges
 * and opens the channels and an exclusive results queue. */
async function openLink(urls: string[], options: ConnectOptions, replyTo: string): Promise<Link> {
  let model: amqp.ChannelModel | undefined;
  let last: unknown;
  for (const url of shuffled(urls)) {
    try {
      model = await amqp.connect(url, {
        timeout: options.connectTimeoutMs ?? 10_000,
        clientProperties: { connection_name: `intent-worker-client ${replyTo}` },
      });
      break;
    } catch (e) {
      last = e;
    }
  }
  if (model === undefined) {
    throw new ClientError(`no RabbitMQ node reachable: ${describe(last)}`, { cause: last });
  }
  const connected = model;
  connected.on("error", () => {
    // Reported through the close event and failed operations.
  });
  try {
    for (const exchange of [
      options.intentsExchange ?? "intents",
      options.resultsExchange ?? "results",
    ]) {
      const probe = await connected.createChannel();
      probe.on("error", () => {});
      try {
        await probe.checkExchange(exchange);
      } catch (e) {
        throw new TopologyMissingError(
          `exchange ${JSON.stringify(exchange)} not found: start a worker first (${describe(e)})`,
          { cause: e },
        );
      }
      await probe.close();
    }
    const publish = await connected.createConfirmChannel();
    const results = await connected.createChannel();
    publish.on("error", () => {});
    results.on("error", () => {});
    const queue = await results.assertQueue("", { exclusive: true, autoDelete: true });
    return { model: connected, publish, results, queue: queue.queue };
  } catch (e) {
    await connected.close().catch(() => {});
    throw e;
  }
}

/** One agent's connection. Use {@link IntentClient.connect}. */
export class IntentClient {
  /** This agent's reply_to. */
  readonly replyTo: string;
  /** The AMQP user_id sent with every intent, or undefined. */
  readonly userId: string | undefined;
  #link: Link;
  readonly #urls: string[];
  readonly #connectOptions: ConnectOptions;
  readonly #intentsExchange: string;
  readonly #resultsExchange: string;
  readonly #statusUrl: string | undefined;
  readonly #statusToken: string | undefined;
  readonly #bindTenant: boolean;
  readonly #bound = new Set<string>();
  readonly #tenants = new Set<string>();
  #reconnecting = false;
  readonly #deadLinks = new WeakSet<Link>();
  readonly #binding = new Map<string, Promise<void>>();
  readonly #answers = new Map<string, ResultEvent[]>();
  readonly #seen = new Set<string>();
  readonly #listeners = new Set<() => void>();
  readonly #returned = new Map<string, number>();
  #closed = false;
  #linkError: Error | undefined;

  private constructor(
    link: Link,
    urls: string[],
    replyTo: string,
    userId: string | undefined,
    options: ConnectOptions,
  ) {
    this.#link = link;
    this.#urls = urls;
    this.#connectOptions = options;
    this.replyTo = replyTo;
    this.userId = userId;
    this.#intentsExchange = options.intentsExchange ?? "intents";
    this.#resultsExchange = options.resultsExchange ?? "results";
    this.#statusUrl = options.statusUrl?.replace(/\/+$/, "");
    this.#statusToken = options.statusToken;
    this.#bindTenant = options.bindTenant ?? false;
  }

  /** Connects to the first node (in a random order) that accepts, checks that the worker's
   * exchanges exist, and opens this agent's results queue (exclusive, deleted with the
   * connection; the status API covers what happened while no queue existed). A lost link is
   * connected again in the background (any node), its tenants bound again. */
  static async connect(
    amqpUrls: string | readonly string[],
    options: ConnectOptions = {},
  ): Promise<IntentClient> {
    const replyTo = options.replyTo ?? `agent-${randomUUID().replaceAll("-", "").slice(0, 12)}`;
    // reply_to by the contract's own rules, before anything is declared.
    validateIntent({ tenant: "t", action_id: "a", tool: "x", arguments: {}, reply_to: replyTo });
    const urls = urlList(amqpUrls);
    let userId: string | undefined;
    if (options.userId === undefined || options.userId === true) {
      userId = decodeURIComponent(new URL(urls[0] as string).username || "guest");
    } else if (typeof options.userId === "string") {
      userId = options.userId;
    }
    const link = await openLink(urls, options, replyTo);
    const client = new IntentClient(link, urls, replyTo, userId, options);
    try {
      await client.#attach(link);
    } catch (e) {
      await link.model.close().catch(() => {});
      throw e;
    }
    return client;
  }

  /** Listens to a new link and consumes its results queue. */
  async #attach(link: Link): Promise<void> {
    const dead = (e: unknown): void => {
      this.#deadLinks.add(link);
      if (link !== this.#link) return;
      this.#linkError ??= e instanceof Error ? e : new Error("connection closed");
      this.#bound.clear();
      this.#notify();
      if (!this.#closed) void this.#reconnect();
    };
    link.model.on("close", dead);
    link.publish.on("error", dead);
    link.publish.on("close", dead);
    link.results.on("error", dead);
    link.publish.on("return", (message: amqp.Message) => {
      const id = String(message.properties.messageId ?? "");
      this.#returned.set(id, (this.#returned.get(id) ?? 0) + 1);
    });
    await link.results.consume(link.queue, (m) => this.#onMessage(m), { noAck: true });
  }

  /** Connects again (any node), binds every tenant this client listens to, then lets publishes
   * through. Events routed while no queue existed are lost: waits fall back to the status API. */
  async #reconnect(): Promise<void> {
    if (this.#reconnecting) return;
    this.#reconnecting = true;
    let delay = 250;
    try {
      while (!this.#closed) {
        await new Promise((r) => setTimeout(r, delay));
        if (this.#closed) return;
        delay = Math.min(delay * 2, 5_000);
        let link: Link;
        try {
          link = await openLink(this.#urls, this.#connectOptions, this.replyTo);
        } catch {
          continue;
        }
        if (this.#closed) {
          await link.model.close().catch(() => {});
          return;
        }
        this.#link = link;
        try {
          await this.#attach(link);
          // Until every wanted tenant is bound (a bind may be asked for meanwhile).
          for (let missing = [...this.#tenants]; missing.length > 0; ) {
            for (const tenant of missing) await this.#bindOn(link, tenant);
            missing = [...this.#tenants].filter((t) => !this.#bound.has(t));
          }
        } catch {
          await link.model.close().catch(() => {});
          continue;
        }
        if (link !== this.#link || this.#deadLinks.has(link)) continue;
        this.#linkError = undefined;
        this.#notify();
        return;
      }
    } finally {
      this.#reconnecting = false;
    }
  }

  /** Resolves when the link is up, or false at the deadline or on close. */
  async #linkUp(deadline: number): Promise<boolean> {
    while (this.#linkError !== undefined && !this.#closed && Date.now() < deadline) {
      await this.#changed(deadline - Date.now());
    }
    return this.#linkError === undefined && !this.#closed;
  }

  /** Closes the connection, bounded even when the link is dead (then the socket is dropped). */
  async close(timeoutMs = 5_000): Promise<void> {
    if (this.#closed) return;
    this.#closed = true;
    this.#notify();
    try {
      await withTimeout(this.#link.model.close(), timeoutMs, () => new Error("close timed out"));
    } catch {
      const stream = (
        this.#link.model.connection as unknown as { stream?: { destroy(e: Error): void } }
      ).stream;
      // With an error, so that amqplib stops its heartbeat timers too.
      stream?.destroy(new Error("closed by the client: the broker did not answer in time"));
    }
  }

  // ---- publishing -------------------------------------------------------------------------

  /** Validates the intent on the exact bytes to send, binds this agent's results key for its
   * tenant (before publishing, so the answer cannot come first), and publishes it with
   * confirms. An intent without reply_to gets this client's. Returns the intent as sent.
   * Throws InvalidIntentError (nothing sent), PublishError or PublishInDoubtError. */
  async publish(intent: Intent, options: PublishOptions = {}): Promise<Intent> {
    // A tracestate alone is refused before anything is bound or sent.
    const explicit = traceHeaders(options);
    const withReply: Intent =
      intent.reply_to === undefined || intent.reply_to === null
        ? { ...intent, reply_to: this.replyTo }
        : intent;
    const { intent: decoded, body } = validateIntent(withReply);
    const timeoutMs = options.timeoutMs ?? 30_000;
    if (decoded.reply_to === this.replyTo) {
      try {
        await withTimeout(this.#bind(decoded.tenant), timeoutMs, () => new Error("timed out"));
      } catch (e) {
        throw new PublishError(
          `intent ${decoded.tenant}:${decoded.action_id} was not sent: binding its results key failed (${describe(e)})`,
          { cause: e },
        );
      }
    }
    await this.#traced(decoded, explicit, (headers) =>
      this.#send(decoded, body, headers, timeoutMs),
    );
    return decoded;
  }

  /** Publishes an already serialized intent (an outbox row's body) byte for byte, after
   * validating it. For relays; agents use {@link publish}. */
  async publishBody(body: Uint8Array, options: PublishOptions = {}): Promise<Intent> {
    const explicit = traceHeaders(options);
    const intent = decodeIntent(body);
    await this.#traced(intent, explicit, (headers) =>
      this.#send(intent, body, headers, options.timeoutMs ?? 30_000),
    );
    return intent;
  }

  /** Runs a send in its producer span (see trace.ts). */
  #traced(
    intent: Intent,
    explicit: Record<string, string>,
    send: (headers: Record<string, string>) => Promise<void>,
  ): Promise<void> {
    const target = {
      exchange: this.#intentsExchange,
      tenant: intent.tenant,
      actionId: intent.action_id,
      tool: intent.tool,
    };
    return inPublishSpan(target, explicit, send);
  }

  async #send(
    intent: Intent,
    body: Uint8Array,
    headers: Record<string, string>,
    timeoutMs: number,
  ): Promise<void> {
    const messageId = `${intent.tenant}:${intent.action_id}`;
    if (!(await this.#linkUp(Date.now() + timeoutMs))) {
      throw new PublishError(
        `intent ${messageId} was not sent: the connection is ${this.#closed ? "closed" : `down (${this.#linkError?.message})`}`,
      );
    }
    const confirmed = new Promise<void>((resolve, reject) => {
      try {
        this.#link.publish.publish(
          this.#intentsExchange,
          intent.tenant,
          Buffer.from(body.buffer, body.byteOffset, body.byteLength),
          {
            persistent: true,
            mandatory: true,
            contentType: "application/json",
            messageId,
            ...(this.userId === undefined ? {} : { userId: this.userId }),
            ...(Object.keys(headers).length > 0 ? { headers } : {}),
          },
          (err: unknown) => {
            if (err === null || err === undefined) {
              resolve();
              return;
            }
            const text = describe(err);
            if (text.includes("nacked")) {
              reject(new PublishError(`intent ${messageId} was nacked by the broker`));
            } else {
              reject(
                new PublishInDoubtError(
                  `intent ${messageId}: the broker's confirm never arrived (${text}); it may or may not be queued, and publishing it again under the same key is safe`,
                  { cause: err },
                ),
              );
            }
          },
        );
      } catch (e) {
        reject(new PublishError(`intent ${messageId} was not sent: ${describe(e)}`, { cause: e }));
      }
    });
    await withTimeout(
      confirmed,
      timeoutMs,
      () =>
        new PublishInDoubtError(
          `intent ${messageId}: no confirm within ${timeoutMs} ms; it may or may not be queued, and publishing it again under the same key is safe`,
        ),
    );
    // A mandatory message that no queue took comes back before its confirm.
    const returns = this.#returned.get(messageId) ?? 0;
    if (returns > 0) {
      if (returns === 1) this.#returned.delete(messageId);
      else this.#returned.set(messageId, returns - 1);
      throw new PublishError(
        `intent ${messageId} was returned unroutable: no queue is bound to the intents exchange for its tenant (is a worker running?)`,
      );
    }
  }

  /** {@link publish} then {@link waitFor} the same action, for this intent's fingerprint. */
  async sendAndWait(intent: Intent, options: SendAndWaitOptions = {}): Promise<ResultEvent> {
    const { timeoutMs, pollIntervalMs, ...trace } = options;
    const sent = await this.publish(intent, trace);
    return this.waitFor(sent.tenant, sent.action_id, {
      fingerprint: fingerprint(sent.tool, sent.arguments, sent.compensates),
      ...(timeoutMs === undefined ? {} : { timeoutMs }),
      ...(pollIntervalMs === undefined ? {} : { pollIntervalMs }),
    });
  }

  /** Undoes the `succeeded` action `originalActionId` of `intent.tenant`: sends `intent` with
   * `compensates` set to it, as {@link sendAndWait} does, and returns its answer.
   *
   * `intent.action_id` is the compensation's own key, chosen by the application like any other
   * (the same on every retry of this compensation, never the original's); its tool must list the
   * original's tool in its `compensation_for`. The worker admits it only while the original is
   * `succeeded`; otherwise the answer is `rejected` with `original_unresolved`,
   * `original_not_applied`, `original_not_found`, `already_compensated` (`detail`: the live
   * compensation's action id) or `compensation_not_allowed`. Every answer about the
   * compensation carries `compensates`. To publish without waiting, {@link publish} an intent
   * with `compensates` set. */
  async compensate(
    originalActionId: string,
    intent: Omit<Intent, "compensates">,
    options: SendAndWaitOptions = {},
  ): Promise<ResultEvent> {
    return this.sendAndWait({ ...intent, compensates: originalActionId }, options);
  }

  // ---- results ------------------------------------------------------------------------------

  /** Binds this agent's results key for `tenant` (done by publish and waitFor). */
  async bind(tenant: string): Promise<void> {
    await this.#bind(tenant);
  }

  #bind(tenant: string): Promise<void> {
    this.#tenants.add(tenant);
    // While the link is down, the reconnection binds it before anything is published.
    if (this.#bound.has(tenant) || this.#linkError !== undefined) return Promise.resolve();
    return this.#bindOn(this.#link, tenant);
  }

  #bindOn(link: Link, tenant: string): Promise<void> {
    if (this.#bound.has(tenant)) return Promise.resolve();
    const key = `${link.queue}\u0000${tenant}`;
    let pending = this.#binding.get(key);
    if (pending === undefined) {
      pending = (async () => {
        await link.results.bindQueue(
          link.queue,
          this.#resultsExchange,
          resultRoutingKey(tenant, this.replyTo),
        );
        if (this.#bindTenant) {
          await link.results.bindQueue(link.queue, this.#resultsExchange, tenant);
        }
        if (link === this.#link) this.#bound.add(tenant);
      })().finally(() => this.#binding.delete(key));
      this.#binding.set(key, pending);
    }
    return pending;
  }

  #onMessage(message: amqp.ConsumeMessage | null): void {
    if (message === null) return;
    let event: ResultEvent;
    try {
      event = parseResultEvent(message.content);
    } catch (e) {
      if (e instanceof InvalidResultEventError) return;
      throw e;
    }
    this.accept(message.fields.routingKey, event);
  }

  /** Records a result event delivered with `routingKey`, as the results consumer does: only
   * for a bound tenant and this agent's key, each `event_id` once. Returns whether it was
   * recorded. (Public for tests and for feeding events from elsewhere.) */
  accept(routingKey: string, event: ResultEvent): boolean {
    if (!this.#bound.has(event.tenant)) return false;
    const mine =
      routingKey === resultRoutingKey(event.tenant, this.replyTo) ||
      (this.#bindTenant && routingKey === event.tenant);
    if (!mine) return false;
    if (this.#seen.has(event.event_id)) return false;
    this.#seen.add(event.event_id);
    if (this.#seen.size > EVENT_IDS_KEPT) {
      const oldest = this.#seen.values().next();
      if (oldest.done !== true) this.#seen.delete(oldest.value);
    }
    const key = `${event.tenant}\u0000${event.action_id}`;
    const events = this.#answers.get(key) ?? [];
    this.#answers.delete(key);
    events.push(event);
    if (events.length > EVENTS_PER_ACTION) events.splice(0, events.length - EVENTS_PER_ACTION);
    this.#answers.set(key, events);
    if (this.#answers.size > ANSWERS_KEPT) {
      const oldest = this.#answers.keys().next();
      if (oldest.done !== true) this.#answers.delete(oldest.value);
    }
    this.#notify();
    return true;
  }

  #notify(): void {
    for (const listener of [...this.#listeners]) listener();
  }

  /** Resolves at the next recorded event (or close), or after `ms`. */
  #changed(ms: number): Promise<void> {
    return new Promise((resolve) => {
      const done = (): void => {
        clearTimeout(timer);
        this.#listeners.delete(done);
        resolve();
      };
      const timer = setTimeout(done, Math.max(0, ms));
      this.#listeners.add(done);
    });
  }

  /** Every event heard for the action (for the intent with `fingerprint`), oldest first. */
  heard(tenant: string, actionId: string, fingerprint?: string): ResultEvent[] {
    return (this.#answers.get(`${tenant}\u0000${actionId}`) ?? []).filter((e) =>
      answersIntent(e, fingerprint),
    );
  }

  #best(tenant: string, actionId: string, fingerprint?: string): ResultEvent | undefined {
    const events = this.heard(tenant, actionId, fingerprint);
    return events.find(isFinal) ?? events[events.length - 1];
  }

  /** The first final answer (succeeded, failed, rejected) for the action, or at the timeout the
   * latest pending. Listens on this agent's results queue and, with the status API configured,
   * asks it every `pollIntervalMs` and once more at the timeout. With `fingerprint` only
   * answers to that intent count. Throws {@link NoAnswerError} if nothing was heard at all. */
  async waitFor(tenant: string, actionId: string, options: WaitOptions = {}): Promise<ResultEvent> {
    const timeoutMs = options.timeoutMs ?? 30_000;
    const pollMs = options.pollIntervalMs ?? 2_000;
    const fp = options.fingerprint;
    await this.#bind(tenant);
    const deadline = Date.now() + timeoutMs;
    let nextPoll = Date.now() + Math.min(pollMs, timeoutMs / 2);
    let latest: ResultEvent | undefined;
    let statusError: unknown;
    const polling = this.#statusUrl !== undefined;
    while (true) {
      const heard = this.#best(tenant, actionId, fp);
      if (heard !== undefined) {
        if (isFinal(heard)) return heard;
        latest = heard;
      }
      const now = Date.now();
      if (now >= deadline || this.#closed) break;
      if (polling && now >= nextPoll) {
        const [polled, error] = await this.#poll(tenant, actionId, fp);
        statusError = error ?? statusError;
        if (polled !== undefined) {
          if (isFinal(polled)) return polled;
          latest = polled;
        }
        nextPoll = Date.now() + pollMs;
      }
      const wake = polling ? Math.min(deadline, nextPoll) : deadline;
      await this.#changed(wake - Date.now());
    }
    if (polling && !this.#closed) {
      const [polled, error] = await this.#poll(tenant, actionId, fp);
      statusError = error ?? statusError;
      if (polled !== undefined && (isFinal(polled) || latest === undefined)) return polled;
    }
    if (latest !== undefined) return latest;
    throw new NoAnswerError(
      `no answer for ${tenant}:${actionId} within ${timeoutMs} ms; the outcome is unknown, do not submit it again under a new action id${statusError === undefined ? "" : ` (status API: ${describe(statusError)})`}`,
    );
  }

  async #poll(
    tenant: string,
    actionId: string,
    fp: string | undefined,
  ): Promise<[ResultEvent | undefined, unknown]> {
    try {
      const polled = await this.status(tenant, actionId);
      if (polled === null || !answersIntent(polled, fp)) return [undefined, undefined];
      return [polled, undefined];
    } catch (e) {
      return [undefined, e];
    }
  }

  /** The action's current answer from the worker's status API
   * (`GET /v1/operations/{tenant}/{action_id}`), or null if the worker has no such action. */
  async status(tenant: string, actionId: string, timeoutMs = 5_000): Promise<ResultEvent | null> {
    if (this.#statusUrl === undefined || this.#statusToken === undefined) {
      throw new StatusApiError("status API not configured (statusUrl and statusToken)");
    }
    return fetchStatus(this.#statusUrl, this.#statusToken, tenant, actionId, timeoutMs);
  }

  /** Every new event about the action (for the intent with `fingerprint`), in arrival order,
   * repeats dropped; ends after a final one, on close, or when `signal` aborts. */
  async *follow(
    tenant: string,
    actionId: string,
    options: FollowOptions = {},
  ): AsyncGenerator<ResultEvent, void, undefined> {
    await this.#bind(tenant);
    const yielded = new Set<string>();
    const { signal, fingerprint: fp } = options;
    const aborted = (): void => this.#notify();
    signal?.addEventListener("abort", aborted);
    try {
      while (!this.#closed && signal?.aborted !== true) {
        for (const event of this.heard(tenant, actionId, fp)) {
          if (yielded.has(event.event_id)) continue;
          yielded.add(event.event_id);
          yield event;
          if (isFinal(event)) return;
        }
        await this.#changed(60_000);
      }
    } finally {
      signal?.removeEventListener("abort", aborted);
    }
  }
}

/** A status API call: the current answer, or null on 404. */
export async function fetchStatus(
  baseUrl: string,
  token: string,
  tenant: string,
  actionId: string,
  timeoutMs = 5_000,
): Promise<ResultEvent | null> {
  const url = `${baseUrl.replace(/\/+$/, "")}/v1/operations/${encodeURIComponent(tenant)}/${encodeURIComponent(actionId)}`;
  let response: Response;
  let body: unknown;
  try {
    response = await fetch(url, {
      headers: { authorization: `Bearer ${token}`, accept: "application/json" },
      signal: AbortSignal.timeout(timeoutMs),
    });
    if (response.status === 404) return null;
    if (!response.ok) throw new StatusApiError(`status API answered ${response.status} for ${url}`);
    body = await response.json();
  } catch (e) {
    if (e instanceof StatusApiError) throw e;
    throw new StatusApiError(`status API request to ${url} failed: ${describe(e)}`, { cause: e });
  }
  try {
    return parseResultEvent(body as object);
  } catch (e) {
    throw new StatusApiError(`status API returned something that is not a result: ${describe(e)}`);
  }
}
