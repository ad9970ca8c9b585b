//! Whether `jetrl run` can reach NATS, checked every second: its own connection's state (a dead local server is
//! noticed at once) and a JetStream round trip with a short deadline (a silent network is noticed within
//! [`PROBE_TIMEOUT`] + [`PROBE_EVERY`], where the client's own pings would take minutes).

use std::time::Duration;

use async_nats::connection::State;
use async_nats::jetstream::context::AccountErrorKind;
use tokio::sync::watch;

pub const PROBE_EVERY: Duration = Duration::from_secs(1);
pub const PROBE_TIMEOUT: Duration = Duration::from_secs(2);

/// The last probe's finding: `None` while the broker answers, else why not.
pub type Unreachable = Option<&'static str>;

/// Probes `bus` every [`PROBE_EVERY`] until the returned receiver is dropped.
pub fn watch(bus: jetrl_bus::Bus) -> watch::Receiver<Unreachable> {
    let (tx, rx) = watch::channel(None);
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(PROBE_EVERY);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let finding = probe(&bus).await;
            if tx.send(finding).is_err() {
                break;
            }
        }
    });
    rx
}

async fn probe(bus: &jetrl_bus::Bus) -> Unreachable {
    if bus.client().connection_state() != State::Connected {
        return Some("connection lost");
    }
    match tokio::time::timeout(PROBE_TIMEOUT, bus.jetstream().query_account()).await {
        Err(_) => Some("no answer within 2 s"),
        Ok(Ok(_)) => None,
        Ok(Err(e)) => match e.kind() {
            // the server answered, if only to refuse
            AccountErrorKind::JetStream(_) => None,
            AccountErrorKind::TimedOut => Some("no answer within 2 s"),
            AccountErrorKind::JetStreamUnavailable => Some("JetStream unavailable"),
            AccountErrorKind::Other => Some("connection lost"),
        },
    }
}
