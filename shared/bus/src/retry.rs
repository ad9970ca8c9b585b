//! Asking again, bounded: a failure that is not permanent ([`Recovery::retryable`]) is retried with backoff
//! (0.1 s doubling to 2 s) while the call is younger than its deadline; a permanent one, or the last one, is
//! returned and counted in `jetrl_bus_errors_total{kind,recovery}`. Each retry is logged and counted in
//! `jetrl_bus_retries_total{kind,recovery}`.
//!
//! The deadline of the group records, the lease and the weight lookups is `nats.connect_timeout_s` (the
//! [`Bus::topology_wait`](crate::Bus::topology_wait)): long enough for a JetStream cluster to elect a new leader
//! after a node dies, short enough that a broker that is really gone is reported.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::{BusError, Cause, Recovery};

/// How long a call may keep asking again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Patience {
    pub first: Duration,
    pub max: Duration,
    /// no retry starts after this much time since the first attempt
    pub deadline: Duration,
    /// how long one attempt may take before it counts as a transient failure: a request sent as the connection
    /// moved to another server (a node died, the server restarted) gets no answer at all, and waiting out the
    /// client's whole request timeout for it would spend the deadline on one lost message
    pub attempt: Duration,
}

/// Longest wait for one attempt (a KV read or write answers in milliseconds when the broker is well).
const ATTEMPT: Duration = Duration::from_secs(3);

impl Patience {
    pub fn within(deadline: Duration) -> Self {
        Self { first: Duration::from_millis(100), max: Duration::from_secs(2), deadline, attempt: ATTEMPT }
    }

    /// Bounds one attempt by [`Patience::attempt`]; running out is a transient failure of `what`.
    pub async fn bounded<T>(
        &self,
        what: &str,
        attempt: impl Future<Output = Result<T, BusError>>,
    ) -> Result<T, BusError> {
        match tokio::time::timeout(self.attempt, attempt).await {
            Ok(result) => result,
            Err(_) => Err(BusError::Request {
                subject: what.to_string(),
                cause: Cause::transient(format!("no answer within {:.1}s", self.attempt.as_secs_f64())),
            }),
        }
    }

    /// No retries at all.
    pub fn none() -> Self {
        Self::within(Duration::ZERO)
    }

    /// Starts the clock of one call.
    pub fn start(&self) -> Backoff {
        Backoff { patience: *self, started: Instant::now(), delays: Delays::new(self.first, self.max), attempt: 1 }
    }

    /// Runs `op` until it succeeds, fails permanently, or the deadline is reached.
    pub async fn retry<T, F, Fut>(&self, what: &str, mut op: F) -> Result<T, BusError>
    where
        F: FnMut() -> Fut,
        Fut: Future<Output = Result<T, BusError>>,
    {
        let mut backoff = self.start();
        loop {
            match self.bounded(what, op()).await {
                Ok(value) => return Ok(value),
                Err(err) => {
                    if !backoff.wait(what, &err).await {
                        return Err(err.counted());
                    }
                }
            }
        }
    }
}

pub use jetrl_telemetry::Delays;

/// The retry state of one call.
#[derive(Debug)]
pub struct Backoff {
    patience: Patience,
    started: Instant,
    delays: Delays,
    attempt: u32,
}

impl Backoff {
    /// After a failure: sleeps and returns true when the call should ask again, false when it should give up
    /// (`err` is permanent or the deadline is reached).
    pub async fn wait(&mut self, what: &str, err: &BusError) -> bool {
        let recovery = err.recovery();
        if recovery == Recovery::Permanent || self.started.elapsed() + self.delays.peek() > self.patience.deadline {
            return false;
        }
        metrics::counter!("jetrl_bus_retries_total", "kind" => err.kind(), "recovery" => recovery.label()).increment(1);
        let delay = self.delays.next_delay();
        tracing::warn!(what, attempt = self.attempt, recovery = recovery.label(), error = %err, delay_s = delay.as_secs_f64(), "asking again");
        tokio::time::sleep(delay).await;
        self.attempt += 1;
        true
    }

    /// Attempts made so far.
    pub fn attempts(&self) -> u32 {
        self.attempt
    }

    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }
}
