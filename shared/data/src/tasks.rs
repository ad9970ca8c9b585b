//! Built-in synthetic tasks, generated from a seed (no downloads).
//!
//! - `reverse`: prompt `reverse 4821=`, answer `1284`.
//! - `sort`: prompt `sort 4821=`, answer `1248`.
//! - `copy`: prompt `copy 4821=`, answer `4821` (the easiest: a fixed relative offset; a pipeline check).
//! - `multiply`: prompt `multiply 37*58=` (`{digits}` is `37*58`, each operand `min_len..=max_len` digits),
//!   answer `2146`. A small model cannot multiply; with the calculator tool (`tool_agent`) it can ask for the
//!   product, which then stands in its context.
//!
//! Scored by the reward service's `jetrl/<task>` rule: the fraction of positions right (so a random policy
//! earns a little credit and learning has a gradient to follow); `multiply` scores the response's last line
//! (the final answer after any tool turns).

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
        TaskName::Multiply => |d| {
            let (a, b) = d.split_once('*').unwrap_or((d, "1"));
            let product = a.parse::<u128>().unwrap_or(0) * b.parse::<u128>().unwrap_or(0);
            product.to_string()
        },
    };
    // multiply's operands are at most 19 digits each (u128 holds their product)
    let (min_len, max_len) = match cfg.name {
        TaskName::Multiply => (cfg.min_len.min(19), cfg.max_len.min(19)),
        _ => (cfg.min_len, cfg.max_len),
    };
    let (size, salt) = match split {
        Split::Train => (cfg.train_size, 0x7261_696e),
        Split::Val => (cfg.val_size, 0x0076_616c),
    };
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ salt);
    let (lo, hi) = (min_len.max(1), max_len.max(min_len.max(1)));
    let number = |rng: &mut rand_chacha::ChaCha8Rng| -> String {
        let len = rng.gen_range(lo..=hi);
        (0..len).map(|_| char::from(b'0' + rng.gen_range(0..10u8))).collect()
    };
    Ok((0..size as u64)
        .map(|index| {
            let digits = match cfg.name {
                TaskName::Multiply => {
                    let a = number(&mut rng);
                    format!("{a}*{}", number(&mut rng))
                }
                _ => number(&mut rng),
            };
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

    #[test]
    fn multiply_prompts_are_two_operands_and_the_answer_is_their_product() {
        let cfg = jetrl_config::TaskConfig {
            name: TaskName::Multiply,
            min_len: 2,
            max_len: 2,
            train_size: 50,
            template: "{digits}=".into(),
            ..Default::default()
        };
        for example in generate(&cfg, Split::Train, 3).unwrap() {
            let Prompt::Text(text) = &example.prompt else { panic!("text prompt") };
            let (a, b) = text.strip_suffix('=').unwrap().split_once('*').unwrap();
            assert_eq!((a.len(), b.len()), (2, 2), "{text}");
            let product = a.parse::<u64>().unwrap() * b.parse::<u64>().unwrap();
            assert_eq!(example.ground_truth, product.to_string(), "{text}");
            assert_eq!(example.data_source, "jetrl/multiply");
        }
    }
}
