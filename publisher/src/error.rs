//! The one error type of the publisher library.

/// Why a publish or a follow did not succeed.
///
/// The publisher never retries on any of these: the caller decides, and when it
/// sends again it sends the same intent under the same `(tenant, action_id)` key.
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    /// The broker connection or channel failed (refused connection, closed channel,
    /// missing exchange, precondition failure, ...). lapin's message already carries
    /// its causes, so it is not chained again as a `source`.
    #[error("AMQP error: {0}{hint}", hint = amqp_hint(.0))]
    Amqp(lapin::Error),

    /// The broker answered and refused the connection: the login (wrong user or password) or
    /// the virtual host (none of that name, or the user may not use it). Every node of a
    /// cluster would answer the same, and retrying cannot help until the setting is fixed.
    #[error("RabbitMQ refused the connection: {reason}{hint}")]
    Refused { reason: String, hint: &'static str },

    /// The message was published with `mandatory = true` and no queue was bound for
    /// its routing key, so the broker returned it (basic.return). Nothing was queued.
    #[error(
        "unroutable: exchange {exchange:?} has no queue bound for routing key {routing_key:?} ({reply_text})"
    )]
    Unroutable {
        exchange: String,
        routing_key: String,
        reply_text: String,
    },

    /// The message was handed to the broker, but the connection or channel failed before its
    /// confirm arrived (its node died, a link was cut): it may or may not be queued. Sending it
    /// again under the same key is safe (the worker's inbox answers a repeat from its row), and
    /// an outbox relay does so. Never a reason to mint a new key.
    #[error("the broker's confirm never arrived ({0}): the intent may or may not be queued; sending it again under the same key is safe")]
    InDoubt(lapin::Error),

    /// The broker negatively acknowledged the message (basic.nack): it did not take
    /// responsibility for it. Whether to send it again (same key) is the caller's call.
    #[error("the broker did not accept the message (publisher confirm nack)")]
    Nacked,

    /// The channel answered without a publisher confirm although confirm mode was
    /// requested; delivery is not proven.
    #[error("the broker sent no publisher confirm; delivery is not proven")]
    NotConfirmed,

    /// The TLS handshake with `peer` failed: its certificate was refused (unknown issuer,
    /// name mismatch, expired...) or it does not speak TLS on that port.
    #[error("{peer}: TLS handshake failed: {reason}")]
    Tls { peer: &'static str, reason: String },

    /// The AMQP URL cannot be parsed.
    #[error("invalid AMQP URL: {0}")]
    BadUrl(String),

    /// A message on the results queue is not a result event.
    #[error("not a result event: {0}")]
    BadResult(String),

    /// The results consumer was cancelled or its channel closed.
    #[error("the results consumer stopped (channel closed or consumer cancelled)")]
    ConsumerClosed,

    /// The intent cannot be sent: the worker's decoder refuses it. [`crate::Publisher`] checks
    /// the rule its message properties depend on, the action key `<tenant>:<action_id>` that is
    /// the AMQP `message_id` (at most 255 bytes: `key_too_long`); nothing was sent.
    #[error("invalid intent: {0}")]
    InvalidIntent(#[from] protocol::DecodeError),

    /// A graceful close got no answer within the close bound (a link gone silent, a stalled
    /// broker): the connection was dropped instead. Whatever it had not settled is the broker's
    /// once the socket goes: unacked results go back to a named queue (they may be seen again;
    /// results carry their `event_id`), an exclusive queue is deleted.
    #[error("the broker did not answer the close within {0:?}; the connection was dropped (unsettled results return to a named queue)")]
    CloseTimedOut(std::time::Duration),

    /// A name or value that AMQP carries as a short string (routing key, exchange or queue name,
    /// binding key, `user_id`, content type) is over 255 bytes; nothing was sent or declared.
    #[error("the {what} is {len} bytes, over the 255-byte limit of an AMQP short string")]
    TooLong { what: &'static str, len: usize },
}

/// `value` as an AMQP short string, or [`PublishError::TooLong`] naming `what` it is. lapin's
/// `From<&str>`/`From<String>` for `ShortString` panics above 255 bytes, so every short string
/// built from input goes through here.
pub(crate) fn short(
    what: &'static str,
    value: &str,
) -> Result<lapin::types::ShortString, PublishError> {
    lapin::types::ShortString::try_new(value).map_err(|_| PublishError::TooLong {
        what,
        len: value.len(),
    })
}

impl PublishError {
    /// A confirm that failed: the broker closing the channel with its own reason (a missing
    /// exchange, a refused `user_id`) refused the message, a plain AMQP error; a lost connection
    /// or channel leaves it in doubt.
    pub(crate) fn confirm_lost(error: lapin::Error) -> PublishError {
        match error.kind() {
            lapin::ErrorKind::ProtocolError(_) => PublishError::Amqp(error),
            _ => PublishError::InDoubt(error),
        }
    }

    /// Whether the message may have been queued although this is an error: only
    /// [`PublishError::InDoubt`]. Either way, sending it again under the same key is safe.
    pub fn in_doubt(&self) -> bool {
        matches!(self, PublishError::InDoubt(_))
    }

    /// The error's kind in a word (`error.type` of a failed publish span).
    pub fn kind(&self) -> &'static str {
        match self {
            PublishError::Amqp(_) => "amqp",
            PublishError::Unroutable { .. } => "unroutable",
            PublishError::InDoubt(_) => "in_doubt",
            PublishError::Nacked => "nacked",
            PublishError::NotConfirmed => "not_confirmed",
            PublishError::Tls { .. } => "tls",
            PublishError::Refused { .. } => "refused",
            PublishError::BadUrl(_) => "bad_url",
            PublishError::BadResult(_) => "bad_result",
            PublishError::ConsumerClosed => "consumer_closed",
            PublishError::InvalidIntent(_) => "invalid_intent",
            PublishError::TooLong { .. } => "too_long",
            PublishError::CloseTimedOut(_) => "close_timed_out",
        }
    }
}

/// What to do about a broker refusal a newcomer meets first (appended to its message), or "".
pub fn amqp_hint(error: &lapin::Error) -> &'static str {
    let lapin::ErrorKind::ProtocolError(e) = error.kind() else {
        return "";
    };
    let message = e.get_message().as_str();
    match e.get_id() {
        404 if message.contains("no exchange") => {
            " (the exchange does not exist yet: start a worker, which declares its exchanges and \
             queues, or load the broker definitions, deploy/rabbitmq/definitions.json; or check \
             INTENTS_EXCHANGE)"
        }
        530 if message.contains("vhost") => {
            " (the virtual host named by AMQP_URL's path does not exist on this broker, or this \
             user may not use it: create it and grant the user, or fix the URL; %2f is the \
             default vhost)"
        }
        403 => " (check the user and password in AMQP_URL)",
        _ => "",
    }
}

/// The refusal a connection attempt ended with, when the broker answered with one (a login or
/// virtual host it refuses), else `None`.
pub fn connection_refusal(error: &lapin::Error) -> Option<PublishError> {
    let lapin::ErrorKind::ProtocolError(e) = error.kind() else {
        return None;
    };
    matches!(e.get_id(), 403 | 530).then(|| PublishError::Refused {
        reason: e.get_message().to_string(),
        hint: amqp_hint(error),
    })
}

impl From<lapin::Error> for PublishError {
    fn from(error: lapin::Error) -> Self {
        PublishError::Amqp(error)
    }
}
