//! The sample requests waiting for enough complete groups: in arrival order, each with its deadline and its
//! sampling progress, and the trainer incarnation they must belong to.

use std::collections::{HashMap, VecDeque};
use std::ops::RangeInclusive;
use std::time::{Duration, Instant};

use jetrl_wire::v1::SampleRequest;

use crate::sampler::Progress;

/// A sample request waiting for enough complete groups.
pub(super) struct Waiting {
    pub request: SampleRequest,
    /// where the answer goes
    pub reply: async_nats::Subject,
    /// answered "not ready" then, if nothing sooner
    pub deadline: Instant,
    /// for the wait histogram
    pub received: Instant,
}

/// The waiting requests, oldest first.
#[derive(Default)]
pub(super) struct WaitingRequests {
    queue: VecDeque<Waiting>,
    /// since when a request has waited with none answered (None: the last one was answered)
    since: Option<Instant>,
    /// the newest trainer incarnation a request came from (0: none named yet)
    incarnation: u64,
    /// per request id: the sample loop's memory (refill credit, metrics) between iterations
    progress: HashMap<String, Progress>,
}

impl WaitingRequests {
    /// Whether a request from trainer `incarnation` comes from one a newer trainer has superseded (0 names none).
    pub fn is_superseded(&self, incarnation: u64) -> bool {
        incarnation != 0 && incarnation < self.incarnation
    }

    /// The newest trainer incarnation a request came from (0: none named yet).
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }

    /// Queues `request` until `now` plus its wait (a newer trainer incarnation first drops the requests of older
    /// ones: their sender is gone).
    pub fn admit(&mut self, request: SampleRequest, reply: async_nats::Subject, now: Instant) {
        if request.incarnation > self.incarnation {
            self.supersede_below(request.incarnation);
        }
        let wait = Duration::from_millis(u64::from(request.wait_ms.max(1)));
        self.since.get_or_insert(now);
        self.queue.push_back(Waiting { request, reply, deadline: now + wait, received: now });
    }

    /// A newer trainer holds the job: the waiting requests of older incarnations are dropped unanswered (groups
    /// handed to them would never be trained on, nor given to the new trainer).
    fn supersede_below(&mut self, incarnation: u64) {
        let (stale, keep): (Vec<_>, Vec<_>) =
            self.queue.drain(..).partition(|w| w.request.incarnation != 0 && w.request.incarnation < incarnation);
        self.queue = keep.into();
        for w in &stale {
            self.progress.remove(&w.request.request_id);
        }
        if self.incarnation != 0 || !stale.is_empty() {
            tracing::info!(
                incarnation,
                previous = self.incarnation,
                dropped_requests = stale.len(),
                "a new trainer incarnation; requests of older ones dropped"
            );
        }
        self.incarnation = incarnation;
    }

    pub fn len(&self) -> usize {
        self.queue.len()
    }

    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// The earliest deadline of a waiting request.
    pub fn next_deadline(&self) -> Option<Instant> {
        self.queue.iter().map(|w| w.deadline).min()
    }

    /// Takes out the requests whose deadline has come by `now`.
    pub fn take_expired(&mut self, now: Instant) -> Vec<Waiting> {
        let (expired, keep): (Vec<_>, Vec<_>) = self.queue.drain(..).partition(|w| w.deadline <= now);
        self.queue = keep.into();
        expired
    }

    /// Takes out every waiting request, oldest first, to try answering each; [`WaitingRequests::put_back`]
    /// returns those still unanswered.
    pub fn take_all(&mut self) -> VecDeque<Waiting> {
        std::mem::take(&mut self.queue)
    }

    /// Puts back requests taken out and not answered, ahead of any that came meanwhile.
    pub fn put_back(&mut self, mut unanswered: VecDeque<Waiting>) {
        unanswered.append(&mut self.queue);
        self.queue = unanswered;
    }

    /// A request was answered: nothing has waited unanswered since then.
    pub fn answered(&mut self) {
        self.since = None;
    }

    /// Since when a request has waited with none answered, while one waits.
    pub fn waiting_since(&self) -> Option<Instant> {
        self.since.filter(|_| !self.queue.is_empty())
    }

    /// The partition of the oldest waiting request (`train` when none waits).
    pub fn partition(&self) -> &str {
        self.queue.front().map_or("train", |w| w.request.partition.as_str())
    }

    /// Whether a waiting request names a GROUPS revision in `revisions` (it waited for the watch to deliver it).
    pub fn names_revision_in(&self, revisions: RangeInclusive<u64>) -> bool {
        self.queue.iter().any(|w| revisions.contains(&w.request.groups_revision))
    }

    /// The sample loop's memory for `request_id` (new if there is none), taken out while the policy runs.
    pub fn take_progress(&mut self, request_id: &str) -> Progress {
        self.progress.remove(request_id).unwrap_or_default()
    }

    /// Keeps `progress` for the next attempt at `request_id`.
    pub fn keep_progress(&mut self, request_id: &str, progress: Progress) {
        self.progress.insert(request_id.to_string(), progress);
    }

    /// Whether the sample loop has memory kept for `request_id`.
    #[cfg(test)]
    pub fn has_progress(&self, request_id: &str) -> bool {
        self.progress.contains_key(request_id)
    }

    /// Forgets the memory of a released request.
    pub fn forget(&mut self, request_id: &str) {
        self.progress.remove(request_id);
    }

    /// The ids of the waiting requests, oldest first.
    #[cfg(test)]
    pub fn request_ids(&self) -> impl Iterator<Item = &str> {
        self.queue.iter().map(|w| w.request.request_id.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn request(id: &str, incarnation: u64, wait_ms: u32) -> SampleRequest {
        SampleRequest { request_id: id.into(), partition: "train".into(), incarnation, wait_ms, ..Default::default() }
    }

    /// Requests `(id, incarnation, wait_ms)` admitted at `now`, in that order.
    fn admitted(now: Instant, requests: &[(&str, u64, u32)]) -> WaitingRequests {
        let mut waiting = WaitingRequests::default();
        for &(id, incarnation, wait_ms) in requests {
            waiting.admit(request(id, incarnation, wait_ms), format!("r.{id}").into(), now);
        }
        waiting
    }

    fn ids(waiting: &WaitingRequests) -> Vec<&str> {
        waiting.request_ids().collect()
    }

    #[test]
    fn a_newer_incarnation_drops_older_requests_and_their_progress_and_supersedes_their_trainer() {
        let now = Instant::now();
        let mut waiting = admitted(now, &[("five", 5, 1000), ("unnamed", 0, 1000)]);
        waiting.keep_progress("five", Progress::default());
        assert_eq!(waiting.incarnation(), 5);
        assert!(waiting.is_superseded(3) && !waiting.is_superseded(5) && !waiting.is_superseded(0));

        waiting.admit(request("seven", 7, 1000), "r.7".into(), now);
        assert_eq!(ids(&waiting), ["unnamed", "seven"], "a request naming no incarnation stays");
        assert!(!waiting.has_progress("five"));
        assert!(waiting.is_superseded(5));
    }

    #[test]
    fn requests_expire_at_their_deadline_and_the_rest_keep_their_order() {
        let now = Instant::now();
        let mut waiting = admitted(now, &[("long", 1, 1000), ("short", 1, 10), ("zero", 1, 0)]);
        assert_eq!(waiting.next_deadline(), Some(now + Duration::from_millis(1)), "a wait of 0 counts as 1 ms");

        let expired: Vec<String> =
            waiting.take_expired(now + Duration::from_millis(10)).into_iter().map(|w| w.request.request_id).collect();
        assert_eq!(expired, ["short", "zero"]);
        assert_eq!(ids(&waiting), ["long"]);
    }

    #[test]
    fn the_wait_counts_from_the_first_unanswered_request_and_only_while_one_waits() {
        let mut waiting = WaitingRequests::default();
        let (t0, t1) = (Instant::now(), Instant::now() + Duration::from_secs(1));
        assert_eq!(waiting.waiting_since(), None);
        waiting.admit(request("a", 1, 1000), "r.a".into(), t0);
        waiting.admit(request("b", 1, 1000), "r.b".into(), t1);
        assert_eq!(waiting.waiting_since(), Some(t0));

        let mut taken = waiting.take_all();
        let first = taken.pop_front().expect("a");
        waiting.answered();
        waiting.put_back(taken);
        assert_eq!(ids(&waiting), ["b"]);
        assert_eq!(waiting.waiting_since(), None, "answered since b came");
        waiting.admit(request("c", 1, 1000), "r.c".into(), t1);
        assert_eq!(waiting.waiting_since(), Some(t1));

        waiting.take_expired(first.deadline + Duration::from_secs(5));
        assert!(waiting.is_empty());
        assert_eq!(waiting.waiting_since(), None, "nothing waits");
    }

    #[test]
    fn requests_put_back_stay_ahead_of_those_that_came_meanwhile() {
        let now = Instant::now();
        let mut waiting = admitted(now, &[("old", 1, 1000)]);
        let taken = waiting.take_all();
        waiting.admit(request("new", 1, 1000), "r.2".into(), now);
        waiting.put_back(taken);
        assert_eq!(ids(&waiting), ["old", "new"]);
        assert_eq!(waiting.len(), 2);
    }

    #[test]
    fn the_partition_and_the_revisions_waited_for_are_those_of_the_waiting_requests() {
        let mut waiting = WaitingRequests::default();
        assert_eq!(waiting.partition(), "train");
        let now = Instant::now();
        let val = SampleRequest { partition: "val".into(), groups_revision: 7, ..request("v", 1, 1000) };
        waiting.admit(val, "r.v".into(), now);
        assert_eq!(waiting.partition(), "val");
        assert!(waiting.names_revision_in(5..=7));
        assert!(!waiting.names_revision_in(8..=9));
        let (before, after) = (7, 7);
        assert!(!waiting.names_revision_in(before + 1..=after), "nothing newly delivered");
    }
}
