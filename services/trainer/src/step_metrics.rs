//! The step's metrics that do not need the model: verl's data metrics of a batch (lengths, off-policy spans and
//! staleness, turns, failures), timings and throughput, who waited for whom (trainer and rollout idle ratios),
//! and the aggregation of separate_async's local updates into one step (verl's `MetricsAggregator`).

use std::collections::BTreeMap;
use tokio::time::Instant;

use jetrl_wire::v1::{GroupState, SampleResponse};

use crate::batch::Sample;

pub type Metrics = BTreeMap<String, f64>;

/// verl's data metrics of a batch that do not need the actor: response and prompt lengths (with their clip
/// ratios), off-policy spans and staleness, turns and tool calls per trajectory (with the share of trajectories that
/// called a tool and the mean score with and without a call), failures; plus the submission span of the trained groups
/// (`step − submit_step + 1`, what the buffer's staleness rule bounds).
pub fn batch_metrics(samples: &[Sample], response: &SampleResponse, step: u64, max_prompt: usize, out: &mut Metrics) {
    stats(&samples.iter().map(|s| s.response.len() as f64).collect::<Vec<_>>(), "response_length", out);
    stats(&samples.iter().map(|s| s.prompt.len() as f64).collect::<Vec<_>>(), "prompt_length", out);
    if !samples.is_empty() {
        let n = samples.len() as f64;
        let clipped = samples.iter().filter(|s| s.truncated).count() as f64 / n;
        out.insert("response_length/clip_ratio".into(), clipped);
        let prompt_clipped = samples.iter().filter(|s| s.prompt.len() >= max_prompt).count() as f64 / n;
        out.insert("prompt_length/clip_ratio".into(), prompt_clipped);
        if samples.iter().any(|s| s.num_turns > 0) {
            stats(&samples.iter().map(|s| f64::from(s.num_turns)).collect::<Vec<_>>(), "training/num_turns", out);
            stats(&samples.iter().map(|s| f64::from(s.tool_calls)).collect::<Vec<_>>(), "training/tool_calls", out);
            // whether calling pays: the share of trajectories with a call, and the mean score with and without one
            let (with, without): (Vec<&Sample>, Vec<&Sample>) = samples.iter().partition(|s| s.tool_calls > 0);
            out.insert("training/tool_calls/share".into(), with.len() as f64 / n);
            for (part, key) in
                [(&with, "training/tool_calls/score_with_call"), (&without, "training/tool_calls/score_without_call")]
            {
                if !part.is_empty() {
                    out.insert(key.into(), part.iter().map(|s| s.score).sum::<f64>() / part.len() as f64);
                }
            }
        }
    }
    stats(
        &samples.iter().map(|s| (s.max_version - s.min_version + 1) as f64).collect::<Vec<_>>(),
        "training/off_policy/trajectory_spans",
        out,
    );
    stats(
        &samples.iter().map(|s| step.saturating_sub(1) as f64 - s.max_version as f64).collect::<Vec<_>>(),
        "training/off_policy/trajectory_staleness",
        out,
    );
    stats(
        &samples.iter().map(|s| step.saturating_sub(1) as f64 - s.min_version as f64).collect::<Vec<_>>(),
        "training/off_policy/trajectory_staleness_worst",
        out,
    );
    stats(
        &response.groups.iter().map(|g| (step + 1).saturating_sub(g.submit_step) as f64).collect::<Vec<_>>(),
        "training/off_policy/group_submit_span",
        out,
    );
    let failed = response.groups.iter().filter(|g| g.state == GroupState::Failure as i32).count();
    out.insert("training/rollout_failure/groups".into(), failed as f64);
    out.insert("training/num_groups".into(), response.groups.len() as f64);
    out.insert("training/num_trajectories".into(), samples.len() as f64);
}

/// A timed phase of a step: `timing_s/<name>` (verl's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Phase {
    /// waiting for the batch (the sample request)
    Gen,
    /// reading the batch's trajectories
    Fetch,
    /// colocate_async: pausing the co-located worker
    Pause,
    OldLogProb,
    Ref,
    Values,
    Adv,
    UpdateCritic,
    UpdateActor,
    SaveCheckpoint,
    /// colocate_async: resuming the co-located worker
    Resume,
    UpdateWeights,
}

impl Phase {
    pub const ALL: [Phase; 12] = [
        Phase::Gen,
        Phase::Fetch,
        Phase::Pause,
        Phase::OldLogProb,
        Phase::Ref,
        Phase::Values,
        Phase::Adv,
        Phase::UpdateCritic,
        Phase::UpdateActor,
        Phase::SaveCheckpoint,
        Phase::Resume,
        Phase::UpdateWeights,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Gen => "gen",
            Phase::Fetch => "fetch",
            Phase::Pause => "pause",
            Phase::OldLogProb => "old_log_prob",
            Phase::Ref => "ref",
            Phase::Values => "values",
            Phase::Adv => "adv",
            Phase::UpdateCritic => "update_critic",
            Phase::UpdateActor => "update_actor",
            Phase::SaveCheckpoint => "save_checkpoint",
            Phase::Resume => "resume",
            Phase::UpdateWeights => "update_weights",
        }
    }

    /// The metric key of its seconds.
    pub fn key(self) -> String {
        format!("timing_s/{}", self.name())
    }
}

/// The seconds the phases of one step (or one update) took.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepTimings(BTreeMap<Phase, f64>);

impl StepTimings {
    pub fn set(&mut self, phase: Phase, seconds: f64) {
        self.0.insert(phase, seconds);
    }

    /// Sets `phase` to the time since `since`.
    pub fn since(&mut self, phase: Phase, since: Instant) {
        self.set(phase, since.elapsed().as_secs_f64());
    }

    pub fn get(&self, phase: Phase) -> Option<f64> {
        self.0.get(&phase).copied()
    }

    /// Takes every phase `other` timed (replacing this one's).
    pub fn extend(&mut self, other: StepTimings) {
        self.0.extend(other.0);
    }

    pub fn iter(&self) -> impl Iterator<Item = (Phase, f64)> + '_ {
        self.0.iter().map(|(&p, &s)| (p, s))
    }

    /// Writes `timing_s/<phase>` of each phase into `out`.
    pub fn write(&self, out: &mut Metrics) {
        for (phase, seconds) in self.iter() {
            out.insert(phase.key(), seconds);
        }
    }

    /// The phases `timing_s/<phase>` of `metrics` holds (separate_async's local updates, averaged).
    pub fn read(metrics: &Metrics) -> Self {
        Self(Phase::ALL.into_iter().filter_map(|p| metrics.get(&p.key()).map(|&s| (p, s))).collect())
    }
}

/// Timings (`timing_s/<phase>`, verl's per-token `timing_per_token_ms/<phase>`) and throughput of a step.
pub fn timing_metrics(timings: &StepTimings, samples: &[Sample], step_s: f64, out: &mut Metrics) {
    let tokens: usize = samples.iter().map(|s| s.prompt.len() + s.response.len()).sum();
    let response_tokens: usize = samples.iter().map(|s| s.response.len()).sum();
    timings.write(out);
    for (phase, seconds) in timings.iter() {
        // verl's per-token timings: generation per response token, the rest per token of the batch; none for
        // the transfers and the co-located worker's handshakes
        let per = match phase {
            Phase::Fetch | Phase::Pause | Phase::Resume => continue,
            Phase::Gen => response_tokens,
            _ => tokens,
        };
        if per > 0 {
            out.insert(format!("timing_per_token_ms/{}", phase.name()), seconds * 1000.0 / per as f64);
        }
    }
    out.insert("timing_s/step".into(), step_s);
    out.insert("perf/total_num_tokens".into(), tokens as f64);
    out.insert("perf/time_per_step".into(), step_s);
    out.insert("perf/throughput".into(), tokens as f64 / step_s.max(1e-9));
}

/// Measures who waited for whom over one step: the trainer's share of the step spent waiting for samples, and
/// the rollout fleet's share of engine time with nothing to decode (from the workers' heartbeats).
pub struct IdleClock {
    started: Instant,
    fleet_idle: f64,
    workers: usize,
}

impl IdleClock {
    /// From the fleet's idle reading at the step's start ([`WeightPlane::fleet_idle_seconds`]).
    ///
    /// [`WeightPlane::fleet_idle_seconds`]: crate::planes::WeightPlane::fleet_idle_seconds
    pub fn start((fleet_idle, workers): (f64, usize)) -> Self {
        Self { started: Instant::now(), fleet_idle, workers }
    }

    /// `perf/trainer_idle_ratio` (the seconds spent waiting for samples over the step) and
    /// `perf/rollout_idle_ratio` (idle engine seconds over worker-seconds; heartbeats lag by up to one interval,
    /// so a step much shorter than that reads coarse).
    pub fn finish(self, (fleet_idle, workers): (f64, usize), trainer_wait_s: f64, out: &mut Metrics) {
        let elapsed = self.started.elapsed().as_secs_f64().max(1e-9);
        out.insert("perf/trainer_idle_ratio".into(), (trainer_wait_s / elapsed).clamp(0.0, 1.0));
        let n = workers.max(self.workers);
        if n > 0 && workers == self.workers {
            let ratio = (fleet_idle - self.fleet_idle) / (elapsed * n as f64);
            out.insert("perf/rollout_idle_ratio".into(), ratio.clamp(0.0, 1.0));
        }
        out.insert("perf/rollout_workers".into(), workers as f64);
    }
}

/// verl's `MetricsAggregator`, combining the local updates of one separate_async step: sums for counters, the
/// last value for the learning rate, max / min for names ending in `max` / `min` (`response_length/max`,
/// `rollout_corr/rollout_is_min`), and a mean weighted by the number of trajectories of each local update
/// otherwise.
#[derive(Default)]
pub struct Aggregator {
    parts: Vec<(Metrics, f64)>,
}

impl Aggregator {
    pub fn add(&mut self, metrics: Metrics, weight: f64) {
        self.parts.push((metrics, weight.max(1e-12)));
    }

    pub fn finish(self) -> Metrics {
        let mut keys: Vec<&String> = self.parts.iter().flat_map(|(m, _)| m.keys()).collect();
        keys.sort();
        keys.dedup();
        let mut out = Metrics::new();
        for key in keys {
            let values: Vec<(f64, f64)> = self.parts.iter().filter_map(|(m, w)| m.get(key).map(|v| (*v, *w))).collect();
            let value = if key.ends_with("max") {
                values.iter().map(|v| v.0).fold(f64::MIN, f64::max)
            } else if key.ends_with("min") {
                values.iter().map(|v| v.0).fold(f64::MAX, f64::min)
            } else if is_counter(key) {
                values.iter().map(|v| v.0).sum()
            } else if key == "actor/lr" || key.starts_with("critic/lr") {
                values.last().map_or(0.0, |v| v.0)
            } else {
                let total: f64 = values.iter().map(|v| v.1).sum();
                values.iter().map(|(v, w)| v * w).sum::<f64>() / total
            };
            out.insert(key.clone(), value);
        }
        out
    }
}

fn is_counter(key: &str) -> bool {
    key.contains("evicted_samples")
        || key.contains("discarded_surplus")
        // `training/num_turns/mean` is a mean (its /min and /max are handled as such above), not a count
        || (key.starts_with("training/num_") && !key.ends_with("/mean"))
        || key.starts_with("training/rollout_failure/groups")
        || key.starts_with("training/refilled")
        || key.starts_with("training/rejected")
        || key.starts_with("timing_s/")
        || key == "perf/total_num_tokens"
}

/// `<name>/mean`, `/max`, `/min` of `values` (nothing when empty).
pub fn stats(values: &[f64], name: &str, out: &mut BTreeMap<String, f64>) {
    if values.is_empty() {
        return;
    }
    out.insert(format!("{name}/mean"), values.iter().sum::<f64>() / values.len() as f64);
    out.insert(format!("{name}/max"), values.iter().copied().fold(f64::MIN, f64::max));
    out.insert(format!("{name}/min"), values.iter().copied().fold(f64::MAX, f64::min));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_updates_aggregate_like_verl() {
        let mut agg = Aggregator::default();
        let m = |pairs: &[(&str, f64)]| pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect::<Metrics>();
        agg.add(
            m(&[("actor/pg_loss", 1.0), ("response_length/max", 4.0), ("actor/lr", 0.1), ("training/num_groups", 2.0)]),
            1.0,
        );
        agg.add(
            m(&[("actor/pg_loss", 4.0), ("response_length/max", 3.0), ("actor/lr", 0.2), ("training/num_groups", 2.0)]),
            3.0,
        );
        let out = agg.finish();
        assert_eq!(out["actor/pg_loss"], (1.0 + 12.0) / 4.0, "weighted by trajectories");
        assert_eq!(out["response_length/max"], 4.0);
        let mut agg = Aggregator::default();
        agg.add(m(&[("rollout_corr/rollout_is_min", 0.0), ("rollout_corr/rollout_is_max", 1.5)]), 1.0);
        agg.add(m(&[("rollout_corr/rollout_is_min", 0.6), ("rollout_corr/rollout_is_max", 1.9)]), 1.0);
        let rc = agg.finish();
        assert_eq!(
            (rc["rollout_corr/rollout_is_min"], rc["rollout_corr/rollout_is_max"]),
            (0.0, 1.9),
            "the extremes of the weights over the local updates, not their mean"
        );
        assert_eq!(out["actor/lr"], 0.2, "the last learning rate");
        assert_eq!(out["training/num_groups"], 4.0, "counts add up");
        let mut agg = Aggregator::default();
        agg.add(m(&[("training/num_turns/mean", 2.0), ("training/num_turns/max", 2.0)]), 1.0);
        agg.add(m(&[("training/num_turns/mean", 1.0), ("training/num_turns/max", 3.0)]), 1.0);
        let out = agg.finish();
        assert_eq!(out["training/num_turns/mean"], 1.5, "a mean over local updates, not their sum");
        assert_eq!(out["training/num_turns/max"], 3.0);
        let mut agg = Aggregator::default();
        agg.add(m(&[("training/tool_calls/mean", 1.0), ("training/tool_calls/min", 1.0)]), 1.0);
        agg.add(m(&[("training/tool_calls/mean", 0.0), ("training/tool_calls/min", 0.0)]), 1.0);
        let out = agg.finish();
        assert_eq!((out["training/tool_calls/mean"], out["training/tool_calls/min"]), (0.5, 0.0));
    }

    #[test]
    fn turns_and_tool_calls_are_counted_per_trajectory() {
        let sample = |num_turns, tool_calls, score| Sample {
            prompt: vec![1],
            response: vec![2],
            num_turns,
            tool_calls,
            score,
            ..Sample::default()
        };
        let mut out = Metrics::new();
        let samples = [sample(2, 0, 0.25), sample(4, 1, 1.0), sample(6, 2, 0.5), sample(2, 0, 0.75)];
        batch_metrics(&samples, &SampleResponse::default(), 1, 8, &mut out);
        assert_eq!(out["training/num_turns/max"], 6.0);
        assert_eq!(
            (out["training/tool_calls/min"], out["training/tool_calls/mean"], out["training/tool_calls/max"]),
            (0.0, 0.75, 2.0)
        );
        assert_eq!(out["training/tool_calls/share"], 0.5);
        assert_eq!(
            (out["training/tool_calls/score_with_call"], out["training/tool_calls/score_without_call"]),
            (0.75, 0.5)
        );
        let mut out = Metrics::new();
        batch_metrics(&samples[..1], &SampleResponse::default(), 1, 8, &mut out);
        assert_eq!(out["training/tool_calls/share"], 0.0);
        assert!(!out.contains_key("training/tool_calls/score_with_call"), "no call, no mean score with one");
    }

    #[test]
    fn step_timings_write_verl_keys_and_per_token_figures_except_for_transfers_and_handshakes() {
        let sample = Sample { prompt: vec![1; 3], response: vec![2; 2], ..Sample::default() };
        let mut timings = StepTimings::default();
        timings.set(Phase::Gen, 0.4);
        timings.set(Phase::Fetch, 0.1);
        timings.set(Phase::UpdateActor, 1.0);
        let mut out = Metrics::new();
        timing_metrics(&timings, &[sample.clone(), sample], 2.0, &mut out);
        assert_eq!((out["timing_s/gen"], out["timing_s/fetch"], out["timing_s/update_actor"]), (0.4, 0.1, 1.0));
        // generation per response token (4), the update per token of the batch (10)
        assert_eq!(out["timing_per_token_ms/gen"], 100.0);
        assert_eq!(out["timing_per_token_ms/update_actor"], 100.0);
        assert!(!out.contains_key("timing_per_token_ms/fetch"));
        assert_eq!(out["timing_s/step"], 2.0);
        // what `write` puts in metrics, `read` gets back (separate_async averages local updates through metrics)
        let mut metrics = Metrics::new();
        timings.write(&mut metrics);
        assert_eq!(StepTimings::read(&metrics), timings);
        assert_eq!(
            Phase::ALL.iter().map(|p| p.name()).collect::<std::collections::BTreeSet<_>>().len(),
            Phase::ALL.len()
        );
    }
}
