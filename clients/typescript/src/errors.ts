/** Base of the client's own errors. */
export class ClientError extends Error {
  constructor(message: string, options?: { cause?: unknown }) {
    super(message, options);
    this.name = new.target.name;
  }
}

/** The broker did not take the intent: nacked, unroutable (no worker declared the topology), or
 * not sent at all. Publishing it again under the same key is safe (the worker's inbox answers a
 * repeat from the ledger). */
export class PublishError extends ClientError {}

/** The intent was handed to the broker but its confirm never arrived (the link or its node died,
 * or the confirm timed out): it may or may not be queued. Publishing it again under the SAME key
 * is safe; never send it under a new action id. */
export class PublishInDoubtError extends PublishError {}

/** An exchange does not exist: no worker has started against this broker and names yet. */
export class TopologyMissingError extends ClientError {}

/** The status API refused the request (bad token) or could not be reached. */
export class StatusApiError extends ClientError {}

/** Nothing at all was heard about the action before the timeout, not even `pending`. The outcome
 * is unknown: do not submit the action again under a new id. */
export class NoAnswerError extends ClientError {}
