//! Waiting for one action's answer: [`Publisher::send_and_wait`] and [`StatusApi`].
//!
//! Routing: the worker publishes a result for an intent with `reply_to` R under routing key
//! `<tenant>.@.<R>` (`protocol::result_routing_key`). `send_and_wait` binds a temporary
//! exclusive queue to exactly that key BEFORE publishing, so it sees only its own agent's
//! results (not every result of the tenant) and cannot miss the answer. It returns the first
//! final answer (`succeeded`, `failed`, `rejected`) for the intent's `(tenant, action_id)`;
//! at the timeout, the status API (when configured) is asked, so an agent whose queue missed
//! the event still learns the answer; otherwise the latest `pending` seen is returned.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_lite::StreamExt;
use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use protocol::{Intent, ResultEvent, Status};
use tokio::time::Instant;

use crate::{topology, PublishError, Publisher};

/// Where an answer came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// The agent's results queue.
    Queue,
    /// `GET /v1/operations/{tenant}/{action_id}` on the worker's status API.
    StatusApi,
}

/// The answer to one action: a result event, final or (at the timeout) `pending`.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub event: ResultEvent,
    pub source: Source,
}

impl Answer {
    /// Whether the answer is final (`succeeded`, `failed` or `rejected`).
    pub fn is_final(&self) -> bool {
        is_final(self.event.status)
    }
}

fn is_final(status: Status) -> bool {
    status != Status::Pending
}

/// Why no answer could be returned.
#[derive(Debug, thiserror::Error)]
pub enum WaitError {
    /// Publishing the intent, or the results queue, failed.
    #[error(transparent)]
    Publish(#[from] PublishError),
    /// Enqueuing the intent in the outbox failed (`send_and_wait_via` with the outbox).
    #[error(transparent)]
    Outbox(#[from] crate::OutboxError),
    /// Neither the queue nor the status API gave any answer before the timeout.
    #[error("no answer for {tenant}:{action_id} within {timeout:?}")]
    NoAnswer {
        tenant: String,
        action_id: String,
        timeout: Duration,
    },
    /// `reply_to` cannot be bound exactly (a `*` or `#` word would be a topic wildcard).
    #[error(
        "reply_to {0:?} contains a `*` or `#` word, which a topic binding treats as a wildcard"
    )]
    BadReplyTo(String),
    /// `<tenant>.@.<reply_to>` is longer than an AMQP routing key may be (255 bytes).
    #[error("the result routing key {0:?} is longer than 255 bytes: use a shorter reply_to")]
    KeyTooLong(String),
    /// The status API answered with an error, or not at all.
    #[error("status API: {0}")]
    Status(String),
}

/// The worker's status API, read with a tenant token.
#[derive(Debug, Clone)]
pub struct StatusApi {
    base: reqwest::Url,
    token: String,
    client: reqwest::Client,
}

impl StatusApi {
    /// `base` is the API's root URL (e.g. `http://127.0.0.1:8080`), `token` a tenant token
    /// (`WORKER_TENANT_TOKENS`) or the admin token.
    pub fn new(base: &str, token: &str) -> Result<StatusApi, WaitError> {
        let base = reqwest::Url::parse(base)
            .map_err(|e| WaitError::Status(format!("bad status URL {base:?}: {e}")))?;
        if base.cannot_be_a_base() {
            return Err(WaitError::Status(format!("bad status URL {base}")));
        }
        let client = crate::tls::http_client()
            .timeout(Duration::from_secs(10))
            .build()
            .map_err(|e| WaitError::Status(e.to_string()))?;
        Ok(StatusApi {
            base,
            token: token.to_owned(),
            client,
        })
    }

    /// The operation's result event now; `None` when the worker has no such operation (or it
    /// belongs to another tenant than the token's).
    pub async fn status(
        &self,
        tenant: &str,
        action_id: &str,
    ) -> Result<Option<ResultEvent>, WaitError> {
        let mut url = self.base.clone();
        url.path_segments_mut()
            .expect("checked in new")
            .pop_if_empty()
            .extend(["v1", "operations", tenant, action_id]);
        let response = self
            .client
            .get(url)
            .bearer_auth(&self.token)
            .send()
            .await
            .map_err(|e| WaitError::Status(e.to_string()))?;
        let status = response.status();
        let body = response
            .bytes()
            .await
            .map_err(|e| WaitError::Status(e.to_string()))?;
        if status == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        if !status.is_success() {
            return Err(WaitError::Status(format!(
                "{status}: {}",
                String::from_utf8_lossy(&body[..body.len().min(300)])
            )));
        }
        serde_json::from_slice(&body)
            .map(Some)
            .map_err(|e| WaitError::Status(format!("not a result event: {e}")))
    }

    /// Asks every `poll` until the answer is final or `timeout` passes; returns the last
    /// answer (possibly `pending`), or [`WaitError::NoAnswer`].
    pub async fn wait(
        &self,
        tenant: &str,
        action_id: &str,
        timeout: Duration,
        poll: Duration,
    ) -> Result<Answer, WaitError> {
        let deadline = Instant::now() + timeout;
        let mut latest = None;
        loop {
            if let Some(event) = self.status(tenant, action_id).await? {
                let answer = Answer {
                    event,
                    source: Source::StatusApi,
                };
                if answer.is_final() {
                    return Ok(answer);
                }
                latest = Some(answer);
            }
            if Instant::now() + poll > deadline {
                break;
            }
            tokio::time::sleep(poll).await;
        }
        latest.ok_or_else(|| WaitError::NoAnswer {
            tenant: tenant.to_owned(),
            action_id: action_id.to_owned(),
            timeout,
        })
    }
}

/// Settings of [`Publisher::send_and_wait`].
#[derive(Debug, Clone)]
pub struct AnswerConfig {
    /// Results exchange (default `results`).
    pub results_exchange: String,
    /// `reply_to` for intents that carry none: chosen once per publisher.
    pub reply_to: String,
    /// Asked at the timeout when the queue gave no final answer.
    pub status_api: Option<StatusApi>,
    /// Which answer ends the wait (default: a final one, or the timeout).
    pub until: Until,
}

/// Which answer ends a wait.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Until {
    /// A final answer (`succeeded`, `failed`, `rejected`); a `pending` one is kept and returned
    /// at the timeout if nothing final came.
    #[default]
    Final,
    /// The first answer about the action, `pending` included: the worker's answer for now
    /// (`publisher send --wait`).
    First,
}

impl Default for AnswerConfig {
    fn default() -> Self {
        AnswerConfig {
            results_exchange: "results".into(),
            reply_to: generated_reply_to(),
            status_api: None,
            until: Until::Final,
        }
    }
}

/// `agent-<pid><time>`: unique to this process run, valid as a `reply_to`.
pub fn generated_reply_to() -> String {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or_default();
    format!("agent-{:x}-{:x}", std::process::id(), nanos)
}

/// AMQP routing keys and binding keys are short strings: at most 255 bytes.
const MAX_ROUTING_KEY: usize = 255;

fn check_reply_to(reply_to: &str) -> Result<(), WaitError> {
    if reply_to.split('.').any(|word| word == "*" || word == "#") {
        return Err(WaitError::BadReplyTo(reply_to.to_owned()));
    }
    Ok(())
}

impl Publisher {
    /// Settings for [`Publisher::send_and_wait`].
    pub fn answers(&self) -> &AnswerConfig {
        &self.answers
    }

    /// Replaces the settings for [`Publisher::send_and_wait`].
    pub fn with_answers(mut self, answers: AnswerConfig) -> Publisher {
        self.answers = answers;
        self
    }

    /// Publishes `intent` and waits up to `timeout` for its answer (see the module docs).
    /// An intent without `reply_to` is sent with this publisher's own
    /// ([`AnswerConfig::reply_to`]); the action key is never changed.
    pub async fn send_and_wait(
        &self,
        intent: &Intent,
        timeout: Duration,
    ) -> Result<Answer, WaitError> {
        self.send_and_wait_with(intent, timeout, &crate::PublishOptions::default())
            .await
    }

    /// [`Publisher::send_and_wait`] with `options` for the publish (the trace context to send).
    pub async fn send_and_wait_with(
        &self,
        intent: &Intent,
        timeout: Duration,
        options: &crate::PublishOptions,
    ) -> Result<Answer, WaitError> {
        self.send_and_wait_via(intent, timeout, |intent| async move {
            self.publish_with(&intent, options)
                .await
                .map_err(WaitError::from)
        })
        .await
    }

    /// Like [`Publisher::send_and_wait`], but `send` puts the intent on its way (e.g. into the
    /// outbox, for `publisher relay` to publish). It is called once, after the results queue
    /// is bound, with the intent as it must be sent (`reply_to` filled in).
    pub async fn send_and_wait_via<F, Fut>(
        &self,
        intent: &Intent,
        timeout: Duration,
        send: F,
    ) -> Result<Answer, WaitError>
    where
        F: FnOnce(Intent) -> Fut,
        Fut: std::future::Future<Output = Result<(), WaitError>>,
    {
        let deadline = Instant::now() + timeout;
        let mut intent = intent.clone();
        let reply_to = intent
            .reply_to
            .get_or_insert_with(|| self.answers.reply_to.clone())
            .clone();
        check_reply_to(&reply_to)?;
        // Refused before any queue is bound: the key could never be sent as a message id.
        protocol::check_action_key(&intent.tenant, &intent.action_id)
            .map_err(PublishError::from)?;

        let (channel, mut consumer) = self.bind_answers(&intent.tenant, &reply_to).await?;

        let outcome = async {
            send(intent.clone()).await?;
            latest_answer(&mut consumer, &intent, deadline, self.answers.until).await
        }
        .await;
        channel.close(200, "OK".into()).await.ok();

        self.final_or_latest(outcome?, &intent, timeout).await
    }

    /// A results queue of its own, bound to this agent's answers about `tenant`, and its
    /// consumer (no acks: the queue is the agent's alone and goes with its channel).
    async fn bind_answers(
        &self,
        tenant: &str,
        reply_to: &str,
    ) -> Result<(lapin::Channel, lapin::Consumer), WaitError> {
        let channel = self
            .connection
            .create_channel()
            .await
            .map_err(PublishError::from)?;
        let exchange = &self.answers.results_exchange;
        let key = protocol::result_routing_key(tenant, Some(reply_to));
        if key.len() > MAX_ROUTING_KEY {
            return Err(WaitError::KeyTooLong(key));
        }
        let consumer = async {
            topology::ensure_topic_exchange(&self.connection, exchange).await?;
            let queue = topology::declare_results_queue(&channel, exchange, &[key], None).await?;
            channel.basic_qos(64, BasicQosOptions::default()).await?;
            Ok::<_, PublishError>(
                channel
                    .basic_consume(
                        crate::error::short("queue name", &queue)?,
                        "".into(),
                        BasicConsumeOptions {
                            no_ack: true,
                            ..BasicConsumeOptions::default()
                        },
                        FieldTable::default(),
                    )
                    .await?,
            )
        }
        .await?;
        Ok((channel, consumer))
    }

    /// The answer to return: a final event from the queue; else the status API's (more current:
    /// the queue may have missed the event, or the agent restarted); else the latest pending one.
    async fn final_or_latest(
        &self,
        from_queue: Option<ResultEvent>,
        intent: &Intent,
        timeout: Duration,
    ) -> Result<Answer, WaitError> {
        let settled = |e: &&ResultEvent| is_final(e.status) || self.answers.until == Until::First;
        if let Some(event) = from_queue.as_ref().filter(settled) {
            return Ok(Answer {
                event: event.clone(),
                source: Source::Queue,
            });
        }
        if let Some(api) = &self.answers.status_api {
            match api.status(&intent.tenant, &intent.action_id).await {
                Ok(Some(event)) if is_final(event.status) || from_queue.is_none() => {
                    return Ok(Answer {
                        event,
                        source: Source::StatusApi,
                    })
                }
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "status API fallback failed"),
            }
        }
        from_queue
            .map(|event| Answer {
                event,
                source: Source::Queue,
            })
            .ok_or_else(|| WaitError::NoAnswer {
                tenant: intent.tenant.clone(),
                action_id: intent.action_id.clone(),
                timeout,
            })
    }
}

/// Reads answers about `intent` until a final one (or, with [`Until::First`], any one) or the
/// deadline; returns it, or the latest pending one, or none.
async fn latest_answer(
    consumer: &mut lapin::Consumer,
    intent: &Intent,
    deadline: Instant,
    until: Until,
) -> Result<Option<ResultEvent>, WaitError> {
    let mut latest: Option<ResultEvent> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let delivery = match tokio::time::timeout(left, consumer.next()).await {
            Err(_elapsed) => break,
            Ok(None) => return Err(PublishError::ConsumerClosed.into()),
            Ok(Some(delivery)) => delivery.map_err(PublishError::from)?,
        };
        let Ok(event) = serde_json::from_slice::<ResultEvent>(&delivery.data) else {
            tracing::warn!("skipped a message on the results queue that is not a result event");
            continue;
        };
        if event.tenant != intent.tenant || event.action_id != intent.action_id {
            continue;
        }
        if is_final(event.status) || until == Until::First {
            return Ok(Some(event));
        }
        latest = Some(event);
    }
    Ok(latest)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_to_wildcards_are_refused() {
        assert!(check_reply_to("agent-7").is_ok());
        assert!(check_reply_to("a.b*c").is_ok());
        assert!(check_reply_to("a.#").is_err());
        assert!(check_reply_to("*").is_err());
        assert!(check_reply_to(&generated_reply_to()).is_ok());
    }
}
