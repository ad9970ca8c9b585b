//! The tokenizer of a checkpoint directory: `tokenizer.json` (HF `tokenizers`), the special tokens around it
//! (EOS, pad, BOS from generation_config.json, config.json and tokenizer_config.json) and the chat template.

use std::collections::BTreeMap;
use std::path::Path;

use minijinja::Value as JinjaValue;
use serde::Serialize;
use serde_json::Value;

use crate::chat_template::ChatTemplate;
use crate::error::{Result, TokenizerError};

/// A tokenizer with the special tokens and chat template that came with it.
#[derive(Debug)]
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    /// Tokens that end a generation (generation_config.json first, then config.json, then tokenizer_config's
    /// `eos_token`).
    eos_token_ids: Vec<u32>,
    pad_token_id: Option<u32>,
    /// `bos_token`, `eos_token`, ... as strings: HF passes these to every chat template.
    special_tokens: BTreeMap<String, String>,
    /// Compiled chat templates by name; HF uses `tool_use` when tools are passed and it exists, else `default`.
    chat_templates: BTreeMap<String, ChatTemplate>,
}

const DEFAULT_TEMPLATE: &str = "default";
const TOOL_USE_TEMPLATE: &str = "tool_use";

/// Runs a `tokenizers` call, turning a panic into an error. The library panics at run time on some
/// tokenizer.json it accepts (a single-sequence template naming sequence B indexes out of bounds on every
/// encode), and a service must not die for a checkpoint's mistake.
fn guarded<T>(what: &str, run: impl FnOnce() -> tokenizers::Result<T>) -> Result<T> {
    match std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)) {
        Ok(result) => result.map_err(|e| TokenizerError::Tokenizer(e.to_string())),
        Err(_) => Err(TokenizerError::Tokenizer(format!("the tokenizers library panicked {what}"))),
    }
}

/// Reads an HF token-id field that may be null, an integer or a list of integers.
fn token_ids(value: Option<&Value>, field: &str) -> Result<Vec<u32>> {
    let as_id = |v: &Value| {
        v.as_u64()
            .and_then(|id| u32::try_from(id).ok())
            .ok_or_else(|| TokenizerError::Config(format!("`{field}` must be a token id or a list of them, got {v}")))
    };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items.iter().map(as_id).collect(),
        Some(v) => Ok(vec![as_id(v)?]),
    }
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| TokenizerError::io(path, e))?;
    serde_json::from_str(&text).map(Some).map_err(|e| TokenizerError::json(path.display().to_string(), e))
}

/// A special token in tokenizer_config.json: a string or an AddedToken object with `content`.
fn token_text(value: Option<&Value>) -> Option<String> {
    match value? {
        Value::String(s) => Some(s.clone()),
        Value::Object(map) => map.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// The chat templates of a directory by name: `chat_template.jinja` (transformers 5), else `chat_template.json`,
/// else tokenizer_config.json's `chat_template` — a string (named `default`) or a list of `{name, template}`.
fn find_chat_templates(dir: &Path, tokenizer_config: Option<&Value>) -> Result<BTreeMap<String, String>> {
    let jinja = dir.join("chat_template.jinja");
    if jinja.exists() {
        let source = std::fs::read_to_string(&jinja).map_err(|e| TokenizerError::io(&jinja, e))?;
        return Ok(BTreeMap::from([(DEFAULT_TEMPLATE.to_string(), source)]));
    }
    let from_value = |value: Option<&Value>, origin: &str| -> Result<BTreeMap<String, String>> {
        match value {
            None | Some(Value::Null) => Ok(BTreeMap::new()),
            Some(Value::String(s)) => Ok(BTreeMap::from([(DEFAULT_TEMPLATE.to_string(), s.clone())])),
            Some(Value::Array(items)) => items
                .iter()
                .map(|item| {
                    match (item.get("name").and_then(Value::as_str), item.get("template").and_then(Value::as_str)) {
                        (Some(name), Some(template)) => Ok((name.to_string(), template.to_string())),
                        _ => Err(TokenizerError::ChatTemplate(format!(
                            "{origin}: a template list entry lacks `name` or `template`"
                        ))),
                    }
                })
                .collect(),
            Some(other) => Err(TokenizerError::ChatTemplate(format!("{origin}: `chat_template` is {other}"))),
        }
    };
    if let Some(json) = read_json(&dir.join("chat_template.json"))? {
        let templates = from_value(json.get("chat_template"), "chat_template.json")?;
        if !templates.is_empty() {
            return Ok(templates);
        }
    }
    from_value(tokenizer_config.and_then(|c| c.get("chat_template")), "tokenizer_config.json")
}

impl Tokenizer {
    /// Loads `tokenizer.json` and the special tokens and chat template of a checkpoint directory.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let invalid = |reason: String| TokenizerError::Tokenizer(format!("{}: {reason}", path.display()));
        let text = std::fs::read_to_string(&path).map_err(|e| invalid(e.to_string()))?;
        // `tokenizers` 0.22 panics (`expect("Helper")`) on a decoder object with a syntax error inside: the syntax
        // is checked here first, and a panic while it builds the tokenizer becomes an error too.
        serde_json::from_str::<serde::de::IgnoredAny>(&text).map_err(|e| invalid(format!("invalid JSON: {e}")))?;
        let inner = std::panic::catch_unwind(|| text.parse::<tokenizers::Tokenizer>())
            .map_err(|_| invalid("the tokenizers library panicked reading it".into()))?
            .map_err(|e| invalid(e.to_string()))?;
        // One encode with the post-processor: a tokenizer that panics on every encode is refused here, by name
        // (an error is left to the encodes that meet it: it may depend on the text).
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| inner.encode("a", true))).is_err() {
            return Err(invalid("the tokenizers library panicked encoding with it".into()));
        }
        let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
        let generation_config = read_json(&dir.join("generation_config.json"))?;
        let model_config = read_json(&dir.join("config.json"))?;

        let mut special_tokens = BTreeMap::new();
        for key in ["bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"] {
            if let Some(text) = token_text(tokenizer_config.as_ref().and_then(|c| c.get(key))) {
                special_tokens.insert(key.to_string(), text);
            }
        }
        // A named special token missing from the vocabulary is ignored (HF would add it as a new token, which
        // the model's embedding could not cover anyway).
        let id_of = |key: &str| -> Option<u32> {
            let text = special_tokens.get(key)?;
            let id = inner.token_to_id(text);
            if id.is_none() {
                tracing::warn!(key, token = %text, "special token is not in the vocabulary");
            }
            id
        };
        let mut eos_token_ids =
            token_ids(generation_config.as_ref().and_then(|c| c.get("eos_token_id")), "eos_token_id")?;
        if eos_token_ids.is_empty() {
            eos_token_ids = token_ids(model_config.as_ref().and_then(|c| c.get("eos_token_id")), "eos_token_id")?;
        }
        if eos_token_ids.is_empty() {
            eos_token_ids.extend(id_of("eos_token"));
        }
        let first_id = |config: Option<&Value>| -> Result<Option<u32>> {
            Ok(token_ids(config.and_then(|c| c.get("pad_token_id")), "pad_token_id")?.first().copied())
        };
        let pad_token_id = match id_of("pad_token") {
            Some(id) => Some(id),
            None => match first_id(model_config.as_ref())? {
                Some(id) => Some(id),
                None => first_id(generation_config.as_ref())?,
            },
        };

        let chat_templates = find_chat_templates(dir, tokenizer_config.as_ref())?
            .into_iter()
            .map(|(name, source)| {
                let template = ChatTemplate::new(&source).map_err(|e| match e {
                    TokenizerError::ChatTemplate(reason) => {
                        TokenizerError::ChatTemplate(format!("template `{name}` {reason}"))
                    }
                    other => other,
                })?;
                Ok((name, template))
            })
            .collect::<Result<BTreeMap<_, _>>>()?;
        Ok(Tokenizer { inner, eos_token_ids, pad_token_id, special_tokens, chat_templates })
    }

    /// Token ids of `text`; `add_special_tokens` applies the tokenizer's post-processor (e.g. a BOS).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = guarded("encoding", || self.inner.encode(text, add_special_tokens))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        guarded("decoding", || self.inner.decode(ids, skip_special_tokens))
    }

    /// Ids that end a generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// The padding id, when the checkpoint names one.
    pub fn pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// A named special token's text (`bos_token`, `eos_token`, `pad_token`, ...) as tokenizer_config.json names
    /// it: a reward model's rendered prompt must not start with the BOS that its server adds again.
    pub fn special_token(&self, name: &str) -> Option<&str> {
        self.special_tokens.get(name).map(String::as_str)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The default chat template text, if the checkpoint has one.
    pub fn chat_template(&self) -> Option<&str> {
        self.chat_templates.get(DEFAULT_TEMPLATE).map(ChatTemplate::source)
    }

    /// The `tokenizers` tokenizer underneath.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Renders the chat template like HF `apply_chat_template(tokenize=False)`. `messages` and `tools` are
    /// anything serialisable to the JSON shapes templates expect (`{"role", "content", ...}` objects; tool
    /// schemas). Maps keep their insertion order (pass `minijinja::Value`s or structs to control it).
    pub fn render_chat<M: Serialize, T: Serialize>(
        &self,
        messages: &[M],
        tools: Option<&[T]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let tool_use = tools.is_some().then(|| self.chat_templates.get(TOOL_USE_TEMPLATE)).flatten();
        let Some(template) = tool_use.or_else(|| self.chat_templates.get(DEFAULT_TEMPLATE)) else {
            return Err(TokenizerError::ChatTemplate(
                "the checkpoint has no (default) chat template (chat_template.jinja or tokenizer_config.json)".into(),
            ));
        };
        let mut vars: BTreeMap<String, JinjaValue> =
            self.special_tokens.iter().map(|(k, v)| (k.clone(), JinjaValue::from(v.as_str()))).collect();
        vars.insert("messages".into(), JinjaValue::from_serialize(messages));
        vars.insert("tools".into(), tools.map_or(JinjaValue::from(()), JinjaValue::from_serialize));
        vars.insert("documents".into(), JinjaValue::from(()));
        vars.insert("add_generation_prompt".into(), JinjaValue::from(add_generation_prompt));
        template.render(vars)
    }

    /// Like HF `apply_chat_template(messages, add_generation_prompt=..., tokenize=True)`: the rendered text
    /// tokenized without adding special tokens (the template already wrote them).
    pub fn apply_chat_template<M: Serialize>(&self, messages: &[M], add_generation_prompt: bool) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, None::<&[JinjaValue]>, add_generation_prompt)?;
        self.encode(&text, false)
    }

    /// [`Self::apply_chat_template`] with tool schemas.
    pub fn apply_chat_template_with_tools<M: Serialize, T: Serialize>(
        &self,
        messages: &[M],
        tools: &[T],
        add_generation_prompt: bool,
    ) -> Result<Vec<u32>> {
        let text = self.render_chat(messages, Some(tools), add_generation_prompt)?;
        self.encode(&text, false)
    }
}
