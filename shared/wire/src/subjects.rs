//! Names of the streams, subjects, consumers and buckets every service agrees on.

/// Work queue of prompt groups: `jetrl.prompts.<partition>`.
pub const PROMPTS_STREAM: &str = "JETRL_PROMPTS";
pub const PROMPTS_SUBJECT: &str = "jetrl.prompts";
/// The durable pull consumer shared by every rollout worker.
pub const ROLLOUT_CONSUMER: &str = "rollout-workers";

/// Generated trajectories (payloads): `jetrl.traj.<partition>.<uid>`, de-duplicated by key.
pub const TRAJ_STREAM: &str = "JETRL_TRAJ";
pub const TRAJ_SUBJECT: &str = "jetrl.traj";

/// Work queue of score requests (one per group, trajectories without token arrays):
/// `jetrl.score.<partition>.<uid>`.
pub const SCORE_STREAM: &str = "JETRL_SCORE";
pub const SCORE_SUBJECT: &str = "jetrl.score";
/// The durable pull consumer on SCORE shared by every reward service.
pub const REWARD_CONSUMER: &str = "reward-service";

/// Scores plus index facts: one RewardBatch per micro-batch of score requests and partition, on
/// `jetrl.rewards.<partition>.batch` (any `jetrl.rewards.<partition>.<name>` is read the same way), with the ids
/// of the requests it answers in [`SCORE_REQUESTS_HEADER`]. The replay buffer's release markers share the stream
/// (on [`RELEASED_SUBJECT`]) so that a restarted buffer reads them in order with the rewards.
pub const REWARDS_STREAM: &str = "JETRL_REWARDS";
pub const REWARDS_SUBJECT: &str = "jetrl.rewards";
/// Every reward batch (four tokens or more; never a release marker): what the buffer's floor purge filters on.
pub const REWARD_BATCHES_FILTER: &str = "jetrl.rewards.*.>";
/// The replay buffer's release markers: one `ReleaseRequest` per release, written before the release is answered.
pub const RELEASED_SUBJECT: &str = "jetrl.rewards.released";
/// Header of a reward batch: the `Nats-Msg-Id`s of the score requests it answers, separated by spaces.
pub const SCORE_REQUESTS_HEADER: &str = "Jetrl-Score-Requests";

/// Group control records, key `<partition>.<uid>`.
pub const GROUPS_BUCKET: &str = "JETRL_GROUPS";
/// Weight manifests, keys `latest` and `v.<version>`.
pub const WEIGHTS_BUCKET: &str = "JETRL_WEIGHTS";
/// Weight blobs (object store).
pub const WEIGHTS_OBJECTS: &str = "JETRL_WEIGHT_BLOBS";
/// Heartbeats, key `<service>.<instance>`.
pub const WORKERS_BUCKET: &str = "JETRL_WORKERS";

/// Replay buffer requests.
pub const BUFFER_SAMPLE: &str = "jetrl.buffer.sample";
pub const BUFFER_RELEASE: &str = "jetrl.buffer.release";
pub const BUFFER_LEDGER: &str = "jetrl.buffer.ledger";
/// Trainer -> checkpoint-sync.
pub const WEIGHTS_ANNOUNCE: &str = "jetrl.weights.announce";
/// Trainer step metrics (JSON), for `jetrl run`'s progress display.
pub const TRAINER_METRICS: &str = "jetrl.trainer.metrics";

/// The partitions of a job: training groups and validation groups.
pub const TRAIN_PARTITION: &str = "train";
pub const VAL_PARTITION: &str = "val";

/// Trainer -> co-located rollout worker handshakes (colocate_async): `jetrl.control.<instance>.<verb>`, verb
/// `pause` or `resume`.
pub fn control_subject(instance: &str, verb: &str) -> String {
    format!("jetrl.control.{instance}.{verb}")
}

pub fn prompt_subject(partition: &str) -> String {
    format!("{PROMPTS_SUBJECT}.{partition}")
}

pub fn traj_subject(partition: &str, uid: &str) -> String {
    format!("{TRAJ_SUBJECT}.{partition}.{uid}")
}

pub fn score_subject(partition: &str, uid: &str) -> String {
    format!("{SCORE_SUBJECT}.{partition}.{uid}")
}

/// Splits a TRAJ or SCORE subject (`jetrl.<kind>.<partition>.<uid>`) into (partition, uid).
pub fn parse_group_subject(subject: &str) -> Option<(&str, &str)> {
    let mut parts = subject.splitn(4, '.');
    match (parts.next(), parts.next(), parts.next(), parts.next()) {
        (Some("jetrl"), Some(_), Some(partition), Some(uid)) if !partition.is_empty() && !uid.is_empty() => {
            Some((partition, uid))
        }
        _ => None,
    }
}

/// Where a reward service publishes the reward batches of partition `partition`.
pub fn reward_batch_subject(partition: &str) -> String {
    format!("{REWARDS_SUBJECT}.{partition}.batch")
}

pub fn group_key(partition: &str, uid: &str) -> String {
    format!("{partition}.{uid}")
}

/// Splits a GROUPS key back into (partition, uid).
pub fn parse_group_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('.')
}
