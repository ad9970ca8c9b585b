//! One file: every name the services agree on, so a rename is seen whole.
//!
//! Names of the streams, subjects, consumers and buckets every service agrees on.
//!
//! Every stream, KV bucket, object store and subject belongs to one job: its namespace (`nats.namespace`, else
//! `run.name`) is part of each name, so any number of jobs share one NATS server without seeing each other's
//! records. [`Names`] builds every name of one namespace; no service spells a name by hand.

/// The durable pull consumer shared by every rollout worker (on the job's PROMPTS stream).
pub const ROLLOUT_CONSUMER: &str = "rollout-workers";
/// The durable pull consumer on the job's SCORE stream shared by every reward service.
pub const REWARD_CONSUMER: &str = "reward-service";
/// Header of a reward batch: the `Nats-Msg-Id`s of the score requests it answers, separated by spaces.
pub const SCORE_REQUESTS_HEADER: &str = "Jetrl-Score-Requests";
/// The key of the trainer's lease in the job's LEASE bucket: one trainer per job.
pub const TRAINER_LEASE_KEY: &str = "trainer";

/// The partitions of a job: training groups and validation groups.
pub const TRAIN_PARTITION: &str = "train";
pub const VAL_PARTITION: &str = "val";

/// Longest namespace: stream and bucket names stay short enough for every NATS limit.
pub const MAX_NAMESPACE_LEN: usize = 32;

/// A namespace that cannot name streams, buckets and subjects.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
#[error(
    "{0:?} is not a valid job namespace: it must be 1 to 32 ASCII letters, digits, '_' or '-', starting with a \
     letter or digit (it is part of the job's NATS stream, bucket and subject names)"
)]
pub struct InvalidNamespace(pub String);

/// Checks `^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$`: valid in stream, bucket and object store names and as one subject
/// token (no `.`, `*`, `>` or white space).
pub fn validate_namespace(namespace: &str) -> Result<(), InvalidNamespace> {
    let bytes = namespace.as_bytes();
    let ok = bytes.len() <= MAX_NAMESPACE_LEN
        && bytes.first().is_some_and(u8::is_ascii_alphanumeric)
        && bytes.iter().all(|&b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(InvalidNamespace(namespace.to_string()))
    }
}

/// Every stream, bucket, object store and subject name of one job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    namespace: String,
    /// `jetrl.<ns>`: the first two tokens of every subject of the job
    prefix: String,
    prompts_stream: String,
    traj_stream: String,
    score_stream: String,
    rewards_stream: String,
    dlq_stream: String,
    ledger_stream: String,
    groups_bucket: String,
    weights_bucket: String,
    workers_bucket: String,
    lease_bucket: String,
    blobs_store: String,
    released_subject: String,
    buffer_sample: String,
    buffer_release: String,
    buffer_ledger: String,
    weights_announce: String,
    trainer_metrics: String,
}

impl Names {
    /// The names of job `namespace` (checked with [`validate_namespace`]).
    pub fn new(namespace: &str) -> Result<Self, InvalidNamespace> {
        validate_namespace(namespace)?;
        let upper = |kind: &str| format!("JETRL_{namespace}_{kind}");
        let prefix = format!("jetrl.{namespace}");
        let subject = |rest: &str| format!("{prefix}.{rest}");
        Ok(Self {
            namespace: namespace.to_string(),
            prompts_stream: upper("PROMPTS"),
            traj_stream: upper("TRAJ"),
            score_stream: upper("SCORE"),
            rewards_stream: upper("REWARDS"),
            dlq_stream: upper("DLQ"),
            ledger_stream: upper("LEDGER"),
            groups_bucket: upper("GROUPS"),
            weights_bucket: upper("WEIGHTS"),
            workers_bucket: upper("WORKERS"),
            lease_bucket: upper("LEASE"),
            blobs_store: upper("BLOBS"),
            released_subject: subject("rewards.released"),
            buffer_sample: subject("buffer.sample"),
            buffer_release: subject("buffer.release"),
            buffer_ledger: subject("buffer.ledger"),
            weights_announce: subject("weights.announce"),
            trainer_metrics: subject("trainer.metrics"),
            prefix,
        })
    }

    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Work queue of prompt groups: `jetrl.<ns>.prompts.<partition>`.
    pub fn prompts_stream(&self) -> &str {
        &self.prompts_stream
    }

    /// Generated trajectories (payloads): `jetrl.<ns>.traj.<partition>.<uid>`, de-duplicated by key.
    pub fn traj_stream(&self) -> &str {
        &self.traj_stream
    }

    /// Score requests (one per group, trajectories without token arrays): `jetrl.<ns>.score.<partition>.<uid>`.
    pub fn score_stream(&self) -> &str {
        &self.score_stream
    }

    /// Scores plus index facts: one RewardBatch per micro-batch of score requests and partition, on
    /// [`Self::reward_batch_subject`] (any `jetrl.<ns>.rewards.<partition>.<name>` is read the same way), with the
    /// ids of the requests it answers in [`SCORE_REQUESTS_HEADER`]. The replay buffer's release markers share the
    /// stream (on [`Self::released_subject`]) so that a restarted buffer reads them in order with the rewards.
    pub fn rewards_stream(&self) -> &str {
        &self.rewards_stream
    }

    /// Dead letters: `jetrl.<ns>.dlq.<service>`.
    pub fn dlq_stream(&self) -> &str {
        &self.dlq_stream
    }

    /// The archive of group records that left the working set (trained and released, or evicted), one compact
    /// `GroupStatus` per retirement on `jetrl.<ns>.ledger.<partition>`: with the live records of
    /// [`Self::groups_bucket`], the job's ledger. Their GROUPS keys are purged once archived, so the bucket (and the
    /// broker's memory) holds the working set, not the run's history.
    pub fn ledger_stream(&self) -> &str {
        &self.ledger_stream
    }

    pub fn ledger_subject(&self, partition: &str) -> String {
        format!("{}.ledger.{partition}", self.prefix)
    }

    /// Every subject of the LEDGER stream.
    pub fn ledger_filter(&self) -> String {
        format!("{}.ledger.>", self.prefix)
    }

    /// Group control records, key `<partition>.<uid>` ([`group_key`]).
    pub fn groups_bucket(&self) -> &str {
        &self.groups_bucket
    }

    /// Weight manifests, keys `latest` and `v.<version>`.
    pub fn weights_bucket(&self) -> &str {
        &self.weights_bucket
    }

    /// Heartbeats, key `<service>.<instance>`.
    pub fn workers_bucket(&self) -> &str {
        &self.workers_bucket
    }

    /// The trainer's lease, key [`TRAINER_LEASE_KEY`].
    pub fn lease_bucket(&self) -> &str {
        &self.lease_bucket
    }

    /// Weight blobs (object store).
    pub fn blobs_store(&self) -> &str {
        &self.blobs_store
    }

    pub fn prompt_subject(&self, partition: &str) -> String {
        format!("{}.prompts.{partition}", self.prefix)
    }

    /// Every subject of the PROMPTS stream.
    pub fn prompts_filter(&self) -> String {
        format!("{}.prompts.>", self.prefix)
    }

    pub fn traj_subject(&self, partition: &str, uid: &str) -> String {
        format!("{}.traj.{partition}.{uid}", self.prefix)
    }

    /// Every subject of the TRAJ stream.
    pub fn traj_filter(&self) -> String {
        format!("{}.traj.>", self.prefix)
    }

    pub fn score_subject(&self, partition: &str, uid: &str) -> String {
        format!("{}.score.{partition}.{uid}", self.prefix)
    }

    /// Every subject of the SCORE stream.
    pub fn score_filter(&self) -> String {
        format!("{}.score.>", self.prefix)
    }

    /// Where a reward service publishes the reward batches of partition `partition`.
    pub fn reward_batch_subject(&self, partition: &str) -> String {
        format!("{}.rewards.{partition}.batch", self.prefix)
    }

    /// Every subject of the REWARDS stream (reward batches and release markers).
    pub fn rewards_filter(&self) -> String {
        format!("{}.rewards.>", self.prefix)
    }

    /// Every reward batch (five tokens or more; never a release marker): what the buffer's floor purge filters on.
    pub fn reward_batches_filter(&self) -> String {
        format!("{}.rewards.*.>", self.prefix)
    }

    /// The replay buffer's release markers: one `ReleaseRequest` per release, written before the release is
    /// answered.
    pub fn released_subject(&self) -> &str {
        &self.released_subject
    }

    /// Replay buffer requests: sample a batch.
    pub fn buffer_sample(&self) -> &str {
        &self.buffer_sample
    }

    /// Replay buffer requests: release trained groups.
    pub fn buffer_release(&self) -> &str {
        &self.buffer_release
    }

    /// Replay buffer requests: the ledger of prompt groups.
    pub fn buffer_ledger(&self) -> &str {
        &self.buffer_ledger
    }

    /// Trainer -> checkpoint-sync.
    pub fn weights_announce(&self) -> &str {
        &self.weights_announce
    }

    /// Trainer step metrics (JSON), for `jetrl run`'s progress display.
    pub fn trainer_metrics(&self) -> &str {
        &self.trainer_metrics
    }

    /// Where `service` copies the messages it refuses.
    pub fn dlq_subject(&self, service: &str) -> String {
        format!("{}.dlq.{service}", self.prefix)
    }

    /// Handshakes between the trainer and its co-located rollout worker (colocate_async):
    /// `jetrl.<ns>.control.<instance>.<verb>`, verb `pause` or `resume`.
    pub fn control_subject(&self, instance: &str, verb: &str) -> String {
        format!("{}.control.{instance}.{verb}", self.prefix)
    }

    /// Splits one of this job's TRAJ or SCORE subjects (`jetrl.<ns>.<kind>.<partition>.<uid>`) into
    /// (partition, uid); `None` for any other subject, another job's included.
    pub fn parse_group_subject<'a>(&self, subject: &'a str) -> Option<(&'a str, &'a str)> {
        let rest = subject.strip_prefix(self.prefix.as_str())?.strip_prefix('.')?;
        let mut parts = rest.splitn(3, '.');
        match (parts.next(), parts.next(), parts.next()) {
            (Some(kind), Some(partition), Some(uid))
                if !kind.is_empty() && !partition.is_empty() && !uid.is_empty() =>
            {
                Some((partition, uid))
            }
            _ => None,
        }
    }
}

/// The namespace of the job whose PROMPTS stream is named `stream` (`JETRL_<ns>_PROMPTS`): how the jobs on a
/// server are found.
pub fn job_of_prompts_stream(stream: &str) -> Option<&str> {
    let namespace = stream.strip_prefix("JETRL_")?.strip_suffix("_PROMPTS")?;
    validate_namespace(namespace).ok().map(|()| namespace)
}

/// A GROUPS key (the bucket belongs to one job, so the key does not repeat the namespace).
pub fn group_key(partition: &str, uid: &str) -> String {
    format!("{partition}.{uid}")
}

/// Splits a GROUPS key back into (partition, uid).
pub fn parse_group_key(key: &str) -> Option<(&str, &str)> {
    key.split_once('.')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_name_of_a_job_carries_its_namespace() {
        let names = Names::new("exp-7").unwrap();
        assert_eq!(names.namespace(), "exp-7");
        assert_eq!(names.prompts_stream(), "JETRL_exp-7_PROMPTS");
        assert_eq!(names.traj_stream(), "JETRL_exp-7_TRAJ");
        assert_eq!(names.score_stream(), "JETRL_exp-7_SCORE");
        assert_eq!(names.rewards_stream(), "JETRL_exp-7_REWARDS");
        assert_eq!(names.dlq_stream(), "JETRL_exp-7_DLQ");
        assert_eq!(names.ledger_stream(), "JETRL_exp-7_LEDGER");
        assert_eq!(names.ledger_subject("train"), "jetrl.exp-7.ledger.train");
        assert_eq!(names.ledger_filter(), "jetrl.exp-7.ledger.>");
        assert_eq!(names.groups_bucket(), "JETRL_exp-7_GROUPS");
        assert_eq!(names.weights_bucket(), "JETRL_exp-7_WEIGHTS");
        assert_eq!(names.workers_bucket(), "JETRL_exp-7_WORKERS");
        assert_eq!(names.lease_bucket(), "JETRL_exp-7_LEASE");
        assert_eq!(names.blobs_store(), "JETRL_exp-7_BLOBS");
        assert_eq!(names.prompt_subject("train"), "jetrl.exp-7.prompts.train");
        assert_eq!(names.prompts_filter(), "jetrl.exp-7.prompts.>");
        assert_eq!(names.traj_subject("train", "u1"), "jetrl.exp-7.traj.train.u1");
        assert_eq!(names.traj_filter(), "jetrl.exp-7.traj.>");
        assert_eq!(names.score_subject("val", "u1"), "jetrl.exp-7.score.val.u1");
        assert_eq!(names.score_filter(), "jetrl.exp-7.score.>");
        assert_eq!(names.reward_batch_subject("train"), "jetrl.exp-7.rewards.train.batch");
        assert_eq!(names.rewards_filter(), "jetrl.exp-7.rewards.>");
        assert_eq!(names.reward_batches_filter(), "jetrl.exp-7.rewards.*.>");
        assert_eq!(names.released_subject(), "jetrl.exp-7.rewards.released");
        assert_eq!(names.buffer_sample(), "jetrl.exp-7.buffer.sample");
        assert_eq!(names.buffer_release(), "jetrl.exp-7.buffer.release");
        assert_eq!(names.buffer_ledger(), "jetrl.exp-7.buffer.ledger");
        assert_eq!(names.weights_announce(), "jetrl.exp-7.weights.announce");
        assert_eq!(names.trainer_metrics(), "jetrl.exp-7.trainer.metrics");
        assert_eq!(names.dlq_subject("reward"), "jetrl.exp-7.dlq.reward");
        assert_eq!(names.control_subject("rollout-0", "pause"), "jetrl.exp-7.control.rollout-0.pause");
    }

    #[test]
    fn two_jobs_share_no_name() {
        let (a, b) = (Names::new("a").unwrap(), Names::new("b").unwrap());
        let all = |n: &Names| {
            vec![
                n.prompts_stream().to_string(),
                n.traj_stream().into(),
                n.score_stream().into(),
                n.rewards_stream().into(),
                n.dlq_stream().into(),
                n.ledger_stream().into(),
                n.groups_bucket().into(),
                n.weights_bucket().into(),
                n.workers_bucket().into(),
                n.lease_bucket().into(),
                n.blobs_store().into(),
                n.prompts_filter(),
                n.traj_filter(),
                n.score_filter(),
                n.rewards_filter(),
                n.ledger_filter(),
                n.buffer_sample().into(),
                n.buffer_release().into(),
                n.buffer_ledger().into(),
                n.weights_announce().into(),
                n.trainer_metrics().into(),
            ]
        };
        let names_of_a: std::collections::HashSet<String> = all(&a).into_iter().collect();
        assert!(all(&b).iter().all(|name| !names_of_a.contains(name)));
    }

    #[test]
    fn group_subjects_parse_back_only_in_their_own_job() {
        let names = Names::new("job_1").unwrap();
        let traj = names.traj_subject("train", "6f1c-aa");
        assert_eq!(names.parse_group_subject(&traj), Some(("train", "6f1c-aa")));
        assert_eq!(names.parse_group_subject(&names.score_subject("val", "u9")), Some(("val", "u9")));
        // another job's subject, and subjects that are not a group's
        assert_eq!(names.parse_group_subject(&Names::new("job_2").unwrap().traj_subject("train", "u")), None);
        assert_eq!(names.parse_group_subject(&Names::new("job").unwrap().traj_subject("train", "u")), None);
        assert_eq!(names.parse_group_subject("jetrl.job_1.traj.train"), None);
        assert_eq!(names.parse_group_subject("jetrl.job_1.traj..u"), None);
        assert_eq!(names.parse_group_subject("jetrl.traj.train.u"), None);
    }

    #[test]
    fn namespaces_that_cannot_name_streams_or_subjects_are_refused() {
        for good in ["a", "demo", "Run_2-b", "0abc", &"x".repeat(MAX_NAMESPACE_LEN)] {
            assert_eq!(validate_namespace(good), Ok(()), "{good}");
        }
        for bad in ["", "-lead", "_lead", "a.b", "a b", "a*", "a>", "ü", "tab\t", &"x".repeat(MAX_NAMESPACE_LEN + 1)] {
            let err = Names::new(bad).expect_err(bad);
            assert_eq!(err, InvalidNamespace(bad.to_string()));
            assert!(err.to_string().contains("1 to 32 ASCII letters"), "{err}");
        }
    }

    #[test]
    fn a_jobs_prompts_stream_names_its_namespace() {
        let names = Names::new("exp_PROMPTS").unwrap();
        assert_eq!(job_of_prompts_stream(names.prompts_stream()), Some("exp_PROMPTS"));
        assert_eq!(job_of_prompts_stream(names.traj_stream()), None);
        assert_eq!(job_of_prompts_stream("JETRL_PROMPTS"), None);
        assert_eq!(job_of_prompts_stream("KV_JETRL_a_GROUPS"), None);
    }

    #[test]
    fn group_keys_round_trip() {
        assert_eq!(parse_group_key(&group_key("train", "u-1")), Some(("train", "u-1")));
    }
}
