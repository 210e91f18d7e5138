/** Separates a tenant from a reply_to in a result routing key; never a word of a tenant. */
export const REPLY_WORD = "@";
/** The longest AMQP routing key, in bytes. */
export const MAX_ROUTING_KEY_BYTES = 255;

/** The results routing key of an intent (the worker's `protocol::result_routing_key`):
 * `<tenant>` without reply_to, `<tenant>.@.<reply_to>` with it, or `<tenant>` when that would
 * be over 255 bytes. */
export function resultRoutingKey(tenant: string, replyTo?: string | null): string {
  if (replyTo === undefined || replyTo === null) return tenant;
  const key = `${tenant}.${REPLY_WORD}.${replyTo}`;
  return new TextEncoder().encode(key).length <= MAX_ROUTING_KEY_BYTES ? key : tenant;
}
