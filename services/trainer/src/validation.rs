//! Validation metrics exactly as verl computes them (`process_validation_metrics` and `_validate` in
//! `verl/trainer/ppo/metric_utils.py` and the trainer):
//!
//! - per data source, per prompt (uid), per variable (`reward` and every numeric reward extra, e.g. `acc`):
//!   `mean@N`, `std@N` over the N samples of the prompt; for k = 2, 4, 8, … < N and k = N, bootstrap
//!   `best@k/{mean,std}` and `worst@k/{mean,std}` (1000 resamples of k with replacement, numpy's legacy
//!   generator seeded 42 for every metric), and `maj@k/{mean,std}` when the reward reports a `pred`;
//! - each metric is averaged over the prompts of the data source;
//! - the core variable (`acc` if reported, else `reward`) at the largest N, for `mean`, `maj` and `best`, goes
//!   to `val-core/<source>/<var>/<metric>`, everything else to `val-aux/…`.
//!
//! numpy's `RandomState` (MT19937 with its legacy seeding and masked rejection sampling) is reproduced here, so
//! the bootstrap numbers are verl's to the last digit, not merely the same statistic.
//!
//! [`validate`] runs verl's `_validate`: every validation prompt generated with `rollout.val_kwargs` (greedy by
//! default), `n` times, scored; one score per session (its final output); `val-aux/num_turns/{min,max,mean}`
//! and `val-aux/tool_calls/{min,max,mean}` over those outputs; the generations dumped to `validation_data_dir/<step>.jsonl` and `log_val_generations` of
//! them picked as verl picks them, for the log and the trackers.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use jetrl_config::JobConfig;
use jetrl_data::Example;
use jetrl_wire::subjects;
use jetrl_wire::v1::{self, SampleResponse};

use crate::dump;
use crate::error::TrainerError;
use crate::numpy_rng::NumpyLegacyRng;
use crate::rollout_client::RolloutClient;

/// What a validation gives the step's records.
#[derive(Debug, Default)]
pub struct Validation {
    /// the `val-core/` and `val-aux/` metrics
    pub metrics: BTreeMap<String, f64>,
    /// the `trainer.log_val_generations` generations verl's trainer hands its trackers
    pub generations: Vec<dump::Generation>,
}

/// verl's `_validate` at `step` over `val`.
pub async fn validate(
    client: &mut RolloutClient,
    cfg: &JobConfig,
    val: &[Example],
    step: u64,
    incarnation: &str,
) -> Result<Validation, TrainerError> {
    let chunk = cfg.data.val_batch_size.map(|b| b as usize).unwrap_or(val.len()).max(1);
    let mut request_ids = Vec::new();
    let mut responses = Vec::new();
    for (i, examples) in val.chunks(chunk).enumerate() {
        let submitted = client.submit_val(step, (i * chunk) as u64, examples).await?;
        let request_id = format!("val-{incarnation}-{step}-{i}");
        let (response, _) = client.sample(&request_id, step, subjects::VAL_PARTITION, submitted as u32).await?;
        responses.push(response);
        request_ids.push(request_id);
    }
    // one score per session: its final output (the largest output index), as verl
    let mut finals: BTreeMap<(String, u32), &v1::Reward> = BTreeMap::new();
    for t in responses.iter().flat_map(|r| r.groups.iter()).flat_map(|g| g.trajectories.iter()) {
        let slot = finals.entry((t.uid.clone(), t.session_id)).or_insert(t);
        if t.index > slot.index {
            *slot = t;
        }
    }
    let samples: Vec<ValSample> = finals
        .values()
        .map(|r| ValSample {
            uid: r.uid.clone(),
            data_source: r.data_source.clone(),
            score: r.score,
            extra: r.extra.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            pred: r.extra_text.get("pred").cloned(),
        })
        .collect();
    let mut out = validation_metrics(&samples);
    // the final outputs' payloads: their turn counts, and the generations to dump or log
    let finals_only = SampleResponse {
        groups: vec![v1::SampledGroup {
            trajectories: finals.values().map(|r| (*r).clone()).collect(),
            ..Default::default()
        }],
        ..Default::default()
    };
    let generations = client.fetch(&finals_only).await?;
    let turns: Vec<f64> = generations.samples.iter().map(|s| f64::from(s.num_turns)).collect();
    if !turns.is_empty() {
        out.insert("val-aux/num_turns/min".into(), turns.iter().copied().fold(f64::INFINITY, f64::min));
        out.insert("val-aux/num_turns/max".into(), turns.iter().copied().fold(f64::NEG_INFINITY, f64::max));
        out.insert("val-aux/num_turns/mean".into(), turns.iter().sum::<f64>() / turns.len() as f64);
        let calls: Vec<f64> = generations.samples.iter().map(|s| f64::from(s.tool_calls)).collect();
        out.insert("val-aux/tool_calls/min".into(), calls.iter().copied().fold(f64::INFINITY, f64::min));
        out.insert("val-aux/tool_calls/max".into(), calls.iter().copied().fold(f64::NEG_INFINITY, f64::max));
        out.insert("val-aux/tool_calls/mean".into(), calls.iter().sum::<f64>() / calls.len() as f64);
    }
    let dump_dir = cfg.trainer.validation_data_dir.clone();
    let log_n = cfg.trainer.log_val_generations as usize;
    let mut picked = Vec::new();
    if dump_dir.is_some() || log_n > 0 {
        let rows =
            dump::generation_rows(client.tokenizer(), step, &generations.samples, &finals_only.groups[0].trajectories);
        if let Some(dir) = dump_dir {
            dump::write_jsonl(&Path::new(&dir).join(format!("{step}.jsonl")), &rows);
        }
        picked = dump::pick_generations(&rows, log_n);
        dump::log_generations(&picked, step);
    }
    client.release(step, request_ids);
    Ok(Validation { metrics: out, generations: picked })
}

/// One scored validation sample: its prompt group, data source, score, numeric extras and text extras.
#[derive(Debug, Clone, Default)]
pub struct ValSample {
    pub uid: String,
    pub data_source: String,
    pub score: f64,
    pub extra: BTreeMap<String, f64>,
    pub pred: Option<String>,
}

/// verl's `bootstrap_metric`: mean and population std of each reduction over `n_bootstrap` resamples of
/// `subset` items drawn with replacement, every call starting from `np.random.seed(seed)`.
/// A reduction of a bootstrap resample to one number (max, min, majority vote).
type Reduction<'a, T> = &'a dyn Fn(&[&T]) -> f64;

fn bootstrap<T>(data: &[T], subset: usize, reductions: &[Reduction<'_, T>], seed: u32) -> Vec<(f64, f64)> {
    const N_BOOTSTRAP: usize = 1000;
    let mut rng = NumpyLegacyRng::new(seed);
    let mut results: Vec<Vec<f64>> = vec![Vec::with_capacity(N_BOOTSTRAP); reductions.len()];
    let mut pick: Vec<&T> = Vec::with_capacity(subset);
    for _ in 0..N_BOOTSTRAP {
        pick.clear();
        for _ in 0..subset {
            pick.push(&data[rng.below(data.len() as u32) as usize]);
        }
        for (out, reduce) in results.iter_mut().zip(reductions) {
            out.push(reduce(&pick));
        }
    }
    results.iter().map(|values| (mean(values), population_std(values))).collect()
}

fn mean(values: &[f64]) -> f64 {
    values.iter().sum::<f64>() / values.len().max(1) as f64
}

fn population_std(values: &[f64]) -> f64 {
    let m = mean(values);
    (values.iter().map(|v| (v - m).powi(2)).sum::<f64>() / values.len().max(1) as f64).sqrt()
}

/// verl's `calc_maj_val`: the value of the first sample voting for the most frequent prediction (ties go to
/// the prediction seen first).
fn majority_value(votes: &[&(f64, String)]) -> f64 {
    let mut order: Vec<&str> = Vec::new();
    let mut counts: HashMap<&str, (usize, f64)> = HashMap::new();
    for (value, pred) in votes.iter().map(|v| (v.0, v.1.as_str())) {
        counts.entry(pred).and_modify(|c| c.0 += 1).or_insert_with(|| {
            order.push(pred);
            (1, value)
        });
    }
    let mut best: Option<(usize, f64)> = None;
    for pred in order {
        let (count, value) = counts[pred];
        if best.is_none_or(|(c, _)| count > c) {
            best = Some((count, value));
        }
    }
    best.map_or(0.0, |(_, v)| v)
}

/// verl's `gen_ns`: 2, 4, 8, … below n, then n itself.
fn sample_sizes(n: usize) -> Vec<usize> {
    if n <= 1 {
        return Vec::new();
    }
    let mut ns = Vec::new();
    let mut k = 2;
    while k < n {
        ns.push(k);
        k *= 2;
    }
    ns.push(n);
    ns
}

/// The metrics of one prompt's values of one variable.
fn prompt_metrics(values: &[f64], preds: Option<&[String]>, seed: u32) -> BTreeMap<String, f64> {
    let n = values.len();
    let mut out = BTreeMap::new();
    out.insert(format!("mean@{n}"), mean(values));
    if n <= 1 {
        return out;
    }
    out.insert(format!("std@{n}"), population_std(values));
    let max = |d: &[&f64]| d.iter().map(|v| **v).fold(f64::NEG_INFINITY, f64::max);
    let min = |d: &[&f64]| d.iter().map(|v| **v).fold(f64::INFINITY, f64::min);
    let votes: Option<Vec<(f64, String)>> = preds.map(|p| values.iter().copied().zip(p.iter().cloned()).collect());
    for k in sample_sizes(n) {
        let r = bootstrap(values, k, &[&max, &min], seed);
        out.insert(format!("best@{k}/mean"), r[0].0);
        out.insert(format!("best@{k}/std"), r[0].1);
        out.insert(format!("worst@{k}/mean"), r[1].0);
        out.insert(format!("worst@{k}/std"), r[1].1);
        if let Some(votes) = &votes {
            let r = bootstrap(votes, k, &[&majority_value], seed);
            out.insert(format!("maj@{k}/mean"), r[0].0);
            out.insert(format!("maj@{k}/std"), r[0].1);
        }
    }
    out
}

/// The values of one data source: uids in first-seen order, and per uid the values of every variable.
type SourceValues<'a> = (Vec<&'a str>, HashMap<&'a str, BTreeMap<String, Vec<f64>>>);

/// `val-core/…` and `val-aux/…` metrics of a validation run (one sample per session: the final output).
pub fn validation_metrics(samples: &[ValSample]) -> BTreeMap<String, f64> {
    const SEED: u32 = 42;
    // data source → uid → variable → values, in first-seen order of uids (verl's dicts keep insertion order)
    let mut by_source: BTreeMap<&str, SourceValues> = BTreeMap::new();
    let mut preds: HashMap<(&str, &str), Vec<String>> = HashMap::new();
    let mut pred_complete: HashMap<(&str, &str), bool> = HashMap::new();
    for s in samples {
        let (order, uids) = by_source.entry(s.data_source.as_str()).or_default();
        let vars = uids.entry(s.uid.as_str()).or_insert_with(|| {
            order.push(s.uid.as_str());
            BTreeMap::new()
        });
        vars.entry("reward".into()).or_default().push(s.score);
        for (k, v) in &s.extra {
            vars.entry(k.clone()).or_default().push(*v);
        }
        let key = (s.data_source.as_str(), s.uid.as_str());
        match &s.pred {
            Some(p) => preds.entry(key).or_default().push(p.clone()),
            None => {
                pred_complete.insert(key, false);
            }
        }
    }
    let mut out = BTreeMap::new();
    for (source, (order, uids)) in &by_source {
        // variable → metric → per-prompt values
        let mut gathered: BTreeMap<String, BTreeMap<String, Vec<f64>>> = BTreeMap::new();
        for uid in order {
            let key = (*source, *uid);
            let uid_preds = preds.get(&key).filter(|_| pred_complete.get(&key).copied().unwrap_or(true));
            for (var, values) in &uids[uid] {
                let p = uid_preds.filter(|p| p.len() == values.len()).map(|p| p.as_slice());
                for (metric, value) in prompt_metrics(values, p, SEED) {
                    gathered.entry(var.clone()).or_default().entry(metric).or_default().push(value);
                }
            }
        }
        let core = if gathered.contains_key("acc") { "acc" } else { "reward" };
        for (var, metrics) in &gathered {
            let n_max = metrics
                .keys()
                .filter_map(|m| m.rsplit('@').next()?.split('/').next()?.parse::<usize>().ok())
                .max()
                .unwrap_or(1);
            for (metric, per_prompt) in metrics {
                let is_core = var == core
                    && ["mean", "maj", "best"].iter().any(|p| metric.starts_with(p))
                    && metric.contains(&format!("@{n_max}"));
                let section = if is_core { "val-core" } else { "val-aux" };
                out.insert(format!("{section}/{source}/{var}/{metric}"), mean(per_prompt));
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mt19937_matches_numpy_legacy_seed_42() {
        // np.random.seed(42); np.random.randint(0, 2**32, size=3, dtype=np.uint64) draws raw 32-bit words
        let mut rng = NumpyLegacyRng::new(42);
        assert_eq!([rng.next_u32(), rng.next_u32(), rng.next_u32()], [1_608_637_542, 3_421_126_067, 4_083_286_876]);
        // np.random.seed(42); np.random.choice(5, size=8)
        let mut rng = NumpyLegacyRng::new(42);
        let picks: Vec<u32> = (0..8).map(|_| rng.below(5)).collect();
        assert_eq!(picks, vec![3, 4, 2, 4, 4, 1, 2, 2]);
    }

    fn sample(uid: &str, score: f64, acc: f64, pred: &str) -> ValSample {
        ValSample {
            uid: uid.into(),
            data_source: "gsm8k".into(),
            score,
            extra: BTreeMap::from([("acc".to_string(), acc)]),
            pred: Some(pred.into()),
        }
    }

    /// Expected values computed with verl's `process_validation_metrics` (numpy 2.4).
    #[test]
    fn metrics_match_verl_process_validation_metrics() {
        let samples = vec![
            sample("a", 1.0, 1.0, "4"),
            sample("a", 0.0, 0.0, "5"),
            sample("a", 1.0, 1.0, "4"),
            sample("a", 0.5, 0.0, "6"),
            sample("b", 0.0, 0.0, "1"),
            sample("b", 0.0, 0.0, "2"),
            sample("b", 1.0, 1.0, "3"),
            sample("b", 0.0, 0.0, "2"),
        ];
        let m = validation_metrics(&samples);
        let expect = |name: &str, value: f64| {
            let got = m.get(name).copied().unwrap_or_else(|| panic!("{name} missing from {m:#?}"));
            assert!((got - value).abs() < 1e-12, "{name}: {got} vs verl {value}");
        };
        expect("val-core/gsm8k/acc/mean@4", 0.375);
        expect("val-aux/gsm8k/acc/std@4", 0.46650635094610965);
        expect("val-core/gsm8k/acc/best@4/mean", 0.8005);
        expect("val-core/gsm8k/acc/best@4/std", 0.35542833800706536);
        expect("val-aux/gsm8k/acc/best@2/std", 0.45711394361560714);
        expect("val-aux/gsm8k/acc/worst@2/mean", 0.159);
        expect("val-aux/gsm8k/acc/worst@4/std", 0.137299170809288);
        expect("val-core/gsm8k/acc/maj@4/mean", 0.391);
        expect("val-core/gsm8k/acc/maj@4/std", 0.43889307050459747);
        expect("val-aux/gsm8k/acc/maj@2/mean", 0.377);
        expect("val-aux/gsm8k/reward/maj@4/mean", 0.43599999999999994);
        expect("val-aux/gsm8k/reward/best@2/mean", 0.63725);
        expect("val-aux/gsm8k/reward/mean@4", 0.4375);
        assert!(!m.contains_key("val-core/gsm8k/reward/mean@4"));
    }

    #[test]
    fn a_single_sample_per_prompt_reports_only_the_mean_and_reward_is_core_without_acc() {
        let samples: Vec<ValSample> = (0..3)
            .map(|i| ValSample {
                uid: format!("u{i}"),
                data_source: "s".into(),
                score: f64::from(i),
                ..Default::default()
            })
            .collect();
        let m = validation_metrics(&samples);
        assert_eq!(m.len(), 1, "{m:?}");
        assert_eq!(m["val-core/s/reward/mean@1"], 1.0);
    }
}
