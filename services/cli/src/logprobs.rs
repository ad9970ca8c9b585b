//! `jetrl logprobs`: log-probs of token sequences or chat messages, JSON lines in, JSON lines out.
//!
//! Request: `{"ids": [...]}` or `{"messages": [...], "add_generation_prompt": bool, "tools": [...]?}`.
//! Output line *i* answers input line *i*, always:
//! `{"line": i, "ids": [...], "logprobs": [...]}` where `logprobs[t] = log p(ids[t+1] | ids[..=t])` (f32) and, for
//! messages, `ids` is the chat template rendered and tokenized; or `{"line": i, "error": "..."}` saying why that
//! line was refused (not JSON, not a request, an id outside the vocabulary, more tokens than the model's
//! context, a template that raised). A bad line never stops the lines after it; only failing to load the model
//! or to read the input or write the output does.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use jetrl_model::{log_probs_of, CausalLm, DType, ModelError, Tokenizer};
use serde::{Deserialize, Serialize};
use tch::Device;

/// A longer line is refused without being held in memory (a million-token prompt is a few MB).
pub const MAX_LINE_BYTES: usize = 16 << 20;

/// What stops the whole run.
#[derive(Debug, thiserror::Error)]
pub enum LogprobsError {
    #[error("loading the model from {dir}: {source}")]
    Model {
        dir: PathBuf,
        #[source]
        source: ModelError,
    },
    #[error("reading the input: {0}")]
    Input(#[source] std::io::Error),
    #[error("writing the output: {0}")]
    Output(#[source] std::io::Error),
}

impl LogprobsError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Model { .. } => "model",
            Self::Input(..) => "input",
            Self::Output(..) => "output",
        }
    }
}

/// Why one line was refused; written on that line's output line.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum LineError {
    #[error("empty line: expected a JSON request")]
    Empty,
    #[error("the line is longer than {limit} bytes")]
    TooLong { limit: usize },
    #[error("the line is not UTF-8: {0}")]
    NotUtf8(String),
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("a request has exactly one of `ids` and `messages`")]
    IdsOrMessages,
    #[error("ids[{index}] = {id} is outside the vocabulary of {vocab} tokens")]
    OutOfVocabulary { index: usize, id: u32, vocab: i64 },
    #[error("{tokens} tokens exceed the model's context of {context} positions (max_position_embeddings)")]
    ContextExceeded { tokens: usize, context: i64 },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    ChatTemplate(String),
    #[error("model: {0}")]
    Model(String),
}

impl LineError {
    /// A stable, low-cardinality label for metrics and logs: the stage that failed.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Empty => "empty",
            Self::TooLong { .. } => "too_long",
            Self::NotUtf8(..) => "not_utf8",
            Self::Invalid(..) => "invalid",
            Self::IdsOrMessages => "ids_or_messages",
            Self::OutOfVocabulary { .. } => "out_of_vocabulary",
            Self::ContextExceeded { .. } => "context_exceeded",
            Self::Tokenizer(..) => "tokenizer",
            Self::ChatTemplate(..) => "chat_template",
            Self::Model(..) => "model",
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Request {
    ids: Option<Vec<u32>>,
    /// Kept as minijinja values so object keys stay in the order they were written (templates that `tojson`
    /// tool arguments print them in that order, as Python does).
    messages: Option<Vec<minijinja::Value>>,
    tools: Option<Vec<minijinja::Value>>,
    #[serde(default)]
    add_generation_prompt: bool,
}

/// One output line.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum OutputLine<'a> {
    Answer { line: usize, ids: &'a [u32], logprobs: &'a [f32] },
    Refused { line: usize, error: String },
}

/// The log-probs of one request.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub ids: Vec<u32>,
    pub logprobs: Vec<f32>,
}

/// How many lines a run read and how many of them were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Summary {
    pub lines: usize,
    pub refused: usize,
}

/// The model (and, once a `messages` line needs it, the tokenizer) answering request lines.
pub struct Driver {
    model: CausalLm,
    model_dir: PathBuf,
    /// Loaded on the first `messages` line; a failure is kept and given as every such line's error.
    tokenizer: Option<Result<Tokenizer, String>>,
}

impl Driver {
    pub fn load(model_dir: &Path, device: Device, dtype: DType) -> Result<Self, LogprobsError> {
        let model = CausalLm::load(model_dir, device, dtype)
            .map_err(|source| LogprobsError::Model { dir: model_dir.to_path_buf(), source })?;
        Ok(Driver { model, model_dir: model_dir.to_path_buf(), tokenizer: None })
    }

    /// Scores with the PEFT adapter in `dir` applied to the model (unmerged, as the trainer computes).
    pub fn with_lora(mut self, dir: &Path) -> Result<Self, LogprobsError> {
        self.model.load_lora(dir).map_err(|source| LogprobsError::Model { dir: dir.to_path_buf(), source })?;
        Ok(self)
    }

    /// Answers one request line (without its newline).
    pub fn answer(&mut self, line: &[u8]) -> Result<Answer, LineError> {
        let text = std::str::from_utf8(line).map_err(|e| LineError::NotUtf8(e.to_string()))?;
        if text.trim().is_empty() {
            return Err(LineError::Empty);
        }
        let mut json = serde_json::Deserializer::from_str(text);
        // The path names the field: serde_json's own message says only what type it expected.
        let request: Request = serde_path_to_error::deserialize(&mut json).map_err(|e| {
            let path = e.path().to_string();
            let inner = e.into_inner();
            LineError::Invalid(if path == "." { inner.to_string() } else { format!("`{path}`: {inner}") })
        })?;
        json.end().map_err(|e| LineError::Invalid(e.to_string()))?;
        let ids = match (request.ids, request.messages) {
            (Some(ids), None) => ids,
            (None, Some(messages)) => {
                self.render(&messages, request.tools.as_deref(), request.add_generation_prompt)?
            }
            _ => return Err(LineError::IdsOrMessages),
        };
        let config = self.model.config();
        // Checked before any tensor exists: the forward pass of a sequence past the context would allocate for
        // all of it (gigabytes for tens of thousands of ids) before the model refused it.
        if ids.len() as u64 > config.max_position_embeddings as u64 {
            return Err(LineError::ContextExceeded { tokens: ids.len(), context: config.max_position_embeddings });
        }
        if let Some((index, &id)) = ids.iter().enumerate().find(|(_, &id)| i64::from(id) >= config.vocab_size) {
            return Err(LineError::OutOfVocabulary { index, id, vocab: config.vocab_size });
        }
        let logprobs = log_probs_of(&self.model, &ids).map_err(|e| LineError::Model(e.to_string()))?;
        Ok(Answer { ids, logprobs })
    }

    fn render(
        &mut self,
        messages: &[minijinja::Value],
        tools: Option<&[minijinja::Value]>,
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>, LineError> {
        let model_dir = &self.model_dir;
        let tokenizer = self.tokenizer.get_or_insert_with(|| Tokenizer::from_dir(model_dir).map_err(|e| e.to_string()));
        let tokenizer = tokenizer.as_ref().map_err(|e| LineError::Tokenizer(e.clone()))?;
        let text = tokenizer.render_chat(messages, tools, add_generation_prompt).map_err(|e| match e {
            jetrl_model::TokenizerError::ChatTemplate(reason) => LineError::ChatTemplate(reason),
            other => LineError::Tokenizer(other.to_string()),
        })?;
        tokenizer.encode(&text, false).map_err(|e| LineError::Tokenizer(e.to_string()))
    }
}

/// Loads the model and answers every line of `input` on `output`, one output line per input line.
pub fn logprobs_jsonl(
    model_dir: &Path,
    lora: Option<&Path>,
    device: Device,
    dtype: DType,
    input: impl BufRead,
    output: impl Write,
) -> Result<Summary, LogprobsError> {
    let mut driver = Driver::load(model_dir, device, dtype)?;
    if let Some(dir) = lora {
        driver = driver.with_lora(dir)?;
    }
    run(&mut driver, input, output)
}

/// Answers every line of `input` on `output` (see the module docs).
pub fn run(driver: &mut Driver, mut input: impl BufRead, mut output: impl Write) -> Result<Summary, LogprobsError> {
    let mut summary = Summary::default();
    let mut line = Vec::new();
    while let Some(read) = read_line(&mut input, &mut line, MAX_LINE_BYTES).map_err(LogprobsError::Input)? {
        summary.lines += 1;
        let number = summary.lines;
        let answer = match read {
            LineRead::Whole => driver.answer(&line),
            LineRead::TooLong => Err(LineError::TooLong { limit: MAX_LINE_BYTES }),
        };
        let written = match &answer {
            Ok(answer) => OutputLine::Answer { line: number, ids: &answer.ids, logprobs: &answer.logprobs },
            Err(err) => {
                summary.refused += 1;
                OutputLine::Refused { line: number, error: err.to_string() }
            }
        };
        serde_json::to_writer(&mut output, &written).map_err(|e| LogprobsError::Output(e.into()))?;
        output.write_all(b"\n").map_err(LogprobsError::Output)?;
        output.flush().map_err(LogprobsError::Output)?;
    }
    Ok(summary)
}

/// How [`read_line`] ended.
#[derive(Debug, PartialEq, Eq)]
enum LineRead {
    /// `line` holds the whole line, without its newline.
    Whole,
    /// The line was longer than the limit; it was read to its end and dropped.
    TooLong,
}

/// Reads the next line into `line` holding at most `limit` bytes of it; `None` at the end of the input.
fn read_line(input: &mut impl BufRead, line: &mut Vec<u8>, limit: usize) -> std::io::Result<Option<LineRead>> {
    line.clear();
    let mut too_long = false;
    let mut read_any = false;
    loop {
        let buffer = match input.fill_buf() {
            Ok(buffer) => buffer,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if buffer.is_empty() {
            break;
        }
        read_any = true;
        let (chunk, done) = match buffer.iter().position(|&b| b == b'\n') {
            Some(end) => (&buffer[..end], Some(end + 1)),
            None => (buffer, None),
        };
        if !too_long && line.len() + chunk.len() <= limit {
            line.extend_from_slice(chunk);
        } else {
            too_long = true;
            line.clear();
        }
        let consumed = done.unwrap_or(buffer.len());
        input.consume(consumed);
        if done.is_some() {
            break;
        }
    }
    if !read_any {
        return Ok(None);
    }
    if line.last() == Some(&b'\r') {
        line.pop();
    }
    Ok(Some(if too_long { LineRead::TooLong } else { LineRead::Whole }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(input: &[u8], limit: usize) -> Vec<(Option<LineRead>, Vec<u8>)> {
        let mut reader = std::io::BufReader::with_capacity(4, input);
        let mut out = Vec::new();
        let mut line = Vec::new();
        loop {
            let read = read_line(&mut reader, &mut line, limit).unwrap();
            let end = read.is_none();
            out.push((read, line.clone()));
            if end {
                return out;
            }
        }
    }

    #[test]
    fn lines_are_read_whole_up_to_the_limit_and_a_longer_one_is_dropped_to_its_end() {
        let read = lines(b"ab\n\n0123456789\r\nxyz", 8);
        assert_eq!(
            read,
            vec![
                (Some(LineRead::Whole), b"ab".to_vec()),
                (Some(LineRead::Whole), b"".to_vec()),
                (Some(LineRead::TooLong), b"".to_vec()),
                (Some(LineRead::Whole), b"xyz".to_vec()),
                (None, b"".to_vec()),
            ]
        );
        assert_eq!(lines(b"", 8), vec![(None, b"".to_vec())]);
        assert_eq!(lines(b"12345678\n", 8)[0], (Some(LineRead::Whole), b"12345678".to_vec()));
    }
}
