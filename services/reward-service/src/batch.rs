//! One file: one micro-batch's path, from decoding the requests to publishing the scores.
//!
//! One micro-batch of score requests (one per prompt group): decode, skip what is already scored, score, publish
//! the rewards of the whole micro-batch as one reward batch per partition, then acknowledge.

use std::collections::{BTreeMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::{pull::OrderedConfig, DeliverPolicy};
use async_nats::jetstream::stream::{DirectGetErrorKind, Stream};
use async_nats::jetstream::AckKind;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, score, Bus, BusError, Publisher};
use jetrl_reward::{RewardEngine, ScoreInput, ScoreOutcome, FAILURES_METRIC};
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::score::{prompt_len, response_len};
use jetrl_wire::subjects::{self, Names};
use jetrl_wire::v1::{Reward, RewardBatch, ScoreRequest, Trajectory};
use jetrl_wire::Message;

use crate::prompt::PromptSource;
use crate::pull::{LeaseId, Leases, Pulled, Room};
use crate::{BATCH_ERRORS_METRIC, BATCH_SECONDS_METRIC, QUEUE_LAG_METRIC, SERVICE, TRAJECTORIES_METRIC};

/// How soon a trajectory whose reward could not be published is offered again.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Trajectories of one group read at most from TRAJ to give the group of a malformed request failure rewards.
const MAX_TRAJECTORIES_PER_GROUP: usize = 4096;
/// A reward message is closed once its encoded rewards and request ids pass this size (NATS's default payload
/// limit is 1 MiB); a request's rewards always stay in one message.
const MAX_MESSAGE_BYTES: usize = 512 * 1024;
/// The scan for a redelivered request's rewards starts this long before the request was stored (clock
/// differences between the servers of a cluster).
const SCAN_SLACK: Duration = Duration::from_secs(2);
/// Reward messages read at most by one scan; past it, what is not found is scored again.
const MAX_SCANNED: usize = 200_000;
/// How long the scan waits for the next message before it treats the stream as read.
const SCAN_WAIT: Duration = Duration::from_secs(2);

/// What every micro-batch shares.
pub struct BatchContext {
    pub bus: Bus,
    pub engine: Arc<RewardEngine>,
    pub prompts: PromptSource,
    /// the REWARDS stream, read to recognise redelivered requests that already have their rewards
    pub rewards: Stream,
    /// the TRAJ stream, read for the keys of a group whose score request does not decode
    pub trajectories: Stream,
    /// trajectories scored per call of the scorer at most (`reward.batch_size`)
    pub batch_size: usize,
    pub leases: Leases,
    pub room: Room,
}

impl BatchContext {
    /// Hands back a request that was pulled but not scored (the service is stopping): another instance gets it
    /// at once.
    pub async fn release_unscored(&self, held: Pulled) {
        self.leases.release(held.lease);
        consume::settle(&held.msg, AckKind::Nak(None)).await;
        self.room.give_back(1);
    }

    /// The ids of the score requests answered by a reward batch stored in REWARDS since `since` (from each
    /// batch's [`subjects::SCORE_REQUESTS_HEADER`], read headers only, in one pass). Any doubt leaves an id out:
    /// its request is then scored again, and the buffer keeps the first reward of each trajectory.
    async fn answered_since(&self, since: async_nats::datetime::DateTime) -> HashSet<String> {
        let mut found = HashSet::new();
        let config = OrderedConfig {
            filter_subject: self.bus.names().reward_batches_filter(),
            deliver_policy: DeliverPolicy::ByStartTime { start_time: since },
            headers_only: true,
            ..Default::default()
        };
        let read = consume::read_stored(&self.rewards, config, MAX_SCANNED, SCAN_WAIT, |msg| {
            let Some(headers) = &msg.headers else { return };
            if let Some(ids) = headers.get(subjects::SCORE_REQUESTS_HEADER) {
                found.extend(ids.as_str().split(' ').filter(|id| !id.is_empty()).map(str::to_string));
            } else if let Some(id) = headers.get(async_nats::header::NATS_MESSAGE_ID) {
                found.insert(id.as_str().to_string());
            }
        })
        .await;
        if let Err(err) = read {
            tracing::warn!(error = %err, "cannot scan REWARDS; redelivered requests not found there are scored again");
        }
        found
    }

    /// Turns the redelivered requests of `items` whose rewards are already in REWARDS (published before a
    /// crash, or by another instance before its ack was lost) into [`Item::AlreadyScored`]: one scan of REWARDS
    /// from the earliest of them, none when nothing was redelivered.
    async fn skip_already_scored(&self, items: Vec<Item>) -> Vec<Item> {
        let since = items
            .iter()
            .filter_map(|item| match item {
                Item::Decoded { held, .. } => held.msg.info().ok().filter(|i| i.delivered > 1).map(|i| i.published),
                _ => None,
            })
            .min();
        let Some(since) = since else { return items };
        let answered = self.answered_since(since - SCAN_SLACK).await;
        items
            .into_iter()
            .map(|item| match item {
                Item::Decoded { held, request, id } if answered.contains(&id) => {
                    tracing::debug!(uid = %request.uid, "redelivered score request already has its rewards");
                    Item::AlreadyScored { held }
                }
                other => other,
            })
            .collect()
    }
}

/// The `Nats-Msg-Id` and sequence of each message on `subject` in `stream` (at most `max`), oldest first. A read
/// that fails ends the list early (logged): callers treat what is missing as absent.
async fn stored_ids(stream: &Stream, subject: &str, max: usize) -> Vec<(String, u64)> {
    let mut found = Vec::new();
    let mut from = 1;
    while found.len() < max {
        match stream.direct_get_next_for_subject(subject, Some(from)).await {
            Ok(stored) => {
                from = stored.sequence + 1;
                if let Some(id) = stored.headers.get(async_nats::header::NATS_MESSAGE_ID) {
                    found.push((id.as_str().to_string(), stored.sequence));
                }
            }
            Err(err) if matches!(err.kind(), DirectGetErrorKind::NotFound) => break,
            Err(err) => {
                tracing::warn!(%subject, error = %err, "cannot read the messages on a subject");
                break;
            }
        }
    }
    found
}

/// A score request of the batch, decoded or not.
enum Item {
    Decoded {
        held: Pulled,
        request: ScoreRequest,
        /// `Nats-Msg-Id` of the request, reused for its reward batch
        id: String,
    },
    /// already has its rewards in REWARDS: acknowledged without scoring
    AlreadyScored { held: Pulled },
    /// undecodable: terminated; its group's stored trajectories (found in TRAJ by the message's subject) get
    /// failure rewards, so the group is never stuck
    Malformed { held: Pulled, batch: Option<(String, RewardBatch)> },
}

impl Item {
    fn held(&self) -> &Pulled {
        match self {
            Item::Decoded { held, .. } | Item::AlreadyScored { held } | Item::Malformed { held, .. } => held,
        }
    }

    /// Trajectories this item stands for (for metrics).
    fn trajectories(&self) -> usize {
        match self {
            Item::Decoded { request, .. } => request.trajectories.len(),
            Item::Malformed { batch: Some((_, batch)), .. } => batch.rewards.len(),
            _ => 0,
        }
    }
}

/// Scores and publishes one micro-batch of requests, then acknowledges it. Never fails: a batch whose rewards
/// cannot be published is handed back (NAK with a delay) and counted.
pub async fn score_batch(context: Arc<BatchContext>, batch: Vec<Pulled>) {
    let started = Instant::now();
    let guard = HeldBatch { context: &context, leases: batch.iter().map(|held| held.lease).collect(), armed: true };
    let mut items = Vec::with_capacity(batch.len());
    for held in batch {
        items.push(decode(&context, held).await);
    }
    let mut items = context.skip_already_scored(items).await;
    let mut inputs = Vec::new();
    for item in &mut items {
        if let Item::Decoded { request, .. } = item {
            inputs.extend(request.trajectories.iter_mut().map(|traj| score_input(&context.prompts, traj)));
        }
    }
    let outcomes = score(&context.engine, inputs, context.batch_size).await;
    match publish(&context.bus, &mut items, outcomes).await {
        Ok(()) => settle(&context, items, AckKind::Ack, started).await,
        Err(err) => {
            // Nothing is acknowledged: the batch comes back; de-duplication absorbs whatever was published.
            tracing::error!(error = %err, requests = items.len(), "rewards not published; the batch comes back");
            metrics::counter!(BATCH_ERRORS_METRIC).increment(1);
            settle(&context, items, AckKind::Nak(Some(RETRY_DELAY)), started).await;
        }
    }
    guard.disarm();
}

/// A batch's leases and room, given up if the batch task ends without settling (a panic): its trajectories
/// then time out at the server and come back, instead of being renewed forever.
struct HeldBatch<'a> {
    context: &'a BatchContext,
    leases: Vec<LeaseId>,
    armed: bool,
}

impl HeldBatch<'_> {
    /// The batch settled every trajectory itself.
    fn disarm(mut self) {
        self.armed = false;
    }
}

impl Drop for HeldBatch<'_> {
    fn drop(&mut self) {
        if self.armed {
            for lease in &self.leases {
                self.context.leases.release(*lease);
            }
            self.context.room.give_back(self.leases.len());
        }
    }
}

async fn decode(context: &BatchContext, held: Pulled) -> Item {
    let header_id = held
        .msg
        .headers
        .as_ref()
        .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
        .map(|v| v.as_str().to_string());
    match ScoreRequest::decode(held.msg.payload.clone()) {
        Ok(mut request) => {
            jetrl_wire::score::expand_common(&mut request, context.prompts.needed());
            let id = header_id.unwrap_or_else(|| jetrl_wire::score::request_id(&request));
            Item::Decoded { held, request, id }
        }
        Err(err) => {
            let reason = format!("malformed score request: {err}");
            let (source, subject) = (context.bus.names().score_stream(), &held.msg.subject);
            consume::dead_letter(SERVICE, source, subject, &reason, &held.msg.payload);
            metrics::counter!(FAILURES_METRIC, "reason" => "malformed_score_request").increment(1);
            tracing::error!(subject = %held.msg.subject, error = %err, "malformed score request terminated");
            let batch = match context.bus.names().parse_group_subject(&held.msg.subject) {
                Some((partition, uid)) => {
                    let rewards =
                        context.failed_group(partition, uid, &format!("malformed score request: {err}")).await;
                    let id = header_id.unwrap_or_else(|| format!("{uid}.malformed"));
                    (!rewards.is_empty()).then_some((id, RewardBatch { rewards }))
                }
                None => None,
            };
            Item::Malformed { held, batch }
        }
    }
}

impl BatchContext {
    /// Failure rewards for every trajectory of group `uid` stored in TRAJ (found by subject, keyed by their
    /// `Nats-Msg-Id`): what a group whose score request cannot be read gets instead of scores.
    async fn failed_group(&self, partition: &str, uid: &str, reason: &str) -> Vec<Reward> {
        let subject = self.bus.names().traj_subject(partition, uid);
        stored_ids(&self.trajectories, &subject, MAX_TRAJECTORIES_PER_GROUP)
            .await
            .into_iter()
            .filter(|(key, _)| TrajectoryKey::parse(key).is_ok())
            .map(|(key, seq)| failure_reward(&key, partition, seq, reason))
            .collect()
    }
}

/// Rule scorers are CPU work with no await inside: a batch of them runs on the blocking pool, so several
/// batches score in parallel and the reactor keeps moving publishes and acks meanwhile. Other routes wait on
/// processes or the network and run here, their calls concurrently. Each call of the scorer gets at most
/// `batch_size` trajectories.
async fn score(engine: &Arc<RewardEngine>, inputs: Vec<ScoreInput>, batch_size: usize) -> Vec<ScoreOutcome> {
    if inputs.is_empty() {
        return Vec::new();
    }
    if engine.route_name() != "rules" {
        // concurrently: the user-function pool and the reward-model client bound the work in flight themselves
        let calls = chunked(inputs, batch_size.max(1)).into_iter().map(|chunk| engine.score_batch(chunk));
        return futures::future::join_all(calls).await.into_iter().flatten().collect();
    }
    // The rules are CPU work: scored on a blocking thread, their metrics recorded here, on the runtime's worker
    // threads (RewardEngine::score_rules says why).
    let keys: Vec<String> = inputs.iter().map(|input| input.key.clone()).collect();
    let scoring = Arc::clone(engine);
    let scored = tokio::task::spawn_blocking(move || {
        let outcomes = scoring.score_rules(&inputs);
        (inputs, outcomes)
    })
    .await;
    match scored {
        Ok((inputs, Some(outcomes))) => {
            engine.observe(&inputs, &outcomes);
            outcomes
        }
        Ok((_, None)) => keys.iter().map(|key| missing_outcome(key, "the reward route is not the rules")).collect(),
        // the rules catch scorer panics themselves; this is only reached if the blocking pool is gone.
        Err(err) => keys.iter().map(|key| missing_outcome(key, &format!("scoring task failed: {err}"))).collect(),
    }
}

fn chunked<T>(items: Vec<T>, size: usize) -> Vec<Vec<T>> {
    let mut chunks = Vec::with_capacity(items.len().div_ceil(size));
    let mut items = items.into_iter().peekable();
    while items.peek().is_some() {
        chunks.push(items.by_ref().take(size).collect());
    }
    chunks
}

/// Publishes the rewards of the whole micro-batch, one message per partition (split past
/// [`MAX_MESSAGE_BYTES`]), each naming the requests it answers, pipelined, and waits until all are stored.
async fn publish(bus: &Bus, items: &mut [Item], outcomes: Vec<ScoreOutcome>) -> Result<(), BusError> {
    let mut messages = RewardMessages::new(bus.names());
    let mut outcomes = outcomes.into_iter();
    for item in items.iter_mut() {
        match item {
            Item::Decoded { request, id, .. } => {
                let (uid, partition) = (request.uid.as_str(), request.partition.as_str());
                let rewards = request.trajectories.iter_mut().map(|traj| {
                    let outcome = outcomes.next().unwrap_or_else(|| {
                        let key = TrajectoryKey::new(uid.to_string(), traj.session_id, traj.index).to_string();
                        missing_outcome(&key, "scorer returned no outcome")
                    });
                    reward_for(traj, uid, partition, outcome)
                });
                let rewards: Vec<Reward> = rewards.collect();
                messages.add(partition, id, rewards);
            }
            Item::Malformed { batch: Some((id, batch)), .. } => {
                let partition = batch.rewards.first().map(|r| r.partition.clone()).unwrap_or_default();
                messages.add(&partition, id, batch.rewards.clone());
            }
            Item::Malformed { batch: None, .. } | Item::AlreadyScored { .. } => {}
        }
    }
    let outgoing = messages.finish();
    // fault injection (inert unless JETRL_CRASH_AT names it): scored, nothing published or acknowledged yet
    jetrl_telemetry::crash::crash_point("reward.mid_batch", 0);
    let mut publisher = Publisher::new(bus, outgoing.len().max(1));
    for message in outgoing {
        publisher.publish(message).await?;
    }
    publisher.drain().await?;
    Ok(())
}

/// The reward messages of one micro-batch being built: per partition, the open message's rewards and the ids of
/// the requests they answer.
struct RewardMessages<'a> {
    names: &'a Names,
    /// by partition: the open message's rewards, the requests they answer, and its encoded size so far
    open: BTreeMap<String, (RewardBatch, Vec<String>, usize)>,
    closed: Vec<Outgoing>,
}

impl<'a> RewardMessages<'a> {
    fn new(names: &'a Names) -> Self {
        Self { names, open: BTreeMap::new(), closed: Vec::new() }
    }

    /// Adds the rewards of request `id` (all to one message).
    fn add(&mut self, partition: &str, id: &str, rewards: Vec<Reward>) {
        if rewards.is_empty() {
            return;
        }
        let (batch, ids, bytes) = self.open.entry(partition.to_string()).or_default();
        // each reward is a length-delimited field: a tag byte and a varint length (at most 3 bytes here)
        *bytes += rewards.iter().map(|reward| reward.encoded_len() + 4).sum::<usize>();
        batch.rewards.extend(rewards);
        ids.push(id.to_string());
        // the header naming the requests counts against the payload limit too
        *bytes += id.len() + 1;
        if *bytes >= MAX_MESSAGE_BYTES {
            let (batch, ids, _) = std::mem::take(self.open.get_mut(partition).expect("just added"));
            self.closed.push(score::reward_message(self.names, partition, &batch, &ids));
        }
    }

    fn finish(mut self) -> Vec<Outgoing> {
        for (partition, (batch, ids, _)) in std::mem::take(&mut self.open) {
            if !ids.is_empty() {
                self.closed.push(score::reward_message(self.names, &partition, &batch, &ids));
            }
        }
        self.closed
    }
}

/// Acknowledges (or hands back) every request of the batch, ends their leases and frees their room.
async fn settle(context: &BatchContext, items: Vec<Item>, kind: AckKind, started: Instant) {
    let acknowledged = matches!(kind, AckKind::Ack);
    let count = items.len();
    let mut trajectories = 0;
    for item in &items {
        let held = item.held();
        trajectories += item.trajectories();
        // A malformed request is terminated, never redelivered, whatever happened to its failure rewards.
        let kind = if matches!(item, Item::Malformed { .. }) { AckKind::Term } else { kind };
        consume::settle(&held.msg, kind).await;
        context.leases.release(held.lease);
    }
    context.room.give_back(count);
    if !acknowledged {
        return;
    }
    metrics::counter!(TRAJECTORIES_METRIC).increment(trajectories as u64);
    metrics::histogram!(BATCH_SECONDS_METRIC).record(started.elapsed().as_secs_f64());
    let now = jetrl_wire::now_unix_ms();
    let lag = metrics::histogram!(QUEUE_LAG_METRIC);
    for item in &items {
        if let Item::Decoded { request, .. } = item {
            for traj in &request.trajectories {
                if let Some(done) = traj.timings.as_ref().map(|t| t.completed_unix_ms).filter(|&ms| ms > 0) {
                    lag.record((now - done).max(0) as f64 / 1000.0);
                }
            }
        }
    }
}

/// The scorer's view of a trajectory. The key, response text and ground truth are moved out (the key comes back
/// with the outcome; the reward carries neither of the others); extra info is parsed only for scorers that read
/// it.
fn score_input(prompts: &PromptSource, traj: &mut Trajectory) -> ScoreInput {
    let prompt = prompts.prompt(traj);
    let extra_info = if prompts.needed() {
        serde_json::from_str(&traj.extra_info_json).unwrap_or(serde_json::Value::Null)
    } else {
        serde_json::Value::Null
    };
    ScoreInput {
        key: std::mem::take(&mut traj.key),
        data_source: traj.data_source.clone(),
        solution_str: std::mem::take(&mut traj.response_text),
        ground_truth: std::mem::take(&mut traj.ground_truth),
        extra_info,
        prompt_str: prompt.text,
        raw_prompt: prompt.messages,
        response_len: response_len(traj) as usize,
    }
}

fn missing_outcome(key: &str, why: &str) -> ScoreOutcome {
    ScoreOutcome {
        key: key.to_string(),
        score: 0.0,
        extra: Default::default(),
        extra_text: Default::default(),
        failure_reason: Some(why.to_string()),
        failure_kind: None,
        scorer: "none",
        seconds: None,
    }
}

/// The reward of a trajectory of request `uid` (its score view: `stored_seq` names the payload in TRAJ).
fn reward_for(traj: &mut Trajectory, uid: &str, partition: &str, outcome: ScoreOutcome) -> Reward {
    Reward {
        // the key went to the scorer and comes back with the outcome; the view is not read again (settling
        // needs only its timings), so its strings move into the reward
        key: outcome.key,
        uid: uid.to_string(),
        partition: partition.to_string(),
        traj_seq: traj.stored_seq,
        score: outcome.score,
        extra: outcome.extra,
        extra_text: outcome.extra_text,
        failure_reason: outcome.failure_reason.unwrap_or_default(),
        prompt_len: prompt_len(traj),
        response_len: response_len(traj),
        min_version: traj.min_version,
        max_version: traj.max_version,
        submit_step: traj.submit_step,
        session_id: traj.session_id,
        index: traj.index,
        data_source: std::mem::take(&mut traj.data_source),
        greedy_baseline: traj.greedy_baseline,
    }
}

/// A zero reward with `reason`, for a stored trajectory that could not be scored.
fn failure_reward(key: &str, partition: &str, traj_seq: u64, reason: &str) -> Reward {
    let parsed = TrajectoryKey::parse(key).ok();
    Reward {
        key: key.to_string(),
        uid: parsed.as_ref().map(|k| k.uid.clone()).unwrap_or_default(),
        partition: partition.to_string(),
        traj_seq,
        failure_reason: reason.to_string(),
        session_id: parsed.as_ref().map(|k| k.session_id).unwrap_or(0),
        index: parsed.as_ref().map(|k| k.index).unwrap_or(0),
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rewards(uid: &str, partition: &str, n: usize, text_bytes: usize) -> Vec<Reward> {
        (0..n)
            .map(|i| Reward {
                key: format!("{uid}_{i}_0"),
                uid: uid.into(),
                partition: partition.into(),
                failure_reason: "x".repeat(text_bytes),
                ..Reward::default()
            })
            .collect()
    }

    fn requests_of(message: &Outgoing) -> Vec<String> {
        let header = message.headers.iter().find(|(name, _)| name == subjects::SCORE_REQUESTS_HEADER);
        header.map(|(_, ids)| ids.split(' ').map(str::to_string).collect()).unwrap_or_default()
    }

    #[test]
    fn a_micro_batch_goes_out_as_one_message_per_partition_naming_its_requests() {
        let names = Names::new("job-a").unwrap();
        let mut messages = RewardMessages::new(&names);
        messages.add("train", "a.2.1", rewards("a", "train", 2, 0));
        messages.add("val", "v.1.1", rewards("v", "val", 1, 0));
        messages.add("train", "b.2.1", rewards("b", "train", 2, 0));
        messages.add("train", "empty.0.1", Vec::new());
        let out = messages.finish();
        assert_eq!(out.len(), 2);
        assert_eq!(out[0].subject, "jetrl.job-a.rewards.train.batch");
        assert_eq!(requests_of(&out[0]), ["a.2.1", "b.2.1"]);
        assert_eq!(RewardBatch::decode(out[0].payload.clone()).unwrap().rewards.len(), 4);
        assert_eq!(out[0].msg_id, Some(jetrl_wire::score::reward_batch_id(&["a.2.1", "b.2.1"])));
        assert_eq!(
            (out[1].subject.as_str(), requests_of(&out[1])),
            ("jetrl.job-a.rewards.val.batch", vec!["v.1.1".into()])
        );
        assert_eq!(out[1].msg_id.as_deref(), Some("v.1.1"), "one request: its own id, as before batching");
    }

    #[test]
    fn a_message_is_closed_past_its_size_limit_and_a_request_is_never_split() {
        let names = Names::new("job-a").unwrap();
        let mut messages = RewardMessages::new(&names);
        // 8 rewards of ~40 KiB: each request is ~320 KiB, so two fill a message past 512 KiB
        for uid in ["a", "b", "c"] {
            messages.add("train", &format!("{uid}.8.1"), rewards(uid, "train", 8, 40 * 1024));
        }
        let out = messages.finish();
        assert_eq!(out.iter().map(requests_of).collect::<Vec<_>>(), [vec!["a.8.1", "b.8.1"], vec!["c.8.1"]]);
        for message in &out {
            let batch = RewardBatch::decode(message.payload.clone()).unwrap();
            assert_eq!(batch.rewards.len() % 8, 0, "whole requests only");
            assert!(message.payload.len() < 1024 * 1024, "{} bytes", message.payload.len());
        }
    }
}
