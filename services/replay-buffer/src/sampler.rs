//! The sampling policy: verl V1's `ReplayBuffer.sample` (sync) and `ReplayBufferAsync.sample` (async
//! modes), as a pure function of the buffer's state — no I/O, no clock.
//!
//! verl runs its policy in a loop that re-reads a TransferQueue snapshot every 2 s. Here the service calls
//! [`next_action`] whenever an input changes (a group record, a reward, a new or retried request) and carries
//! out what it returns: evict groups (then ask again), ask the trainer for refills, answer, or keep waiting.
//! One call is one iteration of verl's loop body, so the decisions — and the metrics — are verl's.

use std::collections::BTreeMap;

use jetrl_wire::v1::{Eviction, GroupState, SampleRequest};

use crate::state::{BufferState, Group};

/// Which of verl's two buffers to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// `ReplayBuffer`: bufferless, one batch per step; staleness settings are no-ops.
    Sync,
    /// `ReplayBufferAsync` (colocate_async, separate_async).
    Async,
}

/// `buffer.max_off_policy_strategy`: `Drop` evicts finished groups with span > threshold and refills as many;
/// `Wait` never evicts and blocks while an in-flight group has span ≥ threshold.
pub use jetrl_config::OffPolicyStrategy as Strategy;

/// The buffer's sampling settings (verl `trainer.v1.sampler.*`, `algorithm.filter_groups.*`).
#[derive(Debug, Clone)]
pub struct SamplerConfig {
    pub mode: Mode,
    pub max_off_policy_threshold: u64,
    pub strategy: Strategy,
    /// DAPO dynamic sampling: the reward metric whose zero spread filters a group
    pub filter_metric: Option<String>,
    pub sync_refill_failed_groups: bool,
    /// sync DAPO: pending + running stay within `max_inflight_gen_batches × train_batch_size`
    pub max_inflight: u64,
    /// DAPO: a request's prompts (its batch and the refills granted for it) stay within this many batches; a
    /// batch still short once no more may be generated fails the request (verl's DAPO `max_num_gen_batches`);
    /// 0 = no cap
    pub max_gen_batches: u64,
}

impl SamplerConfig {
    pub fn from_job(cfg: &jetrl_config::JobConfig) -> Self {
        let fg = &cfg.algorithm.filter_groups;
        Self {
            mode: if cfg.trainer.mode.is_async() { Mode::Async } else { Mode::Sync },
            max_off_policy_threshold: cfg.buffer.max_off_policy_threshold,
            strategy: cfg.buffer.max_off_policy_strategy,
            filter_metric: if fg.enable { fg.metric.clone() } else { None },
            sync_refill_failed_groups: cfg.buffer.sync_refill_failed_groups,
            max_inflight: u64::from(fg.max_inflight_gen_batches.max(1)) * u64::from(cfg.data.train_batch_size),
            max_gen_batches: u64::from(fg.max_num_gen_batches),
        }
    }
}

/// Why a group left the buffer without being trained on.
#[derive(Debug, Clone, PartialEq)]
pub enum EvictReason {
    /// async `drop`: span = step − submit_step + 1 > threshold
    OffPolicy { span: u64 },
    /// DAPO: more than one value of the metric and zero spread
    FilterGroups,
    /// async: any failure; sync with `sync_refill_failed_groups`: a failure without trajectories
    RolloutFailure,
    /// sync DAPO: complete groups left over once the batch is full
    DiscardedSurplus,
}

impl EvictReason {
    /// The group record's `eviction`.
    pub fn eviction(&self) -> Eviction {
        match self {
            EvictReason::OffPolicy { .. } => Eviction::OffPolicy,
            EvictReason::FilterGroups => Eviction::FilterGroups,
            EvictReason::RolloutFailure => Eviction::RolloutFailure,
            EvictReason::DiscardedSurplus => Eviction::DiscardedSurplus,
        }
    }

    /// The group record's `evicted_reason` (the detail beside the eviction).
    pub fn detail(&self) -> String {
        match self {
            EvictReason::OffPolicy { span } => format!("submission span {span}"),
            _ => String::new(),
        }
    }

    pub fn label(&self) -> &'static str {
        self.eviction().label()
    }
}

/// What the service should do next for one waiting request.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// mark these groups evicted, then call [`next_action`] again
    Evict(Vec<(String, EvictReason)>),
    /// ask the trainer for this many new prompts (then wait for it to ask again)
    Refill(u32),
    /// return these groups (oldest submission first); evict `discard` as surplus first
    Answer { selected: Vec<String>, discard: Vec<String> },
    /// nothing to do until an input changes
    Wait,
    /// the request cannot be answered
    Fail(String),
}

/// Per-request memory between iterations (verl keeps these in the locals of its sample loop).
#[derive(Debug, Default, Clone)]
pub struct Progress {
    /// sync DAPO refill credit not yet dispatched
    credit: u64,
    /// sync DAPO: the batch is full; stop dispatching, wait for in-flight work, then select
    draining: bool,
    /// async DAPO: refills the `max_num_gen_batches` cap withheld
    withheld: u64,
    /// refills granted to the trainer for this request so far
    pub granted: u64,
    /// what the last eviction removed (consumed by the next iteration's credit logic)
    last_evicted_filter: u64,
    last_evicted_failed: u64,
    last_evicted_total: u64,
    /// verl-named metrics accumulated over the iterations
    evicted: BTreeMap<&'static str, u64>,
    staleness: Vec<u64>,
}

impl Progress {
    /// Records an eviction the service carried out.
    pub fn record_eviction(&mut self, evicted: &[(String, EvictReason)]) {
        self.last_evicted_filter = evicted.iter().filter(|(_, r)| *r == EvictReason::FilterGroups).count() as u64;
        self.last_evicted_failed = evicted.iter().filter(|(_, r)| *r == EvictReason::RolloutFailure).count() as u64;
        self.last_evicted_total = evicted.iter().filter(|(_, r)| *r != EvictReason::DiscardedSurplus).count() as u64;
        for (_, reason) in evicted {
            *self.evicted.entry(reason.label()).or_insert(0) += 1;
            if let EvictReason::OffPolicy { span } = reason {
                self.staleness.push(*span);
            }
        }
    }

    /// Records refills granted to the trainer.
    pub fn record_refill(&mut self, n: u32) {
        self.granted += u64::from(n);
    }

    /// verl's metric names under `prefix` (`training` or `validation`); empty when nothing was evicted, as
    /// verl's (its tests check `metrics == {}`).
    pub fn metrics(&self, prefix: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        let count = |label: &str| self.evicted.get(label).copied().unwrap_or(0) as f64;
        if count("off_policy") > 0.0 {
            out.insert(format!("{prefix}/off_policy/evicted_samples"), count("off_policy"));
            let n = self.staleness.len().max(1) as f64;
            out.insert(
                format!("{prefix}/off_policy/evicted_samples_staleness/mean"),
                self.staleness.iter().sum::<u64>() as f64 / n,
            );
            out.insert(
                format!("{prefix}/off_policy/evicted_samples_staleness/max"),
                self.staleness.iter().copied().max().unwrap_or(0) as f64,
            );
            out.insert(
                format!("{prefix}/off_policy/evicted_samples_staleness/min"),
                self.staleness.iter().copied().min().unwrap_or(0) as f64,
            );
        }
        if count("filter_groups") > 0.0 {
            out.insert(format!("{prefix}/filter_groups/evicted_samples"), count("filter_groups"));
        }
        if count("discarded_surplus") > 0.0 {
            out.insert(format!("{prefix}/filter_groups/discarded_surplus_samples"), count("discarded_surplus"));
        }
        if count("rollout_failure") > 0.0 {
            out.insert(format!("{prefix}/rollout_failure/evicted_samples"), count("rollout_failure"));
        }
        out
    }
}

fn span(step: u64, submit_step: u64) -> u64 {
    (step + 1).saturating_sub(submit_step)
}

/// The DAPO verdict on a complete finished group: `Ok(true)` = filter it (more than one value, zero spread). A
/// remax group's greedy baseline is not one of its samples and takes no part.
fn dapo_filtered(group: &Group, metric: &str) -> Result<bool, String> {
    let mut values = Vec::with_capacity(group.rewards.len());
    for (&slot, r) in group.rewards.iter().filter(|(_, r)| !r.greedy_baseline) {
        let value = match metric {
            "score" | "seq_reward" | "seq_final_reward" => Some(r.score),
            other => r.extra(other),
        };
        match value {
            Some(v) => values.push(v),
            None => {
                return Err(format!(
                    "algorithm.filter_groups.metric {metric:?} is missing from the reward of trajectory {} \
                     (reward extras: {:?})",
                    group.key(slot),
                    r.extra_names()
                ));
            }
        }
    }
    if values.is_empty() {
        return Err(format!("finished group {} has no trajectories to filter on", group.status.uid));
    }
    if values.len() <= 1 {
        return Ok(false);
    }
    let mean = values.iter().sum::<f64>() / values.len() as f64;
    let var = values.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / values.len() as f64;
    Ok(var == 0.0)
}

/// One iteration of verl's sample loop for `request`.
pub fn next_action(
    state: &BufferState,
    cfg: &SamplerConfig,
    request: &SampleRequest,
    progress: &mut Progress,
) -> Action {
    let partition = request.partition.as_str();
    let step = request.step;
    let batch = request.batch_size as usize;
    // A refill the trainer has not confirmed yet (a lost reply): grant the difference again, never more.
    let owed = progress.granted.saturating_sub(u64::from(request.refilled));
    if owed > 0 {
        return Action::Refill(owed as u32);
    }
    let validation = partition == "val";
    let dapo = if validation { None } else { cfg.filter_metric.as_deref() };
    // eviction reasons, from this one view of the state
    let mut evict: Vec<(String, EvictReason)> = Vec::new();
    if !validation {
        for g in state.sampleable(partition) {
            let uid = g.status.uid.clone();
            let s = span(step, g.status.submit_step);
            if cfg.mode == Mode::Async
                && cfg.strategy == Strategy::Drop
                && g.state() == GroupState::Finished
                && s > cfg.max_off_policy_threshold
            {
                evict.push((uid, EvictReason::OffPolicy { span: s }));
                continue;
            }
            if let (Some(metric), GroupState::Finished) = (dapo, g.state()) {
                match dapo_filtered(g, metric) {
                    Ok(true) => {
                        evict.push((uid, EvictReason::FilterGroups));
                        continue;
                    }
                    Ok(false) => {}
                    Err(message) => return Action::Fail(message),
                }
            }
            if g.state() == GroupState::Failure {
                let evict_failed = match cfg.mode {
                    Mode::Async => true,
                    Mode::Sync => cfg.sync_refill_failed_groups && g.expected.is_empty(),
                };
                if evict_failed {
                    evict.push((uid, EvictReason::RolloutFailure));
                }
            }
        }
    }
    if !evict.is_empty() {
        return Action::Evict(evict);
    }
    let filtered = std::mem::take(&mut progress.last_evicted_filter);
    let failed = std::mem::take(&mut progress.last_evicted_failed);

    let sampleable = state.sampleable(partition);
    let inflight = state.inflight(partition);
    let enough = sampleable.len() >= batch;
    // DAPO's cap: prompts this request may still have refilled (None: no cap)
    let generated = batch as u64 + progress.granted;
    let gen_room = (dapo.is_some() && cfg.max_gen_batches > 0)
        .then(|| (cfg.max_gen_batches * batch as u64).saturating_sub(generated));
    let capped = |wanted: u64| gen_room.map_or(wanted, |room| wanted.min(room));
    // the cap is reached, more groups are wanted, and nothing in flight can fill the batch
    let exhausted = |wanted: u64| gen_room == Some(0) && wanted > 0 && !enough && inflight.is_empty();
    let exhausted_error = || {
        Action::Fail(format!(
            "algorithm.filter_groups.max_num_gen_batches = {}: step {step} generated {generated} prompts ({} \
             batches of {batch}) and has {} of the {batch} groups with a spread in `{}` it needs; the data may be \
             too hard (or too easy) for the policy; set max_num_gen_batches=0 to generate until the batch is full",
            cfg.max_gen_batches,
            cfg.max_gen_batches,
            sampleable.len(),
            dapo.unwrap_or_default(),
        ))
    };

    match cfg.mode {
        Mode::Async => {
            // evict k -> refill k, whatever the reason (within DAPO's cap)
            let wanted = std::mem::take(&mut progress.last_evicted_total);
            let refill = capped(wanted);
            progress.withheld += wanted - refill;
            if refill > 0 {
                return Action::Refill(refill as u32);
            }
            if exhausted(progress.withheld) {
                return exhausted_error();
            }
            if cfg.strategy == Strategy::Wait && !validation {
                let blocked = inflight.iter().any(|g| span(step, g.status.submit_step) >= cfg.max_off_policy_threshold);
                if blocked {
                    return Action::Wait;
                }
            }
            if enough {
                return answer(state, partition, batch, Vec::new(), validation);
            }
            Action::Wait
        }
        Mode::Sync => {
            progress.last_evicted_total = 0;
            if dapo.is_none() && failed > 0 && !enough {
                return Action::Refill(failed as u32);
            }
            if dapo.is_some() {
                if enough {
                    progress.draining = true;
                    progress.credit = 0;
                } else if !progress.draining {
                    progress.credit += 2 * filtered + failed;
                }
                if !progress.draining && progress.credit > 0 {
                    let room = cfg.max_inflight.saturating_sub(inflight.len() as u64);
                    let n = capped(progress.credit.min(room));
                    if n > 0 {
                        progress.credit -= n;
                        return Action::Refill(n as u32);
                    }
                    if exhausted(progress.credit) {
                        return exhausted_error();
                    }
                }
            }
            if enough && (dapo.is_none() || inflight.is_empty()) {
                let discard = if dapo.is_some() {
                    sampleable.iter().skip(batch).map(|g| g.status.uid.clone()).collect()
                } else {
                    Vec::new()
                };
                return answer(state, partition, batch, discard, validation);
            }
            Action::Wait
        }
    }
}

fn answer(state: &BufferState, partition: &str, batch: usize, discard: Vec<String>, validation: bool) -> Action {
    let sampleable = state.sampleable(partition);
    let selected: Vec<&Group> = sampleable.into_iter().take(batch).collect();
    if !validation && batch > 0 && selected.iter().all(|g| g.rewards.is_empty()) {
        return Action::Fail(format!(
            "every one of the {} groups selected for partition {partition:?} is a failed group without trajectories; \
             set buffer.sync_refill_failed_groups=true to refill them",
            selected.len()
        ));
    }
    Action::Answer { selected: selected.iter().map(|g| g.status.uid.clone()).collect(), discard }
}

#[cfg(test)]
mod tests {
    use super::*;
    use jetrl_wire::v1::{GroupStatus, Reward};

    /// A buffer state built group by group, the way records and rewards arrive.
    struct World {
        state: BufferState,
        seq: u64,
    }

    impl World {
        fn new() -> Self {
            Self { state: BufferState::default(), seq: 0 }
        }

        /// A group of `scores.len()` scored trajectories in `state` submitted at `step`.
        fn group(&mut self, uid: &str, state: GroupState, step: u64, scores: &[f64]) {
            self.group_with_baseline(uid, state, step, scores, None);
        }

        /// [`Self::group`], plus a remax greedy baseline scored `baseline` (session `scores.len()`) when given.
        fn group_with_baseline(
            &mut self,
            uid: &str,
            state: GroupState,
            step: u64,
            scores: &[f64],
            baseline: Option<f64>,
        ) {
            let all: Vec<f64> = scores.iter().copied().chain(baseline).collect();
            let keys: Vec<String> = (0..all.len()).map(|i| format!("{uid}_{i}_0")).collect();
            let mut s = GroupStatus {
                uid: uid.into(),
                partition: "train".into(),
                submit_step: step,
                n: scores.len() as u32,
                trajectory_keys: if state.is_terminal() { keys.clone() } else { vec![] },
                ..Default::default()
            };
            s.set_state(state);
            self.state.apply_group(s);
            if state.is_terminal() {
                for (session, (k, &score)) in keys.iter().zip(&all).enumerate() {
                    self.seq += 1;
                    let mut r = Reward {
                        session_id: session as u32,
                        key: k.clone(),
                        uid: uid.into(),
                        partition: "train".into(),
                        score,
                        traj_seq: self.seq,
                        greedy_baseline: session == scores.len(),
                        ..Default::default()
                    };
                    r.extra.insert("acc".into(), score);
                    self.state.apply_reward(r, self.seq);
                }
            }
        }

        /// Runs the policy as the service does: evictions applied at once; returns the final action and the
        /// uids evicted on the way.
        fn run(
            &mut self,
            cfg: &SamplerConfig,
            req: &SampleRequest,
            progress: &mut Progress,
        ) -> (Action, Vec<(String, EvictReason)>) {
            let mut evicted = Vec::new();
            loop {
                match next_action(&self.state, cfg, req, progress) {
                    Action::Evict(list) => {
                        for (uid, reason) in &list {
                            self.state.mark_evicted("train", uid, reason.eviction(), &reason.detail(), 0);
                        }
                        progress.record_eviction(&list);
                        evicted.extend(list);
                    }
                    Action::Answer { selected, discard } => {
                        let list: Vec<_> = discard.iter().map(|u| (u.clone(), EvictReason::DiscardedSurplus)).collect();
                        for uid in &discard {
                            self.state.mark_evicted("train", uid, Eviction::DiscardedSurplus, "", 0);
                        }
                        progress.record_eviction(&list);
                        evicted.extend(list);
                        for uid in &selected {
                            self.state.mark_sampled("train", uid, req.step, &req.request_id, 0);
                        }
                        return (Action::Answer { selected, discard }, evicted);
                    }
                    other => return (other, evicted),
                }
            }
        }
    }

    fn sync() -> SamplerConfig {
        SamplerConfig {
            mode: Mode::Sync,
            max_off_policy_threshold: 8,
            strategy: Strategy::Drop,
            filter_metric: None,
            sync_refill_failed_groups: false,
            max_inflight: 1000,
            max_gen_batches: 0,
        }
    }

    fn asynchronous(strategy: Strategy, threshold: u64) -> SamplerConfig {
        SamplerConfig { mode: Mode::Async, strategy, max_off_policy_threshold: threshold, ..sync() }
    }

    fn req(step: u64, batch: u32) -> SampleRequest {
        SampleRequest {
            request_id: format!("r{step}"),
            step,
            partition: "train".into(),
            batch_size: batch,
            ..Default::default()
        }
    }

    fn selected(action: &Action) -> Vec<String> {
        match action {
            Action::Answer { selected, .. } => selected.clone(),
            other => panic!("expected an answer, got {other:?}"),
        }
    }

    #[test]
    fn only_terminal_groups_are_returned_and_running_ones_stay() {
        let mut w = World::new();
        w.group("a", GroupState::Finished, 1, &[1.0, 0.0]);
        w.group("b", GroupState::Running, 1, &[]);
        let (action, _) = w.run(&sync(), &req(1, 1), &mut Progress::default());
        assert_eq!(selected(&action), vec!["a"]);
        assert_eq!(w.state.group("train", "b").unwrap().state(), GroupState::Running);
        assert_eq!(w.state.group("train", "a").unwrap().state(), GroupState::Sampled);
    }

    #[test]
    fn sampling_waits_until_batch_size_groups_are_complete() {
        let mut w = World::new();
        w.group("a", GroupState::Finished, 1, &[1.0]);
        w.group("b", GroupState::Pending, 1, &[]);
        let mut p = Progress::default();
        assert_eq!(w.run(&sync(), &req(1, 2), &mut p).0, Action::Wait);
        w.group("b", GroupState::Finished, 1, &[0.0]);
        assert_eq!(selected(&w.run(&sync(), &req(1, 2), &mut p).0).len(), 2);
    }

    #[test]
    fn oldest_submission_step_first() {
        let mut w = World::new();
        w.group("late", GroupState::Finished, 5, &[1.0]);
        w.group("early", GroupState::Finished, 2, &[1.0]);
        w.group("mid", GroupState::Finished, 3, &[1.0]);
        assert_eq!(selected(&w.run(&sync(), &req(5, 2), &mut Progress::default()).0), vec!["early", "mid"]);
    }

    #[test]
    fn whole_groups_are_returned() {
        let mut w = World::new();
        for uid in ["a", "b", "c"] {
            w.group(uid, GroupState::Finished, 1, &[0.0, 1.0, 0.0, 1.0]);
        }
        let picked = selected(&w.run(&sync(), &req(1, 3), &mut Progress::default()).0);
        let rows: usize = picked.iter().map(|u| w.state.group("train", u).unwrap().rewards.len()).sum();
        assert_eq!(rows, 12);
    }

    #[test]
    fn empty_failed_group_counts_toward_the_batch_in_sync_mode_without_metrics() {
        let mut w = World::new();
        w.group("ok", GroupState::Finished, 1, &[1.0]);
        w.group("failed", GroupState::Failure, 1, &[]);
        let mut p = Progress::default();
        let picked = selected(&w.run(&sync(), &req(1, 2), &mut p).0);
        assert_eq!(picked.len(), 2);
        assert!(p.metrics("training").is_empty());
    }

    #[test]
    fn a_batch_of_only_empty_failed_groups_is_an_error_naming_the_switch() {
        let mut w = World::new();
        w.group("f1", GroupState::Failure, 1, &[]);
        w.group("f2", GroupState::Failure, 1, &[]);
        match w.run(&sync(), &req(1, 2), &mut Progress::default()).0 {
            Action::Fail(message) => assert!(message.contains("sync_refill_failed_groups"), "{message}"),
            other => panic!("expected a failure, got {other:?}"),
        }
    }

    #[test]
    fn sync_refill_failed_groups_evicts_empty_failures_and_refills_them() {
        let mut w = World::new();
        let cfg = SamplerConfig { sync_refill_failed_groups: true, ..sync() };
        w.group("ok", GroupState::Finished, 1, &[1.0]);
        w.group("empty", GroupState::Failure, 1, &[]);
        w.group("partial", GroupState::Failure, 1, &[0.5]);
        let mut p = Progress::default();
        let (action, evicted) = w.run(&cfg, &req(1, 3), &mut p);
        assert_eq!(action, Action::Refill(1));
        assert_eq!(evicted, vec![("empty".to_string(), EvictReason::RolloutFailure)]);
        // the service grants it; the trainer submits one replacement and asks again
        p.record_refill(1);
        let mut again = req(1, 3);
        again.refilled = 1;
        w.group("new", GroupState::Pending, 1, &[]);
        assert_eq!(w.run(&cfg, &again, &mut p).0, Action::Wait);
        w.group("new", GroupState::Finished, 1, &[0.0]);
        let picked = selected(&w.run(&cfg, &again, &mut p).0);
        assert_eq!(picked.len(), 3);
        assert!(!picked.contains(&"empty".to_string()));
        assert_eq!(p.metrics("training").get("training/rollout_failure/evicted_samples"), Some(&1.0));
    }

    #[test]
    fn a_lost_refill_reply_is_granted_again_never_twice() {
        let mut w = World::new();
        let cfg = asynchronous(Strategy::Drop, 2);
        w.group("stale", GroupState::Finished, 1, &[1.0]);
        let mut p = Progress::default();
        assert_eq!(w.run(&cfg, &req(5, 1), &mut p).0, Action::Refill(1));
        p.record_refill(1);
        // the reply was lost: the trainer asks again having refilled nothing
        assert_eq!(w.run(&cfg, &req(5, 1), &mut p).0, Action::Refill(1));
        // it refilled: no further refill
        let mut done = req(5, 1);
        done.refilled = 1;
        assert_eq!(w.run(&cfg, &done, &mut p).0, Action::Wait);
    }

    #[test]
    fn drop_keeps_span_equal_to_the_threshold_and_refills_exactly_what_it_evicts() {
        let mut w = World::new();
        let cfg = asynchronous(Strategy::Drop, 3);
        // at step 5: span = 5 - submit + 1; submit 3 -> span 3 (kept), submit 2 -> span 4 (dropped)
        w.group("kept", GroupState::Finished, 3, &[1.0]);
        w.group("dropped1", GroupState::Finished, 2, &[1.0]);
        w.group("dropped2", GroupState::Finished, 1, &[1.0]);
        let mut p = Progress::default();
        let (action, evicted) = w.run(&cfg, &req(5, 1), &mut p);
        assert_eq!(action, Action::Refill(2));
        let uids: Vec<&str> = evicted.iter().map(|(u, _)| u.as_str()).collect();
        assert_eq!(uids, vec!["dropped2", "dropped1"]);
        let m = p.metrics("training");
        assert_eq!(m["training/off_policy/evicted_samples"], 2.0);
        assert_eq!(m["training/off_policy/evicted_samples_staleness/max"], 5.0);
        assert_eq!(m["training/off_policy/evicted_samples_staleness/min"], 4.0);
        p.record_refill(2);
        let mut again = req(5, 1);
        again.refilled = 2;
        assert_eq!(selected(&w.run(&cfg, &again, &mut p).0), vec!["kept"]);
    }

    #[test]
    fn sync_mode_ignores_staleness() {
        let mut w = World::new();
        w.group("old", GroupState::Finished, 1, &[1.0]);
        assert_eq!(selected(&w.run(&sync(), &req(100, 1), &mut Progress::default()).0), vec!["old"]);
    }

    #[test]
    fn wait_blocks_on_stale_inflight_groups_and_keeps_stale_terminal_ones() {
        let mut w = World::new();
        let cfg = asynchronous(Strategy::Wait, 3);
        w.group("stale-done", GroupState::Finished, 1, &[1.0]);
        w.group("stale-running", GroupState::Running, 3, &[]);
        // step 5: running span 3 >= 3 blocks sampling
        assert_eq!(w.run(&cfg, &req(5, 1), &mut Progress::default()).0, Action::Wait);
        w.group("stale-running", GroupState::Finished, 3, &[0.0]);
        // never dropped: the very stale terminal group is returned, oldest first
        assert_eq!(selected(&w.run(&cfg, &req(5, 1), &mut Progress::default()).0), vec!["stale-done"]);
    }

    #[test]
    fn async_failures_are_evicted_and_refilled_one_for_one() {
        let mut w = World::new();
        let cfg = asynchronous(Strategy::Drop, 8);
        w.group("f", GroupState::Failure, 1, &[1.0]);
        w.group("ok", GroupState::Finished, 1, &[1.0]);
        let mut p = Progress::default();
        let (action, evicted) = w.run(&cfg, &req(1, 1), &mut p);
        assert_eq!(action, Action::Refill(1));
        assert_eq!(evicted[0].1, EvictReason::RolloutFailure);
    }

    #[test]
    fn async_over_production_drains_in_batches_without_duplicates() {
        let mut w = World::new();
        let cfg = asynchronous(Strategy::Drop, 8);
        for i in 0..10 {
            w.group(&format!("g{i}"), GroupState::Finished, 1, &[f64::from(i)]);
        }
        let mut seen = std::collections::HashSet::new();
        for step in 1..=3 {
            let mut r = req(step, 3);
            r.request_id = format!("s{step}");
            for uid in selected(&w.run(&cfg, &r, &mut Progress::default()).0) {
                assert!(seen.insert(uid), "a group was returned twice");
            }
        }
        assert_eq!(seen.len(), 9);
    }

    #[test]
    fn validation_never_evicts() {
        let mut w = World::new();
        let cfg = SamplerConfig { filter_metric: Some("acc".into()), ..asynchronous(Strategy::Drop, 1) };
        let mut s = GroupStatus { uid: "v".into(), partition: "val".into(), submit_step: 1, ..Default::default() };
        s.set_state(GroupState::Failure);
        w.state.apply_group(s);
        let r = SampleRequest {
            request_id: "val".into(),
            step: 50,
            partition: "val".into(),
            batch_size: 1,
            ..Default::default()
        };
        match next_action(&w.state, &cfg, &r, &mut Progress::default()) {
            Action::Answer { selected, .. } => assert_eq!(selected, vec!["v"]),
            other => panic!("{other:?}"),
        }
    }

    fn dapo(max_inflight: u64) -> SamplerConfig {
        SamplerConfig { filter_metric: Some("acc".into()), max_inflight, ..sync() }
    }

    #[test]
    fn sync_dapo_refills_two_per_filtered_group_and_discards_the_surplus() {
        let mut w = World::new();
        let cfg = dapo(100);
        w.group("mixed1", GroupState::Finished, 1, &[1.0, 0.0]);
        w.group("mixed2", GroupState::Finished, 1, &[0.0, 1.0]);
        w.group("flat", GroupState::Finished, 1, &[1.0, 1.0]);
        let mut p = Progress::default();
        let (action, evicted) = w.run(&cfg, &req(1, 3), &mut p);
        assert_eq!(evicted, vec![("flat".to_string(), EvictReason::FilterGroups)]);
        assert_eq!(action, Action::Refill(2), "two credits per filtered group");
        p.record_refill(2);
        let mut again = req(1, 3);
        again.refilled = 2;
        w.group("new1", GroupState::Pending, 1, &[]);
        w.group("new2", GroupState::Pending, 1, &[]);
        assert_eq!(w.run(&cfg, &again, &mut p).0, Action::Wait);
        w.group("new1", GroupState::Finished, 1, &[1.0, 0.0]);
        // enough now, but DAPO drains in-flight work before selecting
        assert_eq!(w.run(&cfg, &again, &mut p).0, Action::Wait);
        w.group("new2", GroupState::Finished, 1, &[0.0, 1.0]);
        let (action, evicted) = w.run(&cfg, &again, &mut p);
        assert_eq!(selected(&action).len(), 3);
        assert_eq!(evicted, vec![("new2".to_string(), EvictReason::DiscardedSurplus)]);
        let m = p.metrics("training");
        assert_eq!(m["training/filter_groups/evicted_samples"], 1.0);
        assert_eq!(m["training/filter_groups/discarded_surplus_samples"], 1.0);
    }

    #[test]
    fn sync_dapo_streams_credit_within_the_inflight_bound_and_drops_unsent_credit_when_full() {
        let mut w = World::new();
        let cfg = SamplerConfig { sync_refill_failed_groups: true, ..dapo(2) };
        w.group("ok", GroupState::Finished, 1, &[1.0, 0.0]);
        w.group("flat1", GroupState::Finished, 1, &[0.0, 0.0]);
        w.group("flat2", GroupState::Finished, 1, &[1.0, 1.0]);
        w.group("emptyfail", GroupState::Failure, 1, &[]);
        w.group("busy", GroupState::Running, 1, &[]);
        let mut p = Progress::default();
        // credits: 2 + 2 (filtered) + 1 (empty failure) = 5; room = 2 - 1 running = 1
        let (action, _) = w.run(&cfg, &req(1, 2), &mut p);
        assert_eq!(action, Action::Refill(1));
        p.record_refill(1);
        let mut again = req(1, 2);
        again.refilled = 1;
        w.group("r1", GroupState::Pending, 1, &[]);
        // at the bound: nothing more dispatched
        assert_eq!(w.run(&cfg, &again, &mut p).0, Action::Wait);
        w.group("busy", GroupState::Finished, 1, &[0.0, 1.0]);
        // the batch is full (ok, busy): unsent credit is dropped, in-flight r1 drained first
        assert_eq!(w.run(&cfg, &again, &mut p).0, Action::Wait);
        w.group("r1", GroupState::Finished, 1, &[1.0, 0.0]);
        let (action, evicted) = w.run(&cfg, &again, &mut p);
        assert_eq!(selected(&action), vec!["busy", "ok"]);
        assert_eq!(evicted, vec![("r1".to_string(), EvictReason::DiscardedSurplus)]);
    }

    #[test]
    fn dapo_generates_at_most_max_num_gen_batches_batches_then_fails_a_short_batch_naming_the_key() {
        for mode in [Mode::Sync, Mode::Async] {
            let mut w = World::new();
            let cfg = SamplerConfig { mode, max_gen_batches: 2, ..dapo(100) };
            w.group("ok", GroupState::Finished, 1, &[1.0, 0.0]);
            w.group("flat", GroupState::Finished, 1, &[1.0, 1.0]);
            let mut p = Progress::default();
            let mut request = req(1, 2);
            // every refill comes back without a spread: refills go on until 2 batches of 2 prompts are spent
            let message = loop {
                match w.run(&cfg, &request, &mut p).0 {
                    Action::Refill(n) => {
                        p.record_refill(n);
                        for i in request.refilled..request.refilled + n {
                            w.group(&format!("new{i}"), GroupState::Pending, 1, &[]);
                        }
                        // in flight: it waits for them, whatever the cap says
                        request.refilled += n;
                        assert_eq!(w.run(&cfg, &request, &mut p).0, Action::Wait, "{mode:?}");
                        for i in request.refilled - n..request.refilled {
                            w.group(&format!("new{i}"), GroupState::Finished, 1, &[0.0, 0.0]);
                        }
                    }
                    Action::Fail(message) => break message,
                    other => panic!("{mode:?}: {other:?}"),
                }
            };
            assert_eq!(request.refilled, 2, "{mode:?}: the batch and its refills within 2 batches of 2");
            assert!(
                message.contains("algorithm.filter_groups.max_num_gen_batches = 2")
                    && message.contains("1 of the 2 groups"),
                "{mode:?}: {message}"
            );
        }
    }

    #[test]
    fn a_remax_groups_greedy_baseline_takes_no_part_in_the_dapo_filter() {
        let mut w = World::new();
        // the samples of `flat` agree and its greedy baseline differs: the group has no spread to learn from
        w.group_with_baseline("flat", GroupState::Finished, 1, &[1.0, 1.0], Some(0.0));
        w.group_with_baseline("mixed", GroupState::Finished, 1, &[1.0, 0.0], Some(1.0));
        let mut p = Progress::default();
        let (action, evicted) = w.run(&dapo(100), &req(1, 2), &mut p);
        assert_eq!(evicted, vec![("flat".to_string(), EvictReason::FilterGroups)]);
        assert_eq!(action, Action::Refill(2));
    }

    #[test]
    fn dapo_metric_missing_from_a_reward_is_an_error_naming_it() {
        let mut w = World::new();
        let cfg = SamplerConfig { filter_metric: Some("nope".into()), ..sync() };
        w.group("a", GroupState::Finished, 1, &[1.0, 0.0]);
        match w.run(&cfg, &req(1, 1), &mut Progress::default()).0 {
            Action::Fail(m) => assert!(m.contains("nope"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}
