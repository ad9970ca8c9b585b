//! Moves the records of groups that left the working set to the job's LEDGER stream and purges their GROUPS keys
//! ([`jetrl_bus::archive`]), in the background: the buffer's event loop only hands them over.
//!
//! A batch that cannot be archived after [`ATTEMPTS`] tries (or at once, for a permanent failure) is logged and
//! counted, and nothing is lost: its records stay in GROUPS, where every reader of the ledger finds them, and the
//! buffer archives them when it next replays the bucket (its restart).

use std::time::Duration;

use jetrl_bus::{Delays, GroupStore, Recovery};
use jetrl_wire::v1::GroupStatus;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

/// Records archived in one go at most (one window of publishes, then the purges).
const MAX_BATCH: usize = 4096;
/// Tries per batch for a failure that may pass.
const ATTEMPTS: u32 = 4;
/// Backoff after the first failed try, doubled per try.
const FIRST_BACKOFF: Duration = Duration::from_millis(500);
/// Hand-overs (one per turn of the buffer's event loop) waiting for the archiver at most: when it falls behind, the
/// buffer's loop waits for it (so the trainer's next sample does) instead of piling records up in memory.
const QUEUED: usize = 64;

pub type Retired = Vec<(GroupStatus, u64)>;

/// Starts the archiver; it ends when the sender is dropped and what it was handed is archived.
pub fn start(groups: GroupStore) -> (mpsc::Sender<Retired>, JoinHandle<()>) {
    let (tx, rx) = mpsc::channel(QUEUED);
    (tx, tokio::spawn(run(groups, rx)))
}

async fn run(groups: GroupStore, mut rx: mpsc::Receiver<Retired>) {
    while let Some(mut batch) = rx.recv().await {
        while batch.len() < MAX_BATCH {
            match rx.try_recv() {
                Ok(more) => batch.extend(more),
                Err(_) => break,
            }
        }
        archive(&groups, &batch).await;
    }
}

async fn archive(groups: &GroupStore, batch: &[(GroupStatus, u64)]) {
    let mut backoff = Delays::new(FIRST_BACKOFF, FIRST_BACKOFF * 2u32.pow(ATTEMPTS));
    for attempt in 1..=ATTEMPTS {
        match groups.archive(batch).await {
            Ok(purged) => {
                metrics::counter!("jetrl_buffer_archived_groups_total").increment(batch.len() as u64);
                tracing::debug!(archived = batch.len(), purged, "group records archived");
                return;
            }
            Err(err) if attempt < ATTEMPTS && err.recovery() != Recovery::Permanent => {
                tracing::warn!(attempt, groups = batch.len(), error = %err, delay = ?backoff.peek(), "archiving group records; trying again");
                backoff.sleep().await;
            }
            Err(err) => {
                metrics::counter!("jetrl_buffer_archive_errors_total").increment(1);
                tracing::error!(
                    groups = batch.len(),
                    error = %err,
                    "group records not archived: they stay in GROUPS (the ledger reads them there) until the buffer \
                     next replays the bucket"
                );
                return;
            }
        }
    }
}
