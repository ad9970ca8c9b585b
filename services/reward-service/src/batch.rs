//! One micro-batch: decode, skip what is already scored, score, publish the rewards, then acknowledge.

use std::sync::Arc;
use std::time::{Duration, Instant};

use async_nats::jetstream::stream::{DirectGetErrorKind, Stream};
use async_nats::jetstream::AckKind;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{consume, Bus, BusError, Publisher};
use jetrl_reward::{RewardEngine, ScoreInput, ScoreOutcome, FAILURES_METRIC};
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::v1::{Reward, Trajectory};
use jetrl_wire::{packed, subjects, Message};

use crate::prompt::PromptSource;
use crate::pull::{LeaseId, Leases, Pulled, Room};
use crate::{BATCH_ERRORS_METRIC, BATCH_SECONDS_METRIC, QUEUE_LAG_METRIC, SERVICE, TRAJECTORIES_METRIC};

/// How soon a trajectory whose reward could not be published is offered again.
const RETRY_DELAY: Duration = Duration::from_secs(1);
/// Rewards of one uid inspected at most when checking whether a redelivered trajectory is already scored.
const MAX_REWARDS_PER_GROUP_CHECKED: usize = 4096;

/// What every micro-batch shares.
pub struct BatchContext {
    pub bus: Bus,
    pub engine: Arc<RewardEngine>,
    pub prompts: PromptSource,
    /// the REWARDS stream, read to recognise a redelivered trajectory that already has its reward
    pub rewards: Stream,
    pub leases: Leases,
    pub room: Room,
}

impl BatchContext {
    /// Hands back a trajectory that was pulled but not scored (the service is stopping): another instance gets
    /// it at once.
    pub async fn release_unscored(&self, held: Pulled) {
        self.leases.release(held.lease);
        consume::settle(&held.msg, AckKind::Nak(None)).await;
        self.room.give_back(1);
    }

    /// Whether the REWARDS stream already holds the reward of `key` (published before a crash, or by another
    /// instance before its ack was lost). Any doubt answers `false`: publishing again is then de-duplicated by
    /// `Nats-Msg-Id` within the stream's window.
    async fn already_scored(&self, partition: &str, uid: &str, key: &str) -> bool {
        let subject = subjects::reward_subject(partition, uid);
        let mut from = 1;
        for _ in 0..MAX_REWARDS_PER_GROUP_CHECKED {
            match self.rewards.direct_get_next_for_subject(subject.as_str(), Some(from)).await {
                Ok(stored) => {
                    let id = stored.headers.get(async_nats::header::NATS_MESSAGE_ID).map(|v| v.as_str());
                    if id == Some(key) {
                        return true;
                    }
                    from = stored.sequence + 1;
                }
                Err(err) if matches!(err.kind(), DirectGetErrorKind::NotFound) => return false,
                Err(err) => {
                    tracing::warn!(%key, error = %err, "cannot check REWARDS for an earlier reward");
                    return false;
                }
            }
        }
        false
    }
}

/// A trajectory of the batch, decoded or not.
enum Item {
    Decoded {
        held: Pulled,
        traj: Box<Trajectory>,
        seq: u64,
    },
    /// already has its reward in REWARDS: acknowledged without scoring
    AlreadyScored {
        held: Pulled,
    },
    /// undecodable, but its key is known from `Nats-Msg-Id`: it gets a failure reward and is terminated
    Malformed {
        held: Pulled,
        reward: Option<Box<Reward>>,
    },
}

impl Item {
    fn held(&self) -> &Pulled {
        match self {
            Item::Decoded { held, .. } | Item::AlreadyScored { held } | Item::Malformed { held, .. } => held,
        }
    }
}

/// Scores and publishes one micro-batch, then acknowledges it. Never fails: a batch whose rewards cannot be
/// published is handed back (NAK with a delay) and counted.
pub async fn score_batch(context: Arc<BatchContext>, batch: Vec<Pulled>) {
    let started = Instant::now();
    let guard = HeldBatch { context: &context, leases: batch.iter().map(|held| held.lease).collect(), armed: true };
    let mut items = Vec::with_capacity(batch.len());
    for held in batch {
        items.push(decode(&context, held).await);
    }
    let mut inputs = Vec::with_capacity(items.len());
    for item in &mut items {
        if let Item::Decoded { traj, .. } = item {
            inputs.push(score_input(&context.prompts, traj));
        }
    }
    let outcomes = score(&context.engine, inputs).await;
    match publish(&context.bus, &mut items, outcomes).await {
        Ok(()) => settle(&context, items, AckKind::Ack, started).await,
        Err(err) => {
            // Nothing is acknowledged: the batch comes back; de-duplication absorbs whatever was published.
            tracing::error!(error = %err, trajectories = items.len(), "rewards not published; the batch comes back");
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
    let (seq, delivered) = held.msg.info().map(|i| (i.stream_sequence, i.delivered)).unwrap_or((0, 1));
    match Trajectory::decode(held.msg.payload.clone()) {
        Ok(traj) => {
            if delivered > 1 && context.already_scored(&traj.partition, &traj.uid, &traj.key).await {
                tracing::debug!(key = %traj.key, delivered, "redelivered trajectory already has its reward");
                return Item::AlreadyScored { held };
            }
            Item::Decoded { held, traj: Box::new(traj), seq }
        }
        Err(err) => {
            consume::count_malformed(SERVICE, subjects::TRAJ_STREAM);
            metrics::counter!(FAILURES_METRIC, "reason" => "malformed_trajectory").increment(1);
            tracing::error!(subject = %held.msg.subject, error = %err, "malformed trajectory terminated");
            let key = held
                .msg
                .headers
                .as_ref()
                .and_then(|h| h.get(async_nats::header::NATS_MESSAGE_ID))
                .map(|v| v.as_str().to_string());
            let partition = held.msg.subject.split('.').nth(2).unwrap_or("train").to_string();
            let reward = key
                .filter(|k| TrajectoryKey::parse(k).is_ok())
                .map(|key| Box::new(malformed_reward(&key, &partition, seq, &err.to_string())));
            Item::Malformed { held, reward }
        }
    }
}

/// Rule scorers are CPU work with no await inside: a batch of them runs on the blocking pool, so several
/// batches score in parallel and the reactor keeps moving publishes and acks meanwhile. Other routes wait on
/// processes or the network and run here.
async fn score(engine: &Arc<RewardEngine>, inputs: Vec<ScoreInput>) -> Vec<ScoreOutcome> {
    if inputs.is_empty() {
        return Vec::new();
    }
    if engine.route_name() != "rules" {
        return engine.score_batch(inputs).await;
    }
    let keys: Vec<String> = inputs.iter().map(|input| input.key.clone()).collect();
    let engine = Arc::clone(engine);
    match tokio::task::spawn_blocking(move || futures::executor::block_on(engine.score_batch(inputs))).await {
        Ok(outcomes) => outcomes,
        // `score_batch` catches scorer panics itself; this is only reached if the blocking pool is gone.
        Err(err) => keys.iter().map(|key| missing_outcome(key, &format!("scoring task failed: {err}"))).collect(),
    }
}

async fn publish(bus: &Bus, items: &mut [Item], outcomes: Vec<ScoreOutcome>) -> Result<(), BusError> {
    let mut publisher = Publisher::new(bus, items.len().max(1));
    let mut outcomes = outcomes.into_iter();
    for item in items.iter_mut() {
        let reward = match item {
            Item::Decoded { traj, seq, .. } => {
                let outcome =
                    outcomes.next().unwrap_or_else(|| missing_outcome(&traj.key, "scorer returned no outcome"));
                reward_for(traj, *seq, outcome)
            }
            Item::Malformed { reward: Some(reward), .. } => std::mem::take(reward.as_mut()),
            Item::Malformed { reward: None, .. } | Item::AlreadyScored { .. } => continue,
        };
        let subject = subjects::reward_subject(&reward.partition, &reward.uid);
        publisher.publish(Outgoing::protobuf(subject, Some(reward.key.clone()), &reward)).await?;
    }
    publisher.drain().await?;
    Ok(())
}

/// Acknowledges (or hands back) every trajectory of the batch, ends their leases and frees their room.
async fn settle(context: &BatchContext, items: Vec<Item>, kind: AckKind, started: Instant) {
    let acknowledged = matches!(kind, AckKind::Ack);
    let count = items.len();
    for item in &items {
        let held = item.held();
        // A malformed trajectory is terminated, never redelivered, whatever happened to its failure reward.
        let kind = if matches!(item, Item::Malformed { .. }) { AckKind::Term } else { kind };
        consume::settle(&held.msg, kind).await;
        context.leases.release(held.lease);
    }
    context.room.give_back(count);
    if !acknowledged {
        return;
    }
    metrics::counter!(TRAJECTORIES_METRIC).increment(count as u64);
    metrics::histogram!(BATCH_SECONDS_METRIC).record(started.elapsed().as_secs_f64());
    let now = jetrl_wire::now_unix_ms();
    for item in &items {
        if let Item::Decoded { traj, .. } = item {
            if let Some(done) = traj.timings.as_ref().map(|t| t.completed_unix_ms).filter(|&ms| ms > 0) {
                metrics::histogram!(QUEUE_LAG_METRIC).record((now - done).max(0) as f64 / 1000.0);
            }
        }
    }
}

/// The scorer's view of a trajectory. The response text is moved out (the reward does not carry it); extra
/// info is parsed only for scorers that read it.
fn score_input(prompts: &PromptSource, traj: &mut Trajectory) -> ScoreInput {
    let prompt = prompts.prompt(traj);
    let extra_info = if prompts.needed() {
        serde_json::from_str(&traj.extra_info_json).unwrap_or(serde_json::Value::Null)
    } else {
        serde_json::Value::Null
    };
    ScoreInput {
        key: traj.key.clone(),
        data_source: traj.data_source.clone(),
        solution_str: std::mem::take(&mut traj.response_text),
        ground_truth: std::mem::take(&mut traj.ground_truth),
        extra_info,
        prompt_str: prompt.text,
        raw_prompt: prompt.messages,
        response_len: packed::u32_len(&traj.response_ids),
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
    }
}

fn reward_for(traj: &Trajectory, traj_seq: u64, outcome: ScoreOutcome) -> Reward {
    Reward {
        key: traj.key.clone(),
        uid: traj.uid.clone(),
        partition: traj.partition.clone(),
        traj_seq,
        score: outcome.score,
        extra: outcome.extra.into_iter().collect(),
        extra_text: outcome.extra_text.into_iter().collect(),
        failure_reason: outcome.failure_reason.unwrap_or_default(),
        prompt_len: packed::u32_len(&traj.prompt_ids) as u32,
        response_len: packed::u32_len(&traj.response_ids) as u32,
        min_version: traj.min_version,
        max_version: traj.max_version,
        submit_step: traj.submit_step,
        session_id: traj.session_id,
        index: traj.index,
        data_source: traj.data_source.clone(),
    }
}

fn malformed_reward(key: &str, partition: &str, traj_seq: u64, error: &str) -> Reward {
    let parsed = TrajectoryKey::parse(key).ok();
    Reward {
        key: key.to_string(),
        uid: parsed.as_ref().map(|k| k.uid.clone()).unwrap_or_default(),
        partition: partition.to_string(),
        traj_seq,
        failure_reason: format!("malformed trajectory: {error}"),
        session_id: parsed.as_ref().map(|k| k.session_id).unwrap_or(0),
        index: parsed.as_ref().map(|k| k.index).unwrap_or(0),
        ..Default::default()
    }
}
