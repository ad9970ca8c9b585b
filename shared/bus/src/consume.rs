//! Pull consumption: decoding with poison-message handling, and acknowledgement helpers.

use std::sync::{PoisonError, RwLock};
use std::time::Duration;

use async_nats::jetstream::{self, consumer::PullConsumer, AckKind};
use futures::StreamExt;

use crate::{Bus, BusError, Cause};

/// Where this process sets malformed messages aside: a connection and the job's dead-letter prefix
/// (`jetrl.<ns>.dlq`). Set by each service when it connects ([`route_dead_letters`]); the last one wins.
static DEAD_LETTERS: RwLock<Option<(async_nats::Client, String)>> = RwLock::new(None);

/// At most this much of a dead letter's payload is kept (an oversized message is cut; `Jetrl-Bytes` says how
/// long it was).
pub const DEAD_LETTER_MAX_BYTES: usize = 64 * 1024;

/// Sends this process's dead letters to `bus`'s job (its DLQ stream, declared with the topology).
pub fn route_dead_letters(bus: &Bus) {
    let prefix = bus.names().dlq_subject("");
    let prefix = prefix.trim_end_matches('.').to_string();
    *DEAD_LETTERS.write().unwrap_or_else(PoisonError::into_inner) = Some((bus.client().clone(), prefix));
}

/// Sets a malformed or invalid message aside: counted as [`count_malformed`] does, and copied (best effort, never
/// waited on) to the job's dead-letter stream on `jetrl.<ns>.dlq.<service>` with headers naming where it came
/// from (`Jetrl-Subject`), who refused it (`Jetrl-Service`), why (`Jetrl-Reason`) and its size (`Jetrl-Bytes`).
/// The stream keeps a bounded history (see the topology); `jetrl status` counts it by service.
pub fn dead_letter(service: &str, source: &str, subject: &str, reason: &str, payload: &[u8]) {
    count_malformed(service, source);
    let Some((client, prefix)) = DEAD_LETTERS.read().unwrap_or_else(PoisonError::into_inner).clone() else {
        return;
    };
    let mut headers = async_nats::HeaderMap::new();
    let one_line =
        |text: &str| -> String { text.chars().map(|c| if c.is_control() { ' ' } else { c }).take(512).collect() };
    headers.insert("Jetrl-Subject", one_line(subject).as_str());
    headers.insert("Jetrl-Service", service);
    headers.insert("Jetrl-Reason", one_line(reason).as_str());
    headers.insert("Jetrl-Bytes", payload.len().to_string().as_str());
    let kept = bytes::Bytes::copy_from_slice(&payload[..payload.len().min(DEAD_LETTER_MAX_BYTES)]);
    let target = format!("{prefix}.{service}");
    tokio::spawn(async move {
        if let Err(err) = client.publish_with_headers(target.clone(), headers, kept).await {
            tracing::warn!(subject = %target, error = %err, "dead letter not sent");
        }
    });
}

/// Decodes a protobuf message. A message that does not decode is counted in
/// `jetrl_<service>_malformed_messages_total{stream}`, logged with its subject and terminated, so it is
/// never redelivered; the caller just moves on.
pub async fn decode_or_term<M: prost::Message + Default>(msg: &jetstream::Message, service: &str) -> Option<M> {
    match M::decode(msg.payload.as_ref()) {
        Ok(decoded) => Some(decoded),
        Err(err) => {
            let stream = msg.info().map(|i| i.stream.to_string()).unwrap_or_else(|_| "unknown".into());
            let reason = format!("malformed: does not decode as {}: {err}", std::any::type_name::<M>());
            dead_letter(service, &stream, &msg.subject, &reason, &msg.payload);
            tracing::error!(subject = %msg.subject, %stream, error = %err, bytes = msg.payload.len(), "malformed message terminated");
            if let Err(err) = msg.ack_with(AckKind::Term).await {
                tracing::warn!(subject = %msg.subject, error = %err, "could not terminate malformed message");
            }
            None
        }
    }
}

/// Counts one malformed message for `service`, labelled by where it came from (a stream or a subject
/// family; bounded).
pub fn count_malformed(service: &str, source: &str) {
    metrics::counter!(format!("jetrl_{service}_malformed_messages_total"), "source" => source.to_string()).increment(1);
}

/// Acknowledges and waits for the server's confirmation (used when the ack itself must be durable before
/// moving on, e.g. before deleting state).
pub async fn ack_confirmed(msg: &jetstream::Message) -> Result<(), BusError> {
    msg.double_ack().await.map_err(|e| BusError::Consume { what: msg.subject.to_string(), cause: Cause::other(e) })
}

/// Fire-and-forget ack of the given kind; a lost ack only causes a redelivery that de-duplication absorbs.
pub async fn settle(msg: &jetstream::Message, kind: AckKind) {
    let label = match kind {
        AckKind::Ack => "ack",
        AckKind::Nak(_) => "nak",
        AckKind::Progress => "progress",
        AckKind::Next => "next",
        AckKind::Term => "term",
    };
    if let Err(err) = msg.ack_with(kind).await {
        tracing::warn!(subject = %msg.subject, kind = label, error = %err, "ack not sent");
    }
}

/// Pulls up to `max` messages, yielding each as it arrives; returns after `max` messages or `expires`.
pub async fn pull(
    consumer: &PullConsumer,
    max: usize,
    expires: Duration,
) -> Result<jetstream::consumer::pull::Batch, BusError> {
    consumer
        .batch()
        .max_messages(max.max(1))
        .expires(expires)
        .messages()
        .await
        .map_err(|e| BusError::Consume { what: "pull".into(), cause: Cause::of(e) })
}

/// Pulls a batch and collects it (for tests and simple loops).
pub async fn pull_collect(
    consumer: &PullConsumer,
    max: usize,
    expires: Duration,
) -> Result<Vec<jetstream::Message>, BusError> {
    let mut batch = pull(consumer, max, expires).await?;
    let mut out = Vec::new();
    while let Some(item) = batch.next().await {
        match item {
            Ok(msg) => out.push(msg),
            Err(err) => return Err(BusError::Consume { what: "pull".into(), cause: Cause::other(err) }),
        }
    }
    Ok(out)
}

/// Reads what `stream` holds now for `config` (an ordered consumer: its filter and start), oldest first, handing
/// each message to `each`; stops at the stream's last message as of the call or after `max` messages. Returns how
/// many were read. For one-off reads (a scan, a test's check), not for following a stream.
///
/// When no message comes for `wait` before the end, the read fails (transient: the caller asks again) instead of
/// returning what it had: a consumer that stalls while a cluster elects a leader must not pass for a short stream.
pub async fn read_stored(
    stream: &jetstream::stream::Stream,
    config: jetstream::consumer::pull::OrderedConfig,
    max: usize,
    wait: Duration,
    each: impl FnMut(&jetstream::Message),
) -> Result<usize, BusError> {
    read_stored_until(stream, config, max, wait, None, each).await
}

/// [`read_stored`] that must deliver stream sequence `reach` (the last message on the filter, as the stream
/// leader has it): in a cluster the ordered consumer may be placed on a replica still catching up after a
/// restart, which holds fewer messages and reports none pending before `reach`; the read then waits for it and
/// fails (transient) after `wait` without one, instead of passing a short read for the whole (a ledger read that
/// way missed the last step's groups).
pub async fn read_stored_through(
    stream: &jetstream::stream::Stream,
    config: jetstream::consumer::pull::OrderedConfig,
    reach: u64,
    wait: Duration,
    each: impl FnMut(&jetstream::Message),
) -> Result<usize, BusError> {
    read_stored_until(stream, config, usize::MAX, wait, Some(reach), each).await
}

async fn read_stored_until(
    stream: &jetstream::stream::Stream,
    config: jetstream::consumer::pull::OrderedConfig,
    max: usize,
    wait: Duration,
    reach: Option<u64>,
    mut each: impl FnMut(&jetstream::Message),
) -> Result<usize, BusError> {
    let what = stream.cached_info().config.name.clone();
    let failed = |cause: Cause| BusError::Consume { what: what.clone(), cause };
    let state = stream.get_info().await.map_err(|e| failed(Cause::of(e)))?.state;
    if state.messages == 0 {
        return Ok(0);
    }
    let behind = |read: usize| {
        failed(Cause::transient(format!(
            "the consumer's replica has not caught up: {read} read, #{} expected",
            reach.unwrap_or_default()
        )))
    };
    let consumer = stream.create_consumer(config).await.map_err(|e| failed(Cause::of(e)))?;
    if consumer.cached_info().num_pending == 0 {
        return match reach {
            Some(_) => Err(behind(0)),
            None => Ok(0),
        };
    }
    let mut messages = consumer.messages().await.map_err(|e| failed(Cause::of(e)))?;
    let mut read = 0;
    while read < max {
        let Ok(next) = tokio::time::timeout(wait, messages.next()).await else {
            return Err(failed(Cause::transient(format!(
                "no message for {:.1}s after {read} of the stored ones (the stream's last is #{}{})",
                wait.as_secs_f64(),
                state.last_sequence,
                reach.map(|r| format!(", #{r} expected")).unwrap_or_default()
            ))));
        };
        let msg =
            next.ok_or_else(|| failed(Cause::transient("the consumer ended")))?.map_err(|e| failed(Cause::of(e)))?;
        read += 1;
        each(&msg);
        let Ok(info) = msg.info() else { break };
        let done = match reach {
            Some(reach) => info.stream_sequence >= reach,
            None => info.pending == 0 || info.stream_sequence >= state.last_sequence,
        };
        if done {
            break;
        }
    }
    Ok(read)
}
