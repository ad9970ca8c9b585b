//! A simulated rollout producer (and scorer) writing through the real data plane: group records in the
//! GROUPS bucket, trajectory payloads in TRAJ, score requests in SCORE, and — when no reward service runs —
//! reward batches in REWARDS; and the trainer's side of it, pending records and prompt tasks on PROMPTS. Used by
//! the replay-buffer integration tests and the `dataplane` and `soak` benchmarks.

use bytes::Bytes;
use jetrl_bus::publish::Outgoing;
use jetrl_bus::{score, Bus, BusError, GroupStore, Publisher};
use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::v1::{GroupState, GroupStatus, PromptTask, Reward, RewardBatch, Trajectory};
use jetrl_wire::{packed, Message};

/// What a simulated group looks like.
#[derive(Debug, Clone)]
pub struct GroupSpec {
    pub uid: String,
    pub partition: String,
    pub submit_step: u64,
    /// one score per session; the group's trajectories are `{uid}_{i}_0`
    pub scores: Vec<f64>,
    pub state: GroupState,
    /// encoded size of each trajectory message in bytes (the payload size): response tokens (ids, mask and
    /// log-probs, 9 bytes a token) plus padding in `extra_info_json` up to exactly this size
    pub payload_bytes: usize,
    /// the scorer the reward service will pick (`sim` is unknown to it: a zero reward with a reason)
    pub data_source: String,
}

impl GroupSpec {
    pub fn finished(uid: &str, submit_step: u64, scores: &[f64]) -> Self {
        Self {
            uid: uid.into(),
            partition: "train".into(),
            submit_step,
            scores: scores.to_vec(),
            state: GroupState::Finished,
            payload_bytes: 64,
            data_source: "sim".into(),
        }
    }
}

/// The prompt task of a simulated group: `n` is the number of scores, the prompt is the reverse task's.
pub fn prompt_task(spec: &GroupSpec) -> PromptTask {
    PromptTask {
        uid: spec.uid.clone(),
        partition: spec.partition.clone(),
        n: spec.scores.len() as u32,
        submit_step: spec.submit_step,
        data_source: "jetrl/reverse".into(),
        ground_truth: "1234".into(),
        ..Default::default()
    }
}

/// The pending record of a simulated group, as the trainer writes it before publishing the task.
fn pending_record(spec: &GroupSpec) -> GroupStatus {
    let mut status = GroupStatus {
        uid: spec.uid.clone(),
        partition: spec.partition.clone(),
        submit_step: spec.submit_step,
        n: spec.scores.len() as u32,
        task: Some(prompt_task(spec)),
        ..Default::default()
    };
    status.set_state(GroupState::Pending);
    status
}

/// Writes a pending record (as the trainer does); returns it with its revision.
pub async fn submit(groups: &GroupStore, spec: &GroupSpec) -> Result<(GroupStatus, u64), BusError> {
    let status = pending_record(spec);
    let revision = groups.create(&status).await?;
    Ok((status, revision))
}

/// Submits groups as the trainer does: every pending record first (a worker must never see a task without one),
/// then each prompt task on the PROMPTS stream (de-duplicated by uid), for rollout workers to pull.
pub async fn submit_prompts(bus: &Bus, groups: &GroupStore, specs: &[GroupSpec]) -> Result<(), BusError> {
    let records: Vec<GroupStatus> = specs.iter().map(pending_record).collect();
    groups.create_many(&records).await?;
    let mut publisher = Publisher::new(bus, 512);
    for spec in specs {
        let subject = bus.names().prompt_subject(&spec.partition);
        publisher.publish(Outgoing::protobuf(subject, Some(spec.uid.clone()), &prompt_task(spec))).await?;
    }
    publisher.drain().await.map(|_| ())
}

/// Bytes a response token takes in a trajectory message: a u32 id, a u8 mask and an f32 log-prob.
const BYTES_PER_TOKEN: usize = 9;

/// The response length of the spec's trajectories.
pub fn response_tokens(spec: &GroupSpec) -> usize {
    (spec.payload_bytes.saturating_sub(FIELDS_ALLOWANCE) / BYTES_PER_TOKEN).max(1)
}

/// A trajectory whose encoded size is `payload_bytes` (when that is more than its fields need): response token
/// ids, mask and log-probs, padded in `extra_info_json`. The response text encodes the score for the simulated
/// scorer.
pub fn trajectory(spec: &GroupSpec, session: usize) -> Trajectory {
    let tokens = response_tokens(spec);
    let ids: Vec<u32> = (0..tokens as u32).map(|t| t.wrapping_mul(2_654_435_761) % 151_000).collect();
    let mut traj = Trajectory {
        key: TrajectoryKey::new(spec.uid.clone(), session as u32, 0).to_string(),
        uid: spec.uid.clone(),
        session_id: session as u32,
        partition: spec.partition.clone(),
        submit_step: spec.submit_step,
        prompt_ids: packed::pack_u32(&[1, 2, 3, 4]),
        response_mask: Bytes::from(vec![1u8; tokens]),
        logprobs: packed::pack_f32(&vec![-0.5; tokens]),
        response_ids: packed::pack_u32(&ids),
        response_text: if spec.data_source == "sim" { format!("{}", spec.scores[session]) } else { "4321".into() },
        data_source: spec.data_source.clone(),
        ground_truth: if spec.data_source == "sim" { String::new() } else { "1234".into() },
        min_version: spec.submit_step,
        max_version: spec.submit_step,
        ..Default::default()
    };
    let base = traj.encoded_len();
    if spec.payload_bytes > base + PAD_JSON_OVERHEAD {
        // The padding field's own length prefix grows with it: correct by the difference until exact (at a
        // prefix-size boundary it can end a byte short).
        let mut pad = spec.payload_bytes - base - PAD_JSON_OVERHEAD;
        for _ in 0..4 {
            traj.extra_info_json = format!("{{\"pad\":\"{}\"}}", "x".repeat(pad));
            let len = traj.encoded_len();
            if len <= spec.payload_bytes && len + 1 >= spec.payload_bytes {
                break;
            }
            pad = (pad + spec.payload_bytes).saturating_sub(len);
        }
    }
    traj
}

/// Length of `{"pad":""}`.
const PAD_JSON_OVERHEAD: usize = 10;
/// Room left for a trajectory's other fields (key, uid, prompt, text, padding) when sizing its response.
const FIELDS_ALLOWANCE: usize = 256;

/// Generates a group as a rollout worker would: running, every trajectory published and acknowledged, its score
/// request, then the terminal status with the keys. `known` is the pending record and revision when the caller
/// has them (saves a read). Returns the trajectories' stream sequences, in session order.
pub async fn produce(
    bus: &Bus,
    groups: &GroupStore,
    spec: &GroupSpec,
    known: Option<(GroupStatus, u64)>,
) -> Result<Vec<u64>, BusError> {
    let trajectories: Vec<Trajectory> = (0..spec.scores.len()).map(|session| trajectory(spec, session)).collect();
    produce_built(bus, groups, spec, known, &trajectories).await
}

/// [`produce`] with the group's trajectories already built (a benchmark builds them before its clock starts, as
/// generating them is the rollout's work, not the data plane's).
pub async fn produce_built(
    bus: &Bus,
    groups: &GroupStore,
    spec: &GroupSpec,
    known: Option<(GroupStatus, u64)>,
    trajectories: &[Trajectory],
) -> Result<Vec<u64>, BusError> {
    let kv_err = |e: jetrl_bus::groups::GroupUpdateError| BusError::Kv {
        bucket: groups.kv().name.clone(),
        key: spec.uid.clone(),
        cause: jetrl_bus::Cause::other(e),
    };
    let running =
        groups.update_from(&spec.partition, &spec.uid, known, |_| Some(GroupState::Running)).await.map_err(kv_err)?;
    let keys: Vec<String> = trajectories.iter().map(|t| t.key.clone()).collect();
    let (acks, _) = score::publish_group(bus, &spec.partition, &spec.uid, trajectories).await?;
    let state = spec.state;
    groups
        .update_from(&spec.partition, &spec.uid, running, |s| {
            s.trajectory_keys = keys.clone();
            Some(state)
        })
        .await
        .map_err(kv_err)?;
    let seq_of: std::collections::HashMap<&str, u64> =
        acks.iter().filter_map(|a| a.msg_id.as_deref().map(|k| (k, a.sequence))).collect();
    Ok(keys.iter().map(|k| seq_of.get(k.as_str()).copied().unwrap_or(0)).collect())
}

/// Publishes the rewards of a produced group directly, as one reward batch (when no reward service is running).
pub async fn score(publisher: &mut Publisher, spec: &GroupSpec, seqs: &[u64]) -> Result<(), BusError> {
    let id = format!("{}.sim", spec.uid);
    let names = publisher.bus().names().clone();
    publisher.publish(score::reward_message(&names, &spec.partition, &reward_batch(spec, seqs), &[id])).await?;
    publisher.drain().await.map(|_| ())
}

/// The rewards of a produced group (`seqs`: its trajectories' TRAJ sequences), as a reward service would score
/// them.
pub fn reward_batch(spec: &GroupSpec, seqs: &[u64]) -> RewardBatch {
    let mut batch = RewardBatch::default();
    for (session, (&score, &seq)) in spec.scores.iter().zip(seqs).enumerate() {
        let key = TrajectoryKey::new(spec.uid.clone(), session as u32, 0).to_string();
        let mut reward = Reward {
            key,
            uid: spec.uid.clone(),
            partition: spec.partition.clone(),
            traj_seq: seq,
            score,
            submit_step: spec.submit_step,
            session_id: session as u32,
            response_len: response_tokens(spec) as u32,
            prompt_len: 4,
            min_version: spec.submit_step,
            max_version: spec.submit_step,
            ..Default::default()
        };
        reward.extra.insert("acc".into(), score);
        batch.rewards.push(reward);
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trajectory_has_the_encoded_size_its_spec_asks_for() {
        for bytes in [1024, 16 * 1024, 100_000, 2 * 1024 * 1024] {
            let mut spec = GroupSpec::finished("u", 1, &[1.0]);
            spec.payload_bytes = bytes;
            let len = trajectory(&spec, 0).encoded_len();
            assert!(len <= bytes && len + 1 >= bytes, "asked for {bytes} bytes, got {len}");
        }
    }
}
