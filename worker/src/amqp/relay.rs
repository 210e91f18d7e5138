//! The result relay: publishes committed result events from the outbox with publisher
//! confirms (routing key: the tenant) and records them published. Events no queue is bound for
//! are recorded too and counted; they stay readable in the outbox and through the status API.
//!
//! Two sources feed it. This worker's own completions arrive in memory, already claimed for
//! it in the outbox by the commit that wrote them, in the batcher's relay epoch
//! ([`crate::batch::completion`]); they go first, cost no claim statement, and are recorded
//! published by advancing the epoch's watermark at most every `POLL` (a crash before that
//! publishes them again, never loses them). Everything else (intake answers, expiries,
//! operator events, other workers' lapsed rows, hand-offs that were dropped, epochs retired
//! here) is claimed from the outbox with `claim_unpublished`, when nothing was handed or at
//! least every `POLL`, and marked published row by row.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::{BasicProperties, Channel, Connection};
use lapin::{Confirmation, PublisherConfirm};
use metrics::counter;
use protocol::trace::TraceContext;
use tokio_util::sync::CancellationToken;
use tracing::Instrument as _;

use super::AmqpError;
use crate::context::Context;
use crate::ledger::outbox::OutboxRow;
use crate::lock;
use crate::telemetry::metrics as m;
use crate::telemetry::spans;

/// Events published per round.
const BATCH: i64 = 256;
/// How often the relay looks in the outbox even without a wake-up (other workers' commits,
/// released rows), and at least how often it does while handed events keep it busy.
const POLL: Duration = Duration::from_millis(500);

/// A relay bound to one confirmed channel.
pub struct Relay {
    channel: Channel,
    exchange: String,
    ctx: Arc<Context>,
    /// When this relay last claimed from the outbox.
    last_claim: Mutex<Option<Instant>>,
    /// When this relay last looked for epochs to retire.
    last_retire: Mutex<Option<Instant>>,
    watermark: Mutex<Watermark>,
    /// The latest epoch of handed events taken for the round in progress (0: none). A relay
    /// dropped in mid-round freezes it: those events were neither confirmed nor given back.
    taken: Mutex<i64>,
}

/// The epoch of the handed events this relay saw last, how far its confirms reach, and what
/// earlier epochs are still owed.
#[derive(Debug)]
struct Watermark {
    /// 0 before the first handed event.
    epoch: i64,
    /// Every handed event of `epoch` up to this id is confirmed (or was given back).
    through: i64,
    /// What this relay last wrote as the epoch's watermark.
    written: i64,
    /// When this relay last wrote a watermark (a write also says the epoch's relay is alive).
    written_at: Instant,
    /// Watermarks of earlier epochs, confirmed but not written yet.
    owed: Vec<(i64, i64)>,
}

impl Relay {
    pub async fn new(
        connection: &Connection,
        exchange: String,
        ctx: Arc<Context>,
    ) -> Result<Relay, AmqpError> {
        let channel = connection
            .create_channel()
            .await
            .map_err(AmqpError::broker("opening the relay channel"))?;
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .map_err(AmqpError::broker("confirm.select"))?;
        // From now on this worker's completion events are inserted claimed for this relay.
        ctx.completions.relay_attached(true);
        Ok(Relay {
            channel,
            exchange,
            ctx,
            last_claim: Mutex::new(None),
            last_retire: Mutex::new(None),
            watermark: Mutex::new(Watermark {
                epoch: 0,
                through: 0,
                written: 0,
                written_at: Instant::now(),
                owed: Vec::new(),
            }),
            taken: Mutex::new(0),
        })
    }

    /// One relay round: take the handed events (up to a batch), claim from the outbox when
    /// nothing was handed or the last claim is `POLL` old (so a steady stream of hand-offs
    /// never starves intake answers or lapsed rows), publish, await confirms, mark. Returns
    /// events published.
    pub async fn step(&self) -> Result<usize, AmqpError> {
        let rows = self.gather().await;
        if rows.is_empty() {
            return Ok(0);
        }
        let traces: Vec<TraceContext> = rows.iter().filter_map(row_trace).collect();
        let span = spans::publish_results(&self.exchange, rows.len(), &traces);
        let settled = async {
            // All in flight at once: lapin resolves a publish only once its I/O thread has
            // written it, so awaiting each in turn would cost two thread switches per event.
            let sent = kit::join::in_order(rows.iter().map(|row| self.publish(row))).await;
            settle(rows.iter().zip(sent).collect()).await
        }
        .instrument(span)
        .await;
        if let Err(e) = self.ctx.ledger.release_unpublished(&settled.failed).await {
            // Still in their epochs: the watermark must not pass them. Freezing the round's
            // latest epoch freezes the earlier ones with it.
            tracing::warn!(error = %e, "cannot release unpublished events");
            self.ctx.completions.freeze_epoch(*lock(&self.taken));
        }
        let marked = self.advance(&rows, &settled.published);
        // Confirmed, not yet recorded published: a crash here publishes them again.
        #[cfg(feature = "fault-points")]
        for row in rows.iter().filter(|r| settled.published.contains(&r.id)) {
            let action_id = row.field("action_id");
            crate::fault::point(
                "after_results_confirmed",
                action_id.as_deref().unwrap_or_default(),
            );
        }
        if let Err(e) = self.ctx.ledger.mark_published(&marked).await {
            // They will be published again after the hold: agents dedupe by event_id.
            tracing::warn!(error = %e, "cannot mark events published");
        }
        *lock(&self.taken) = 0;
        // A broken link ends this relay: what it confirmed is written now.
        let every = if settled.broken.is_some() {
            Duration::ZERO
        } else {
            POLL
        };
        self.write_watermark(every, false).await;
        if let Some(e) = settled.broken {
            return Err(AmqpError::Broker {
                what: "publishing results".into(),
                error: e,
            });
        }
        Ok(settled.published.len())
    }

    /// Takes a round's confirmed events into the watermark: the handed ones of an epoch still
    /// advancing. Returns the rest, to be marked published one by one.
    fn advance(&self, rows: &[OutboxRow], published: &[i64]) -> Vec<i64> {
        let confirmed: std::collections::HashSet<i64> = published.iter().copied().collect();
        let mut marked = Vec::new();
        let mut w = lock(&self.watermark);
        for row in rows.iter().filter(|r| confirmed.contains(&r.id)) {
            match row.relay_epoch {
                Some(epoch) if !self.ctx.completions.is_frozen(epoch) => {
                    if epoch != w.epoch {
                        // The batcher began a new epoch: the old one gets no more events.
                        if w.epoch != 0 && w.through > w.written {
                            let old = (w.epoch, w.through);
                            w.owed.push(old);
                        }
                        w.epoch = epoch;
                        w.through = 0;
                        w.written = 0;
                    }
                    w.through = w.through.max(row.id);
                }
                _ => marked.push(row.id),
            }
        }
        marked
    }

    /// Writes what the watermark owes: earlier epochs' at once, the current epoch's once `every`
    /// has passed since the last write. With `keep_alive`, the current epoch is written again
    /// every third of the relay hold even with nothing new, so an idle worker's epoch is not
    /// retired (unless the batcher left it). A write that fails is tried again later; until
    /// then the events are only not recorded published (published again if the epoch is
    /// retired meanwhile).
    async fn write_watermark(&self, every: Duration, keep_alive: bool) {
        let keep_alive_every = self.ctx.relay_hold / 3;
        let (owed, due) = {
            let mut w = lock(&self.watermark);
            let since = w.written_at.elapsed();
            // Only the epoch the batcher still writes into: one it left may hold events it
            // never handed over, which reach a relay only once the epoch is retired.
            let advancing = w.epoch != 0
                && !self.ctx.completions.is_frozen(w.epoch)
                && self.ctx.completions.current_epoch() == Some(w.epoch);
            let due = w.epoch != 0
                && ((w.through > w.written && since >= every)
                    || (keep_alive && advancing && since >= keep_alive_every));
            (
                std::mem::take(&mut w.owed),
                due.then_some((w.epoch, w.through)),
            )
        };
        for (epoch, through) in owed {
            if let Err(e) = self.ctx.ledger.advance_epoch(epoch, through).await {
                tracing::warn!(error = %e, epoch, "cannot record a relay epoch's events published");
            }
        }
        let Some((epoch, through)) = due else {
            return;
        };
        match self.ctx.ledger.advance_epoch(epoch, through).await {
            Ok(live) => {
                let mut w = lock(&self.watermark);
                if w.epoch == epoch {
                    w.written = w.written.max(through);
                    w.written_at = Instant::now();
                    if !live {
                        // Retired while this relay was silent for the hold: its events above
                        // the old watermark went back to the outbox, and the batcher begins a
                        // new epoch.
                        tracing::info!(epoch, "this relay's epoch was retired meanwhile");
                        w.epoch = 0;
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, epoch, "cannot record a relay epoch's events published")
            }
        }
    }

    /// Retires the epochs of relays silent for the hold, at most every quarter hold.
    async fn retire_epochs(&self) {
        let hold = self.ctx.relay_hold;
        {
            let mut last = lock(&self.last_retire);
            if last.is_some_and(|t| t.elapsed() < (hold / 4).max(POLL)) {
                return;
            }
            *last = Some(Instant::now());
        }
        match self.ctx.ledger.retire_epochs(hold).await {
            Ok(0) => {}
            Ok(events) => tracing::info!(
                events,
                "retired relay epochs nothing advanced for the relay hold; their unpublished events go to any relay"
            ),
            Err(e) => tracing::warn!(error = %e, "cannot retire silent relay epochs"),
        }
    }

    /// The round's rows: the handed ones first, then (when a claim is due) rows claimed from
    /// the outbox, up to a batch in all. An outbox that cannot be read is logged and tried
    /// again next round.
    async fn gather(&self) -> Vec<OutboxRow> {
        let handed = self.ctx.completions.take_handed(BATCH as usize);
        if handed.stale > 0 {
            tracing::info!(
                events = handed.stale,
                "handed result events waited too long; left to the outbox once their epoch is retired"
            );
        }
        let mut rows = handed.rows;
        *lock(&self.taken) = rows.iter().filter_map(|r| r.relay_epoch).max().unwrap_or(0);
        let claim_due = {
            let last = lock(&self.last_claim);
            rows.is_empty() || last.is_none_or(|t| t.elapsed() >= POLL)
        };
        if claim_due && (rows.len() as i64) < BATCH {
            self.retire_epochs().await;
            *lock(&self.last_claim) = Some(Instant::now());
            match self
                .ctx
                .ledger
                .claim_unpublished(
                    &self.ctx.worker_id,
                    BATCH - rows.len() as i64,
                    self.ctx.relay_hold,
                )
                .await
            {
                Ok(claimed) => rows.extend(claimed),
                // With nothing handed there is nothing to publish; else publish what was
                // handed. Either way the outbox is tried again next round.
                Err(e) => tracing::warn!(error = %e, "relay cannot read the outbox"),
            }
        }
        rows
    }

    /// Publishes one event (mandatory, persistent, message id = event id, type = status).
    async fn publish(&self, row: &OutboxRow) -> lapin::Result<PublisherConfirm> {
        let mut props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(2)
            .with_message_id(row.event_id.as_str().into())
            .with_type(row.status.as_str().into());
        if let Some(cx) = row_trace(row) {
            let mut headers = lapin::types::FieldTable::default();
            super::trace::write(&mut headers, &cx);
            props = props.with_headers(headers);
        }
        self.channel
            .basic_publish(
                self.exchange.as_str().into(),
                row.routing_key.as_str().into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                row.payload.as_bytes(),
                props,
            )
            .await
    }
    /// Runs until `stop`, then does a last round so committed results leave before exit: what
    /// was handed first, then the outbox backlog.
    pub async fn run(self, stop: CancellationToken) -> Result<(), AmqpError> {
        loop {
            let n = self.step().await?;
            // More to do (a full batch, or events handed over while it ran): the next round at
            // once. The relay keeps no pace of its own: the intake's batches arrive here as
            // batches already (see crate::batch).
            let saturated = n as i64 == BATCH || self.ctx.completions.handed_waiting();
            if saturated {
                continue;
            }
            tokio::select! {
                _ = stop.cancelled() => break,
                _ = self.ctx.relay_wake.notified() => {}
                _ = tokio::time::sleep(POLL) => {}
            }
            self.write_watermark(POLL, true).await;
            // An idle relay publishes nothing that would fail: notice a lost link here, so
            // `/readyz` and the hand-off do not count on a relay whose node has gone.
            if !self.channel.status().connected() {
                return Err(AmqpError::Topology(
                    "the relay's channel closed (its broker node went away?)".into(),
                ));
            }
        }
        while self.step().await? > 0 || self.ctx.completions.handed_waiting() {}
        self.write_watermark(Duration::ZERO, false).await;
        super::close_channel(&self.channel, "shutdown").await;
        Ok(())
    }
}

/// The trace context an event is sent with (the span that decided it, or the intent's).
fn row_trace(row: &OutboxRow) -> Option<TraceContext> {
    let parent = protocol::trace::TraceParent::parse(row.traceparent.as_deref()?).ok()?;
    Some(TraceContext {
        parent,
        state: row.tracestate.clone(),
    })
}

/// What the broker's confirms said about a round's events.
struct Settled {
    /// Confirmed (or returned unroutable, which is final too): marked published.
    published: Vec<i64>,
    /// Nacked or lost with the channel: released for the next round.
    failed: Vec<i64>,
    /// The channel broke: the link is lost.
    broken: Option<lapin::Error>,
}

/// Awaits each publish's confirm, in order.
async fn settle(pending: Vec<(&OutboxRow, lapin::Result<PublisherConfirm>)>) -> Settled {
    let mut settled = Settled {
        published: Vec::new(),
        failed: Vec::new(),
        broken: None,
    };
    for (row, confirm) in pending {
        let result = match confirm {
            Ok(c) => c.await,
            Err(e) => Err(e),
        };
        match result {
            Ok(Confirmation::Ack(None)) | Ok(Confirmation::NotRequested) => {
                m::result_published(&row.status);
                settled.published.push(row.id);
            }
            Ok(Confirmation::Ack(Some(returned))) => {
                counter!(m::RESULTS_UNROUTABLE).increment(1);
                log_unroutable(row, &returned);
                settled.published.push(row.id);
            }
            Ok(Confirmation::Nack(_)) => settled.failed.push(row.id),
            Err(e) => {
                settled.failed.push(row.id);
                settled.broken.get_or_insert(e);
            }
        }
    }
    settled
}

/// An event no queue is bound for, by key, status and the broker's reason only: the event
/// carries the receipt and the agent's arguments, which never reach a log.
fn log_unroutable(row: &OutboxRow, returned: &lapin::message::BasicReturnMessage) {
    let field = |name: &str| row.field(name).unwrap_or_default();
    tracing::warn!(
        tenant = %field("tenant"),
        action_id = %field("action_id"),
        status = %row.status,
        routing_key = %row.routing_key,
        reply_code = returned.reply_code,
        reply_text = %returned.reply_text,
        "no queue is bound for this tenant's results; the event stays in the outbox and the status API"
    );
}

impl Drop for Relay {
    /// A stopped relay, or one whose link is lost, takes no hand-offs: until the next one
    /// connects, completion events are inserted unclaimed and published by whichever relay
    /// reaches them first (no wait for a hold after the link comes back).
    fn drop(&mut self) {
        self.ctx.completions.relay_attached(false);
        let taken = *lock(&self.taken);
        if taken != 0 {
            self.ctx.completions.freeze_epoch(taken);
        }
    }
}
