//! The data (`data.*`): datasets or a built-in task, batch size and lengths, validation sampling.

use serde::{Deserialize, Serialize};

use crate::{TaskName, Truncation};

/// A built-in synthetic task (`data.task`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TaskConfig {
    pub name: TaskName,
    pub min_len: u32,
    pub max_len: u32,
    pub train_size: u32,
    pub val_size: u32,
    /// the prompt text; `{task}` and `{digits}` are replaced (use `{digits}=` for the `tiny-digits` model,
    /// whose vocabulary has no letters)
    pub template: String,
}

impl Default for TaskConfig {
    fn default() -> Self {
        Self {
            name: TaskName::Reverse,
            min_len: 4,
            max_len: 4,
            train_size: 20_000,
            val_size: 64,
            template: "{task} {digits}=".into(),
        }
    }
}

/// verl's `data.*`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    pub task: Option<TaskConfig>,
    /// verl-format `.parquet`, `.jsonl` or `.arrow` files, or HF `datasets` directories (`save_to_disk`), of rows
    /// with `prompt` chat messages, `data_source`, `reward_model.ground_truth`, `extra_info`
    pub train_files: Vec<String>,
    pub val_files: Vec<String>,
    /// rows kept from the train files; -1 = all (verl `train_max_samples`)
    pub train_max_samples: i64,
    /// rows kept from the val files; -1 = all (verl `val_max_samples`)
    pub val_max_samples: i64,
    /// prompt groups per step
    pub train_batch_size: u32,
    /// prompts per validation request; null = the whole validation set at once
    pub val_batch_size: Option<u32>,
    /// prompt tokens after the chat template; longer prompts are filtered or truncated
    pub max_prompt_length: u32,
    pub max_response_length: u32,
    pub shuffle: bool,
    /// shuffle the validation set (verl `validation_shuffle`)
    pub validation_shuffle: bool,
    pub seed: u64,
    pub prompt_key: String,
    /// the column of a row's images (verl `image_key`): a row whose column holds any is refused when the data
    /// loads, as jetrl trains on text prompts only
    pub image_key: String,
    /// the column of a row's videos (verl `video_key`), refused like `image_key`'s
    pub video_key: String,
    /// drop rows whose templated prompt exceeds `max_prompt_length` when the dataset is loaded
    pub filter_overlong_prompts: bool,
    /// what to do with a prompt over `max_prompt_length`
    pub truncation: Truncation,
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            task: None,
            train_files: vec![],
            val_files: vec![],
            train_max_samples: -1,
            val_max_samples: -1,
            train_batch_size: 1024,
            val_batch_size: None,
            max_prompt_length: 512,
            max_response_length: 512,
            shuffle: true,
            validation_shuffle: false,
            seed: 42,
            prompt_key: "prompt".into(),
            image_key: "images".into(),
            video_key: "videos".into(),
            filter_overlong_prompts: false,
            truncation: Truncation::Error,
        }
    }
}
