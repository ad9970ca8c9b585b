//! How far the GROUPS watch has read the bucket: the newest revision delivered, whether its initial replay is
//! done, and the latest time as of which it had delivered everything the bucket held.

use std::collections::VecDeque;
use std::ops::RangeInclusive;
use std::time::Instant;

/// Bucket revisions remembered for the watch to reach at most (one per watch check; the oldest go first).
const MAX_MARKS: usize = 1024;

#[derive(Debug, Default)]
pub(super) struct GroupsCursor {
    /// the newest GROUPS revision the watch has delivered: a sample request naming a newer one waits for it
    revision: u64,
    /// the initial replay of the GROUPS bucket is done
    current: bool,
    /// `(when, the GROUPS bucket's last revision then)`, oldest first, not yet delivered by the watch
    marks: VecDeque<(Instant, u64)>,
    /// the latest time as of which the watch is known to have delivered everything the bucket held: orphan
    /// rewards are forgotten only when their groups' records would have come by then (a watch whose consumer sits
    /// on a cluster node still catching up delivers late, and its rewards must not be dropped meanwhile)
    seen_through: Option<Instant>,
}

impl GroupsCursor {
    /// A cursor before the first entry; `current` when the bucket is empty (there is nothing to replay).
    pub fn new(current: bool) -> Self {
        Self { current, ..Self::default() }
    }

    /// The watch delivered an entry: `seen` is the newest revision it has delivered, and `delta` how many entries
    /// of its initial replay follow this one. Returns the revisions newly delivered (a request waiting for one
    /// of them can be decided now).
    pub fn delivered(&mut self, seen: u64, delta: u64) -> RangeInclusive<u64> {
        let before = self.revision;
        self.revision = seen;
        self.reach_marks();
        if delta == 0 {
            self.current = true;
        }
        before + 1..=self.revision
    }

    /// The bucket's last revision was `newest` at `asked`: once the watch has delivered it, it had everything the
    /// bucket held at that moment.
    pub fn mark(&mut self, asked: Instant, newest: u64) {
        if self.marks.len() >= MAX_MARKS {
            self.marks.pop_front();
        }
        self.marks.push_back((asked, newest));
        self.reach_marks();
    }

    /// Every mark at or below the revision delivered is reached.
    fn reach_marks(&mut self) {
        while let Some(&(at, newest)) = self.marks.front() {
            if newest > self.revision {
                break;
            }
            self.seen_through = Some(at);
            self.marks.pop_front();
        }
    }

    /// The newest revision the watch has delivered.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// Whether the initial replay of the bucket is done.
    pub fn is_current(&self) -> bool {
        self.current
    }

    /// The latest time as of which the watch had delivered everything the bucket held (None: not known yet).
    pub fn seen_through(&self) -> Option<Instant> {
        self.seen_through
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn the_replay_is_current_at_its_last_entry_and_each_delivery_returns_the_revisions_it_reached() {
        let mut cursor = GroupsCursor::new(false);
        assert!(!cursor.is_current());
        assert_eq!(cursor.delivered(3, 2), 1..=3);
        assert!(!cursor.is_current(), "two entries of the replay still follow");
        assert_eq!(cursor.delivered(5, 0), 4..=5);
        assert!(cursor.is_current());
        assert_eq!(cursor.revision(), 5);
        assert!(cursor.delivered(5, 0).is_empty(), "nothing newer delivered");
        assert!(GroupsCursor::new(true).is_current(), "an empty bucket has nothing to replay");
    }

    #[test]
    fn the_watch_has_seen_through_a_mark_once_it_delivers_the_revision_the_bucket_had_then() {
        let mut cursor = GroupsCursor::new(true);
        let (t0, t1) = (Instant::now(), Instant::now() + Duration::from_secs(5));
        cursor.mark(t0, 4);
        cursor.mark(t1, 9);
        assert_eq!(cursor.seen_through(), None);
        cursor.delivered(4, 0);
        assert_eq!(cursor.seen_through(), Some(t0));
        cursor.delivered(8, 0);
        assert_eq!(cursor.seen_through(), Some(t0), "revision 9 not yet delivered");
        cursor.delivered(9, 0);
        assert_eq!(cursor.seen_through(), Some(t1));

        let t2 = t1 + Duration::from_secs(5);
        cursor.mark(t2, 9);
        assert_eq!(cursor.seen_through(), Some(t2), "a bucket that has not moved is seen through at once");
    }

    #[test]
    fn the_oldest_marks_go_first_beyond_the_bound() {
        let mut cursor = GroupsCursor::new(true);
        let t0 = Instant::now();
        for i in 0..=MAX_MARKS as u64 {
            cursor.mark(t0 + Duration::from_secs(i), 10 + i);
        }
        cursor.delivered(10, 0);
        assert_eq!(cursor.seen_through(), None, "the first mark was dropped");
        cursor.delivered(11, 0);
        assert_eq!(cursor.seen_through(), Some(t0 + Duration::from_secs(1)));
    }
}
