//! Fuzzing what the tokenizer crate reads from a checkpoint directory with proptest: `tokenizer.json` (through HF
//! `tokenizers`), `tokenizer_config.json`, the special-token side files (`generation_config.json`,
//! `config.json`, `chat_template.json`, `chat_template.jinja`), chat templates themselves (compiled and rendered
//! as untrusted code), and the chat messages a template renders.
//!
//! Inputs are random bytes and valid examples mutated structurally and byte by byte (templates with jinja
//! tokens spliced in: loops, ranges, macros, recursion, string repetition). Properties: no panic, every case
//! within a time bound (a template that loops for ever runs out of fuel), an error that names its stage and
//! file, and text that encodes then decodes to itself.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../wire/tests/fuzz_support/json.rs"]
mod json_mutate;
#[path = "../../wire/tests/fuzz_support/bytes.rs"]
mod mutate;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use jetrl_tokenizer::chat_template::{MAX_RENDERED_BYTES, RENDER_FUEL};
use jetrl_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};
use proptest::prelude::*;
use serde_json::{json, Value};

fn config() -> ProptestConfig {
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

/// A case must finish well within this; a render that runs out of fuel takes a few tens of milliseconds.
const CASE_LIMIT: Duration = Duration::from_secs(10);

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chatml-word-level")
}

fn hf_sample() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/golden/hf-sample/llama")
}

fn read_json(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).expect("a fixture file")).expect("fixture JSON")
}

// ---------------------------------------------------------------------------------------------------------------
// Chat templates

/// Qwen2.5's template (tools, tool calls, tool responses), as its checkpoints ship it.
const QWEN_TOOLS_TEMPLATE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\n' + messages[0]['content'] + '<|im_end|>\n' }}
    {%- else %}
        {{- '<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\n<tool_call>\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

/// A Llama-3-style template: namespace, strftime_now, raise_exception, a filtered loop.
const LLAMA_STYLE_TEMPLATE: &str = r#"{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- set ns = namespace(system='') %}
{%- for m in messages %}{%- if m.role == 'system' %}{%- set ns.system = ns.system + m.content | trim %}{%- endif %}{%- endfor %}
{{- '<|start_header_id|>system<|end_header_id|>\n\nToday Date: ' + date_string + '\n' + ns.system + '<|eot_id|>' }}
{%- for m in messages if m.role != 'system' %}
{%- if m.role not in ['user', 'assistant', 'tool'] %}{{ raise_exception('bad role ' ~ m.role) }}{%- endif %}
{{- '<|start_header_id|>' + m.role + '<|end_header_id|>\n\n' + m.content | trim + '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}
"#;

fn template_seeds() -> Vec<String> {
    let fixture_template = read_json(&fixture().join("tokenizer_config.json"))["chat_template"]
        .as_str()
        .expect("the fixture has a chat template")
        .to_string();
    let hf_sample_template =
        std::fs::read_to_string(hf_sample().join("chat_template.jinja")).expect("hf-sample chat_template.jinja");
    vec![fixture_template, hf_sample_template, QWEN_TOOLS_TEMPLATE.to_string(), LLAMA_STYLE_TEMPLATE.to_string()]
}

/// Jinja fragments spliced into templates. Repetition stays at 100 KB: fuel bounds instructions, not the cost
/// of one (`'x' * 100000000` in a loop spends minutes within the fuel; see `RENDER_FUEL`), and a case must stay
/// cheap.
const JINJA_TOKENS: &[&[u8]] = &[
    b"{{",
    b"}}",
    b"{%",
    b"%}",
    b"{#",
    b"#}",
    b"{%-",
    b"-%}",
    b"{{-",
    b"-}}",
    b"for x in range(100000)",
    b"endfor",
    b"if ",
    b"endif",
    b"else",
    b"elif ",
    b"set ns.x = ",
    b"namespace(x=[])",
    b"macro m(a)",
    b"endmacro",
    b"m(1)",
    b"loop(",
    b"recursive",
    b"call ",
    b"endcall",
    b"caller()",
    b"filter upper",
    b"endfilter",
    b"* 99999",
    b" ~ ",
    b"|tojson",
    b"|tojson(indent=2)",
    b"|map('tojson')",
    b"|join",
    b"|list",
    b"|sort",
    b"messages",
    b"message",
    b"tools",
    b"[0]",
    b"[-1]",
    b"['role']",
    b".content",
    b"raise_exception('x')",
    b"strftime_now('%A')",
    b"loop.index0",
    b"break",
    b"continue",
    b"(",
    b")",
    b"[",
    b"]",
    b"'",
    b"\"",
    b"\\",
    b"include 'x'",
    b"import 'x' as y",
    b"extends 'chat'",
    b"block b",
    b"endblock",
    b"super()",
    b"self",
    b"range(-1)",
    b"1/0",
    b"1//0",
    b"2**64",
    b"9e999",
    b"|int",
    b"|float",
    b"|round",
    b"[::-1]",
    b".split()",
    b".items()",
    b"|length",
    b"|batch(0)",
    b"|slice(0)",
    b"|indent(99999)",
    b"|center(99999)",
    b"\xff",
];

fn messages() -> Value {
    json!([
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 7 times 6?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "mul", "arguments": {"a": 7, "b": 6}}}]},
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": "42"}
    ])
}

fn tools() -> Value {
    json!([{"type": "function", "function": {"name": "mul", "description": "a times b",
        "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}])
}

fn variables(
    messages: &Value,
    tools: Option<&Value>,
    add_generation_prompt: bool,
) -> BTreeMap<String, minijinja::Value> {
    BTreeMap::from([
        ("messages".to_string(), minijinja::Value::from_serialize(messages)),
        ("tools".to_string(), tools.map_or(minijinja::Value::from(()), minijinja::Value::from_serialize)),
        ("add_generation_prompt".to_string(), minijinja::Value::from(add_generation_prompt)),
        ("bos_token".to_string(), minijinja::Value::from("<s>")),
        ("eos_token".to_string(), minijinja::Value::from("</s>")),
    ])
}

fn template_input() -> impl Strategy<Value = String> {
    let seeds: Vec<Vec<u8>> = template_seeds().into_iter().map(String::into_bytes).collect();
    prop_oneof![
        1 => mutate::random_bytes(128).prop_map(|b| mutate::lossy(&b)),
        6 => mutate::mutated(seeds, JINJA_TOKENS).prop_map(|b| mutate::lossy(&b)),
    ]
}

/// Renders `source` as untrusted code: compiled, then rendered with and without tools, each within the bound.
fn check_template(source: &str, messages: &Value) -> Result<(), TestCaseError> {
    let started = Instant::now();
    match ChatTemplate::new(source) {
        Err(TokenizerError::ChatTemplate(reason)) => prop_assert!(reason.starts_with("does not compile: ")),
        Err(other) => prop_assert!(false, "compiling gave {:?}", other),
        Ok(template) => {
            for tools in [None, Some(tools())] {
                match template.render(variables(messages, tools.as_ref(), true)) {
                    Ok(text) => prop_assert!(text.len() <= MAX_RENDERED_BYTES),
                    Err(TokenizerError::ChatTemplate(reason)) => prop_assert!(!reason.is_empty()),
                    Err(other) => prop_assert!(false, "rendering gave {:?}", other),
                }
            }
        }
    }
    prop_assert!(started.elapsed() < CASE_LIMIT, "took {:?}: {:?}", started.elapsed(), source);
    Ok(())
}

// ---------------------------------------------------------------------------------------------------------------
// Checkpoint files

/// More tokenizer models than the fixtures have, so mutations reach each model's and component's decoder.
fn extra_tokenizer_seeds() -> Vec<Value> {
    let added = json!([{"id": 0, "content": "<unk>", "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": false, "special": true}]);
    vec![
        json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
            "pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "post_processor": null,
            "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "always", "split": true},
            "model": {"type": "Unigram", "unk_id": 0, "byte_fallback": false,
                "vocab": [["<unk>", 0.0], ["▁a", -1.0], ["b", -2.0], ["▁", -3.0], ["a", -2.5], ["c", -4.0]]}}),
        json!({"version": "1.0", "truncation": null, "padding": null, "added_tokens": added,
            "normalizer": {"type": "BertNormalizer", "clean_text": true, "handle_chinese_chars": true,
                "strip_accents": null, "lowercase": true},
            "pre_tokenizer": {"type": "Split", "pattern": {"Regex": "\\s+|[0-9]"}, "behavior": "Isolated",
                "invert": false},
            "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<unk>", "type_id": 0}},
                {"Sequence": {"id": "A", "type_id": 0}}], "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                {"Sequence": {"id": "B", "type_id": 1}}], "special_tokens": {"<unk>": {"id": "<unk>", "ids": [0],
                "tokens": ["<unk>"]}}},
            "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": true},
            "model": {"type": "WordPiece", "unk_token": "<unk>", "continuing_subword_prefix": "##",
                "max_input_chars_per_word": 100, "vocab": {"<unk>": 0, "a": 1, "##b": 2, "c": 3, "1": 4}}}),
    ]
}

fn tokenizer_json_seeds() -> Vec<Value> {
    let mut seeds = vec![read_json(&fixture().join("tokenizer.json")), read_json(&hf_sample().join("tokenizer.json"))];
    seeds.extend(extra_tokenizer_seeds());
    seeds
}

fn tokenizer_config_seeds() -> Vec<Value> {
    let mut list = read_json(&fixture().join("tokenizer_config.json"));
    list["chat_template"] = json!([
        {"name": "default", "template": template_seeds()[0]},
        {"name": "tool_use", "template": QWEN_TOOLS_TEMPLATE},
    ]);
    list["bos_token"] = json!({"content": "<s>", "lstrip": false, "normalized": false, "rstrip": false,
        "single_word": false, "__type": "AddedToken"});
    vec![
        read_json(&fixture().join("tokenizer_config.json")),
        read_json(&hf_sample().join("tokenizer_config.json")),
        list,
    ]
}

/// The side files and valid contents of each.
fn side_file_seeds() -> Vec<(&'static str, Value)> {
    vec![
        ("generation_config.json", json!({"eos_token_id": [3, 0], "pad_token_id": 0, "bos_token_id": 1})),
        ("config.json", json!({"model_type": "qwen2", "eos_token_id": 3, "pad_token_id": null})),
        ("chat_template.json", json!({"chat_template": template_seeds()[0]})),
        ("chat_template.jinja", Value::String(template_seeds()[3].clone())),
    ]
}

/// What a loaded tokenizer must do with any text and any ids: no panic, and encode then decode is exact for
/// text made of whole tokens of the word-level fixture.
fn exercise(tokenizer: &Tokenizer, texts: &[&str]) -> Result<(), TestCaseError> {
    let vocab = tokenizer.vocab_size() as u32;
    for text in texts {
        if let Ok(ids) = tokenizer.encode(text, true) {
            let _ = tokenizer.decode(&ids, false);
            let _ = tokenizer.decode(&ids, true);
        }
    }
    for ids in [vec![0, 1, 2], vec![vocab, vocab.saturating_add(1), u32::MAX], vec![]] {
        let _ = tokenizer.decode(&ids, false);
    }
    let _ = tokenizer.render_chat(messages().as_array().map_or(&[][..], Vec::as_slice), Some(&[tools()]), true);
    let _ = tokenizer.apply_chat_template(&[json!({"role": "user", "content": texts[0]})], true);
    Ok(())
}

/// Writes the fixture directory with `replace` written over one of its files, and loads it.
fn load_with(dir: &Path, replace: &str, content: &[u8]) -> Result<Tokenizer, TokenizerError> {
    for file in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture().join(file), dir.join(file)).expect("copying the fixture");
    }
    std::fs::write(dir.join(replace), content).expect("writing the mutated file");
    Tokenizer::from_dir(dir)
}

/// Errors name their stage, and a file's error names the file.
fn check_load_error(err: &TokenizerError, file: &str) -> Result<(), TestCaseError> {
    let text = err.to_string();
    match err {
        TokenizerError::Io { path, .. } => prop_assert!(path.ends_with(file), "{}", text),
        TokenizerError::Json { what, .. } => prop_assert!(what.ends_with(file), "{}", text),
        TokenizerError::Tokenizer(reason) if file == "tokenizer.json" => {
            prop_assert!(reason.contains("tokenizer.json"), "{}", text)
        }
        TokenizerError::Config(reason) => prop_assert!(reason.contains("token_id"), "{}", text),
        TokenizerError::ChatTemplate(reason) => prop_assert!(!reason.is_empty()),
        TokenizerError::Tokenizer(reason) => prop_assert!(!reason.is_empty()),
    }
    Ok(())
}

thread_local!(static SCRATCH: mutate::Scratch = mutate::Scratch::new());

fn next_dir() -> PathBuf {
    SCRATCH.with(mutate::Scratch::next_dir)
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn untrusted_chat_templates_compile_and_render_within_bounds(source in template_input()) {
        check_template(&source, &messages())?;
    }

    #[test]
    fn chat_messages_of_any_shape_render_or_are_refused(
        template in proptest::sample::select(template_seeds()),
        messages in json_mutate::json_mutated(vec![messages(), json!([{"role": "user", "content": "hi"}])]),
    ) {
        check_template(&template, &messages)?;
    }

    #[test]
    fn tokenizer_json_loads_or_is_refused_naming_it(input in json_mutate::json_bytes(tokenizer_json_seeds(), 128)) {
        let started = Instant::now();
        match load_with(&next_dir(), "tokenizer.json", &input) {
            Ok(tokenizer) => exercise(&tokenizer, &["reverse 1234", "ab c1 ▁é", "", "\u{0}\u{ffff}"])?,
            Err(err) => check_load_error(&err, "tokenizer.json")?,
        }
        prop_assert!(started.elapsed() < CASE_LIMIT, "took {:?}", started.elapsed());
    }

    #[test]
    fn tokenizer_config_json_loads_or_is_refused_naming_it(
        input in json_mutate::json_bytes(tokenizer_config_seeds(), 128),
    ) {
        let started = Instant::now();
        match load_with(&next_dir(), "tokenizer_config.json", &input) {
            Ok(tokenizer) => exercise(&tokenizer, &["reverse 1234"])?,
            Err(err) => check_load_error(&err, "tokenizer_config.json")?,
        }
        prop_assert!(started.elapsed() < CASE_LIMIT, "took {:?}", started.elapsed());
    }

    #[test]
    fn special_token_files_load_or_are_refused_naming_them(
        (file, input) in proptest::sample::select(side_file_seeds()).prop_flat_map(|(file, seed)| {
            let bytes = match &seed {
                Value::String(text) => mutate::mutated(vec![text.clone().into_bytes()], JINJA_TOKENS).boxed(),
                _ => json_mutate::json_bytes(vec![seed], 64).boxed(),
            };
            (Just(file), bytes)
        }),
    ) {
        let started = Instant::now();
        match load_with(&next_dir(), file, &input) {
            Ok(tokenizer) => exercise(&tokenizer, &["reverse 1234"])?,
            Err(err) => check_load_error(&err, file)?,
        }
        prop_assert!(started.elapsed() < CASE_LIMIT, "took {:?}", started.elapsed());
    }

    #[test]
    fn whole_tokens_encode_then_decode_exactly(words in proptest::collection::vec(
        proptest::sample::select(vec!["reverse", "sort", "1234", "4321", "user", "assistant"]), 0..12,
    )) {
        thread_local!(static FIXTURE: Tokenizer = Tokenizer::from_dir(&fixture()).expect("the fixture loads"));
        let text = words.join(" ");
        FIXTURE.with(|tokenizer| {
            let ids = tokenizer.encode(&text, false).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(ids.len(), words.len());
            prop_assert_eq!(tokenizer.decode(&ids, false).ok(), Some(text.clone()));
            Ok(())
        })?;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Hostile templates: each stops with an error naming why, quickly and without exhausting the stack.

fn render_error(source: &str) -> String {
    let started = Instant::now();
    let template = ChatTemplate::new(source).expect("compiles");
    let err = template.render(variables(&messages(), None, true)).expect_err("the template must be refused");
    assert!(started.elapsed() < CASE_LIMIT, "took {:?}", started.elapsed());
    err.to_string()
}

#[test]
fn a_template_that_loops_for_ever_runs_out_of_fuel() {
    let err = render_error("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}");
    assert!(err.contains("out of fuel"), "{err}");
}

#[test]
fn a_template_that_recurses_for_ever_hits_the_recursion_limit() {
    let err = render_error("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}");
    assert!(err.contains("recursion"), "{err}");
}

#[test]
fn a_template_that_writes_without_end_is_cut_at_the_output_limit() {
    let err = render_error("{% for i in range(100000) %}{{ 'x' * 1000000 }}{% endfor %}");
    assert!(err.contains(&format!("exceeds {MAX_RENDERED_BYTES} bytes")), "{err}");
}

/// Found by this suite: minijinja drops and prints values recursively, so a template nesting a value 30,000
/// levels deep (8 instructions a level) overflowed the stack and aborted the process.
#[test]
fn a_value_nested_as_deep_as_the_fuel_allows_is_printed_and_dropped_without_overflow() {
    for (per_level, open, close) in [(1, "[", "]"), (40, &*"[".repeat(40), &*"]".repeat(40))] {
        let iterations = RENDER_FUEL as usize / per_level;
        let source = format!(
            "{{% set ns = namespace(x=[]) %}}{{% for i in range({iterations}) %}}{{% set ns.x = {open}ns.x{close} %}}\
             {{% endfor %}}{{{{ ns.x }}}}"
        );
        let template = ChatTemplate::new(&source).unwrap();
        let _ = template.render(variables(&messages(), None, true));
    }
}

#[test]
fn tojson_of_a_value_nested_without_end_is_refused() {
    let err = render_error(
        "{% set ns = namespace(x=[]) %}{% for i in range(600) %}{% set ns.x = [ns.x] %}{% endfor %}{{ ns.x | tojson }}",
    );
    assert!(err.contains("nested deeper than 512 levels"), "{err}");
}

#[test]
fn deeply_nested_template_syntax_is_refused_at_compile_time() {
    let source = format!("{{{{ {}1{} }}}}", "(".repeat(10_000), ")".repeat(10_000));
    let err = ChatTemplate::new(&source).unwrap_err().to_string();
    assert!(err.contains("does not compile"), "{err}");
}

#[test]
fn real_templates_render_thousands_of_messages_within_the_fuel() {
    // 2,000 turns (4,000 messages) with tools through the Qwen template.
    let turns: Vec<Value> = (0..2_000)
        .flat_map(|i| {
            [json!({"role": "user", "content": format!("question {i}")}), json!({"role": "assistant", "content": "42"})]
        })
        .collect();
    let template = ChatTemplate::new(QWEN_TOOLS_TEMPLATE).unwrap();
    let text = template.render(variables(&Value::Array(turns), Some(&tools()), true)).unwrap();
    assert!(text.contains("question 1999"));
}

/// Found by this suite: `tokenizers` 0.22 panics (`expect("Helper")` in its decoder deserialiser) on a
/// tokenizer.json whose `decoder` object has a syntax error inside, which took the process down.
#[test]
fn a_syntax_error_inside_the_decoder_object_is_an_error_naming_the_file() {
    let text = std::fs::read_to_string(fixture().join("tokenizer.json")).unwrap();
    let broken = text.replace("\"decoder\": null", "\"decoder\": {\"type\" \"WordPiece\"}");
    assert_ne!(broken, text);
    let dir = tempfile::tempdir().unwrap();
    let err = load_with(dir.path(), "tokenizer.json", broken.as_bytes()).unwrap_err();
    assert!(matches!(err, TokenizerError::Tokenizer(_)), "{err}");
    let text = err.to_string();
    assert!(text.contains("tokenizer.json: invalid JSON: expected `:`"), "{text}");
}

/// Found by this suite: `tokenizers` accepts a post-processor whose single-sequence template names sequence B,
/// then panics (index out of bounds) on every encode with special tokens.
#[test]
fn a_tokenizer_that_panics_when_encoding_is_refused_at_load_naming_the_file() {
    let mut tokenizer = read_json(&fixture().join("tokenizer.json"));
    tokenizer["post_processor"] = json!({"type": "TemplateProcessing",
        "single": [{"Sequence": {"id": "B", "type_id": 0}}],
        "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {}});
    let dir = tempfile::tempdir().unwrap();
    let err = load_with(dir.path(), "tokenizer.json", tokenizer.to_string().as_bytes()).unwrap_err().to_string();
    assert!(err.contains("tokenizer.json: the tokenizers library panicked encoding"), "{err}");
}
