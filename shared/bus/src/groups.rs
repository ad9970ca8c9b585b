//! Prompt-group control records in the GROUPS KV bucket (key `<partition>.<uid>`).
//!
//! Every transition is a compare-and-set on the entry's revision (verl's TransferQueue does a
//! read-merge-write that two writers can interleave). The legal transitions are checked here, once:
//! `pending → running → finished | failure` (a redelivered task sets `running` again), and
//! `finished | failure → sampled | evicted`, plus three the trainer's bookkeeping writes: `pending | running →
//! evicted` (a resumed trainer retires in-flight work; a row submitted again gets a new record under a new uid, so
//! no record ever returns to `pending`), `sampled → evicted` (a resume rolls back training after its checkpoint; a
//! sampled group the trainer cannot train on is rejected) and `evicted → evicted` (an eviction's reason amended by a
//! rollback).

use std::time::Duration;

use async_nats::jetstream::kv;
use jetrl_wire::v1::{Eviction, GroupState, GroupStatus};
use jetrl_wire::{subjects, Message};

use crate::retry::Patience;
use crate::{Bus, BusError, Cause};

/// CAS retries before reporting contention as an error.
const MAX_CAS_ATTEMPTS: u32 = 16;

/// Why a group update was not applied.
#[derive(Debug, thiserror::Error)]
pub enum GroupUpdateError {
    #[error("group {key} does not exist")]
    Missing { key: String },
    #[error("group {key}: transition {from} -> {to} is not allowed")]
    IllegalTransition { key: String, from: &'static str, to: &'static str },
    #[error(transparent)]
    Bus(#[from] BusError),
}

impl GroupUpdateError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Missing { .. } => "missing",
            Self::IllegalTransition { .. } => "illegal_transition",
            Self::Bus(..) => "bus",
        }
    }
}

#[derive(Clone)]
pub struct GroupStore {
    kv: kv::Store,
    /// the job's connection: the ledger's archive ([`crate::archive`]) is a stream beside the bucket
    pub(crate) bus: Bus,
    /// how long a read or write of a record keeps asking again through transient failures and a cluster's
    /// leader election (`nats.connect_timeout_s`)
    pub(crate) patience: Patience,
}

pub(crate) fn kv_err(kv: &kv::Store, key: &str, cause: Cause) -> BusError {
    BusError::Kv { bucket: kv.name.clone(), key: key.into(), cause }
}

fn decode_err(key: &str, source: prost::DecodeError) -> BusError {
    BusError::Decode { what: format!("group {key}"), source }
}

/// Whether `from → to` is a legal group transition.
pub fn transition_allowed(from: GroupState, to: GroupState) -> bool {
    use GroupState::*;
    matches!(
        (from, to),
        (Pending, Running)
            | (Running, Running) // a redelivered task restarts the group
            | (Running, Finished | Failure)
            | (Finished | Failure, Sampled | Evicted)
            | (Pending | Running, Evicted)
            // a resumed trainer rolls back what was trained after its checkpoint; a trainer rejects a sampled group
            // it cannot train on (a payload missing or invalid): both are recorded as evictions with a reason
            | (Sampled, Evicted)
            // an eviction's reason amended: a resume rolls back an eviction made after its checkpoint
            | (Evicted, Evicted)
    )
}

impl GroupStore {
    pub async fn open(bus: &Bus) -> Result<Self, BusError> {
        let kv = bus.key_value(bus.names().groups_bucket()).await?;
        Ok(Self { kv, bus: bus.clone(), patience: Patience::within(bus.topology_wait()) })
    }

    /// The same store with another retry deadline.
    pub fn with_patience(mut self, patience: Patience) -> Self {
        self.patience = patience;
        self
    }

    pub fn kv(&self) -> &kv::Store {
        &self.kv
    }

    /// Creates a new group record; fails if the key exists. A create that failed transiently is asked again; when
    /// the retry finds the key already holding exactly this record, the first attempt was applied and its
    /// revision is returned.
    pub async fn create(&self, status: &GroupStatus) -> Result<u64, BusError> {
        let key = subjects::group_key(&status.partition, &status.uid);
        let value: bytes::Bytes = status.encode_to_vec().into();
        let mut backoff = self.patience.start();
        loop {
            let attempt = async { self.kv.create(&key, value.clone()).await.map_err(Cause::of) };
            let err = match tokio::time::timeout(self.patience.attempt, attempt).await {
                Ok(Ok(revision)) => return Ok(revision),
                Ok(Err(cause)) if cause.is_create_conflict() && backoff.attempts() > 1 => {
                    match self.entry(&key).await? {
                        Some(entry) if entry.value == value => return Ok(entry.revision),
                        _ => kv_err(&self.kv, &key, cause),
                    }
                }
                Ok(Err(cause)) => kv_err(&self.kv, &key, cause),
                Err(_) => kv_err(&self.kv, &key, self.no_answer()),
            };
            if !backoff.wait("create group record", &err).await {
                return Err(err.counted());
            }
        }
    }

    /// Creates many records with all requests in flight at once; returns the newest revision written (0: none).
    pub async fn create_many(&self, statuses: &[GroupStatus]) -> Result<u64, BusError> {
        let results = futures::future::join_all(statuses.iter().map(|s| self.create(s))).await;
        results.into_iter().try_fold(0, |newest, revision| revision.map(|r| newest.max(r)))
    }

    fn no_answer(&self) -> Cause {
        Cause::transient(format!("no answer within {:.1}s", self.patience.attempt.as_secs_f64()))
    }

    /// The raw entry of `key`, asked again through transient failures.
    async fn entry(&self, key: &str) -> Result<Option<kv::Entry>, BusError> {
        self.patience
            .retry("read group record", || async {
                self.kv.entry(key).await.map_err(|e| kv_err(&self.kv, key, Cause::of(e)))
            })
            .await
    }

    /// Current record and revision.
    pub async fn get(&self, partition: &str, uid: &str) -> Result<Option<(GroupStatus, u64)>, BusError> {
        let key = subjects::group_key(partition, uid);
        let Some(entry) = self.entry(&key).await? else { return Ok(None) };
        if entry.operation != kv::Operation::Put {
            return Ok(None);
        }
        let status = GroupStatus::decode(entry.value.as_ref()).map_err(|e| decode_err(&key, e))?;
        Ok(Some((status, entry.revision)))
    }

    /// Applies `change` with compare-and-set, re-reading and retrying on a concurrent write. `change` gets
    /// the current record and returns the new state to move to (checked against [`transition_allowed`]),
    /// or `None` to leave the record as it is.
    pub async fn update(
        &self,
        partition: &str,
        uid: &str,
        change: impl FnMut(&mut GroupStatus) -> Option<GroupState>,
    ) -> Result<Option<GroupStatus>, GroupUpdateError> {
        Ok(self.update_from(partition, uid, None, change).await?.map(|(status, _)| status))
    }

    /// [`GroupStore::update`] starting from a record and revision the caller already holds (from `create`,
    /// a previous update or a watch): the first compare-and-set needs no read, so a writer that knows the
    /// revision pays one round trip instead of two. Falls back to re-reading when the revision moved.
    /// Returns the new record and its revision.
    pub async fn update_from(
        &self,
        partition: &str,
        uid: &str,
        known: Option<(GroupStatus, u64)>,
        mut change: impl FnMut(&mut GroupStatus) -> Option<GroupState>,
    ) -> Result<Option<(GroupStatus, u64)>, GroupUpdateError> {
        let key = subjects::group_key(partition, uid);
        let mut known = known;
        // a write that failed transiently may still have been applied: the next read shows it
        let mut unconfirmed: Option<bytes::Bytes> = None;
        let mut backoff = self.patience.start();
        for attempt in 0..MAX_CAS_ATTEMPTS {
            let (mut status, revision) = match known.take() {
                Some(k) => k,
                None => match self.get(partition, uid).await? {
                    Some((current, revision)) => {
                        if unconfirmed.take().is_some_and(|written| written == current.encode_to_vec()) {
                            return Ok(Some((current, revision)));
                        }
                        (current, revision)
                    }
                    None => return Err(GroupUpdateError::Missing { key }),
                },
            };
            let from = status.state();
            let Some(to) = change(&mut status) else { return Ok(None) };
            if !transition_allowed(from, to) {
                return Err(GroupUpdateError::IllegalTransition { key, from: from.label(), to: to.label() });
            }
            status.set_state(to);
            status.updated_unix_ms = jetrl_wire::now_unix_ms();
            let value: bytes::Bytes = status.encode_to_vec().into();
            let written = tokio::time::timeout(self.patience.attempt, self.kv.update(&key, value.clone(), revision));
            match written.await {
                Ok(Ok(new_revision)) => return Ok(Some((status, new_revision))),
                Ok(Err(err)) if crate::error::lost_compare_and_set(&err) => {
                    tracing::debug!(%key, attempt, "group record changed concurrently; retrying");
                    if attempt > 0 {
                        let delays = crate::Delays::new(Duration::from_millis(2), Duration::from_millis(64));
                        tokio::time::sleep(delays.nth(attempt)).await;
                    }
                }
                failed => {
                    let cause = match failed {
                        Ok(Err(err)) => Cause::of(err),
                        _ => self.no_answer(),
                    };
                    let err = kv_err(&self.kv, &key, cause);
                    if !backoff.wait("update group record", &err).await {
                        return Err(err.counted().into());
                    }
                    unconfirmed = Some(value);
                }
            }
        }
        Err(kv_err(&self.kv, &key, Cause::transient("too much contention")).counted().into())
    }
}

/// Decodes a watched entry; `None` for deletes/purges or undecodable values (counted by the caller).
pub fn decode_entry(entry: &kv::Entry) -> Option<Result<GroupStatus, BusError>> {
    if entry.operation != kv::Operation::Put {
        return None;
    }
    Some(GroupStatus::decode(entry.value.as_ref()).map_err(|e| decode_err(&entry.key, e)))
}

impl GroupStore {
    /// All records of `partition` (current values); the listing is asked again as a whole through transient
    /// failures.
    pub async fn list(&self, partition: &str) -> Result<Vec<GroupStatus>, BusError> {
        Ok(self.list_with_revisions(partition).await?.into_iter().map(|(status, _)| status).collect())
    }

    /// [`GroupStore::list`] with each record's revision.
    pub async fn list_with_revisions(&self, partition: &str) -> Result<Vec<(GroupStatus, u64)>, BusError> {
        self.patience.retry("list group records", || self.list_once(partition)).await
    }

    /// The keys come from the stream leader (`STREAM.INFO` with a subject filter), not from a consumer (what
    /// `kv.keys()` uses): in a cluster an ephemeral consumer is placed on any replica, and one on a node still
    /// catching up after a restart lists only what that node has (a ledger read that way missed the last step's
    /// groups). The values are then read from the leader too ([`crate::topology::bucket_reads_direct`]).
    async fn list_once(&self, partition: &str) -> Result<Vec<(GroupStatus, u64)>, BusError> {
        use futures::StreamExt;
        let err = |key: &str, cause: Cause| kv_err(&self.kv, key, cause);
        let prefix = self.kv.prefix.as_str();
        let filter = format!("{prefix}{}", subjects::group_key(partition, ">"));
        let mut listed = self.kv.stream.info_with_subjects(&filter).await.map_err(|e| err("*", Cause::of(e)))?;
        let mut names = Vec::new();
        while let Some(listed) = listed.next().await {
            let (subject, _messages) = listed.map_err(|e| err("*", Cause::of(e)))?;
            if let Some(key) = subject.strip_prefix(prefix) {
                if subjects::parse_group_key(key).is_some_and(|(p, _)| p == partition) {
                    names.push(key.to_string());
                }
            }
        }
        let fetched = futures::future::join_all(names.iter().map(|k| self.kv.entry(k))).await;
        let mut out = Vec::new();
        for (key, entry) in names.iter().zip(fetched) {
            if let Some(entry) = entry.map_err(|e| err(key, Cause::of(e)))? {
                if let Some(Ok(status)) = decode_entry(&entry) {
                    out.push((status, entry.revision));
                }
            }
        }
        Ok(out)
    }

    /// Marks a group evicted at trainer step `step` with `eviction` and its `detail` (ledger), whatever its non-final
    /// state. Returns the revision written (None when the record was already sampled or evicted, and left as it is).
    pub async fn evict(
        &self,
        partition: &str,
        uid: &str,
        eviction: Eviction,
        detail: &str,
        step: u64,
    ) -> Result<Option<u64>, GroupUpdateError> {
        self.evict_unless(partition, uid, eviction, detail, step, |s| {
            matches!(s.state(), GroupState::Sampled | GroupState::Evicted)
        })
        .await
    }

    /// Marks a group evicted at `step` with `eviction` (and its `detail`) whatever state it is in: a sampled one (a
    /// rollback after a resume, a group the trainer rejected) or an evicted one (its reason amended by a rollback).
    pub async fn retract(
        &self,
        partition: &str,
        uid: &str,
        eviction: Eviction,
        detail: &str,
        step: u64,
    ) -> Result<(), GroupUpdateError> {
        self.evict_unless(partition, uid, eviction, detail, step, |s| is_evicted_as(s, eviction, detail))
            .await
            .map(drop)
    }

    /// Evicts the group at `step` with `eviction` and `detail`, unless `keep(record)` says to leave it as it is.
    async fn evict_unless(
        &self,
        partition: &str,
        uid: &str,
        eviction: Eviction,
        detail: &str,
        step: u64,
        keep: impl Fn(&GroupStatus) -> bool,
    ) -> Result<Option<u64>, GroupUpdateError> {
        self.update_from(partition, uid, None, |s| {
            if keep(s) {
                return None;
            }
            s.set_eviction(eviction);
            s.evicted_reason = detail.to_string();
            s.evicted_step = step;
            Some(GroupState::Evicted)
        })
        .await
        .map(|written| written.map(|(_, revision)| revision))
    }
}

/// Whether `record` is already evicted with `eviction` and `detail` (a retraction of it writes nothing).
pub(crate) fn is_evicted_as(record: &GroupStatus, eviction: Eviction, detail: &str) -> bool {
    record.state() == GroupState::Evicted && record.eviction() == eviction && record.evicted_reason == detail
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Exactly the lifecycle of the module doc: a row submitted again gets a new record under a new uid (the old one
    /// is evicted), so nothing ever moves back to `pending`; a sampled group can only be retracted (a rollback after
    /// a resume, a rejection), and an eviction's reason amended.
    #[test]
    fn only_the_documented_transitions_are_allowed() {
        use GroupState::*;
        let all = [Unspecified, Pending, Running, Finished, Failure, Sampled, Evicted];
        let documented = [
            (Pending, Running),
            (Running, Running),
            (Running, Finished),
            (Running, Failure),
            (Finished, Sampled),
            (Finished, Evicted),
            (Failure, Sampled),
            (Failure, Evicted),
            (Pending, Evicted),
            (Running, Evicted),
            (Sampled, Evicted),
            (Evicted, Evicted),
        ];
        for from in all {
            for to in all {
                assert_eq!(
                    transition_allowed(from, to),
                    documented.contains(&(from, to)),
                    "{} -> {}",
                    from.label(),
                    to.label()
                );
            }
        }
    }
}
