//! The ledger's archive: group records that left the working set move from the GROUPS bucket to the job's LEDGER
//! stream.
//!
//! A group trained and released, or evicted, is never changed again by the data path; only a resumed trainer's
//! rollback amends it. Kept in GROUPS, every such record would stay in the broker's memory (one subject per key,
//! with its revisions' garbage in the bucket's blocks) and in every watcher's for the whole run: `just bench soak`
//! measured the broker at +130% RSS over nine minutes. So the replay buffer, which sees a group retire, appends the
//! record (without its prompt task and trajectory keys) to LEDGER and then purges its key from GROUPS up to that
//! revision; a newer revision written in between is not purged, and is archived when it retires in turn.
//!
//! Readers of the whole history ([`GroupStore::records`]: the row ledger, a trainer's resume) merge both: the
//! newest copy of each uid. A rollback of a record that is only in the archive is appended to it
//! ([`GroupStore::retract_known`]). Which copy is the newest is decided by [`Version`], never by a clock: an
//! amendment (only ever made to a key already purged, and uids are never re-created) over any copy, then the
//! higher KV revision (an archived copy carries its revision in [`REVISION_HEADER`]), then the later one read.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use futures::StreamExt;
use jetrl_wire::v1::{Eviction, GroupState, GroupStatus};
use jetrl_wire::{subjects, Message};

use crate::groups::{kv_err, GroupUpdateError};
use crate::publish::{Outgoing, Publisher};
use crate::{BusError, Cause, GroupStore};

/// Purge requests in flight at once.
const PURGES_IN_FLIGHT: usize = 128;
/// Archive publishes awaiting their acks at once.
const PUBLISH_WINDOW: usize = 1024;
/// How long a scan of the archive waits for its next message before it takes the scan as complete.
const SCAN_WAIT: Duration = Duration::from_secs(2);

/// Header of an archived copy: the KV revision it was archived at.
pub const REVISION_HEADER: &str = "Jetrl-Revision";
/// Header of an amendment (a rollback appended to the archive): the step it rolled back to.
pub const AMENDED_HEADER: &str = "Jetrl-Amended";

/// The order of a uid's copies: (amended, KV revision); equal versions keep the later one read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Version {
    amended: bool,
    revision: u64,
}

/// What the archive keeps of a record: everything the ledger and a resume read, without the prompt task and the
/// trajectory keys.
pub fn compact(status: &GroupStatus) -> GroupStatus {
    GroupStatus { task: None, trajectory_keys: Vec::new(), ..status.clone() }
}

/// Keeps `record` as its uid's copy unless a copy of a higher version is there already.
fn keep_newest(by_uid: &mut HashMap<String, (Version, GroupStatus)>, version: Version, record: GroupStatus) {
    match by_uid.get(&record.uid) {
        Some((current, _)) if *current > version => {}
        _ => {
            by_uid.insert(record.uid.clone(), (version, record));
        }
    }
}

impl GroupStore {
    /// Archives retired records, `(record, revision)`: each is appended to LEDGER (de-duplicated by key and
    /// revision within the stream's duplicate window; a reader keeps one copy per uid in any case, so archiving
    /// again after a crash is harmless), then, once all are stored, each key is purged from GROUPS up to its
    /// revision. A record of revision 0 (unknown) is archived and not purged. Returns how many keys were purged.
    pub async fn archive(&self, retired: &[(GroupStatus, u64)]) -> Result<usize, BusError> {
        if retired.is_empty() {
            return Ok(0);
        }
        let names = self.bus.names();
        let mut publisher = Publisher::new(&self.bus, retired.len().min(PUBLISH_WINDOW));
        for (status, revision) in retired {
            let id = format!("{}@{revision}", subjects::group_key(&status.partition, &status.uid));
            let subject = names.ledger_subject(&status.partition);
            let message =
                Outgoing::protobuf(subject, Some(id), &compact(status)).header(REVISION_HEADER, revision.to_string());
            publisher.publish(message).await?;
        }
        publisher.drain().await?;
        // owned inputs (no closure over borrowed tuples) keep this future `Send` for every lifetime
        let targets: Vec<(String, u64)> = retired
            .iter()
            .filter(|(_, revision)| *revision > 0)
            .map(|(status, revision)| (subjects::group_key(&status.partition, &status.uid), *revision))
            .collect();
        // one copy of the bucket's handle for every purge (it carries the stream's cached info)
        let (kv, attempt) = (std::sync::Arc::new(self.kv().clone()), self.patience.attempt);
        let purges = targets.into_iter().map(move |(key, revision)| {
            let kv = kv.clone();
            async move {
                let subject = format!("{}{key}", kv.prefix);
                // everything on the key below revision + 1: a newer revision, written since, stays
                let purge = kv.stream.purge().filter(subject).sequence(revision + 1);
                match tokio::time::timeout(attempt, purge).await {
                    Ok(result) => result.map(drop).map_err(|e| kv_err(&kv, &key, Cause::of(e))),
                    Err(_) => Err(kv_err(&kv, &key, Cause::transient("purge: no answer"))),
                }
            }
        });
        let mut results = futures::stream::iter(purges).buffer_unordered(PURGES_IN_FLIGHT);
        let (mut purged, mut failed) = (0usize, None);
        while let Some(result) = results.next().await {
            match result {
                Ok(()) => purged += 1,
                Err(err) => failed = failed.or(Some(err)),
            }
        }
        match failed {
            // the records are archived; a key left in GROUPS is archived and purged again when the buffer next
            // replays the bucket, and until then readers find the same record twice (one copy is kept)
            Some(err) => Err(err.counted()),
            None => Ok(purged),
        }
    }

    /// Every record of `partition` the job has: the live ones in GROUPS and the archived ones, the newest copy of
    /// each uid. The live records are read first, so a group archived meanwhile is found in the archive.
    pub async fn records(&self, partition: &str) -> Result<Vec<GroupStatus>, BusError> {
        let live = self.list_with_revisions(partition).await?;
        let mut by_uid = self.patience.retry("read the ledger archive", || self.archived(partition)).await?;
        for (record, revision) in live {
            keep_newest(&mut by_uid, Version { amended: false, revision }, record);
        }
        Ok(by_uid.into_values().map(|(_, record)| record).collect())
    }

    /// The archived records of `partition`, the newest copy of each uid. A message that does not decode is
    /// counted and skipped (only this job's services may write the stream).
    async fn archived(&self, partition: &str) -> Result<HashMap<String, (Version, GroupStatus)>, BusError> {
        let names = self.bus.names();
        let stream = self.bus.stream(names.ledger_stream()).await?;
        let subject = names.ledger_subject(partition);
        // the archive's last record as the stream leader has it: the read must get that far
        let reach = match stream.get_last_raw_message_by_subject(&subject).await {
            Ok(last) => last.sequence,
            Err(e) if e.kind() == LastRawMessageErrorKind::NoMessageFound => return Ok(HashMap::new()),
            Err(e) => return Err(BusError::Consume { what: names.ledger_stream().into(), cause: Cause::of(e) }),
        };
        let config = OrderedConfig { filter_subject: subject, ..Default::default() };
        let mut by_uid = HashMap::new();
        let mut malformed = 0u64;
        crate::consume::read_stored_through(&stream, config, reach, SCAN_WAIT, |msg| {
            let header = |name: &str| msg.headers.as_ref().and_then(|h| h.get(name)).map(|v| v.as_str().to_string());
            let version = Version {
                amended: header(AMENDED_HEADER).is_some(),
                revision: header(REVISION_HEADER).and_then(|r| r.parse().ok()).unwrap_or(0),
            };
            match GroupStatus::decode(msg.payload.clone()) {
                Ok(record) => keep_newest(&mut by_uid, version, record),
                Err(_) => malformed += 1,
            }
        })
        .await?;
        if malformed > 0 {
            crate::consume::count_malformed("ledger", names.ledger_stream());
            tracing::warn!(malformed, stream = names.ledger_stream(), "undecodable ledger records skipped");
        }
        Ok(by_uid)
    }

    /// [`GroupStore::retract`] for a record read with [`GroupStore::records`]: when its key has been archived and
    /// purged, the retraction (the record as read, evicted at `step` with `eviction` and `detail`) is appended to
    /// the archive instead.
    pub async fn retract_known(
        &self,
        record: &GroupStatus,
        eviction: Eviction,
        detail: &str,
        step: u64,
    ) -> Result<(), GroupUpdateError> {
        match self.retract(&record.partition, &record.uid, eviction, detail, step).await {
            Err(GroupUpdateError::Missing { .. }) => {}
            other => return other,
        }
        if crate::groups::is_evicted_as(record, eviction, detail) {
            return Ok(());
        }
        let mut amended = compact(record);
        amended.set_eviction(eviction);
        amended.evicted_reason = detail.to_string();
        amended.evicted_step = step;
        amended.set_state(GroupState::Evicted);
        amended.updated_unix_ms = jetrl_wire::now_unix_ms();
        let key = subjects::group_key(&record.partition, &record.uid);
        let id = format!("{key}@amended:{step}:{}", eviction.describe(detail));
        let subject = self.bus.names().ledger_subject(&record.partition);
        let message = Outgoing::protobuf(subject, Some(id), &amended).header(AMENDED_HEADER, step.to_string());
        self.bus.publish_durable(message).await?;
        Ok(())
    }
}
