//! The REWARDS input's bookkeeping: whether its initial replay is done, which orphan rewards may be forgotten, and
//! the floor purge (one at a time, and only above what is already purged).

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Rewards of a group whose record has not arrived this long after them are forgotten (the record of a live
/// group is created before its prompt is sent; these belong to deleted or foreign groups and would hold the purge
/// floor down for ever), once the groups watch has delivered everything the bucket held since they came.
const ORPHAN_TTL: Duration = Duration::from_secs(120);

#[derive(Debug, Default)]
pub(super) struct RewardsInput {
    /// the initial replay of the REWARDS stream is done
    current: bool,
    /// `(when, the newest REWARDS sequence read)` at each purge tick of the last ORPHAN_TTL, oldest first
    read_history: VecDeque<(Instant, u64)>,
    /// REWARDS is purged below this sequence (written by the purge task)
    purged_below: Arc<AtomicU64>,
    /// the floor purge in flight, if any
    purge: Option<tokio::task::JoinHandle<()>>,
}

impl RewardsInput {
    /// Before the first message; `current` when the stream is empty (there is nothing to replay).
    pub fn new(current: bool) -> Self {
        Self { current, ..Self::default() }
    }

    /// Whether the initial replay of the stream is done.
    pub fn is_current(&self) -> bool {
        self.current
    }

    /// A message was delivered with `pending` more after it: the replay is done at the last.
    pub fn delivered(&mut self, pending: u64) {
        if pending == 0 {
            self.current = true;
        }
    }

    /// A purge tick at `now`, with REWARDS read through `read` and the groups watch known to have delivered
    /// everything the bucket held as of `groups_seen_through`: the sequence below which orphan rewards may be
    /// forgotten (read more than [`ORPHAN_TTL`] ago, and their records would have come by now; 0: none).
    pub fn orphan_horizon(&mut self, now: Instant, read: u64, groups_seen_through: Option<Instant>) -> u64 {
        self.read_history.push_back((now, read));
        let mut horizon = 0;
        while let Some(&(at, seq)) = self.read_history.front() {
            if now.duration_since(at) < ORPHAN_TTL || groups_seen_through.is_none_or(|seen| seen < at) {
                break;
            }
            horizon = seq;
            self.read_history.pop_front();
        }
        horizon
    }

    /// Whether a purge below `floor` is due: none in flight, and `floor` above what is purged.
    pub fn purge_due(&self, floor: u64) -> bool {
        self.purge.as_ref().is_none_or(|task| task.is_finished()) && floor > self.purged_below.load(Ordering::Relaxed)
    }

    /// Runs `purge` (of everything below `floor`; true when done) in the background; `floor` counts as purged once
    /// it is done.
    pub fn start_purge(&mut self, floor: u64, purge: impl Future<Output = bool> + Send + 'static) {
        let purged_below = Arc::clone(&self.purged_below);
        self.purge = Some(tokio::spawn(async move {
            if purge.await {
                purged_below.store(floor, Ordering::Relaxed);
            }
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_replay_is_current_at_the_last_pending_message() {
        let mut rewards = RewardsInput::new(false);
        rewards.delivered(3);
        assert!(!rewards.is_current());
        rewards.delivered(0);
        assert!(rewards.is_current());
        assert!(RewardsInput::new(true).is_current(), "an empty stream has nothing to replay");
    }

    #[test]
    fn orphans_are_forgotten_only_past_the_ttl_and_once_the_groups_watch_has_caught_up_since() {
        let mut rewards = RewardsInput::new(true);
        let t0 = Instant::now();
        assert_eq!(rewards.orphan_horizon(t0, 10, Some(t0)), 0);
        let t1 = t0 + Duration::from_secs(60);
        assert_eq!(rewards.orphan_horizon(t1, 20, Some(t1)), 0, "younger than the TTL");
        let t2 = t0 + ORPHAN_TTL;
        assert_eq!(rewards.orphan_horizon(t2, 30, None), 0, "the watch is not known to have delivered anything");
        assert_eq!(rewards.orphan_horizon(t2, 30, Some(t0)), 10, "what was read at t0");
        let t3 = t1 + ORPHAN_TTL;
        assert_eq!(rewards.orphan_horizon(t3, 40, Some(t0)), 0, "the watch has not caught up since t1");
        assert_eq!(rewards.orphan_horizon(t3, 40, Some(t3)), 20, "what was read at t1");
    }

    /// Whether a purge below `floor` becomes due within a second (the purge in flight finishes meanwhile).
    async fn due_soon(rewards: &RewardsInput, floor: u64) -> bool {
        let until_due = async {
            while !rewards.purge_due(floor) {
                tokio::task::yield_now().await;
            }
        };
        tokio::time::timeout(Duration::from_secs(1), until_due).await.is_ok()
    }

    #[tokio::test]
    async fn one_purge_at_a_time_and_a_floor_counts_as_purged_once_its_purge_is_done() {
        let mut rewards = RewardsInput::new(true);
        assert!(rewards.purge_due(1));
        let (release, done) = tokio::sync::oneshot::channel::<bool>();
        rewards.start_purge(5, async move { done.await.unwrap_or(false) });
        assert!(!rewards.purge_due(7), "a purge is in flight");

        release.send(true).expect("the purge waits");
        assert!(due_soon(&rewards, 7).await);
        assert!(!rewards.purge_due(5), "already purged below 5");

        rewards.start_purge(7, async { false });
        assert!(due_soon(&rewards, 7).await, "a purge that failed is tried again");
    }
}
