//! Reading stored payloads back by stream sequence, many at a time.
//!
//! A sampled batch names its trajectories by TRAJ stream sequence, and a group's trajectories share one subject
//! (`jetrl.<ns>.traj.<partition>.<uid>`). One batched direct get per group (ADR-31: `seq`, `next_by_subj`, `batch`;
//! nats-server ≥ 2.11) returns all of them in one request instead of one round trip per trajectory. Anything a
//! batch did not return (an older server, messages in between on the same subject) is fetched one by one.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use bytes::Bytes;
use futures::StreamExt;

use async_nats::jetstream::stream::{DirectGetError, DirectGetErrorKind};

use crate::{Bus, BusError, Cause};

/// Batched requests in flight at once.
const CONCURRENT_BATCHES: usize = 32;
/// Single direct gets in flight at once (the fallback).
const CONCURRENT_SINGLE: usize = 64;
/// How long one batch may take before the rest of it is fetched one by one.
const BATCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Extra messages a batch may read past the wanted ones (other messages on the same subject).
const SLACK: usize = 8;

impl Bus {
    /// The payloads at `wanted` (subject, stream sequence) in `stream`, by sequence. A sequence that is not
    /// in the stream (purged, expired) is absent from the map; a failed request is an error.
    pub async fn fetch_by_sequence(
        &self,
        stream: &str,
        wanted: &[(String, u64)],
    ) -> Result<HashMap<u64, Bytes>, BusError> {
        // subjects owned, not borrowed: a closure over borrowed items makes this future one the compiler cannot
        // prove `Send` where a caller boxes it (`BoxFuture`, the trainer's data plane)
        let mut by_subject: BTreeMap<String, Vec<u64>> = BTreeMap::new();
        for (subject, seq) in wanted {
            by_subject.entry(subject.clone()).or_default().push(*seq);
        }
        let batches: Vec<HashMap<u64, Bytes>> =
            futures::stream::iter(by_subject.into_iter().map(|(subject, mut seqs)| async move {
                seqs.sort_unstable();
                seqs.dedup();
                self.direct_get_batch(stream, &subject, &seqs).await.unwrap_or_default()
            }))
            .buffer_unordered(CONCURRENT_BATCHES)
            .collect()
            .await;
        let mut found: HashMap<u64, Bytes> = batches.into_iter().flatten().collect();
        let missing: Vec<u64> = wanted.iter().map(|(_, s)| *s).filter(|s| !found.contains_key(s)).collect();
        if !missing.is_empty() {
            let handle = self.stream(stream).await?;
            let replicated = self.replicas() > 1;
            let singles: Vec<(u64, Result<Bytes, DirectGetError>)> =
                futures::stream::iter(missing.into_iter().map(|seq| {
                    let handle = &handle;
                    async move {
                        match handle.direct_get(seq).await {
                            Ok(msg) => (seq, Ok(msg.payload)),
                            // a follower that has not applied it yet (just written, or a node catching up after
                            // a restart) answers "not found": the stream leader decides
                            Err(e) if replicated && e.kind() == DirectGetErrorKind::NotFound => {
                                (seq, from_leader(handle, seq).await)
                            }
                            Err(e) => (seq, Err(e)),
                        }
                    }
                }))
                .buffer_unordered(CONCURRENT_SINGLE)
                .collect()
                .await;
            for (seq, result) in singles {
                match result {
                    Ok(payload) => {
                        found.insert(seq, payload);
                    }
                    // not found: the caller reports the missing key
                    Err(e) if e.kind() == DirectGetErrorKind::NotFound => {}
                    Err(e) => {
                        return Err(BusError::Request {
                            subject: format!("direct get {stream} #{seq}"),
                            cause: Cause::of(e),
                        })
                    }
                }
            }
        }
        Ok(found)
    }

    /// One batched direct get: the messages on `subject` from `seqs[0]` on, keeping those in `seqs`.
    pub(crate) async fn direct_get_batch(
        &self,
        stream: &str,
        subject: &str,
        seqs: &[u64],
    ) -> Result<HashMap<u64, Bytes>, BusError> {
        let (Some(&first), Some(&last)) = (seqs.first(), seqs.last()) else { return Ok(HashMap::new()) };
        let client = self.client();
        let request_subject = format!("$JS.API.DIRECT.GET.{stream}");
        let err = |cause: Cause| BusError::Request { subject: request_subject.clone(), cause };
        let inbox = client.new_inbox();
        let mut replies = client.subscribe(inbox.clone()).await.map_err(|e| err(Cause::of(e)))?;
        let body = serde_json::json!({ "seq": first, "next_by_subj": subject, "batch": seqs.len() + SLACK });
        client
            .publish_with_reply(request_subject.clone(), inbox, body.to_string().into())
            .await
            .map_err(|e| err(Cause::of(e)))?;
        let mut out = HashMap::with_capacity(seqs.len());
        let collect = async {
            while let Some(msg) = replies.next().await {
                // a status reply ends the batch: 204 end of batch, 404 nothing (more) found, others errors
                if msg.status.is_some() {
                    break;
                }
                let seq = msg
                    .headers
                    .as_ref()
                    .and_then(|h| h.get("Nats-Sequence"))
                    .and_then(|v| v.as_str().parse::<u64>().ok());
                let Some(seq) = seq else { break };
                if seqs.binary_search(&seq).is_ok() {
                    out.insert(seq, msg.payload);
                }
                if seq >= last || out.len() == seqs.len() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(BATCH_TIMEOUT, collect).await;
        Ok(out)
    }
}

/// The message at `seq` read through its stream's leader (`STREAM.MSG.GET`, not a direct get): "not found" only
/// when the leader has no such message.
async fn from_leader(handle: &async_nats::jetstream::stream::Stream, seq: u64) -> Result<Bytes, DirectGetError> {
    use async_nats::jetstream::stream::RawMessageErrorKind;
    match handle.get_raw_message(seq).await {
        Ok(msg) => Ok(msg.payload),
        Err(e) if e.kind() == RawMessageErrorKind::NoMessageFound => {
            Err(DirectGetError::new(DirectGetErrorKind::NotFound))
        }
        Err(e) => Err(DirectGetError::with_source(DirectGetErrorKind::Other, e)),
    }
}
