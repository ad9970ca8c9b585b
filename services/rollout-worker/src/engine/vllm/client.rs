//! vLLM's HTTP routes the worker uses, typed: generation by token ids (`/inference/v1/generate`), abort, pause and
//! resume, weight versions and reloads (`/collective_rpc` with `reload_weights`), LoRA adapters, sleep and wake-up.
//! Every call carries the server's key and a deadline; an answer that is not 2xx becomes [`VllmError::Status`]
//! with the server's message.

use std::time::Duration;

use jetrl_model::{Finish, Sampling};
use jetrl_telemetry::http::{self, HttpEndpoint, HttpError};
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};

use super::VllmError;

/// What vLLM puts before a generate request's id in its engine (the id an abort names).
const ENGINE_ID_PREFIX: &str = "generate-tokens-";

/// How long a control call (pause, reload, adapter) may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(600);

/// A connection to one vLLM server.
#[derive(Debug, Clone)]
pub struct Client {
    pub endpoint: HttpEndpoint,
    pub url: String,
    authorization: Option<String>,
    generate_timeout: Duration,
}

/// One sample to generate: the context ids (the prompt, and a resumed prefix after it) and how to sample.
#[derive(Debug, Clone, Serialize)]
pub struct GenerateRequest {
    pub request_id: String,
    pub token_ids: Vec<u32>,
    pub sampling_params: SamplingParams,
    /// the served model, or a LoRA adapter's name
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<String>,
}

/// vLLM's `SamplingParams`, the fields jetrl sets.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct SamplingParams {
    pub n: u32,
    pub temperature: f32,
    pub top_p: f32,
    pub top_k: i64,
    pub repetition_penalty: f32,
    pub max_tokens: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<u64>,
    pub stop_token_ids: Vec<u32>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub stop: Vec<String>,
    /// jetrl keeps the token that completes a stop string, as its own engine does
    pub include_stop_str_in_output: bool,
    pub ignore_eos: bool,
    /// 0: the sampled token's log-prob alone
    pub logprobs: u32,
    /// text only when stop strings need it
    pub detokenize: bool,
    pub skip_special_tokens: bool,
}

impl SamplingParams {
    /// jetrl's sampling for `max_tokens` more tokens, with the model's end-of-sequence ids as stop ids (so vLLM
    /// ends where jetrl's engine would, whatever the checkpoint's generation config says).
    pub fn of(sampling: &Sampling, max_tokens: usize, seed: Option<u64>, eos: &[u32]) -> Self {
        let mut stop_token_ids = sampling.stop_token_ids.clone();
        if !sampling.ignore_eos {
            stop_token_ids.extend_from_slice(eos);
        }
        stop_token_ids.sort_unstable();
        stop_token_ids.dedup();
        Self {
            n: 1,
            temperature: sampling.temperature,
            top_p: sampling.top_p,
            top_k: if sampling.top_k <= 0 { -1 } else { sampling.top_k },
            repetition_penalty: sampling.repetition_penalty,
            max_tokens,
            seed,
            stop_token_ids,
            stop: sampling.stop.clone(),
            include_stop_str_in_output: true,
            ignore_eos: sampling.ignore_eos,
            logprobs: 0,
            detokenize: !sampling.stop.is_empty(),
            skip_special_tokens: false,
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct GenerateResponse {
    pub choices: Vec<Choice>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Choice {
    /// which of the request's `n` samples
    #[serde(default)]
    pub index: usize,
    #[serde(default)]
    pub finish_reason: Option<String>,
    #[serde(default)]
    pub stop_reason: Option<Value>,
    #[serde(default)]
    pub token_ids: Option<Vec<u32>>,
    #[serde(default)]
    pub logprobs: Option<Logprobs>,
    #[serde(default)]
    pub weight_versions: Option<Vec<WeightVersionSpan>>,
    /// with `--enable-return-routed-experts`: a base64 `.npy` array `[tokens - 1, layers, top_k]`
    #[serde(default)]
    pub routed_experts: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Logprobs {
    #[serde(default)]
    pub content: Option<Vec<TokenLogprob>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct TokenLogprob {
    pub token_id: u32,
    pub logprob: f32,
}

/// Output tokens `[start, end)` were sampled by the weights labelled `version`.
#[derive(Debug, Clone, Deserialize, PartialEq, Eq)]
pub struct WeightVersionSpan {
    pub version: String,
    pub start: u32,
    pub end: u32,
}

/// One generated sample as the worker needs it.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub finish: Finish,
    /// `(first token, version)` runs, from vLLM's weight-version spans (empty when it sent none)
    pub version_runs: Vec<(u32, u64)>,
    /// the experts each prompt and output token but the last was routed to, token-major, and the experts per
    /// token (layers × top_k); empty when the server returns none
    pub routed_experts: (Vec<u16>, usize),
}

impl Choice {
    /// The sample, checked: as many log-probs as tokens, each for its own token.
    pub fn into_sample(self, eos: &[u32]) -> Result<Sample, VllmError> {
        let tokens = self.token_ids.unwrap_or_default();
        let content = self.logprobs.and_then(|l| l.content).unwrap_or_default();
        if content.len() != tokens.len() {
            return Err(VllmError::Malformed(format!(
                "{} tokens but {} log-probs (is the server's --max-logprobs 0 or more?)",
                tokens.len(),
                content.len()
            )));
        }
        if let Some((i, _)) = content.iter().zip(&tokens).enumerate().find(|(_, (lp, &t))| lp.token_id != t) {
            return Err(VllmError::Malformed(format!("log-prob {i} is not for token {i}")));
        }
        let logprobs = content.iter().map(|lp| lp.logprob).collect();
        let finish = match self.finish_reason.as_deref() {
            Some("length") => Finish::Length,
            Some("abort") => Finish::Aborted,
            Some("stop") | None => match self.stop_reason {
                Some(Value::String(s)) => Finish::StopString(s),
                Some(Value::Number(n)) => match n.as_u64().and_then(|id| u32::try_from(id).ok()) {
                    Some(id) if eos.contains(&id) => Finish::Eos(id),
                    Some(id) => Finish::StopToken(id),
                    None => Finish::Length,
                },
                _ => match tokens.last() {
                    Some(&last) if eos.contains(&last) => Finish::Eos(last),
                    _ => Finish::Length,
                },
            },
            Some(other) => return Err(VllmError::Malformed(format!("finish reason {other:?}"))),
        };
        let mut version_runs = Vec::new();
        for span in self.weight_versions.unwrap_or_default() {
            if span.end <= span.start {
                continue;
            }
            let version = span
                .version
                .parse::<u64>()
                .map_err(|_| VllmError::Malformed(format!("weight version {:?} is not jetrl's tag", span.version)))?;
            if version_runs.last().map(|&(_, v)| v) != Some(version) {
                version_runs.push((span.start, version));
            }
        }
        let routed_experts = match &self.routed_experts {
            Some(b64) => decode_npy_u16(b64)?,
            None => (Vec::new(), 0),
        };
        Ok(Sample { tokens, logprobs, finish, version_runs, routed_experts })
    }
}

impl Client {
    pub fn new(url: &str, api_key: Option<&str>, generate_timeout: Duration) -> Result<Self, VllmError> {
        let endpoint = HttpEndpoint::parse(url.trim_end_matches('/'))
            .map_err(|e| VllmError::Config { key: "rollout.vllm.url", message: e.to_string() })?;
        Ok(Self {
            endpoint,
            url: url.trim_end_matches('/').to_string(),
            authorization: api_key.map(|k| format!("Bearer {k}")),
            generate_timeout,
        })
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Option<&[u8]>,
        timeout: Duration,
    ) -> Result<Vec<u8>, VllmError> {
        let auth = self.authorization.as_deref().map(|a| ("Authorization", a));
        let headers: Vec<(&str, &str)> = auth.into_iter().collect();
        let request = http::Request {
            method,
            path,
            headers: &headers,
            content_type: body.map(|_| "application/json"),
            body: body.unwrap_or_default(),
        };
        let response = http::send(&self.endpoint, &request, timeout).await.map_err(|source| match source {
            HttpError::Timeout(after) => VllmError::Timeout { path: path.to_string(), after },
            source => VllmError::Http { url: format!("{}{path}", self.url), source: std::sync::Arc::new(source) },
        })?;
        if !(200..300).contains(&response.status) {
            let text = String::from_utf8_lossy(&response.body);
            return Err(VllmError::Status {
                path: path.to_string(),
                status: response.status,
                message: server_message(&text),
            });
        }
        Ok(response.body)
    }

    async fn post_json(&self, path: &str, body: &Value, timeout: Duration) -> Result<Value, VllmError> {
        let bytes = serde_json::to_vec(body).map_err(|e| VllmError::Malformed(e.to_string()))?;
        let answer = self.call("POST", path, Some(&bytes), timeout).await?;
        if answer.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&answer).map_err(|e| VllmError::Malformed(format!("{path}: {e}")))
    }

    async fn get_json(&self, path: &str) -> Result<Value, VllmError> {
        let answer = self.call("GET", path, None, CONTROL_TIMEOUT).await?;
        serde_json::from_slice(&answer).map_err(|e| VllmError::Malformed(format!("{path}: {e}")))
    }

    /// The request's `n` samples, in order, waited for until they end (or are aborted).
    pub async fn generate(&self, request: &GenerateRequest, eos: &[u32]) -> Result<Vec<Sample>, VllmError> {
        let body = serde_json::to_vec(request).map_err(|e| VllmError::Malformed(e.to_string()))?;
        let answer = self.call("POST", "/inference/v1/generate", Some(&body), self.generate_timeout).await?;
        let response: GenerateResponse = serde_json::from_slice(&answer)
            .map_err(|e| VllmError::Malformed(format!("/inference/v1/generate: {e}")))?;
        samples(response, request.sampling_params.n as usize, eos)
    }

    /// Aborts these requests (by the ids the worker gave them); their generate calls answer with what they had.
    pub async fn abort(&self, request_ids: &[String]) -> Result<(), VllmError> {
        if request_ids.is_empty() {
            return Ok(());
        }
        // the engine knows a generate request as `generate-tokens-<request_id>`
        let engine_ids: Vec<String> = request_ids.iter().map(|id| format!("{ENGINE_ID_PREFIX}{id}")).collect();
        self.post_json("/inference/v1/abort_requests", &json!({ "request_ids": engine_ids }), CONTROL_TIMEOUT)
            .await
            .map(drop)
    }

    /// `abort`: in-flight requests end at once with what they had; `keep`: they wait in the engine for `resume`.
    pub async fn pause(&self, mode: &str) -> Result<(), VllmError> {
        self.post_json(&format!("/pause?mode={mode}"), &json!({}), CONTROL_TIMEOUT).await.map(drop)
    }

    pub async fn resume(&self) -> Result<(), VllmError> {
        self.post_json("/resume", &json!({}), CONTROL_TIMEOUT).await.map(drop)
    }

    /// Loads the weights in `dir` (safetensors with HF names) into the running model.
    pub async fn reload_weights(&self, dir: &std::path::Path) -> Result<(), VllmError> {
        let body = json!({
            "method": "reload_weights",
            "kwargs": { "weights_path": dir.display().to_string() },
        });
        self.post_json("/collective_rpc", &body, CONTROL_TIMEOUT).await.map(drop)
    }

    /// Labels the tokens sampled from now on with jetrl's version tag.
    pub async fn set_weight_version(&self, version: u64) -> Result<(), VllmError> {
        self.post_json("/update_weight_version", &json!({ "new_version": version.to_string() }), CONTROL_TIMEOUT)
            .await
            .map(drop)
    }

    /// The label `set_weight_version` gave (None before any).
    pub async fn weight_version(&self) -> Result<Option<String>, VllmError> {
        let info = self.get_json("/weight_info").await?;
        Ok(info.get("weight_version").and_then(|v| v.as_str()).map(str::to_string))
    }

    pub async fn load_lora_adapter(&self, name: &str, dir: &std::path::Path) -> Result<(), VllmError> {
        let body = json!({ "lora_name": name, "lora_path": dir.display().to_string() });
        self.post_json("/v1/load_lora_adapter", &body, CONTROL_TIMEOUT).await.map(drop)
    }

    pub async fn unload_lora_adapter(&self, name: &str) -> Result<(), VllmError> {
        self.post_json("/v1/unload_lora_adapter", &json!({ "lora_name": name }), CONTROL_TIMEOUT).await.map(drop)
    }

    /// Releases the KV cache and, at level 1, offloads the weights to the host (`/sleep`, dev mode).
    pub async fn sleep(&self, level: u32) -> Result<(), VllmError> {
        self.post_json(&format!("/sleep?level={level}"), &json!({}), CONTROL_TIMEOUT).await.map(drop)
    }

    pub async fn wake_up(&self) -> Result<(), VllmError> {
        self.post_json("/wake_up", &json!({}), CONTROL_TIMEOUT).await.map(drop)
    }
}

/// A base64 `.npy` array of unsigned or non-negative integers (`|u1`, `<u2`, `<i4`, `<i8`, C order, 3 dimensions), as
/// its values and the product of its last two dimensions.
fn decode_npy_u16(b64: &str) -> Result<(Vec<u16>, usize), VllmError> {
    use base64::Engine as _;
    let bad = |why: &str| VllmError::Malformed(format!("routed_experts: {why}"));
    let bytes = base64::engine::general_purpose::STANDARD.decode(b64).map_err(|e| bad(&e.to_string()))?;
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not an .npy array"));
    }
    let (header_len, start) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        _ if bytes.len() >= 12 => (u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize, 12),
        _ => return Err(bad("truncated header")),
    };
    let header = bytes.get(start..start + header_len).ok_or_else(|| bad("truncated header"))?;
    let header = std::str::from_utf8(header).map_err(|_| bad("header is not text"))?;
    let field = |key: &str| header.split(key).nth(1).map(str::trim_start);
    let descr = field("'descr':").and_then(|s| s.split('\'').nth(1)).ok_or_else(|| bad("no descr"))?;
    if field("'fortran_order':").is_some_and(|s| s.starts_with("True")) {
        return Err(bad("Fortran order"));
    }
    let shape: Vec<usize> = field("'shape':")
        .and_then(|s| s.strip_prefix('(')?.split(')').next())
        .ok_or_else(|| bad("no shape"))?
        .split(',')
        .filter(|d| !d.trim().is_empty())
        .map(|d| d.trim().parse::<usize>().map_err(|_| bad("shape")))
        .collect::<Result<_, _>>()?;
    let [_, layers, top_k] = shape[..] else { return Err(bad(&format!("shape {shape:?} is not [tokens, layers, k]"))) };
    let data = &bytes[start + header_len..];
    let values: Vec<u64> = match descr {
        "|u1" => data.iter().map(|&b| u64::from(b)).collect(),
        "<u2" => data.chunks_exact(2).map(|c| u64::from(u16::from_le_bytes([c[0], c[1]]))).collect(),
        "<i4" => data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u64).collect(),
        "<i8" => data.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().unwrap_or_default()) as u64).collect(),
        other => return Err(bad(&format!("dtype {other}"))),
    };
    if values.len() != shape.iter().product::<usize>() {
        return Err(bad(&format!("{} values for shape {shape:?}", values.len())));
    }
    let values = values
        .into_iter()
        .map(|v| u16::try_from(v).map_err(|_| bad(&format!("expert {v}"))))
        .collect::<Result<Vec<u16>, _>>()?;
    Ok((values, layers * top_k))
}

/// The `n` samples of a response, by their choice index (each exactly once).
fn samples(response: GenerateResponse, n: usize, eos: &[u32]) -> Result<Vec<Sample>, VllmError> {
    let mut out: Vec<Option<Sample>> = vec![None; n];
    for choice in response.choices {
        let index = choice.index;
        let slot = out
            .get_mut(index)
            .ok_or_else(|| VllmError::Malformed(format!("choice {index} of a request for {n} samples")))?;
        if slot.is_some() {
            return Err(VllmError::Malformed(format!("choice {index} answered twice")));
        }
        *slot = Some(choice.into_sample(eos)?);
    }
    out.into_iter()
        .enumerate()
        .map(|(i, s)| s.ok_or_else(|| VllmError::Malformed(format!("no choice {i} of {n}"))))
        .collect()
}

/// The message of vLLM's error body (`{"error": {"message": ...}}`, `{"error": "..."}`, `{"detail": ...}`), or
/// the start of the body.
fn server_message(body: &str) -> String {
    let parsed: Option<Value> = serde_json::from_str(body).ok();
    let found = parsed.as_ref().and_then(|v| {
        v.pointer("/error/message")
            .or_else(|| v.get("error"))
            .or_else(|| v.get("detail"))
            .or_else(|| v.get("message"))
            .map(|m| match m {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            })
    });
    let mut text = found.unwrap_or_else(|| body.trim().to_string());
    if text.len() > 500 {
        let mut cut = 500;
        while !text.is_char_boundary(cut) {
            cut -= 1;
        }
        text.truncate(cut);
        text.push('…');
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn choice(json: Value) -> Choice {
        serde_json::from_value(json).unwrap()
    }

    #[test]
    fn a_choice_becomes_a_sample_with_its_finish_and_version_runs() {
        let c = choice(json!({
            "finish_reason": "stop", "stop_reason": null, "token_ids": [5, 6, 2],
            "logprobs": {"content": [
                {"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.0}, {"token_id": 2, "logprob": -0.1}
            ]},
            "weight_versions": [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
        }));
        let s = c.into_sample(&[2]).unwrap();
        assert_eq!(s.tokens, vec![5, 6, 2]);
        assert_eq!(s.logprobs, vec![-0.5, -1.0, -0.1]);
        assert_eq!(s.finish, Finish::Eos(2));
        assert_eq!(s.version_runs, vec![(0, 3), (2, 4)]);
    }

    #[test]
    fn stop_reasons_map_to_jetrls_finishes() {
        let base = |reason: &str, stop: Value| {
            choice(json!({"finish_reason": reason, "stop_reason": stop, "token_ids": [7],
                "logprobs": {"content": [{"token_id": 7, "logprob": -0.2}]}}))
            .into_sample(&[2])
            .unwrap()
            .finish
        };
        assert_eq!(base("stop", json!(7)), Finish::StopToken(7));
        assert_eq!(base("stop", json!(2)), Finish::Eos(2));
        assert_eq!(base("stop", json!("ab")), Finish::StopString("ab".into()));
        assert_eq!(base("length", Value::Null), Finish::Length);
        assert_eq!(base("abort", Value::Null), Finish::Aborted);
    }

    #[test]
    fn a_sample_whose_log_probs_do_not_match_its_tokens_is_refused() {
        let missing = choice(json!({"finish_reason": "length", "token_ids": [1, 2], "logprobs": null}));
        assert!(matches!(missing.into_sample(&[]), Err(VllmError::Malformed(_))));
        let shifted = choice(json!({"finish_reason": "length", "token_ids": [1],
            "logprobs": {"content": [{"token_id": 9, "logprob": -1.0}]}}));
        assert!(matches!(shifted.into_sample(&[]), Err(VllmError::Malformed(_))));
        let tag = choice(json!({"finish_reason": "length", "token_ids": [1],
            "logprobs": {"content": [{"token_id": 1, "logprob": -1.0}]},
            "weight_versions": [{"version": "default", "start": 0, "end": 1}]}));
        assert!(matches!(tag.into_sample(&[]), Err(VllmError::Malformed(_))));
    }

    #[test]
    fn sampling_params_add_the_models_end_ids_and_ask_for_text_only_for_stop_strings() {
        let s = Sampling { stop_token_ids: vec![9, 3], max_tokens: 10, ..Sampling::default() };
        let p = SamplingParams::of(&s, 7, Some(1), &[2, 3]);
        assert_eq!(p.stop_token_ids, vec![2, 3, 9]);
        assert_eq!(p.max_tokens, 7);
        assert!(!p.detokenize);
        let s = Sampling { stop: vec!["\n".into()], top_k: 0, ..Sampling::default() };
        let p = SamplingParams::of(&s, 1, None, &[]);
        assert!(p.detokenize && p.include_stop_str_in_output);
        assert_eq!(p.top_k, -1);
    }

    #[test]
    fn a_response_must_answer_each_sample_once() {
        let choice = |i: usize| {
            json!({"index": i, "finish_reason": "length", "token_ids": [i],
            "logprobs": {"content": [{"token_id": i, "logprob": -1.0}]}})
        };
        let response =
            |choices: Vec<Value>| -> GenerateResponse { serde_json::from_value(json!({"choices": choices})).unwrap() };
        let two = samples(response(vec![choice(1), choice(0)]), 2, &[]).unwrap();
        assert_eq!(two[0].tokens, vec![0]);
        assert_eq!(two[1].tokens, vec![1]);
        assert!(samples(response(vec![choice(0)]), 2, &[]).is_err());
        assert!(samples(response(vec![choice(0), choice(0)]), 2, &[]).is_err());
        assert!(samples(response(vec![choice(2)]), 1, &[]).is_err());
    }

    #[test]
    fn server_errors_keep_their_message() {
        assert_eq!(server_message(r#"{"error": {"message": "prompt too long", "code": 400}}"#), "prompt too long");
        assert_eq!(server_message(r#"{"detail": "Unauthorized"}"#), "Unauthorized");
        assert_eq!(server_message("plain text"), "plain text");
    }

    /// `.npy` bytes of a `[tokens, layers, k]` array in `descr`, base64.
    fn npy(descr: &str, shape: [usize; 3], data: &[u8]) -> String {
        use base64::Engine as _;
        let (t, l, k) = (shape[0], shape[1], shape[2]);
        let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': ({t}, {l}, {k}), }}");
        while (10 + header.len() + 1) % 64 != 0 {
            header.push(' ');
        }
        header.push('\n');
        let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
        bytes.extend_from_slice(&(header.len() as u16).to_le_bytes());
        bytes.extend_from_slice(header.as_bytes());
        bytes.extend_from_slice(data);
        base64::engine::general_purpose::STANDARD.encode(bytes)
    }

    #[test]
    fn routed_experts_arrive_as_numpy_arrays_of_any_integer_width() {
        let with_routes = |routes: String| {
            choice(json!({"finish_reason": "length", "token_ids": [5, 6],
                "logprobs": {"content": [{"token_id": 5, "logprob": -0.5}, {"token_id": 6, "logprob": -1.0}]},
                "routed_experts": routes}))
        };
        let bytes: Vec<u8> = vec![3, 1, 0, 7, 2, 2, 6, 5];
        let s = with_routes(npy("|u1", [2, 2, 2], &bytes)).into_sample(&[]).unwrap();
        assert_eq!(s.routed_experts, (vec![3, 1, 0, 7, 2, 2, 6, 5], 4));
        let wide: Vec<u8> = [300u16, 1].iter().flat_map(|v| v.to_le_bytes()).collect();
        let s = with_routes(npy("<u2", [1, 1, 2], &wide)).into_sample(&[]).unwrap();
        assert_eq!(s.routed_experts, (vec![300, 1], 2));
        let int32: Vec<u8> = [9i32, 4].iter().flat_map(|v| v.to_le_bytes()).collect();
        let s = with_routes(npy("<i4", [1, 2, 1], &int32)).into_sample(&[]).unwrap();
        assert_eq!(s.routed_experts, (vec![9, 4], 2));
        // a short array, a float one and a non-array are named
        for bad in [npy("|u1", [2, 2, 2], &bytes[..7]), npy("<f4", [1, 1, 1], &[0; 4]), "bm90IG5weQ==".to_string()] {
            let err = with_routes(bad).into_sample(&[]).unwrap_err().to_string();
            assert!(err.contains("routed_experts"), "{err}");
        }
    }
}
