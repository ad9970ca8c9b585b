//! Datasets for the trainer.
//!
//! - [`Example`]: one prompt row, verl's dataset schema (`prompt` chat messages or raw text, `data_source`,
//!   `reward_model.ground_truth`, `extra_info`, optional `agent_name`).
//! - [`tasks`]: built-in synthetic tasks with partial-credit rewards (the demo's job), generated from a seed.
//! - [`load_file`]: verl-format datasets, rows with `prompt` chat messages, `data_source`,
//!   `reward_model.ground_truth`, `extra_info`: `.parquet` (what verl's preprocessing scripts write; snappy, zstd
//!   and gzip pages), `.jsonl`, or HF `datasets` on disk ([`hf_dataset`]: a `Dataset.save_to_disk` directory or
//!   one of its `.arrow` files, read by [`arrow_ipc`]).
//! - [`prompt`]: the prompt as token ids — chat template, length filtering and truncation (verl `data.*`).
//! - [`DataLoader`]: seeded shuffling, re-iterated forever, with a cursor that a checkpoint can save.

pub mod arrow_ipc;
pub mod hf_dataset;
pub mod parquet_rows;
pub mod prompt;
pub mod tasks;

use std::path::Path;

use rand::seq::SliceRandom;
use rand::SeedableRng;
use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("reading {path}: {message}")]
    Read { path: String, message: String },
    #[error("{path} line {line}: {message}")]
    Row { path: String, line: usize, message: String },
    /// a row of a parquet or Arrow file (1-based)
    #[error("{path} row {row}: {message}")]
    Record { path: String, row: usize, message: String },
    #[error("dataset is empty: {0}")]
    Empty(String),
    #[error(
        "dataset format of {0} is not supported (.parquet, .jsonl, .arrow, or a directory `datasets` wrote with \
         save_to_disk)"
    )]
    Format(String),
    #[error("prompt of row {index}: {message}")]
    Prompt { index: u64, message: String },
}

impl DataError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Read { .. } => "read",
            Self::Row { .. } => "row",
            Self::Record { .. } => "record",
            Self::Empty(..) => "empty",
            Self::Format(..) => "format",
            Self::Prompt { .. } => "prompt",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

/// What the model is given.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Prompt {
    /// raw text, tokenized as is (no chat template)
    Text(String),
    /// chat messages, rendered with the model's chat template (add_generation_prompt = true)
    Messages(Vec<ChatMessage>),
}

/// One dataset row.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Example {
    /// verl's `extra_info.index` (else the row number)
    pub index: u64,
    pub data_source: String,
    pub prompt: Prompt,
    pub ground_truth: String,
    pub extra_info: serde_json::Value,
    pub agent_name: Option<String>,
}

/// A verl dataset row as found in JSONL.
#[derive(Deserialize)]
struct VerlRow {
    #[serde(default)]
    data_source: Option<String>,
    #[serde(default)]
    reward_model: Option<serde_json::Value>,
    #[serde(default)]
    extra_info: Option<serde_json::Value>,
    #[serde(default)]
    agent_name: Option<String>,
}

fn ground_truth_text(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// The columns a row is read by: verl's `data.prompt_key`, `data.image_key` and `data.video_key`. A prompt
/// column's name alone stands for these with verl's image and video columns (`images`, `videos`).
#[derive(Debug, Clone, Copy)]
pub struct Columns<'a> {
    pub prompt: &'a str,
    pub image: &'a str,
    pub video: &'a str,
}

impl<'a> From<&'a str> for Columns<'a> {
    fn from(prompt: &'a str) -> Self {
        Self { prompt, image: "images", video: "videos" }
    }
}

impl<'a> From<&'a jetrl_config::DataConfig> for Columns<'a> {
    fn from(cfg: &'a jetrl_config::DataConfig) -> Self {
        Self { prompt: &cfg.prompt_key, image: &cfg.image_key, video: &cfg.video_key }
    }
}

/// Whether a column's value holds something, as Python's truth test reads it (verl's `example.pop(key) or []`).
fn holds_something(value: &serde_json::Value) -> bool {
    use serde_json::Value;
    match value {
        Value::Null => false,
        Value::Bool(b) => *b,
        Value::Number(n) => n.as_f64() != Some(0.0),
        Value::String(s) => !s.is_empty(),
        Value::Array(items) => !items.is_empty(),
        Value::Object(map) => !map.is_empty(),
    }
}

/// Converts one verl row (a JSON object) into an [`Example`]; `row` is the row number, the index when the row
/// has no `extra_info.index`. A row with images or videos is refused: jetrl trains on text prompts only, and verl
/// would put them in the prompt.
pub(crate) fn example_from_row(
    mut value: serde_json::Value,
    columns: Columns<'_>,
    row: usize,
) -> Result<Example, String> {
    for (column, key, what) in [(columns.image, "image_key", "images"), (columns.video, "video_key", "videos")] {
        if value.get(column).is_some_and(holds_something) {
            return Err(format!(
                "column `{column}` (data.{key}) holds {what}: multi-modal inputs are not built, jetrl trains on \
                 text prompts only (give a dataset without {what}, or drop the column)"
            ));
        }
    }
    let prompt_key = columns.prompt;
    let prompt_value = value.get_mut(prompt_key).map(|v| v.take());
    let parsed: VerlRow = serde_json::from_value(value).map_err(|e| e.to_string())?;
    let prompt = match prompt_value {
        Some(serde_json::Value::String(text)) => Prompt::Text(text),
        Some(messages @ serde_json::Value::Array(_)) => {
            Prompt::Messages(serde_json::from_value(messages).map_err(|e| format!("{prompt_key}: {e}"))?)
        }
        _ => return Err(format!("missing `{prompt_key}` (chat messages or text)")),
    };
    let ground_truth =
        parsed.reward_model.as_ref().and_then(|rm| rm.get("ground_truth")).map(ground_truth_text).unwrap_or_default();
    let extra_info = parsed.extra_info.unwrap_or(serde_json::Value::Null);
    let index = extra_info.get("index").and_then(|v| v.as_u64()).unwrap_or(row as u64);
    Ok(Example {
        index,
        data_source: parsed.data_source.unwrap_or_default(),
        prompt,
        ground_truth,
        extra_info,
        agent_name: parsed.agent_name,
    })
}

/// What a row visitor gets: the row as a JSON object of its columns, and its 0-based number in the dataset (the
/// line number in JSONL). An error it returns becomes the row's error, naming the file and the row.
pub(crate) type OnRow<'a> = dyn FnMut(serde_json::Value, usize) -> Result<(), String> + 'a;

/// Visits every row of a dataset: a `.parquet`, `.jsonl` or `.arrow` file, or a `datasets` `save_to_disk`
/// directory.
fn visit_rows(path: &Path, on_row: &mut OnRow<'_>) -> Result<(), DataError> {
    if path.is_dir() {
        return hf_dataset::visit_dir(path, on_row);
    }
    match path.extension().and_then(|e| e.to_str()) {
        Some("parquet") => parquet_rows::visit_parquet(path, on_row),
        Some("jsonl") | Some("json") => visit_jsonl(path, on_row),
        Some("arrow") => hf_dataset::visit_arrow_file(path, None, &mut 0, on_row).map(|_| ()),
        _ if !path.exists() => {
            Err(DataError::Read { path: path.display().to_string(), message: "no such file or directory".into() })
        }
        _ => Err(DataError::Format(path.display().to_string())),
    }
}

/// Loads verl-format rows from a `.parquet`, `.jsonl` or `.arrow` file, or a directory HF `datasets` wrote with
/// `Dataset.save_to_disk`. `columns` names the prompt column (verl `data.prompt_key`) and the image and video
/// columns whose rows are refused ([`Columns`]).
pub fn load_file<'a>(path: &Path, columns: impl Into<Columns<'a>>) -> Result<Vec<Example>, DataError> {
    let columns = columns.into();
    let mut out = Vec::new();
    visit_rows(path, &mut |row, n| {
        out.push(example_from_row(row, columns, n)?);
        Ok(())
    })?;
    if out.is_empty() {
        return Err(DataError::Empty(path.display().to_string()));
    }
    Ok(out)
}

/// Every row of a dataset ([`load_file`]'s formats) as a JSON object of all its columns, as the loader sees it
/// before picking out the verl fields.
pub fn load_rows(path: &Path) -> Result<Vec<serde_json::Value>, DataError> {
    let mut out = Vec::new();
    visit_rows(path, &mut |row, _| {
        out.push(row);
        Ok(())
    })?;
    Ok(out)
}

/// Loads verl-format rows from a JSONL file. `prompt_key` names the prompt column (verl `data.prompt_key`).
pub fn load_jsonl(path: &Path, prompt_key: &str) -> Result<Vec<Example>, DataError> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("jsonl") | Some("json") => load_file(path, prompt_key),
        _ => Err(DataError::Format(path.display().to_string())),
    }
}

fn visit_jsonl(path: &Path, on_row: &mut OnRow<'_>) -> Result<(), DataError> {
    let name = path.display().to_string();
    let text =
        std::fs::read_to_string(path).map_err(|e| DataError::Read { path: name.clone(), message: e.to_string() })?;
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let row_err = |message: String| DataError::Row { path: name.clone(), line: i + 1, message };
        let value: serde_json::Value = serde_json::from_str(line).map_err(|e| row_err(e.to_string()))?;
        on_row(value, i).map_err(row_err)?;
    }
    Ok(())
}

/// verl's `train_max_samples` / `val_max_samples`: keep `max` rows (a seeded random subset when shuffling,
/// else the first ones); a negative `max` keeps all.
pub fn limit_samples(examples: Vec<Example>, max: i64, shuffle: bool, seed: u64) -> Vec<Example> {
    if max < 0 || max as usize >= examples.len() {
        return examples;
    }
    let max = max as usize;
    if !shuffle {
        return examples.into_iter().take(max).collect();
    }
    let mut order: Vec<usize> = (0..examples.len()).collect();
    order.shuffle(&mut rand_chacha::ChaCha8Rng::seed_from_u64(seed));
    let mut keep: Vec<usize> = order.into_iter().take(max).collect();
    keep.sort_unstable();
    let mut slots: Vec<Option<Example>> = examples.into_iter().map(Some).collect();
    keep.into_iter().filter_map(|i| slots[i].take()).collect()
}

/// Where a [`DataLoader`] is: enough to resume the exact same sequence of batches.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LoaderState {
    pub epoch: u64,
    pub cursor: usize,
}

/// One row drawn by a [`DataLoader`]: the unit of the exactly-once ledger is (`epoch`, `row`).
#[derive(Debug, Clone, PartialEq)]
pub struct Drawn {
    pub epoch: u64,
    /// position in the dataset (0-based)
    pub row: u64,
    pub example: Example,
}

/// Seeded, re-iterated forever (verl re-iterates on StopIteration); each epoch reshuffles with
/// `seed + epoch`.
pub struct DataLoader {
    examples: Vec<Example>,
    order: Vec<usize>,
    shuffle: bool,
    seed: u64,
    state: LoaderState,
}

impl DataLoader {
    pub fn new(examples: Vec<Example>, shuffle: bool, seed: u64) -> Result<Self, DataError> {
        if examples.is_empty() {
            return Err(DataError::Empty("dataloader".into()));
        }
        let mut loader =
            Self { order: (0..examples.len()).collect(), examples, shuffle, seed, state: LoaderState::default() };
        loader.reorder();
        Ok(loader)
    }

    fn reorder(&mut self) {
        self.order = self.order_of(self.state.epoch);
    }

    /// The order rows are drawn in during `epoch` (reshuffled with `seed + epoch`).
    fn order_of(&self, epoch: u64) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.examples.len()).collect();
        if self.shuffle {
            let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(epoch));
            order.shuffle(&mut rng);
        }
        order
    }

    /// Where `(epoch, row)` comes in the sequence of draws (0 = the first row of epoch 0), or `None` for a row
    /// outside the dataset. A loader at state `s` has drawn exactly the positions below [`DataLoader::drawn`].
    pub fn position_of(
        &self,
        epoch: u64,
        row: u64,
        cache: &mut std::collections::HashMap<u64, Vec<u64>>,
    ) -> Option<u64> {
        let len = self.examples.len() as u64;
        let positions = cache.entry(epoch).or_insert_with(|| {
            let mut at = vec![0u64; self.examples.len()];
            for (i, &r) in self.order_of(epoch).iter().enumerate() {
                at[r] = i as u64;
            }
            at
        });
        positions.get(row as usize).map(|&i| epoch * len + i)
    }

    /// How many rows a loader at `state` has drawn: positions below this were drawn.
    pub fn drawn(&self, state: LoaderState) -> u64 {
        state.epoch * self.examples.len() as u64 + state.cursor as u64
    }

    pub fn len(&self) -> usize {
        self.examples.len()
    }

    pub fn is_empty(&self) -> bool {
        self.examples.is_empty()
    }

    /// The next `n` examples, wrapping into the next epoch as needed.
    pub fn next_batch(&mut self, n: usize) -> Vec<Example> {
        self.next_rows(n).into_iter().map(|d| d.example).collect()
    }

    /// The next `n` rows with where they come from (epoch, position in the dataset), wrapping into the next
    /// epoch as needed.
    pub fn next_rows(&mut self, n: usize) -> Vec<Drawn> {
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            if self.state.cursor >= self.order.len() {
                self.state.epoch += 1;
                self.state.cursor = 0;
                self.reorder();
            }
            let row = self.order[self.state.cursor];
            out.push(Drawn { epoch: self.state.epoch, row: row as u64, example: self.examples[row].clone() });
            self.state.cursor += 1;
        }
        out
    }

    pub fn state(&self) -> LoaderState {
        self.state
    }

    /// Restores a saved position.
    pub fn restore(&mut self, state: LoaderState) {
        self.state = state;
        self.reorder();
    }

    pub fn examples(&self) -> &[Example] {
        &self.examples
    }
}

/// The train and validation sets a job configures: files when given, else the built-in task.
pub fn load_datasets(cfg: &jetrl_config::DataConfig) -> Result<(Vec<Example>, Vec<Example>), DataError> {
    if !cfg.train_files.is_empty() {
        let mut train = Vec::new();
        for f in &cfg.train_files {
            train.extend(load_file(Path::new(f), cfg)?);
        }
        let mut val = Vec::new();
        for f in &cfg.val_files {
            val.extend(load_file(Path::new(f), cfg)?);
        }
        let train = limit_samples(train, cfg.train_max_samples, cfg.shuffle, cfg.seed);
        let val = limit_samples(val, cfg.val_max_samples, cfg.validation_shuffle, cfg.seed);
        return Ok((train, val));
    }
    let task = cfg.task.clone().unwrap_or_default();
    Ok((tasks::generate(&task, tasks::Split::Train, cfg.seed)?, tasks::generate(&task, tasks::Split::Val, cfg.seed)?))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn verl_jsonl_rows_load_with_messages_ground_truth_and_index() {
        let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
        writeln!(
            f,
            r#"{{"data_source":"openai/gsm8k","prompt":[{{"role":"user","content":"1+1?"}}],"reward_model":{{"style":"rule","ground_truth":"2"}},"extra_info":{{"index":7}}}}"#
        )
        .unwrap();
        writeln!(
            f,
            r#"{{"data_source":"x","prompt":"raw text","reward_model":{{"ground_truth":{{"target":["a"]}}}}}}"#
        )
        .unwrap();
        let rows = load_jsonl(f.path(), "prompt").unwrap();
        assert_eq!(rows.len(), 2);
        assert_eq!(rows[0].index, 7);
        assert_eq!(rows[0].ground_truth, "2");
        assert_eq!(rows[0].prompt, Prompt::Messages(vec![ChatMessage { role: "user".into(), content: "1+1?".into() }]));
        assert_eq!(rows[1].prompt, Prompt::Text("raw text".into()));
        assert_eq!(rows[1].ground_truth, r#"{"target":["a"]}"#);
    }

    #[test]
    fn a_row_with_videos_is_refused_and_empty_media_columns_load() {
        let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
        writeln!(f, r#"{{"prompt":"a","images":[],"videos":null}}"#).unwrap();
        writeln!(f, r#"{{"prompt":"<video>b","clips":[{{"video":"b.mp4"}}]}}"#).unwrap();
        let cfg = jetrl_config::DataConfig { video_key: "clips".into(), ..Default::default() };
        let err = load_file(f.path(), &cfg).unwrap_err().to_string();
        assert!(err.contains("line 2") && err.contains("column `clips` (data.video_key) holds videos"), "{err}");
        let only_first = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
        std::fs::write(only_first.path(), "{\"prompt\":\"a\",\"images\":[],\"videos\":null}\n").unwrap();
        assert_eq!(load_file(only_first.path(), &cfg).unwrap().len(), 1);
    }

    #[test]
    fn bad_row_error_names_file_and_line() {
        let mut f = tempfile::Builder::new().suffix(".jsonl").tempfile().unwrap();
        writeln!(f, r#"{{"prompt":"ok"}}"#).unwrap();
        writeln!(f, "not json").unwrap();
        let err = load_jsonl(f.path(), "prompt").unwrap_err().to_string();
        assert!(err.contains("line 2"), "{err}");
    }

    #[test]
    fn loader_wraps_epochs_and_resumes_to_the_same_batches() {
        let examples: Vec<Example> = (0..10).map(example).collect();
        let mut a = DataLoader::new(examples.clone(), true, 3).unwrap();
        a.next_batch(7);
        let saved = a.state();
        let expected: Vec<u64> = a.next_batch(8).iter().map(|e| e.index).collect();
        let mut b = DataLoader::new(examples, true, 3).unwrap();
        b.restore(saved);
        let got: Vec<u64> = b.next_batch(8).iter().map(|e| e.index).collect();
        assert_eq!(got, expected);
        assert_eq!(b.state().epoch, 1);
    }

    fn example(i: u64) -> Example {
        Example {
            index: i,
            data_source: "t".into(),
            prompt: Prompt::Text(i.to_string()),
            ground_truth: String::new(),
            extra_info: serde_json::Value::Null,
            agent_name: None,
        }
    }

    #[test]
    fn max_samples_keeps_a_seeded_subset_in_file_order() {
        let rows: Vec<Example> = (0..20).map(example).collect();
        let first = limit_samples(rows.clone(), 5, false, 1);
        assert_eq!(first.iter().map(|e| e.index).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4]);
        let a = limit_samples(rows.clone(), 5, true, 1);
        let b = limit_samples(rows.clone(), 5, true, 1);
        assert_eq!(a, b);
        assert_eq!(a.len(), 5);
        assert_ne!(a, first, "shuffled: a seeded random subset, not the first rows");
        assert!(a.windows(2).all(|w| w[0].index < w[1].index));
        assert_eq!(limit_samples(rows, -1, true, 1).len(), 20);
    }

    #[test]
    fn unknown_file_extension_is_a_format_error_and_a_missing_path_a_read_error() {
        let f = tempfile::Builder::new().suffix(".csv").tempfile().unwrap();
        let err = load_file(f.path(), "prompt").unwrap_err();
        assert!(matches!(err, DataError::Format(_)), "{err}");
        let err = load_file(Path::new("/nonexistent/gsm8k"), "prompt").unwrap_err();
        assert!(err.to_string().contains("/nonexistent/gsm8k: no such file or directory"), "{err}");
    }
}
