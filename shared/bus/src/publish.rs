//! JetStream publishing with de-duplication and pipelined acknowledgements.
//!
//! Awaiting each publish ack in turn caps a publisher at one round trip per message (~5k msg/s on
//! loopback); keeping a bounded window of acks in flight gives the broker's full rate (60–70k msg/s)
//! while still knowing, for each message, that it is durable. A failed or timed-out ack is retried with
//! the same `Nats-Msg-Id`, so the stream stores the message once, after a backoff (0.1 s doubling, at most 2 s)
//! and at most [`MAX_ATTEMPTS`] times. What cannot succeed however often it is tried fails at once, without a
//! retry: a publish the server refuses (a permissions violation: it sends no ack, only an error), a message above
//! the server's `max_payload`, a stream refusing it on its expectations.

use std::future::IntoFuture;
use std::pin::Pin;

use async_nats::header::{HeaderMap, NATS_MESSAGE_ID};
use async_nats::jetstream::context::PublishAckFuture;
use bytes::Bytes;
use futures::stream::FuturesUnordered;
use futures::StreamExt;

use crate::{Bus, BusError, Cause};

/// Publish attempts per message before giving up (failures that may pass on a retry only), unless the message's
/// first send is younger than the bus's patience (`nats.connect_timeout_s`): a JetStream cluster answers "no
/// stream" for the seconds it elects a stream's leader, longer than five quick attempts.
const MAX_ATTEMPTS: u32 = 5;

/// Backoff before the second attempt; doubled per attempt up to [`MAX_BACKOFF`].
const FIRST_BACKOFF: std::time::Duration = std::time::Duration::from_millis(100);
const MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(2);

/// Largest ack window a [`Publisher`] keeps (below the context's `max_ack_inflight` of 4096).
pub const MAX_WINDOW: usize = 4000;

/// One message to publish.
#[derive(Clone, Debug)]
pub struct Outgoing {
    pub subject: String,
    /// `Nats-Msg-Id`: the stream keeps one copy per id within its duplicate window
    pub msg_id: Option<String>,
    pub headers: Vec<(String, String)>,
    pub payload: Bytes,
}

impl Outgoing {
    pub fn new(subject: impl Into<String>, msg_id: Option<String>, payload: Bytes) -> Self {
        Self { subject: subject.into(), msg_id, headers: Vec::new(), payload }
    }

    pub fn protobuf(subject: impl Into<String>, msg_id: Option<String>, message: &impl prost::Message) -> Self {
        Self::new(subject, msg_id, Bytes::from(message.encode_to_vec()))
    }

    pub fn header(mut self, name: &str, value: impl Into<String>) -> Self {
        self.headers.push((name.to_string(), value.into()));
        self
    }

    fn header_map(&self) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(id) = &self.msg_id {
            headers.insert(NATS_MESSAGE_ID, id.as_str());
        }
        for (name, value) in &self.headers {
            headers.insert(name.as_str(), value.as_str());
        }
        headers
    }
}

/// The acknowledgement of one published message.
#[derive(Debug, Clone)]
pub struct Acked {
    pub subject: String,
    pub msg_id: Option<String>,
    /// stream sequence of the stored message (of the first copy when this one was a duplicate)
    pub sequence: u64,
    pub duplicate: bool,
}

/// Why a publish was not acknowledged decides whether it is sent again ([`Cause::recovery`]): a lost or late ack, a
/// broken connection, a full ack window may pass on a retry; so may "no stream" (no responders), which a cluster
/// answers while a stream's leader is being elected. A message above the server's `max_payload`, one a stream
/// refuses on its expectations (last id or sequence) or a subject this identity may not publish to (the server's
/// permissions violation) will not, however often it is sent.
type AckFuture = Pin<Box<dyn std::future::Future<Output = (Outgoing, Attempt, Result<Acked, Cause>)> + Send>>;

/// Which attempt at sending a message this is, and when the first one was made.
#[derive(Debug, Clone, Copy)]
struct Attempt {
    number: u32,
    first: std::time::Instant,
}

impl Attempt {
    fn first() -> Self {
        Self { number: 1, first: std::time::Instant::now() }
    }

    fn next(self) -> Self {
        Self { number: self.number + 1, ..self }
    }
}

/// Publishes with a bounded window of acknowledgements in flight.
pub struct Publisher {
    bus: Bus,
    max_inflight: usize,
    inflight: FuturesUnordered<AckFuture>,
    /// acks collected while making room in the window; handed out by [`Publisher::drain`]
    done: Vec<Acked>,
}

impl Publisher {
    pub fn new(bus: &Bus, max_inflight: usize) -> Self {
        Self {
            bus: bus.clone(),
            max_inflight: max_inflight.max(1),
            inflight: FuturesUnordered::new(),
            done: Vec::new(),
        }
    }

    /// Sends `message`; returns once it is on the wire and the window has room (not when acked).
    pub async fn publish(&mut self, message: Outgoing) -> Result<(), BusError> {
        let max = self.bus.max_payload();
        if max > 0 && message.payload.len() > max {
            return Err(BusError::PayloadTooLarge { subject: message.subject, bytes: message.payload.len(), max });
        }
        while self.inflight.len() >= self.max_inflight {
            self.settle_one().await?;
        }
        let future = send(&self.bus, message, Attempt::first()).await?;
        self.inflight.push(future);
        Ok(())
    }

    async fn settle_one(&mut self) -> Result<(), BusError> {
        let Some((message, sent, result)) = self.inflight.next().await else { return Ok(()) };
        let attempt = sent.number;
        let backoff = crate::Delays::new(FIRST_BACKOFF, MAX_BACKOFF).nth(attempt);
        let patient = sent.first.elapsed() + backoff < self.bus.topology_wait();
        match result {
            Ok(acked) => {
                self.done.push(acked);
                Ok(())
            }
            Err(cause) if !cause.recovery().retryable() => {
                metrics::counter!("jetrl_bus_publish_permanent_failures_total").increment(1);
                let cause = cause.context("permanent: not retried");
                Err(BusError::Publish { subject: message.subject, cause }.counted())
            }
            Err(err) if attempt < MAX_ATTEMPTS || patient => {
                tracing::warn!(subject = %message.subject, attempt, error = %err, recovery = err.recovery().label(), ?backoff, "publish not acknowledged; retrying");
                metrics::counter!("jetrl_bus_publish_retries_total").increment(1);
                tokio::time::sleep(backoff).await;
                let future = send(&self.bus, message, sent.next()).await?;
                self.inflight.push(future);
                Ok(())
            }
            Err(cause) => {
                let cause = cause.context(format!("after {attempt} attempts"));
                Err(BusError::Publish { subject: message.subject, cause }.counted())
            }
        }
    }

    /// Waits for every outstanding ack; returns all acks since the last drain, in completion order.
    pub async fn drain(&mut self) -> Result<Vec<Acked>, BusError> {
        while !self.inflight.is_empty() {
            self.settle_one().await?;
        }
        Ok(std::mem::take(&mut self.done))
    }

    pub fn inflight(&self) -> usize {
        self.inflight.len()
    }

    /// The connection (and job) this publisher writes to.
    pub fn bus(&self) -> &Bus {
        &self.bus
    }
}

/// Puts one message on the wire; the returned future resolves with its ack. A free function (not a
/// method) so that a `&Publisher` is never held across an await: `Publisher` is `Send` but not `Sync`.
async fn send(bus: &Bus, message: Outgoing, attempt: Attempt) -> Result<AckFuture, BusError> {
    let (refusals, sent) = (bus.refusals(), std::time::Instant::now());
    let ack: PublishAckFuture = bus
        .jetstream()
        .publish_with_headers(message.subject.clone(), message.header_map(), message.payload.clone())
        .await
        .map_err(|e| BusError::Publish { subject: message.subject.clone(), cause: Cause::of(e) })?;
    Ok(Box::pin(async move {
        // A subject this identity may not publish to gets no ack, only the server's permissions violation: wait
        // for either, so a refusal fails now rather than after every attempt's timeout.
        let acked = tokio::select! {
            result = ack.into_future() => result
                .map(|ack| Acked {
                    subject: message.subject.clone(),
                    msg_id: message.msg_id.clone(),
                    sequence: ack.sequence,
                    duplicate: ack.duplicate,
                })
                .map_err(Cause::of),
            refused = refusals.refused(&message.subject, sent) => Err(Cause::permanent(refused)),
        };
        (message, attempt, acked)
    }))
}

impl Bus {
    /// Publishes one message and waits for its ack (for low-rate control messages).
    pub async fn publish_durable(&self, message: Outgoing) -> Result<Acked, BusError> {
        let mut publisher = Publisher::new(self, 1);
        publisher.publish(message).await?;
        let mut acks = publisher.drain().await?;
        acks.pop().ok_or_else(|| BusError::Publish { subject: "?".into(), cause: Cause::transient("no ack") })
    }
}
