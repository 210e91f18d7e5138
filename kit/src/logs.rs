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
use tracing_subscriber::EnvFilter;

/// Installs the global log subscriber on stderr: `RUST_LOG` (else `default_filter`) selects
/// what is logged, [`payload_free`] always applies, `json` writes one JSON object a line. A
/// second call (tests, a library user with its own subscriber) changes nothing.
pub fn init(json: bool, ansi: bool, default_filter: &str) {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_filter));
    let registry = tracing_subscriber::registry()
        .with(filter)
        .with(tracing_subscriber::filter::filter_fn(payload_free));
    let text = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let _ = if json {
        registry.with(text.json().flatten_event(true)).try_init()
    } else {
        registry.with(text).try_init()
    };
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
