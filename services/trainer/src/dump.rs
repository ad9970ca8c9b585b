//! verl's generation dumps: `trainer.rollout_data_dir/<step>.jsonl` (every trained trajectory),
//! `trainer.validation_data_dir/<step>.jsonl` (every validation generation) and the `log_val_generations` lines.
//! A dump that cannot be written is logged, never fatal: dumps are diagnostics.

use std::collections::HashMap;
use std::path::Path;

use jetrl_model::Tokenizer;
use jetrl_wire::v1;

use crate::batch::Sample;
use crate::numpy_rng::NumpyLegacyRng;

/// One validation generation as verl's `ValidationGenerationsLogger` gets it.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Generation {
    pub input: String,
    pub output: String,
    pub score: f64,
}

/// verl's rollout dump: one JSON line per trajectory (input, output, score, ground truth, step); jetrl adds the
/// token ids, the response mask (0 = tool output), log-probs, versions, turns and tool calls; with remax, the
/// score of the prompt's greedy rollout as `reward_baseline`.
pub fn rollout_rows(tokenizer: &Tokenizer, step: u64, samples: &[Sample]) -> Vec<serde_json::Value> {
    samples
        .iter()
        .map(|s| {
            let mut row = serde_json::json!({
                "input": tokenizer.decode(&s.prompt, false).unwrap_or_default(),
                "output": tokenizer.decode(&s.response, false).unwrap_or_default(),
                "score": s.score,
                "gts": s.ground_truth,
                "step": step,
                "uid": s.uid,
                "key": s.key,
                "prompt_ids": s.prompt,
                "response_ids": s.response,
                "response_mask": s.response_mask,
                "rollout_log_probs": s.rollout_logprobs,
                "version_runs": s.version_runs,
                "min_version": s.min_version,
                "max_version": s.max_version,
                "num_turns": s.num_turns,
                "tool_calls": s.tool_calls,
            });
            if let (Some(obj), Some(baseline)) = (row.as_object_mut(), s.reward_baseline) {
                obj.insert("reward_baseline".into(), serde_json::json!(baseline));
            }
            row
        })
        .collect()
}

/// verl's `_dump_generations` rows: input, output, gts, score, step and the reward extras. Input and output are
/// decoded without special tokens, as verl's `_validate` decodes them.
pub fn generation_rows(
    tokenizer: &Tokenizer,
    step: u64,
    samples: &[Sample],
    rewards: &[v1::Reward],
) -> Vec<serde_json::Value> {
    let by_key: HashMap<&str, &v1::Reward> = rewards.iter().map(|r| (r.key.as_str(), r)).collect();
    samples
        .iter()
        .map(|s| {
            let mut row = serde_json::json!({
                "input": tokenizer.decode(&s.prompt, true).unwrap_or_default(),
                "output": tokenizer.decode(&s.response, true).unwrap_or_default(),
                "gts": s.ground_truth,
                "score": s.score,
                "step": step,
                "uid": s.uid,
                "data_source": s.data_source,
            });
            if let (Some(obj), Some(r)) = (row.as_object_mut(), by_key.get(s.key.as_str())) {
                for (k, v) in &r.extra {
                    obj.insert(k.clone(), serde_json::json!(v));
                }
                for (k, v) in &r.extra_text {
                    obj.insert(k.clone(), serde_json::json!(v));
                }
            }
            row
        })
        .collect()
}

/// Writes one JSON object per line; a failure is logged, not fatal.
pub fn write_jsonl(path: &Path, rows: &[serde_json::Value]) {
    let mut out = String::new();
    for row in rows {
        out.push_str(&row.to_string());
        out.push('\n');
    }
    let written = path.parent().map_or(Ok(()), std::fs::create_dir_all).and_then(|_| std::fs::write(path, out));
    if let Err(err) = written {
        tracing::warn!(error = %err, path = %path.display(), "dump not written");
    }
}

/// verl's `_maybe_log_val_generations` pick of `n` generations: sorted by input, shuffled by numpy's
/// `RandomState(42)`, the first `n`, so that the same ones are picked as in verl.
pub fn pick_generations(rows: &[serde_json::Value], n: usize) -> Vec<Generation> {
    if n == 0 {
        return Vec::new();
    }
    let mut generations: Vec<Generation> = rows
        .iter()
        .map(|row| Generation {
            input: row["input"].as_str().unwrap_or_default().to_string(),
            output: row["output"].as_str().unwrap_or_default().to_string(),
            score: row["score"].as_f64().unwrap_or(f64::NAN),
        })
        .collect();
    generations.sort_by(|a, b| a.input.cmp(&b.input));
    NumpyLegacyRng::new(42).shuffle(&mut generations);
    generations.truncate(n);
    generations
}

/// The picked generations in the log, one line each.
pub fn log_generations(generations: &[Generation], step: u64) {
    for g in generations {
        tracing::info!(step, input = g.input, output = g.output, score = g.score, "validation generation");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `np.random.RandomState(42).shuffle(list(range(10)))` is `[8, 1, 5, 0, 7, 2, 9, 4, 3, 6]`.
    #[test]
    fn generations_are_picked_as_numpys_seeded_shuffle_picks_them() {
        let rows: Vec<serde_json::Value> =
            (0..10).rev().map(|i| serde_json::json!({"input": format!("q{i}"), "output": "a", "score": i})).collect();
        let picked: Vec<f64> = pick_generations(&rows, 4).iter().map(|g| g.score).collect();
        assert_eq!(picked, [8.0, 1.0, 5.0, 0.0]);
        assert!(pick_generations(&rows, 0).is_empty());
        assert_eq!(pick_generations(&rows, 50).len(), 10);
    }
}
