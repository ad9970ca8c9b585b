//! Prompts as token ids, as verl's `RLHFDataset` makes them: chat messages rendered with the model's chat
//! template (`add_generation_prompt=True`), raw text tokenized as is; prompts longer than
//! `data.max_prompt_length` dropped at load time (`filter_overlong_prompts`) or cut by `data.truncation`
//! (`left` keeps the end, `right` the start, `middle` both ends; `error` refuses the row).
//!
//! The tokenizer is behind [`PromptTokenizer`] so this crate stays free of libtorch; the trainer implements
//! it for the model's tokenizer (whose chat template comes from `tokenizer_config.json`).

use crate::{ChatMessage, DataError, Example, Prompt};

/// What turns prompts into token ids.
pub trait PromptTokenizer {
    /// `apply_chat_template(messages, add_generation_prompt=True, tokenize=True)`.
    fn chat_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String>;
    /// Raw text with the tokenizer's own special tokens.
    fn text_ids(&self, text: &str) -> Result<Vec<u32>, String>;
}

/// verl's `data.truncation`.
pub use jetrl_config::Truncation;

/// `data.max_prompt_length` and `data.truncation`.
#[derive(Debug, Clone, Copy)]
pub struct PromptLimits {
    pub max_len: usize,
    pub truncation: Truncation,
}

impl PromptLimits {
    pub fn from_config(cfg: &jetrl_config::DataConfig) -> Self {
        Self { max_len: cfg.max_prompt_length as usize, truncation: cfg.truncation }
    }
}

/// The prompt's ids before any length limit.
pub fn prompt_ids(example: &Example, tokenizer: &dyn PromptTokenizer) -> Result<Vec<u32>, DataError> {
    let ids = match &example.prompt {
        Prompt::Messages(messages) => tokenizer.chat_ids(messages),
        Prompt::Text(text) => tokenizer.text_ids(text),
    };
    ids.map_err(|message| DataError::Prompt { index: example.index, message })
}

/// Applies `data.truncation` to a prompt over the limit.
pub fn truncate(ids: Vec<u32>, limits: PromptLimits, index: u64) -> Result<Vec<u32>, DataError> {
    let max = limits.max_len;
    if ids.len() <= max {
        return Ok(ids);
    }
    Ok(match limits.truncation {
        Truncation::Left => ids[ids.len() - max..].to_vec(),
        Truncation::Right => ids[..max].to_vec(),
        Truncation::Middle => {
            let left = max / 2;
            let right = max - left;
            ids[..left].iter().chain(&ids[ids.len() - right..]).copied().collect()
        }
        Truncation::Error => {
            return Err(DataError::Prompt {
                index,
                message: format!(
                    "prompt length {} is longer than data.max_prompt_length {max} (set data.truncation or \
                     data.filter_overlong_prompts)",
                    ids.len()
                ),
            })
        }
    })
}

/// The prompt's ids within the limits.
pub fn tokenize_prompt(
    example: &Example,
    tokenizer: &dyn PromptTokenizer,
    limits: PromptLimits,
) -> Result<Vec<u32>, DataError> {
    truncate(prompt_ids(example, tokenizer)?, limits, example.index)
}

/// verl's `filter_overlong_prompts`: keeps the rows whose prompt fits `max_len` tokens; returns them and how
/// many were dropped.
pub fn filter_overlong(
    examples: Vec<Example>,
    tokenizer: &dyn PromptTokenizer,
    max_len: usize,
) -> Result<(Vec<Example>, usize), DataError> {
    let before = examples.len();
    let mut kept = Vec::with_capacity(before);
    for e in examples {
        if prompt_ids(&e, tokenizer)?.len() <= max_len {
            kept.push(e);
        }
    }
    let dropped = before - kept.len();
    Ok((kept, dropped))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One id per character; chat: `<role>` marker (id 1) then the content, then the generation prompt (id 2).
    struct CharTokenizer;

    impl PromptTokenizer for CharTokenizer {
        fn chat_ids(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, String> {
            let mut ids = Vec::new();
            for m in messages {
                ids.push(1);
                ids.extend(m.content.chars().map(|c| c as u32));
            }
            ids.push(2);
            Ok(ids)
        }

        fn text_ids(&self, text: &str) -> Result<Vec<u32>, String> {
            Ok(text.chars().map(|c| c as u32).collect())
        }
    }

    fn text(index: u64, t: &str) -> Example {
        Example {
            index,
            data_source: "t".into(),
            prompt: Prompt::Text(t.into()),
            ground_truth: String::new(),
            extra_info: serde_json::Value::Null,
            agent_name: None,
        }
    }

    #[test]
    fn truncation_modes_keep_the_ends_verl_keeps() {
        let ids: Vec<u32> = (0..10).collect();
        let limits = |truncation| PromptLimits { max_len: 5, truncation };
        assert_eq!(truncate(ids.clone(), limits(Truncation::Left), 0).unwrap(), vec![5, 6, 7, 8, 9]);
        assert_eq!(truncate(ids.clone(), limits(Truncation::Right), 0).unwrap(), vec![0, 1, 2, 3, 4]);
        assert_eq!(truncate(ids.clone(), limits(Truncation::Middle), 0).unwrap(), vec![0, 1, 7, 8, 9]);
        let err = truncate(ids, limits(Truncation::Error), 7).unwrap_err();
        assert!(matches!(err, DataError::Prompt { index: 7, .. }), "{err}");
        assert_eq!(truncate(vec![1, 2], limits(Truncation::Error), 0).unwrap(), vec![1, 2]);
    }

    #[test]
    fn chat_prompts_are_measured_after_the_template_when_filtering() {
        let chat = Example {
            prompt: Prompt::Messages(vec![ChatMessage { role: "user".into(), content: "abc".into() }]),
            ..text(1, "")
        };
        // "abc" is 3 tokens, 5 with the template's markers
        let (kept, dropped) = filter_overlong(vec![chat.clone(), text(2, "abcd")], &CharTokenizer, 4).unwrap();
        assert_eq!(dropped, 1);
        assert_eq!(kept, vec![text(2, "abcd")]);
        let ids =
            tokenize_prompt(&chat, &CharTokenizer, PromptLimits { max_len: 4, truncation: Truncation::Left }).unwrap();
        assert_eq!(ids, vec![97, 98, 99, 2]);
    }

    #[test]
    fn unknown_truncation_is_rejected() {
        assert!("both".parse::<Truncation>().is_err());
        assert_eq!("middle".parse::<Truncation>().unwrap(), Truncation::Middle);
    }
}
