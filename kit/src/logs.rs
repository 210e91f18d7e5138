//! What may reach a log. Intents carry the agent's arguments and result events carry the
//! downstream's receipts (names, card holders, addresses); neither is ever logged, at any
//! level, whatever `RUST_LOG` says. Our own log lines name keys, states and reasons only;
//! some libraries print whole messages, and [`payload_free`] keeps those events out:
//!
//! - lapin logs every message the broker returns (an unroutable result) with its body at WARN,
//!   and content frames at TRACE;
//! - rmcp logs each JSON-RPC request and response (tool arguments, answers) at DEBUG and TRACE.

use tracing::{Level, Metadata};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;
use tracing_subscriber::{EnvFilter, Layer as _};

/// Installs the global log subscriber on stderr: `RUST_LOG` (else `default_filter`) selects
/// what is logged, [`payload_free`] always applies, `json` writes one JSON object a line. A
/// second call (tests, a library user with its own subscriber) changes nothing.
pub fn init(json: bool, ansi: bool, default_filter: &str) {
    init_with(json, ansi, default_filter, Traces::Off);
}

/// Whether spans are exported as well as logs.
pub enum Traces<'a> {
    Off,
    /// Our spans go to this exporter (`RUST_LOG` does not select them: it is about logs), and
    /// every log line inside a recorded span carries its `trace_id` and `span_id`.
    #[cfg(feature = "otel-export")]
    Export(&'a crate::otel::export::Export),
    #[doc(hidden)]
    _Lifetime(std::marker::PhantomData<&'a ()>),
}

/// [`init`], with span export when `traces` says so.
pub fn init_with(json: bool, ansi: bool, default_filter: &str, traces: Traces<'_>) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let text = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let logs = if json {
        text.json()
            .flatten_event(true)
            .map_event_format(|f| ids::WithTraceIds {
                inner: f,
                json: true,
            })
            .with_filter(filter)
            .boxed()
    } else {
        text.map_event_format(|f| ids::WithTraceIds {
            inner: f,
            json: false,
        })
        .with_filter(filter)
        .boxed()
    };
    #[cfg(feature = "otel-export")]
    let spans = match traces {
        Traces::Export(export) => Some(
            // Only what the spans are for: no source location, thread, target or busy/idle
            // timings (each an attribute or a clock read on every span or every poll), and no
            // OpenTelemetry context attached on every poll (our code reads a span's context
            // from the span itself).
            tracing_opentelemetry::layer()
                .with_tracer(export.tracer())
                .with_location(false)
                .with_threads(false)
                .with_target(false)
                .with_tracked_inactivity(false)
                .with_context_activation(false)
                .with_filter(tracing_subscriber::filter::filter_fn(exported)),
        ),
        _ => None,
    };
    #[cfg(not(feature = "otel-export"))]
    let spans = {
        let _ = traces;
        None::<tracing_subscriber::layer::Identity>
    };
    let recording = spans.is_some();
    let installed = tracing_subscriber::registry()
        .with(tracing_subscriber::filter::filter_fn(payload_free))
        .with(logs)
        .with(spans)
        .try_init();
    #[cfg(feature = "otel")]
    if recording && installed.is_ok() {
        crate::otel::set_recording();
    }
    #[cfg(not(feature = "otel"))]
    let _ = (recording, installed);
}

/// What the span exporter records: our own spans at INFO and above (not the libraries'), and
/// our warnings and errors as span events. Ours: the workspace's crates, the example agent
/// (examples/demo-agent, whose `agent turn` spans start each intent's trace) among them.
#[cfg_attr(not(feature = "otel-export"), allow(dead_code))]
fn exported(meta: &Metadata<'_>) -> bool {
    let ours = ["worker", "publisher", "kit", "demo_agent"]
        .iter()
        .any(|crate_name| meta.target().starts_with(crate_name));
    ours && if meta.is_span() {
        *meta.level() <= Level::INFO
    } else {
        *meta.level() <= Level::WARN
    }
}

mod ids {
    //! Log lines that carry the ids of the span they were written in.
    use std::fmt;

    use tracing::{Event, Subscriber};
    use tracing_subscriber::fmt::format::Writer;
    use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
    use tracing_subscriber::registry::LookupSpan;

    /// Adds `trace_id` and `span_id` of the current span (when an OpenTelemetry layer records
    /// it) to the line `inner` writes: JSON lines get two more fields, text lines start with
    /// them. The current span is read from the dispatcher, not from the log layer's context,
    /// which sees no spans.
    pub struct WithTraceIds<F> {
        pub inner: F,
        pub json: bool,
    }

    impl<S, N, F> FormatEvent<S, N> for WithTraceIds<F>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'a> FormatFields<'a> + 'static,
        F: FormatEvent<S, N>,
    {
        fn format_event(
            &self,
            ctx: &FmtContext<'_, S, N>,
            mut writer: Writer<'_>,
            event: &Event<'_>,
        ) -> fmt::Result {
            let Some((trace_id, span_id)) = current_ids(ctx) else {
                return self.inner.format_event(ctx, writer, event);
            };
            if !self.json {
                write!(writer, "trace_id={trace_id} span_id={span_id} ")?;
                return self.inner.format_event(ctx, writer, event);
            }
            let mut line = String::new();
            self.inner
                .format_event(ctx, Writer::new(&mut line), event)?;
            match line.trim_end().strip_suffix('}') {
                Some(head) => writeln!(
                    writer,
                    "{head},\"trace_id\":\"{trace_id}\",\"span_id\":\"{span_id}\"}}"
                ),
                None => writer.write_str(&line),
            }
        }
    }

    #[cfg(feature = "otel-export")]
    fn current_ids<S, N>(_: &FmtContext<'_, S, N>) -> Option<(String, String)>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'a> FormatFields<'a> + 'static,
    {
        let cx = crate::otel::context_of(&tracing::Span::current())?;
        Some((cx.parent.trace_id_hex(), cx.parent.parent_id_hex()))
    }

    #[cfg(not(feature = "otel-export"))]
    fn current_ids<S, N>(_: &FmtContext<'_, S, N>) -> Option<(String, String)>
    where
        S: Subscriber + for<'a> LookupSpan<'a>,
        N: for<'a> FormatFields<'a> + 'static,
    {
        None
    }
}

/// Whether an event or span may be recorded: `false` for the library call sites that print
/// message payloads. Install it as a global filter beside the `RUST_LOG` one (a user's
/// `lapin=trace` must not bring the payloads back).
pub fn payload_free(meta: &Metadata<'_>) -> bool {
    let target = meta.target();
    let level = *meta.level();
    if target.starts_with("lapin::returned_messages") {
        return level == Level::ERROR;
    }
    if target.starts_with("lapin") || target.starts_with("amq_protocol") {
        return level < Level::TRACE;
    }
    if target.starts_with("rmcp") {
        return level < Level::DEBUG;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::payload_free;
    use tracing::Level;

    fn allowed(target: &'static str, level: Level) -> bool {
        // `Metadata` needs 'static parts; build one per case through a callsite-free path.
        struct Cs;
        impl tracing::callsite::Callsite for Cs {
            fn set_interest(&self, _: tracing::subscriber::Interest) {}
            fn metadata(&self) -> &tracing::Metadata<'_> {
                unreachable!()
            }
        }
        static CS: Cs = Cs;
        let meta = tracing::Metadata::new(
            "event",
            target,
            level,
            None,
            None,
            None,
            tracing::field::FieldSet::new(&[], tracing::callsite::Identifier(&CS)),
            tracing::metadata::Kind::EVENT,
        );
        payload_free(&meta)
    }

    #[test]
    fn payload_printing_call_sites_are_dropped_at_every_level() {
        assert!(!allowed("lapin::returned_messages", Level::WARN));
        assert!(!allowed("lapin::channels", Level::TRACE));
        assert!(!allowed("amq_protocol::frame", Level::TRACE));
        assert!(!allowed("rmcp::service", Level::DEBUG));
        assert!(!allowed(
            "rmcp::transport::streamable_http_server::tower",
            Level::TRACE
        ));
        assert!(allowed("lapin::channel", Level::INFO));
        assert!(allowed("lapin::io_loop", Level::DEBUG));
        assert!(allowed("rmcp::service", Level::INFO));
        assert!(allowed("worker::amqp::relay", Level::TRACE));
    }
}
