//! Names of the streams, subjects, consumers and buckets every service agrees on.

/// Work queue of prompt groups: `jetrl.prompts.<partition>`.
pub const PROMPTS_STREAM: &str = "JETRL_PROMPTS";
pub const PROMPTS_SUBJECT: &str = "jetrl.prompts";
/// The durable pull consumer shared by every rollout worker.
pub const ROLLOUT_CONSUMER: &str = "rollout-workers";

/// Generated trajectories (payloads): `jetrl.traj.<partition>.<uid>`, de-duplicated by key.
pub const TRAJ_STREAM: &str = "JETRL_TRAJ";
pub const TRAJ_SUBJECT: &str = "jetrl.traj";
/// The durable pull consumer shared by every reward service.
pub const REWARD_CONSUMER: &str = "reward-service";

/// Scores plus index facts: `jetrl.rewards.<partition>.<uid>`, de-duplicated by key.
pub const REWARDS_STREAM: &str = "JETRL_REWARDS";
pub const REWARDS_SUBJECT: &str = "jetrl.rewards";

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
pub const BUFFER_STATS: &str = "jetrl.buffer.stats";
/// Trainer -> checkpoint-sync.
pub const WEIGHTS_ANNOUNCE: &str = "jetrl.weights.announce";
/// Trainer step metrics (JSON), for `jetrl run`'s progress display.
pub const TRAINER_METRICS: &str = "jetrl.trainer.metrics";

pub fn prompt_subject(partition: &str) -> String {
    format!("{PROMPTS_SUBJECT}.{partition}")
}

pub fn traj_subject(partition: &str, uid: &str) -> String {
    format!("{TRAJ_SUBJECT}.{partition}.{uid}")
}

pub fn reward_subject(partition: &str, uid: &str) -> String {
    format!("{REWARDS_SUBJECT}.{partition}.{uid}")
}

pub fn group_key(partition: &str, uid: &str) -> String {
    format!("{partition}.{uid}")
}

/// Splits a GROUPS key back into (partition, uid).
pub fn parse_group_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('.')
}
