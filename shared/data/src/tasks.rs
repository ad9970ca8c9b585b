//! Built-in synthetic tasks, generated from a seed (no downloads).
//!
//! - `reverse`: prompt `reverse 4821=`, answer `1284`.
//! - `sort`: prompt `sort 4821=`, answer `1248`.
//! - `copy`: prompt `copy 4821=`, answer `4821` (the easiest: a fixed relative offset; a pipeline check).
//!
//! Scored by the reward service's `jetrl/<task>` rule: the fraction of positions right (so a random policy
//! earns a little credit and learning has a gradient to follow).

use rand::{Rng, SeedableRng};

use jetrl_config::TaskName;

use crate::{DataError, Example, Prompt};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Split {
    Train,
    Val,
}

/// Generates the split of a task. Train and val use different seeds, so they rarely overlap.
pub fn generate(cfg: &jetrl_config::TaskConfig, split: Split, seed: u64) -> Result<Vec<Example>, DataError> {
    let answer: fn(&str) -> String = match cfg.name {
        TaskName::Reverse => |d| d.chars().rev().collect(),
        TaskName::Copy => |d| d.to_string(),
        TaskName::Sort => |d| {
            let mut c: Vec<char> = d.chars().collect();
            c.sort_unstable();
            c.into_iter().collect()
        },
    };
    let (size, salt) = match split {
        Split::Train => (cfg.train_size, 0x7261_696e),
        Split::Val => (cfg.val_size, 0x0076_616c),
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ salt);
    let (lo, hi) = (cfg.min_len.max(1), cfg.max_len.max(cfg.min_len.max(1)));
    Ok((0..size as u64)
        .map(|index| {
            let len = rng.gen_range(lo..=hi);
            let digits: String = (0..len).map(|_| char::from(b'0' + rng.gen_range(0..10u8))).collect();
            Example {
                index,
                data_source: format!("jetrl/{}", cfg.name),
                prompt: Prompt::Text(cfg.template.replace("{task}", cfg.name.as_str()).replace("{digits}", &digits)),
                ground_truth: answer(&digits),
                extra_info: serde_json::json!({ "index": index, "split": if split == Split::Train { "train" } else { "val" } }),
                agent_name: None,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reverse_and_sort_examples_have_the_right_answers_and_are_seeded() {
        let cfg = jetrl_config::TaskConfig {
            name: TaskName::Reverse,
            min_len: 4,
            max_len: 4,
            train_size: 5,
            val_size: 2,
            ..Default::default()
        };
        let a = generate(&cfg, Split::Train, 1).unwrap();
        let b = generate(&cfg, Split::Train, 1).unwrap();
        assert_eq!(a, b);
        let Prompt::Text(text) = &a[0].prompt else { panic!("text prompt") };
        let digits = text.trim_start_matches("reverse ").trim_end_matches('=');
        assert_eq!(a[0].ground_truth, digits.chars().rev().collect::<String>());
        assert_eq!(a[0].data_source, "jetrl/reverse");
        let sort = jetrl_config::TaskConfig { name: TaskName::Sort, ..cfg.clone() };
        let s = generate(&sort, Split::Val, 1).unwrap();
        let mut chars: Vec<char> = s[0].ground_truth.chars().collect();
        chars.sort_unstable();
        assert_eq!(s[0].ground_truth, chars.into_iter().collect::<String>());
    }
}
