//! Reading the inputs again while the trainer waits.
//!
//! The buffer learns of group records from a watch of the GROUPS bucket and of rewards from a consumer of the
//! REWARDS stream. Both are ordered consumers that JetStream places on one node; through a cluster failover they
//! are recreated by the client, and the buffer checks that neither has stalled behind its store. A run in the
//! three-node cluster test still stood still once (four groups finished and scored, the trainer told "not ready"
//! for minutes) without either check firing, and the cause was not found. So when a sample request has waited
//! [`Reread::after`] with nothing coming in, the buffer reads both again from what the stores hold now: every
//! group record (the newest of each key) and every message left in REWARDS. What it already knew is skipped;
//! anything new it finds is applied, counted and reported, which names the missed update next time.
//! While a re-read finds nothing, the next waits twice as long (up to ten times the first).

use std::time::{Duration, Instant};

/// One re-read in progress: what the inputs had delivered when it began, and what it found since.
#[derive(Debug, Clone, PartialEq)]
pub struct Pass {
    pub started: Instant,
    /// the newest GROUPS revision delivered when the re-read began: entries up to it are replays
    pub groups_through: u64,
    /// the newest REWARDS sequence read when the re-read began: messages up to it are replays
    pub rewards_through: u64,
    /// replayed group records newer than what the buffer had
    pub found_records: u64,
    /// replayed rewards of live groups the buffer had not indexed
    pub found_rewards: u64,
}

impl Pass {
    pub fn found(&self) -> u64 {
        self.found_records + self.found_rewards
    }
}

/// When to re-read, and the pass in progress.
#[derive(Debug)]
pub struct Reread {
    /// the first wait before a re-read; zero: never
    after: Duration,
    /// the wait before the next one (doubles while re-reads find nothing)
    interval: Duration,
    /// not before this (the last re-read plus the interval)
    next_at: Option<Instant>,
    current: Option<Pass>,
}

/// How long a re-read's replay is given before it is reported.
pub const REPORT_AFTER: Duration = Duration::from_secs(10);
/// The longest wait between re-reads, as a multiple of the first.
const MAX_FACTOR: u32 = 10;

impl Reread {
    pub fn new(after: Duration) -> Self {
        Self { after, interval: after, next_at: None, current: None }
    }

    /// Whether to re-read now: a request has waited since `waiting_since` for at least the interval, nothing came
    /// in on either input for a third of the first wait, and no re-read is in progress or too recent.
    pub fn due(&self, now: Instant, waiting_since: Option<Instant>, last_input: Instant) -> bool {
        if self.after.is_zero() || self.current.is_some() {
            return false;
        }
        let Some(since) = waiting_since else { return false };
        now.saturating_duration_since(since) >= self.interval
            && now.saturating_duration_since(last_input) >= self.after / 3
            && self.next_at.is_none_or(|at| now >= at)
    }

    /// A re-read begins: the inputs have delivered through `groups_through` and `rewards_through`.
    pub fn begin(&mut self, now: Instant, groups_through: u64, rewards_through: u64) {
        self.current = Some(Pass { started: now, groups_through, rewards_through, found_records: 0, found_rewards: 0 });
        self.interval = (self.interval * 2).min(self.after * MAX_FACTOR);
        self.next_at = Some(now + self.interval);
    }

    /// A sample request was answered: the next wait starts from the first interval again.
    pub fn answered(&mut self) {
        self.interval = self.after;
        self.next_at = None;
    }

    /// Whether a GROUPS entry at `revision` is a replay of the re-read in progress.
    pub fn replays_record(&self, revision: u64) -> bool {
        self.current.as_ref().is_some_and(|p| revision <= p.groups_through)
    }

    /// Whether a REWARDS message at `seq` is a replay of the re-read in progress.
    pub fn replays_reward(&self, seq: u64) -> bool {
        self.current.as_ref().is_some_and(|p| seq <= p.rewards_through)
    }

    pub fn found_record(&mut self) {
        if let Some(p) = self.current.as_mut() {
            p.found_records += 1;
        }
    }

    pub fn found_rewards(&mut self, n: u64) {
        if let Some(p) = self.current.as_mut() {
            p.found_rewards += n;
        }
    }

    /// The pass in progress once it has had [`REPORT_AFTER`] to replay, ended; a pass that found something also
    /// resets the interval (the inputs had missed an update: the next one is looked for as soon).
    pub fn finish(&mut self, now: Instant) -> Option<Pass> {
        let done = self.current.as_ref().is_some_and(|p| now.saturating_duration_since(p.started) >= REPORT_AFTER);
        if !done {
            return None;
        }
        let pass = self.current.take()?;
        if pass.found() > 0 {
            self.answered();
        }
        Some(pass)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: Duration = Duration::from_secs(1);

    #[test]
    fn a_re_read_waits_for_a_long_wait_and_quiet_inputs_then_backs_off_while_it_finds_nothing() {
        let t0 = Instant::now();
        let mut r = Reread::new(30 * S);
        assert!(!r.due(t0 + 100 * S, None, t0), "no waiting request: never");
        assert!(!r.due(t0 + 29 * S, Some(t0), t0), "waited less than the interval");
        assert!(!r.due(t0 + 30 * S, Some(t0), t0 + 25 * S), "an input came 5 s ago (< 10 s)");
        assert!(r.due(t0 + 30 * S, Some(t0), t0 + 20 * S));
        r.begin(t0 + 30 * S, 7, 9);
        assert!(!r.due(t0 + 200 * S, Some(t0), t0), "one pass at a time");
        assert!(r.replays_record(7) && !r.replays_record(8));
        assert!(r.replays_reward(9) && !r.replays_reward(10));
        assert_eq!(r.finish(t0 + 35 * S), None, "the replay is given REPORT_AFTER");
        let pass = r.finish(t0 + 40 * S).expect("ended");
        assert_eq!(pass.found(), 0);
        assert!(!r.replays_record(1), "no pass in progress: nothing is a replay");
        // found nothing: the next waits 60 s after the last began
        assert!(!r.due(t0 + 89 * S, Some(t0), t0));
        assert!(r.due(t0 + 90 * S, Some(t0), t0));
        r.begin(t0 + 90 * S, 7, 9);
        r.finish(t0 + 100 * S);
        assert!(!r.due(t0 + 209 * S, Some(t0), t0), "then 120 s");
        assert!(r.due(t0 + 210 * S, Some(t0), t0));
        for _ in 0..10 {
            r.begin(t0, 0, 0);
            r.current = None;
        }
        assert_eq!(r.interval, 300 * S, "capped at ten times the first");
        r.answered();
        assert_eq!(r.interval, 30 * S);
    }

    #[test]
    fn a_pass_that_found_something_resets_the_interval_and_zero_means_never() {
        let t0 = Instant::now();
        let mut r = Reread::new(30 * S);
        r.begin(t0, 1, 1);
        r.found_record();
        r.found_rewards(2);
        let pass = r.finish(t0 + REPORT_AFTER).expect("ended");
        assert_eq!((pass.found_records, pass.found_rewards), (1, 2));
        assert!(r.due(t0 + 30 * S, Some(t0), t0), "reset: due again after the first interval");
        let never = Reread::new(Duration::ZERO);
        assert!(!never.due(t0 + 1000 * S, Some(t0), t0));
    }
}
