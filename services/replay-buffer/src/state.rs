//! One file: the buffer's pure state machine, whose transitions are read together.
//!
//! The replay buffer's pure state: group records, the index of scored trajectories, and the selection
//! policy. No I/O, no tasks: the service feeds it events and carries out its decisions.
//!
//! The index is compact on purpose (≤ 1 KiB per buffered trajectory at 100k trajectories): a trajectory is
//! known by `(session_id, index)` inside its group, strings shared by many trajectories (data source, extra
//! metric names) are interned, and payloads never enter the buffer.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::sync::Arc;

use jetrl_wire::keys::TrajectoryKey;
use jetrl_wire::v1::{Eviction, GroupState, GroupStatus, LedgerEntry, Reward, SampledGroup};

/// `(session_id, index)`: a trajectory's place in its group (its key is `{uid}_{session_id}_{index}`).
pub type Slot = (u32, u32);

/// One indexed trajectory: its score, index facts and where its payload is. The payload stays in the TRAJ
/// stream.
#[derive(Debug, Clone)]
pub struct IndexedReward {
    pub traj_seq: u64,
    /// sequence of the Reward message in the REWARDS stream
    pub reward_seq: u64,
    pub score: f64,
    pub prompt_len: u32,
    pub response_len: u32,
    pub min_version: u64,
    pub max_version: u64,
    pub data_source: Arc<str>,
    pub extra: Box<[(Arc<str>, f64)]>,
    pub extra_text: Box<[(Arc<str>, Box<str>)]>,
    pub failure_reason: Option<Box<str>>,
    /// a remax group's greedy baseline: it sets the group's baseline and is not one of its samples
    pub greedy_baseline: bool,
}

impl IndexedReward {
    /// A numeric reward extra (`acc`, ...) by name.
    pub fn extra(&self, name: &str) -> Option<f64> {
        self.extra.iter().find(|(k, _)| &**k == name).map(|(_, v)| *v)
    }

    pub fn extra_names(&self) -> Vec<&str> {
        self.extra.iter().map(|(k, _)| &**k).collect()
    }
}

/// Everything the buffer knows about one prompt group.
#[derive(Debug, Clone, Default)]
pub struct Group {
    /// the control record as last seen in the GROUPS bucket, without its task and trajectory keys (kept as
    /// `expected` instead), to save memory
    pub status: GroupStatus,
    /// the trajectories the worker listed with the terminal state
    pub expected: Vec<Slot>,
    /// scored trajectories
    pub rewards: BTreeMap<Slot, IndexedReward>,
    /// sampled and released by the trainer (it then leaves the working set for [`BufferState::retired`])
    pub released: bool,
    /// KV revision of the record last seen (0: unknown), for a compare-and-set without reading it again
    pub revision: u64,
    /// The lowest REWARDS sequence this group's rewards may still be at: one past the last the buffer had read when
    /// the group's record first came (a reward is published after its group's record is). Until the group has
    /// every reward, REWARDS is not purged from here on: a reward its consumer missed stays for a re-read to find.
    pub rewards_from: u64,
}

impl Group {
    pub fn state(&self) -> GroupState {
        self.status.state()
    }

    /// Still part of the working set: not evicted, and not sampled-and-released. Retired groups stay only
    /// for the ledger and the state counts.
    fn is_live(&self) -> bool {
        match self.state() {
            GroupState::Evicted => false,
            GroupState::Sampled => !self.released,
            _ => true,
        }
    }

    /// Terminal, and every trajectory the worker listed has been scored.
    pub fn is_complete(&self) -> bool {
        self.state().is_terminal() && self.expected.iter().all(|k| self.rewards.contains_key(k))
    }

    /// Its rewards may still come: in flight, or terminal and not yet complete (a sampled group had them all).
    fn awaits_rewards(&self) -> bool {
        match self.state() {
            GroupState::Sampled | GroupState::Evicted => false,
            state if state.is_terminal() => !self.is_complete(),
            _ => true,
        }
    }

    /// The key of a trajectory of this group.
    pub fn key(&self, slot: Slot) -> String {
        TrajectoryKey::new(self.status.uid.clone(), slot.0, slot.1).to_string()
    }

    /// The record as last seen, with its revision, for a compare-and-set that needs no read (None when the
    /// revision is unknown). It lacks the prompt task, which the buffer does not keep: only pending and running
    /// records are re-issued from their task, and this serves the buffer's own transitions out of `finished` or
    /// `failure`.
    pub fn known_record(&self) -> Option<(GroupStatus, u64)> {
        if self.revision == 0 {
            return None;
        }
        let mut status = self.status.clone();
        status.trajectory_keys = self.expected.iter().map(|&slot| self.key(slot)).collect();
        Some((status, self.revision))
    }
}

/// Retired groups whose ledger rows the buffer keeps (the most recent ones), for `buffer.ledger` (`jetrl status`'s
/// staleness figures): the whole ledger is in the job's LEDGER stream ([`jetrl_bus::archive`]); the buffer's
/// memory stays bounded however long the run.
pub const RETIRED_KEPT: usize = 16_384;

/// A group out of the working set (evicted, or sampled and released): its ledger row and nothing more, kept for
/// the [`RETIRED_KEPT`] most recent. Each is a few dozen bytes instead of a [`Group`] (its record, its index):
/// `just bench soak` measured the buffer at +1045% RSS over nine minutes while it kept whole groups, and +299%
/// while it kept every retired row.
#[derive(Debug, Clone)]
struct Retired {
    partition: Arc<str>,
    uid: Box<str>,
    state: GroupState,
    submit_step: u64,
    sampled_step: u64,
    eviction: Eviction,
    evicted_reason: Option<Arc<str>>,
    /// trajectories the worker listed
    listed: u32,
    /// KV revision of the record it left with (0: unknown): a copy of that record or an older one is an echo
    revision: u64,
    /// its place in [`BufferState::retired_order`]
    serial: u64,
}

impl Retired {
    fn label(&self) -> &'static str {
        self.state.label()
    }
}

/// Counts of [`BufferState::waiting_view`].
#[derive(Debug, Clone, Default, PartialEq)]
pub struct WaitingView {
    pub complete: usize,
    pub generating: usize,
    pub scoring: usize,
    pub orphan_rewards: usize,
}

/// Group and trajectory index of one buffer.
#[derive(Debug)]
pub struct BufferState {
    /// by `<partition>.<uid>`: the groups of the working set (pending to sampled-and-not-released)
    groups: HashMap<String, Group>,
    /// by `<partition>.<uid>`: the most recent groups that left it ([`RETIRED_KEPT`])
    retired: HashMap<String, Retired>,
    /// keys of `retired` (with their serial) oldest first, to forget the oldest
    retired_order: VecDeque<(String, u64)>,
    retired_serial: u64,
    /// records that left the working set, with their revision, for the caller to archive
    /// ([`Self::take_retired_records`])
    to_archive: Vec<(GroupStatus, u64)>,
    /// keys of the live groups: everything an event or a sample request looks at
    live: HashSet<String>,
    /// retired groups by (partition, state label)
    retired_counts: HashMap<(String, &'static str), u64>,
    /// rewards that arrived before their group record (a reward can overtake the terminal status)
    orphans: HashMap<String, BTreeMap<Slot, IndexedReward>>,
    /// groups named by a release marker before their record was seen (a restart's two replays run side by side)
    released_unseen: HashSet<String>,
    /// interned strings (data sources, metric names)
    strings: HashMap<Box<str>, Arc<str>>,
    /// the newest REWARDS sequence read ([`Self::rewards_read_through`])
    rewards_read: u64,
}

impl Default for BufferState {
    /// The retired rows' table is sized once, for twice [`RETIRED_KEPT`]: rows leave and arrive for ever, and a
    /// hash table whose erased slots run out rehashes in place only while it is at most half full, otherwise it
    /// doubles. Sized for exactly [`RETIRED_KEPT`] it doubled once, minutes into a run, when enough slots had been
    /// erased (`just bench soak` saw a 3.6–4 MiB step in the buffer's RSS at minute 3 or 5, then flat).
    fn default() -> Self {
        Self {
            groups: HashMap::new(),
            retired: HashMap::with_capacity(2 * RETIRED_KEPT),
            retired_order: VecDeque::with_capacity(RETIRED_KEPT + 1),
            retired_serial: 0,
            to_archive: Vec::new(),
            live: HashSet::new(),
            retired_counts: HashMap::new(),
            orphans: HashMap::new(),
            released_unseen: HashSet::new(),
            strings: HashMap::new(),
            rewards_read: 0,
        }
    }
}

fn key(partition: &str, uid: &str) -> String {
    format!("{partition}.{uid}")
}

impl BufferState {
    /// Puts `k` in or out of the live set after its group changed: a group that left the working set is moved to
    /// [`Self::retired`] in its compact form and tallied under its state.
    fn refresh(&mut self, k: &str) {
        let Some(group) = self.groups.get(k) else {
            self.live.remove(k);
            return;
        };
        if group.is_live() {
            if !self.live.contains(k) {
                self.live.insert(k.to_string());
            }
            return;
        }
        self.live.remove(k);
        let Some(group) = self.groups.remove(k) else { return };
        self.to_archive.push((group.status.clone(), group.revision));
        let s = group.status;
        self.retired_serial += 1;
        let retired = Retired {
            partition: self.intern(&s.partition),
            state: s.state(),
            submit_step: s.submit_step,
            sampled_step: s.sampled_step,
            eviction: s.eviction(),
            evicted_reason: (!s.evicted_reason.is_empty()).then(|| self.intern(&s.evicted_reason)),
            listed: group.expected.len() as u32,
            uid: s.uid.into_boxed_str(),
            revision: group.revision,
            serial: self.retired_serial,
        };
        *self.retired_counts.entry((retired.partition.to_string(), retired.label())).or_insert(0) += 1;
        self.retired.insert(k.to_string(), retired);
        self.retired_order.push_back((k.to_string(), self.retired_serial));
        // forget the oldest rows (their tallies stay): the archive has them
        while self.retired_order.len() > RETIRED_KEPT {
            let Some((old, serial)) = self.retired_order.pop_front() else { break };
            if self.retired.get(&old).is_some_and(|r| r.serial == serial) {
                self.retired.remove(&old);
            }
        }
    }

    /// The records that left the working set since the last call, with the KV revision each was last seen at:
    /// the caller archives them ([`jetrl_bus::GroupStore::archive`]).
    pub fn take_retired_records(&mut self) -> Vec<(GroupStatus, u64)> {
        std::mem::take(&mut self.to_archive)
    }

    /// Takes `k` out of the retired groups (its record changed, or was deleted), untallied.
    fn unretire(&mut self, k: &str) -> Option<Retired> {
        let retired = self.retired.remove(k)?;
        Self::untally(&mut self.retired_counts, &retired.partition, retired.label());
        Some(retired)
    }

    fn untally(counts: &mut HashMap<(String, &'static str), u64>, partition: &str, label: &'static str) {
        if let Some(n) = counts.get_mut(&(partition.to_string(), label)) {
            *n = n.saturating_sub(1);
        }
    }

    fn live_groups(&self) -> impl Iterator<Item = &Group> {
        self.live.iter().filter_map(|k| self.groups.get(k))
    }

    /// After a restart's replay: sampled groups whose payloads are gone (listed trajectories, none indexed)
    /// were released before the restart; retire them.
    pub fn retire_replayed_releases(&mut self) {
        // the groups named by a release marker whose record the replay did not bring were archived: none comes now
        self.released_unseen.clear();
        let keys: Vec<String> = self
            .live_groups()
            .filter(|g| g.state() == GroupState::Sampled && g.rewards.is_empty() && !g.expected.is_empty())
            .map(|g| key(&g.status.partition, &g.status.uid))
            .collect();
        for k in keys {
            if let Some(g) = self.groups.get_mut(&k) {
                g.released = true;
            }
            self.refresh(&k);
        }
    }

    fn intern(&mut self, s: &str) -> Arc<str> {
        if let Some(a) = self.strings.get(s) {
            return a.clone();
        }
        let a: Arc<str> = Arc::from(s);
        self.strings.insert(Box::from(s), a.clone());
        a
    }

    /// Applies a record from the GROUPS bucket (initial replay or change) whose revision is not known.
    pub fn apply_group(&mut self, status: GroupStatus) {
        self.apply_group_at(status, 0);
    }

    /// Applies a record from the GROUPS bucket (initial replay or change) at KV `revision`.
    pub fn apply_group_at(&mut self, mut status: GroupStatus, revision: u64) {
        status.task = None;
        let expected: Vec<Slot> = std::mem::take(&mut status.trajectory_keys)
            .iter()
            .filter_map(|k| TrajectoryKey::parse(k).ok().map(|t| (t.session_id, t.index)))
            .collect();
        let k = key(&status.partition, &status.uid);
        // the echo of a record the group retired with (or of an older one): nothing new
        if revision > 0 && self.retired.get(&k).is_some_and(|r| revision <= r.revision) {
            return;
        }
        // a retired group's record again (an eviction's reason amended, a sampled group retracted, a watch
        // started again): it comes back as a group, released if it was, and leaves again below
        let was_released = self.unretire(&k).is_some_and(|r| r.state == GroupState::Sampled);
        let rewards_from = self.rewards_read + 1;
        let group = self.groups.entry(k.clone()).or_insert_with(|| Group { rewards_from, ..Group::default() });
        group.released |= was_released;
        // A re-issued group (back to pending) discards its partial trajectories.
        if status.state() == GroupState::Pending && group.state() != GroupState::Pending {
            group.rewards.clear();
        }
        if !expected.is_empty() || !status.state().is_terminal() {
            group.expected = expected;
        }
        group.status = status;
        group.revision = revision;
        if let Some(orphans) = self.orphans.remove(&group.status.uid) {
            group.rewards.extend(orphans);
        }
        if group.state() == GroupState::Sampled && self.released_unseen.remove(&k) {
            group.released = true;
            group.rewards.clear();
        }
        self.refresh(&k);
    }

    /// A release marker read back from REWARDS: its groups were released (by this buffer before a restart, or
    /// just now). Returns those that were still live, as [`Self::release`] does, so their payloads can be purged;
    /// groups not seen yet are released when their record arrives.
    pub fn apply_release_marker(&mut self, groups: &[String]) -> Vec<(String, String, usize)> {
        let mut out = Vec::new();
        for k in groups {
            if self.retired.contains_key(k) {
                continue;
            }
            match self.groups.get(k).map(Group::state) {
                Some(GroupState::Sampled) => out.extend(self.release_group(k)),
                Some(_) => {}
                None => {
                    // its record comes later in the replay, or never (archived out of GROUPS): either way a reward
                    // copy of it is read by nobody
                    if let Some((_, uid)) = jetrl_wire::subjects::parse_group_key(k) {
                        self.orphans.remove(uid);
                    }
                    self.released_unseen.insert(k.clone());
                }
            }
        }
        out
    }

    /// The lowest REWARDS sequence still needed: an indexed reward's (of a live group or an orphan), or the first
    /// at which a live group still short of rewards may find one. Everything below it may be purged. None when
    /// neither is there.
    pub fn reward_floor(&self) -> Option<u64> {
        let live = self.live_groups().flat_map(|g| g.rewards.values());
        let indexed = live.chain(self.orphans.values().flat_map(BTreeMap::values)).map(|r| r.reward_seq);
        // a live group still short of rewards may own a message the consumer missed (see `Group::rewards_from`)
        let awaited = self.live_groups().filter(|g| g.awaits_rewards()).map(|g| g.rewards_from);
        indexed.chain(awaited).min()
    }

    /// REWARDS has been read through sequence `seq` (groups whose record comes from now on have their rewards
    /// after it).
    pub fn rewards_read_through(&mut self, seq: u64) {
        self.rewards_read = self.rewards_read.max(seq);
    }

    /// The newest REWARDS sequence read (0: none yet).
    pub fn rewards_read(&self) -> u64 {
        self.rewards_read
    }

    /// Forgets orphan rewards (of groups whose record never came) that are all older than REWARDS sequence
    /// `seq`; returns how many were dropped. They would otherwise hold [`Self::reward_floor`] down for ever.
    pub fn drop_orphans_below(&mut self, seq: u64) -> usize {
        let mut dropped = 0;
        self.orphans.retain(|_, rewards| {
            let stale = rewards.values().all(|r| r.reward_seq < seq);
            if stale {
                dropped += rewards.len();
            }
            !stale
        });
        dropped
    }

    /// A deleted group record: forget the group.
    pub fn remove_group(&mut self, partition: &str, uid: &str) {
        let k = key(partition, uid);
        self.groups.remove(&k);
        self.unretire(&k);
        self.live.remove(&k);
    }

    /// Indexes a scored trajectory; false if it was already indexed (a redelivery).
    pub fn apply_reward(&mut self, reward: Reward, reward_seq: u64) -> bool {
        let slot = (reward.session_id, reward.index);
        let entry = IndexedReward {
            traj_seq: reward.traj_seq,
            reward_seq,
            score: reward.score,
            prompt_len: reward.prompt_len,
            response_len: reward.response_len,
            min_version: reward.min_version,
            max_version: reward.max_version,
            data_source: self.intern(&reward.data_source),
            extra: reward.extra.iter().map(|(k, v)| (self.intern(k), *v)).collect(),
            extra_text: reward.extra_text.iter().map(|(k, v)| (self.intern(k), Box::from(v.as_str()))).collect(),
            failure_reason: (!reward.failure_reason.is_empty()).then(|| Box::from(reward.failure_reason.as_str())),
            greedy_baseline: reward.greedy_baseline,
        };
        let k = key(&reward.partition, &reward.uid);
        if self.retired.contains_key(&k) || self.released_unseen.contains(&k) {
            // a late copy for a group that left the working set (trained, or evicted): nothing reads it
            return false;
        }
        let map = match self.groups.get_mut(&k) {
            // a late copy (a score request redelivered after its group was trained on): nothing reads it
            Some(group) if group.released => return false,
            Some(group) => &mut group.rewards,
            None => self.orphans.entry(reward.uid.clone()).or_default(),
        };
        if map.contains_key(&slot) {
            return false;
        }
        map.insert(slot, entry);
        true
    }

    /// A group of the working set (None for one that left it: see [`Self::ledger`]).
    pub fn group(&self, partition: &str, uid: &str) -> Option<&Group> {
        self.groups.get(&key(partition, uid))
    }

    /// The GROUPS revision of the record the buffer has for a group, live or retired (None: not known; 0: known at
    /// an unknown revision).
    pub fn known_revision(&self, partition: &str, uid: &str) -> Option<u64> {
        let k = key(partition, uid);
        self.groups.get(&k).map(|g| g.revision).or_else(|| self.retired.get(&k).map(|r| r.revision))
    }

    /// Whether a record read again from the bucket (at `revision`) tells the buffer something it does not know:
    /// a group it has never seen, or a newer record of one it has.
    pub fn is_news(&self, partition: &str, uid: &str, revision: u64) -> bool {
        self.known_revision(partition, uid).is_none_or(|known| known > 0 && revision > known)
    }

    /// What a waiting request of `partition` waits on, for the logs: groups complete and sampleable, being
    /// generated (pending or running), finished but not every trajectory scored, and rewards whose group the
    /// buffer has not seen.
    pub fn waiting_view(&self, partition: &str) -> WaitingView {
        let mut view =
            WaitingView { orphan_rewards: self.orphans.values().map(BTreeMap::len).sum(), ..Default::default() };
        for g in self.live_groups().filter(|g| g.status.partition == partition) {
            if g.is_complete() {
                view.complete += 1;
            } else if g.state().is_inflight() {
                view.generating += 1;
            } else if g.state().is_terminal() {
                view.scoring += 1;
            }
        }
        view
    }

    /// Marks a group evicted locally (the KV write is done by the caller; `revision` is the one it wrote, 0 if
    /// unknown): it retires with that revision, so its archive purges the record and the write's echo is ignored.
    pub fn mark_evicted(&mut self, partition: &str, uid: &str, eviction: Eviction, detail: &str, revision: u64) {
        let k = key(partition, uid);
        if let Some(group) = self.groups.get_mut(&k) {
            group.status.set_state(GroupState::Evicted);
            group.status.set_eviction(eviction);
            group.status.evicted_reason = detail.to_string();
            if revision > 0 {
                group.revision = revision;
            }
        }
        self.refresh(&k);
    }

    /// Groups of `partition` still being generated or scored: pending, running, or terminal with a listed
    /// trajectory not yet scored.
    pub fn inflight(&self, partition: &str) -> Vec<&Group> {
        self.live_groups()
            .filter(|g| g.status.partition == partition)
            .filter(|g| g.state().is_inflight() || (g.state().is_terminal() && !g.is_complete()))
            .collect()
    }

    /// Marks a group sampled locally (the KV write is done by the caller; `revision` is the one it wrote, 0 if
    /// unknown).
    pub fn mark_sampled(&mut self, partition: &str, uid: &str, step: u64, request_id: &str, revision: u64) {
        if let Some(group) = self.groups.get_mut(&key(partition, uid)) {
            group.status.set_state(GroupState::Sampled);
            group.status.sampled_step = step;
            group.status.sample_request_id = request_id.to_string();
            if revision > 0 {
                group.revision = revision;
            }
        }
    }

    /// Complete terminal groups of `partition`, oldest submission step first (ties by uid, so the
    /// order is deterministic).
    pub fn sampleable(&self, partition: &str) -> Vec<&Group> {
        let mut out: Vec<&Group> =
            self.live_groups().filter(|g| g.status.partition == partition && g.is_complete()).collect();
        out.sort_by(|a, b| {
            a.status.submit_step.cmp(&b.status.submit_step).then_with(|| a.status.uid.cmp(&b.status.uid))
        });
        out
    }

    /// The uids to return for a request of `batch_size` groups, or None if not enough are ready.
    pub fn select(&self, partition: &str, batch_size: usize) -> Option<Vec<String>> {
        let ready = self.sampleable(partition);
        (ready.len() >= batch_size).then(|| ready.iter().take(batch_size).map(|g| g.status.uid.clone()).collect())
    }

    /// Groups already consumed by `request_id` (a retried request after a buffer restart).
    pub fn sampled_by(&self, request_id: &str) -> Vec<&Group> {
        let mut out: Vec<&Group> = self
            .live_groups()
            .filter(|g| g.state() == GroupState::Sampled && g.status.sample_request_id == request_id)
            .collect();
        out.sort_by(|a, b| {
            a.status.submit_step.cmp(&b.status.submit_step).then_with(|| a.status.uid.cmp(&b.status.uid))
        });
        out
    }

    /// The wire form of a selected group: every indexed trajectory, in key order.
    pub fn sampled_group(&self, group: &Group) -> SampledGroup {
        let s = &group.status;
        SampledGroup {
            uid: s.uid.clone(),
            state: s.state,
            submit_step: s.submit_step,
            trajectories: group
                .rewards
                .iter()
                .map(|(&slot, r)| Reward {
                    key: group.key(slot),
                    uid: s.uid.clone(),
                    partition: s.partition.clone(),
                    traj_seq: r.traj_seq,
                    score: r.score,
                    extra: r.extra.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
                    extra_text: r.extra_text.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
                    failure_reason: r.failure_reason.as_deref().unwrap_or_default().to_string(),
                    prompt_len: r.prompt_len,
                    response_len: r.response_len,
                    min_version: r.min_version,
                    max_version: r.max_version,
                    submit_step: s.submit_step,
                    session_id: slot.0,
                    index: slot.1,
                    data_source: r.data_source.to_string(),
                    greedy_baseline: r.greedy_baseline,
                })
                .collect(),
        }
    }

    /// Drops the trajectory index of groups consumed by `request_ids`; returns the released groups as
    /// (partition, uid, trajectories) so the caller can record the release and purge their payloads (one subject
    /// per group).
    pub fn release(&mut self, request_ids: &[String]) -> Vec<(String, String, usize)> {
        let keys: Vec<String> = self
            .live_groups()
            .filter(|g| g.state() == GroupState::Sampled && request_ids.contains(&g.status.sample_request_id))
            .map(|g| key(&g.status.partition, &g.status.uid))
            .collect();
        keys.iter().filter_map(|k| self.release_group(k)).collect()
    }

    /// Releases the group under key `k` unless it is unknown or released already: drops its trajectory index and
    /// retires it. Returns (partition, uid, trajectories released).
    fn release_group(&mut self, k: &str) -> Option<(String, String, usize)> {
        let group = self.groups.get_mut(k).filter(|g| !g.released)?;
        let released = std::mem::take(&mut group.rewards).len();
        group.released = true;
        let out = (group.status.partition.clone(), group.status.uid.clone(), released);
        self.refresh(k);
        Some(out)
    }

    /// Count of groups by state label, for one partition (or all when `partition` is empty).
    pub fn counts(&self, partition: &str) -> BTreeMap<&'static str, u64> {
        let mut out = BTreeMap::new();
        for g in self.live_groups().filter(|g| partition.is_empty() || g.status.partition == partition) {
            *out.entry(g.state().label()).or_insert(0) += 1;
        }
        for ((p, label), n) in &self.retired_counts {
            if *n > 0 && (partition.is_empty() || p == partition) {
                *out.entry(*label).or_insert(0) += n;
            }
        }
        out
    }

    /// Number of indexed trajectories (for the memory-per-trajectory figure).
    pub fn indexed_trajectories(&self) -> usize {
        self.live_groups().map(|g| g.rewards.len()).sum::<usize>()
            + self.orphans.values().map(|m| m.len()).sum::<usize>()
    }

    /// Ledger rows for `uids` (all when empty) of `partition` (all when empty), at most `limit`.
    pub fn ledger(&self, partition: &str, uids: &[String], limit: usize) -> Vec<LedgerEntry> {
        let wanted = |p: &str, uid: &str| {
            (partition.is_empty() || p == partition) && (uids.is_empty() || uids.iter().any(|u| u == uid))
        };
        let live = self.groups.values().filter(|g| wanted(&g.status.partition, &g.status.uid)).map(|g| LedgerEntry {
            uid: g.status.uid.clone(),
            partition: g.status.partition.clone(),
            state: g.status.state,
            submit_step: g.status.submit_step,
            sampled_step: g.status.sampled_step,
            evicted_reason: g.status.evicted_reason.clone(),
            trajectories: g.expected.len() as u32,
            eviction: g.status.eviction,
        });
        let retired = self.retired.values().filter(|r| wanted(&r.partition, &r.uid)).map(|r| LedgerEntry {
            uid: r.uid.to_string(),
            partition: r.partition.to_string(),
            state: r.state as i32,
            submit_step: r.submit_step,
            sampled_step: r.sampled_step,
            evicted_reason: r.evicted_reason.as_deref().unwrap_or_default().to_string(),
            trajectories: r.listed,
            eviction: r.eviction as i32,
        });
        let mut rows: Vec<LedgerEntry> = live.chain(retired).collect();
        rows.sort_by(|a, b| a.submit_step.cmp(&b.submit_step).then_with(|| a.uid.cmp(&b.uid)));
        rows.truncate(limit);
        rows
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(uid: &str, state: GroupState, step: u64, keys: &[&str]) -> GroupStatus {
        let mut s = GroupStatus {
            uid: uid.into(),
            partition: "train".into(),
            submit_step: step,
            n: keys.len() as u32,
            trajectory_keys: keys.iter().map(|k| k.to_string()).collect(),
            ..Default::default()
        };
        s.set_state(state);
        s
    }

    fn reward(uid: &str, key: &str, seq: u64) -> Reward {
        let k = TrajectoryKey::parse(key).unwrap();
        Reward {
            uid: uid.into(),
            key: key.into(),
            partition: "train".into(),
            traj_seq: seq,
            session_id: k.session_id,
            index: k.index,
            ..Default::default()
        }
    }

    #[test]
    fn group_is_sampleable_only_when_terminal_and_every_listed_trajectory_is_scored() {
        let mut s = BufferState::default();
        s.apply_group(status("a", GroupState::Running, 1, &[]));
        s.apply_reward(reward("a", "a_0_0", 1), 1);
        assert!(s.select("train", 1).is_none(), "running group must not be sampled");
        s.apply_group(status("a", GroupState::Finished, 1, &["a_0_0", "a_1_0"]));
        assert!(s.select("train", 1).is_none(), "a listed trajectory is not scored yet");
        s.apply_reward(reward("a", "a_1_0", 2), 2);
        assert_eq!(s.select("train", 1).unwrap(), vec!["a".to_string()]);
    }

    #[test]
    fn the_last_seen_record_comes_back_with_its_revision_and_keys_but_without_its_task() {
        let mut s = BufferState::default();
        let mut record = status("a", GroupState::Finished, 3, &["a_0_0", "a_1_0", "a_1_1"]);
        record.task = Some(jetrl_wire::v1::PromptTask { uid: "a".into(), ..Default::default() });
        s.apply_group(record.clone());
        assert_eq!(s.group("train", "a").unwrap().known_record(), None, "no revision known: read it first");
        s.apply_group_at(record.clone(), 17);
        let (known, revision) = s.group("train", "a").unwrap().known_record().expect("known");
        assert_eq!(revision, 17);
        assert_eq!(known.trajectory_keys, record.trajectory_keys);
        assert_eq!((known.state(), known.submit_step, known.task), (GroupState::Finished, 3, None));
    }

    #[test]
    fn rewards_arriving_before_the_group_record_are_kept() {
        let mut s = BufferState::default();
        assert!(s.apply_reward(reward("a", "a_0_0", 1), 1));
        assert!(!s.apply_reward(reward("a", "a_0_0", 1), 1), "duplicate must be ignored");
        s.apply_group(status("a", GroupState::Finished, 1, &["a_0_0"]));
        assert_eq!(s.select("train", 1).unwrap(), vec!["a".to_string()]);
        assert_eq!(s.indexed_trajectories(), 1);
    }

    #[test]
    fn selection_is_oldest_submission_step_first_and_whole_groups() {
        let mut s = BufferState::default();
        for (uid, step) in [("c", 3), ("a", 1), ("b", 2)] {
            let keys: Vec<String> = (0..4).map(|i| format!("{uid}_{i}_0")).collect();
            let key_refs: Vec<&str> = keys.iter().map(|k| k.as_str()).collect();
            s.apply_group(status(uid, GroupState::Finished, step, &key_refs));
            for (i, k) in keys.iter().enumerate() {
                s.apply_reward(reward(uid, k, i as u64), i as u64);
            }
        }
        assert_eq!(s.select("train", 2).unwrap(), vec!["a".to_string(), "b".to_string()]);
        assert!(s.select("train", 4).is_none());
        let g = s.group("train", "a").unwrap();
        assert_eq!(s.sampled_group(g).trajectories.len(), 4);
    }

    #[test]
    fn a_record_read_again_is_news_only_when_unknown_or_newer_and_the_waiting_view_counts_each_kind() {
        let mut s = BufferState::default();
        assert!(s.is_news("train", "a", 5), "never seen");
        s.apply_group_at(status("a", GroupState::Running, 1, &[]), 5);
        assert!(!s.is_news("train", "a", 5) && !s.is_news("train", "a", 4), "what the buffer has, or older");
        assert!(s.is_news("train", "a", 6), "a newer record (the watch missed it)");
        s.apply_group_at(status("b", GroupState::Finished, 1, &["b_0_0", "b_0_1"]), 7);
        s.apply_reward(reward("b", "b_0_0", 1), 1);
        s.apply_group_at(status("c", GroupState::Finished, 1, &["c_0_0"]), 8);
        s.apply_reward(reward("c", "c_0_0", 2), 2);
        s.apply_reward(reward("z", "z_0_0", 3), 3);
        let view = s.waiting_view("train");
        assert_eq!(view, WaitingView { complete: 1, generating: 1, scoring: 1, orphan_rewards: 1 });
        s.mark_sampled("train", "c", 1, "r1", 9);
        s.release(&["r1".into()]);
        assert_eq!(s.known_revision("train", "c"), Some(9), "a retired group's revision is known");
        assert!(!s.is_news("train", "c", 9) && s.is_news("train", "c", 10));
        s.apply_group(status("d", GroupState::Pending, 1, &[]));
        assert!(!s.is_news("train", "d", 3), "known at no revision: the buffer cannot tell, and keeps what it has");
    }

    #[test]
    fn failed_group_with_no_trajectories_is_still_sampleable_in_sync_mode() {
        let mut s = BufferState::default();
        s.apply_group(status("f", GroupState::Failure, 1, &[]));
        assert_eq!(s.select("train", 1).unwrap(), vec!["f".to_string()]);
    }

    #[test]
    fn sampled_groups_are_not_selected_again_and_are_found_by_request_id() {
        let mut s = BufferState::default();
        s.apply_group(status("a", GroupState::Finished, 1, &[]));
        s.mark_sampled("train", "a", 5, "train-5", 0);
        assert!(s.select("train", 1).is_none());
        assert_eq!(s.sampled_by("train-5").len(), 1);
        assert!(s.sampled_by("train-6").is_empty());
    }

    #[test]
    fn release_returns_payload_sequences_and_drops_the_index_and_a_late_copy_of_a_reward_is_ignored() {
        let mut s = BufferState::default();
        s.apply_group(status("a", GroupState::Finished, 1, &["a_0_0"]));
        s.apply_reward(reward("a", "a_0_0", 11), 21);
        s.mark_sampled("train", "a", 1, "r1", 0);
        assert_eq!(s.release(&["r1".into()]), vec![("train".to_string(), "a".to_string(), 1)]);
        assert_eq!(s.indexed_trajectories(), 0);
        // a score request redelivered after its group was trained on
        assert!(!s.apply_reward(reward("a", "a_0_0", 11), 27));
        assert_eq!((s.indexed_trajectories(), s.reward_floor()), (0, None));
        assert_eq!(s.counts("train").get("sampled"), Some(&1));
    }

    #[test]
    fn reissued_group_discards_partial_trajectories() {
        let mut s = BufferState::default();
        s.apply_group(status("a", GroupState::Running, 1, &[]));
        s.apply_reward(reward("a", "a_0_0", 1), 1);
        s.apply_group(status("a", GroupState::Pending, 4, &[]));
        assert_eq!(s.indexed_trajectories(), 0);
    }

    #[test]
    fn retired_groups_leave_the_working_set_but_stay_in_counts_and_ledger() {
        let mut s = BufferState::default();
        for (uid, step) in [("a", 1), ("b", 1), ("c", 2)] {
            let k = format!("{uid}_0_0");
            s.apply_group(status(uid, GroupState::Finished, step, &[&k]));
            s.apply_reward(reward(uid, &k, step), step);
        }
        s.mark_sampled("train", "a", 1, "r1", 0);
        s.release(&["r1".into()]);
        s.mark_evicted("train", "b", Eviction::OffPolicy, "submission span 3", 0);
        // the KV echo of the buffer's own writes changes nothing
        let mut echo = status("b", GroupState::Evicted, 1, &["b_0_0"]);
        echo.set_eviction(Eviction::OffPolicy);
        echo.evicted_reason = "submission span 3".into();
        s.apply_group(echo);
        assert_eq!(s.live.len(), 1, "only c is live");
        assert_eq!(s.select("train", 1).unwrap(), vec!["c".to_string()]);
        let counts = s.counts("train");
        assert_eq!((counts["sampled"], counts["evicted"], counts["finished"]), (1, 1, 1));
        assert_eq!(s.ledger("train", &[], 10).len(), 3);
        s.remove_group("train", "b");
        assert_eq!(s.counts("train").get("evicted").copied().unwrap_or(0), 0);
        assert_eq!(s.indexed_trajectories(), 1);
    }

    /// A group that leaves the working set keeps only its ledger row; a late reward copy for it is ignored (not
    /// kept as an orphan), and its record coming again (an amended eviction) keeps one row and one tally.
    #[test]
    fn a_retired_group_keeps_only_its_ledger_row() {
        let mut s = BufferState::default();
        s.apply_group(status("a", GroupState::Finished, 1, &["a_0_0", "a_1_0"]));
        s.apply_reward(reward("a", "a_0_0", 1), 1);
        s.apply_reward(reward("a", "a_1_0", 1), 2);
        s.mark_sampled("train", "a", 1, "r1", 0);
        assert_eq!(s.release(&["r1".into()]).len(), 1);
        assert!(s.groups.is_empty() && s.retired.contains_key("train.a"));
        assert!(s.group("train", "a").is_none(), "not part of the working set");
        assert!(!s.apply_reward(reward("a", "a_0_0", 1), 3), "a late copy is ignored");
        assert!(s.orphans.is_empty());
        let row = &s.ledger("train", &["a".into()], 10)[0];
        assert_eq!((row.state(), row.sampled_step, row.trajectories), (GroupState::Sampled, 1, 2));
        // a resume rolls the training back: the record comes again, evicted with a reason
        let mut retracted = status("a", GroupState::Evicted, 1, &["a_0_0", "a_1_0"]);
        retracted.set_eviction(Eviction::RolledBack);
        retracted.evicted_reason = "trained at step 1 after the checkpoint of step 0".into();
        s.apply_group(retracted);
        assert!(s.groups.is_empty() && s.live.is_empty());
        let counts = s.counts("train");
        assert_eq!((counts.get("sampled").copied().unwrap_or(0), counts["evicted"]), (0, 1));
        let rows = s.ledger("train", &[], 10);
        assert_eq!(rows.len(), 1);
        assert_eq!((rows[0].state(), rows[0].eviction()), (GroupState::Evicted, Eviction::RolledBack));
        assert_eq!(rows[0].evicted_reason, "trained at step 1 after the checkpoint of step 0");
        assert!(s.apply_release_marker(&["train.a".into()]).is_empty(), "a marker for it changes nothing");
    }

    /// Rows retire for ever: the retired table keeps the newest [`RETIRED_KEPT`] and never reallocates (sized
    /// for exactly that many it doubled once its erased slots ran out, a step in the buffer's memory minutes in).
    #[test]
    fn retired_rows_churn_without_the_table_ever_growing() {
        let mut s = BufferState::default();
        let (table, order) = (s.retired.capacity(), s.retired_order.capacity());
        // sized for exactly RETIRED_KEPT, the table doubled after ~150,000 rows
        let rows = 12 * RETIRED_KEPT;
        for i in 0..rows {
            let uid = format!("g{i}");
            s.apply_group(status(&uid, GroupState::Evicted, 1, &[]));
            // `capacity()` is rows + free slots: erased slots lower it until the table rehashes; a doubling raises it
            assert!(s.retired.capacity() <= table, "the retired table grew after {i} rows");
        }
        assert_eq!((s.retired.len(), s.retired_order.len()), (RETIRED_KEPT, RETIRED_KEPT));
        assert_eq!(s.retired_order.capacity(), order);
        assert_eq!(s.counts("train")["evicted"], rows as u64, "every row is tallied");
        assert!(s.retired.contains_key(&format!("train.g{}", rows - 1)));
        assert!(!s.retired.contains_key("train.g0"), "the oldest are forgotten");
    }

    #[test]
    fn the_reward_floor_is_the_oldest_reward_a_live_group_or_orphan_still_needs() {
        let mut s = BufferState::default();
        assert_eq!(s.reward_floor(), None);
        s.apply_group(status("a", GroupState::Finished, 1, &["a_0_0", "a_1_0"]));
        s.apply_group(status("b", GroupState::Finished, 1, &["b_0_0"]));
        s.apply_reward(reward("a", "a_0_0", 1), 10);
        s.apply_reward(reward("a", "a_1_0", 2), 12);
        s.apply_reward(reward("b", "b_0_0", 3), 11);
        assert_eq!(s.reward_floor(), Some(10));
        s.mark_sampled("train", "a", 1, "r1", 0);
        assert_eq!(s.reward_floor(), Some(10), "sampled and not released: a retried request needs it");
        s.release(&["r1".into()]);
        assert_eq!(s.reward_floor(), Some(11));
        s.apply_reward(reward("x", "x_0_0", 4), 9);
        assert_eq!(s.reward_floor(), Some(9), "an orphan may still get its record");
        assert_eq!(s.drop_orphans_below(9), 0);
        assert_eq!(s.drop_orphans_below(10), 1);
        assert_eq!(s.reward_floor(), Some(11));
    }

    #[test]
    fn a_group_short_of_rewards_holds_the_floor_where_its_rewards_may_start() {
        let mut s = BufferState::default();
        s.rewards_read_through(20);
        s.apply_group(status("a", GroupState::Running, 1, &[]));
        s.rewards_read_through(24);
        s.apply_group(status("b", GroupState::Finished, 1, &["b_0_0"]));
        s.apply_reward(reward("b", "b_0_0", 1), 25);
        s.rewards_read_through(25);
        // a's reward may be anywhere after 20, the one a lost delivery would leave out included
        assert_eq!(s.reward_floor(), Some(21));
        s.apply_group(status("a", GroupState::Finished, 1, &["a_0_0", "a_1_0"]));
        s.apply_reward(reward("a", "a_0_0", 2), 30);
        assert_eq!(s.reward_floor(), Some(21), "terminal and one reward short");
        s.apply_reward(reward("a", "a_1_0", 3), 31);
        assert_eq!(s.reward_floor(), Some(25), "complete: its indexed rewards hold it");
        s.mark_sampled("train", "b", 1, "r1", 0);
        s.release(&["r1".into()]);
        assert_eq!(s.reward_floor(), Some(30));
    }

    #[test]
    fn a_release_marker_retires_its_groups_whether_their_records_come_before_or_after_it() {
        let mut s = BufferState::default();
        // record first (sampled, its left-over reward replayed), then the marker
        s.apply_group(status("a", GroupState::Sampled, 1, &["a_0_0"]));
        s.apply_reward(reward("a", "a_0_0", 1), 3);
        // marker first: the record and the reward of `b` arrive after it
        let released = s.apply_release_marker(&["train.a".into(), "train.b".into()]);
        assert_eq!(released, vec![("train".to_string(), "a".to_string(), 1)]);
        s.apply_reward(reward("b", "b_0_0", 2), 4);
        s.apply_group(status("b", GroupState::Sampled, 1, &["b_0_0"]));
        // a group sampled and not released is untouched
        s.apply_group(status("c", GroupState::Sampled, 2, &["c_0_0"]));
        s.apply_reward(reward("c", "c_0_0", 5), 5);
        assert!(s.apply_release_marker(&["train.a".into()]).is_empty(), "a marker read twice changes nothing");
        assert_eq!(s.live.iter().collect::<Vec<_>>(), vec!["train.c"]);
        assert_eq!((s.indexed_trajectories(), s.reward_floor()), (1, Some(5)));
        assert_eq!(s.counts("train")["sampled"], 3);
    }

    #[test]
    fn after_a_restart_sampled_groups_without_payloads_are_retired() {
        let mut s = BufferState::default();
        // released before the restart: record says sampled, rewards purged
        s.apply_group(status("old", GroupState::Sampled, 1, &["old_0_0"]));
        // sampled but not yet released: its reward is still in the stream
        s.apply_group(status("cur", GroupState::Sampled, 2, &["cur_0_0"]));
        s.apply_reward(reward("cur", "cur_0_0", 5), 6);
        s.retire_replayed_releases();
        assert!(s.live.contains("train.cur") && !s.live.contains("train.old"));
        assert_eq!(s.counts("train")["sampled"], 2);
    }
}
