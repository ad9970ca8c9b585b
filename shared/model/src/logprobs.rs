//! The JSON-lines log-prob driver behind `jetrl logprobs`: one request per line, one answer per line.
//!
//! Request: `{"ids": [...]}` or `{"messages": [...], "add_generation_prompt": bool, "tools": [...]?}`.
//! Answer: `{"ids": [...], "logprobs": [...]}` where `logprobs[t] = log p(ids[t+1] | ids[..=t])` (f32) and, for
//! messages, `ids` is the chat template rendered and tokenized.

use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};
use tch::Device;

use crate::device::DType;
use crate::error::{ModelError, Result};
use crate::model::CausalLm;
use crate::recompute::log_probs_of;
use crate::tokenizer::Tokenizer;

#[derive(Deserialize)]
struct Request {
    ids: Option<Vec<u32>>,
    /// Kept as minijinja values so object keys stay in the order they were written (templates that `tojson`
    /// tool arguments print them in that order, as Python does).
    messages: Option<Vec<minijinja::Value>>,
    tools: Option<Vec<minijinja::Value>>,
    #[serde(default)]
    add_generation_prompt: bool,
}

#[derive(Serialize)]
struct Answer<'a> {
    ids: &'a [u32],
    logprobs: &'a [f32],
}

/// Runs the driver with the model on the CPU in f32 (the reference precision).
pub fn logprobs_jsonl(model_dir: &Path, input: impl BufRead, output: impl Write) -> Result<()> {
    logprobs_jsonl_on(model_dir, Device::Cpu, DType::F32, input, output)
}

/// [`logprobs_jsonl`] on a chosen device and dtype. Blank lines are skipped; a bad line stops the run with an
/// error naming its (1-based) number, after the answers to the lines before it were written.
pub fn logprobs_jsonl_on(
    model_dir: &Path,
    device: Device,
    dtype: DType,
    input: impl BufRead,
    mut output: impl Write,
) -> Result<()> {
    let model = CausalLm::load(model_dir, device, dtype)?;
    let mut tokenizer: Option<Tokenizer> = None;
    let out_err = |e: std::io::Error| ModelError::io("<output>", e);
    for (index, line) in input.lines().enumerate() {
        let number = index + 1;
        let line = line.map_err(|e| ModelError::io("<input>", e))?;
        if line.trim().is_empty() {
            continue;
        }
        let at_line = |reason: String| ModelError::Line { line: number, reason };
        let request: Request = serde_json::from_str(&line).map_err(|e| at_line(format!("invalid request: {e}")))?;
        let ids = match (request.ids, request.messages) {
            (Some(ids), None) => ids,
            (None, Some(messages)) => {
                if tokenizer.is_none() {
                    tokenizer = Some(Tokenizer::from_dir(model_dir).map_err(|e| at_line(e.to_string()))?);
                }
                let Some(tok) = tokenizer.as_ref() else { continue };
                let text = tok
                    .render_chat(&messages, request.tools.as_deref(), request.add_generation_prompt)
                    .map_err(|e| at_line(e.to_string()))?;
                tok.encode(&text, false).map_err(|e| at_line(e.to_string()))?
            }
            _ => return Err(at_line("a request has exactly one of `ids` and `messages`".into())),
        };
        let logprobs = log_probs_of(&model, &ids).map_err(|e| at_line(e.to_string()))?;
        serde_json::to_writer(&mut output, &Answer { ids: &ids, logprobs: &logprobs })
            .map_err(|e| ModelError::json("answer", e))?;
        output.write_all(b"\n").map_err(out_err)?;
        output.flush().map_err(out_err)?;
    }
    Ok(())
}
