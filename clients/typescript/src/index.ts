export {
  type ConnectOptions,
  type FollowOptions,
  fetchStatus,
  IntentClient,
  type PublishOptions,
  type SendAndWaitOptions,
  type WaitOptions,
} from "./client.js";
export {
  ClientError,
  NoAnswerError,
  PublishError,
  PublishInDoubtError,
  StatusApiError,
  TopologyMissingError,
} from "./errors.js";
export { fingerprint, fingerprintCanonical } from "./fingerprint.js";
export {
  actionKey,
  CODES,
  type DecodedIntent,
  decodeIntent,
  type Intent,
  type InvalidIntentCode,
  InvalidIntentError,
  intentBody,
  MAX_ACTION_KEY_BYTES,
  MAX_INTENT_BYTES,
  MAX_KEY_LEN,
  MAX_TOOL_LEN,
  validateIntent,
} from "./intent.js";
export { canonicalJson, type JsonArray, type JsonObject, type JsonValue } from "./json.js";
export { createOutbox, enqueue, OUTBOX_DDL, type Queryable } from "./outbox.js";
export {
  answersIntent,
  type FailedEvent,
  InvalidResultEventError,
  isFinal,
  type PendingEvent,
  parseResultEvent,
  type RejectedEvent,
  type RejectReason,
  type ResultEvent,
  type Status,
  type SucceededEvent,
  type Uncertainty,
} from "./result.js";
export { MAX_ROUTING_KEY_BYTES, REPLY_WORD, resultRoutingKey } from "./routing.js";
export {
  actionFromScope,
  actionScope,
  answerFor,
  currentActionId,
  type ExecuteOptions,
  type IntentTool,
  type IntentToolOptions,
  intentTool,
  MissingActionIdError,
  type ParametersSchema,
  RESERVED_PARAMETERS,
  type ToolAnswer,
} from "./tool.js";
export { SPAN_NAME, TRACEPARENT, TRACESTATE, type TraceContext, traceHeaders } from "./trace.js";
