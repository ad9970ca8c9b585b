//! `docs/configuration.md` against the code: every documented key is a key of [`JobConfig`], every key of
//! `JobConfig` is documented, and every documented key is read by some code path (or refused by validation).
//!
//! "Read" is a textual heuristic over the production sources (`services/*/src`, `shared/*/src`, this crate's
//! validation included; test modules, `tests.rs` files and benchmark binaries left out):
//!
//! - the key's Rust field `f` (its serde name, or the field it is renamed from) must occur as `.f` that is neither
//!   a method call (`.f(`) nor the target of an assignment (`.f = ...`), outside string literals: declaring,
//!   defaulting, setting or naming a key in a message is not using it;
//! - the occurrence must be tied to the key's own struct, since other structs have fields of the same names
//!   (`seed`, `enable`, `request_timeout_s`, the trainer's own `calculate_entropy` setting, ...): written
//!   `parent.f` (`nats.request_timeout_s`, `self.filter_groups.max_num_gen_batches`), or `x.f` where
//!   `let x = ...parent;` (`let kw = &cfg.rollout.val_kwargs;` ... `kw.top_k`), or inside an `impl` or `fn` whose
//!   header names the struct (`fn new(config: &RewardModelConfig)`).
//!
//! A key of one allowed value ([`single_valued`]) needs no reader: parsing refuses every other value. A key listed
//! in [`NOT_READ_YET`] must be unread, with the reason; once something reads it the test asks for its removal.
//!
//! It catches keys nothing reads (as `actor.calculate_entropy`, `trainer.max_critic_ckpt_to_keep` and
//! `algorithm.filter_groups.max_num_gen_batches` once were). It cannot see a value that is read and then never
//! used (`nats.request_timeout_s` was stored in the `Bus` while every request used a literal): that takes the
//! behaviour tests of each key.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use jetrl_config::{JobConfig, RolloutCorrectionConfig, SimulateConfig, TaskConfig};
use regex::Regex;

/// Documented keys nothing reads yet, and why they stay documented: each must be unread (the test fails once it
/// is read, so the entry goes).
const NOT_READ_YET: &[(&str, &str)] = &[];

/// Keys whose type allows one value, with how many it allows (checked to be 1: a second value needs a reader).
fn single_valued() -> Vec<(&'static str, usize)> {
    vec![("rollout.multi_turn.format", jetrl_config::ToolCallFormat::ALL.len())]
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// One documented key: its path under the job file (`actor.optim.lr`) and the documentation line it came from.
#[derive(Debug, Clone)]
struct DocumentedKey {
    path: Vec<String>,
    line: usize,
}

/// The keys of the `## <section>` tables. A row's first cell names one key or several: `a.b`, then more keys
/// either as paths under the section (`kl_ctrl.target_kl`), or, without a dot, as siblings of the first
/// (`policy_loss.clip_cov_ratio`, `clip_cov_lb` → `policy_loss.clip_cov_lb`; `.top_p` likewise). `optim.*` stands
/// for the `optim` section.
fn documented_keys(doc: &str) -> Vec<DocumentedKey> {
    let key = Regex::new(r"`([^`]+)`").unwrap();
    let mut section: Option<String> = None;
    let mut out = Vec::new();
    // only tables whose header's first cell is `key` list keys (a section may hold other tables too)
    let mut in_key_table = false;
    for (i, line) in doc.lines().enumerate() {
        if let Some(name) = line.strip_prefix("## ") {
            section = Some(name.trim().to_string());
            continue;
        }
        let Some(section) = &section else { continue };
        let Some(first_cell) = line.strip_prefix('|').and_then(|rest| rest.split('|').next()) else {
            in_key_table = false;
            continue;
        };
        let first_cell = first_cell.trim();
        if first_cell == "key" {
            in_key_table = true;
            continue;
        }
        if !in_key_table || first_cell.starts_with("---") {
            continue;
        }
        let names: Vec<&str> = key.captures_iter(first_cell).map(|c| c.get(1).unwrap().as_str()).collect();
        assert!(!names.is_empty(), "docs/configuration.md:{}: no `key` in the first cell: {line}", i + 1);
        let first: Vec<&str> = names[0].trim_end_matches(".*").split('.').collect();
        let parent = &first[..first.len() - 1];
        for (n, name) in names.iter().enumerate() {
            let name = name.trim_end_matches(".*");
            let relative: Vec<String> = if n == 0 || (name.contains('.') && !name.starts_with('.')) {
                name.split('.').map(str::to_string).collect()
            } else {
                parent.iter().map(|s| s.to_string()).chain([name.trim_start_matches('.').to_string()]).collect()
            };
            let path = std::iter::once(section.clone()).chain(relative).collect();
            out.push(DocumentedKey { path, line: i + 1 });
        }
    }
    out
}

/// The default job as JSON, with the optional sections filled in so their keys have a place.
fn job_json() -> serde_json::Value {
    let mut cfg = JobConfig::default();
    cfg.data.task = Some(TaskConfig::default());
    cfg.algorithm.rollout_correction = Some(RolloutCorrectionConfig::default());
    cfg.trainer.simulate = Some(SimulateConfig::default());
    serde_json::to_value(&cfg).unwrap()
}

fn lookup<'a>(value: &'a serde_json::Value, path: &[String]) -> Option<&'a serde_json::Value> {
    path.iter().try_fold(value, |v, part| v.get(part))
}

/// Every key path of the JSON: the leaves, and the sections (objects) on the way.
fn all_paths(value: &serde_json::Value, prefix: &mut Vec<String>, out: &mut BTreeSet<Vec<String>>) {
    if let serde_json::Value::Object(map) = value {
        for (k, v) in map {
            prefix.push(k.clone());
            out.insert(prefix.clone());
            all_paths(v, prefix, out);
            prefix.pop();
        }
    }
}

/// A configuration struct field: its Rust name and the struct its type names (if it is one of ours).
#[derive(Debug, Clone)]
struct Field {
    rust_name: String,
    ty: String,
}

/// The configuration structs of `shared/config/src`: name → serde key → field. Serde renames are honoured.
fn config_structs() -> BTreeMap<String, BTreeMap<String, Field>> {
    let header = Regex::new(r"^pub struct (\w+) \{").unwrap();
    let field = Regex::new(r"^\s+pub (\w+): (.+),\s*$").unwrap();
    let rename = Regex::new(r#"#\[serde\(rename = "(\w+)"\)\]"#).unwrap();
    let ident = Regex::new(r"[A-Z]\w*").unwrap();
    let mut structs = BTreeMap::new();
    let dir = repo_root().join("shared/config/src");
    // the job's structs are in the crate's top-level files (verl/ translates verl's tree into them)
    for path in std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).filter(|p| p.is_file()) {
        let text = std::fs::read_to_string(path).unwrap();
        let mut current: Option<(String, BTreeMap<String, Field>)> = None;
        let mut renamed: Option<String> = None;
        for line in text.lines() {
            if let Some(c) = header.captures(line) {
                current = Some((c[1].to_string(), BTreeMap::new()));
            } else if line == "}" {
                if let Some((name, fields)) = current.take() {
                    structs.insert(name, fields);
                }
            } else if let Some((_, fields)) = current.as_mut() {
                if let Some(c) = rename.captures(line) {
                    renamed = Some(c[1].to_string());
                } else if let Some(c) = field.captures(line) {
                    // the last capitalised identifier: `Option<TaskConfig>` → TaskConfig
                    let ty = ident.find_iter(&c[2]).last().map_or(String::new(), |m| m.as_str().to_string());
                    let key = renamed.take().unwrap_or_else(|| c[1].to_string());
                    fields.insert(key, Field { rust_name: c[1].to_string(), ty });
                }
            }
        }
    }
    structs
}

/// The production sources, each with its string and char literals emptied, its test modules cut out, comment lines
/// dropped and method chains split over lines joined (`cfg\n    .checkpoint\n    .dir` → `cfg.checkpoint.dir`).
fn production_sources() -> Vec<(PathBuf, String)> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            if path.is_dir() {
                let name = path.file_name().unwrap().to_string_lossy().to_string();
                if !matches!(name.as_str(), "tests" | "benches" | "target" | "fuzz") {
                    walk(&path, out);
                }
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    for top in ["services", "shared"] {
        walk(&repo_root().join(top), &mut files);
    }
    let chain = Regex::new(r"\s*\n\s*\.").unwrap();
    files
        .into_iter()
        .filter(|p| {
            let s = p.to_string_lossy();
            let name = p.file_name().unwrap().to_string_lossy();
            s.contains("/src/") && name != "tests.rs" && !(s.contains("/src/bin/") && name.contains("bench"))
        })
        .map(|p| {
            let text = std::fs::read_to_string(&p).unwrap();
            let kept = without_test_items(&code_only(&text));
            (p, chain.replace_all(&kept, ".").into_owned())
        })
        .collect()
}

/// `text` without comments, and with every string and char literal emptied (`""`, `' '`); line breaks are kept.
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    let ident = |c: char| c.is_alphanumeric() || c == '_';
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            i += 2;
            while i < chars.len() && !(chars[i] == '*' && chars.get(i + 1) == Some(&'/')) {
                if chars[i] == '\n' {
                    out.push('\n');
                }
                i += 1;
            }
            i += 2;
        } else if c == 'r' && matches!(next, Some('"' | '#')) && !(i > 0 && ident(chars[i - 1])) {
            // a raw string: r"...", r#"..."#
            let hashes = chars[i + 1..].iter().take_while(|&&h| h == '#').count();
            if chars.get(i + 1 + hashes) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            i += 2 + hashes;
            while i < chars.len() && !(chars[i] == '"' && chars[i + 1..].iter().take(hashes).all(|&h| h == '#')) {
                i += 1;
            }
            i += 1 + hashes;
            out.push_str("\"\"");
        } else if c == '"' {
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if c == '\'' && (next == Some('\\') || chars.get(i + 2) == Some(&'\'')) {
            // a char literal ('x', '\n', '\u{..}'); a lifetime has no closing quote
            i += 1;
            while i < chars.len() && chars[i] != '\'' {
                i += if chars[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

/// `text` without the items under `#[cfg(test)]` and without comment lines.
fn without_test_items(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]" {
            // skip the item: a one-line `use ...;` or a braced block
            let mut depth = 0i64;
            let mut opened = false;
            for item in lines.by_ref() {
                depth += item.matches('{').count() as i64 - item.matches('}').count() as i64;
                opened |= item.contains('{');
                if (opened && depth <= 0) || (!opened && item.trim_end().ends_with(';')) {
                    break;
                }
            }
            continue;
        }
        if !line.trim_start().starts_with("//") {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Whether `source` reads field `f` (see the module doc): `.f` not followed by `(` or by an assignment.
fn reads(source: &str, f: &str, qualifier: Option<&str>) -> bool {
    let pattern = match qualifier {
        Some(parent) => format!(r"\b{parent}\.{f}\b"),
        None => format!(r"\.{f}\b"),
    };
    let re = Regex::new(&pattern).unwrap();
    let read = re.find_iter(source).any(|m| {
        let rest = source[m.end()..].trim_start();
        let assignment = rest.starts_with('=') && !rest.starts_with("==") && !rest.starts_with("=>");
        let compound = ["+=", "-=", "*=", "/="].iter().any(|op| rest.starts_with(op));
        !(rest.starts_with('(') || assignment || compound)
    });
    read
}

/// The bodies of the `fn` and `impl` items whose header (the text before their `{`) names `name` as a word.
fn blocks_naming(source: &str, name: &str) -> Vec<String> {
    let item = Regex::new(r"\b(fn|impl)\b").unwrap();
    let word = Regex::new(&format!(r"\b{name}\b")).unwrap();
    let mut out = Vec::new();
    for m in item.find_iter(source) {
        let rest = &source[m.start()..];
        let Some(open) = rest.find(['{', ';']) else { continue };
        if rest.as_bytes()[open] != b'{' || !word.is_match(&rest[..open]) {
            continue;
        }
        let mut depth = 0usize;
        for (i, c) in rest[open..].char_indices() {
            match c {
                '{' => depth += 1,
                '}' => {
                    depth -= 1;
                    if depth == 0 {
                        out.push(rest[open..open + i + 1].to_string());
                        break;
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// Whether `source` reads field `f` of the struct `owner` found under key `parent` (see the module doc).
fn reads_field_of(source: &str, f: &str, parent: &str, owner: &str) -> bool {
    if !source.contains(&format!(".{f}")) {
        return false;
    }
    if reads(source, f, Some(parent)) {
        return true;
    }
    let alias =
        Regex::new(&format!(r"let (?:mut )?(\w+)(?::[^=]+)? = &?(?:mut )?[\w.]*\b{parent}(?:\.clone\(\))?;")).unwrap();
    if alias.captures_iter(source).any(|c| reads(source, f, Some(&c[1]))) {
        return true;
    }
    blocks_naming(source, owner).iter().any(|block| reads(block, f, None))
}

#[test]
fn every_documented_key_is_a_job_key_and_every_job_key_is_documented() {
    let doc = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let keys = documented_keys(&doc);
    assert!(keys.len() > 150, "only {} keys read from docs/configuration.md: is the table format changed?", keys.len());
    let json = job_json();
    let unknown: Vec<String> = keys
        .iter()
        .filter(|k| lookup(&json, &k.path).is_none())
        .map(|k| format!("{} (line {})", k.path.join("."), k.line))
        .collect();
    assert!(unknown.is_empty(), "documented but not keys of JobConfig: {unknown:#?}");

    let documented: BTreeSet<Vec<String>> = keys.iter().map(|k| k.path.clone()).collect();
    let mut every = BTreeSet::new();
    all_paths(&json, &mut Vec::new(), &mut every);
    // a documented section documents what is under it (`critic.optim.*`, `custom_reward_function.reward_kwargs`)
    let undocumented: Vec<String> = every
        .iter()
        .filter(|path| !(1..=path.len()).any(|n| documented.contains(&path[..n])))
        .filter(|path| !every.iter().any(|other| other.len() > path.len() && other.starts_with(path)))
        .map(|path| path.join("."))
        .collect();
    assert!(undocumented.is_empty(), "keys of JobConfig missing from docs/configuration.md: {undocumented:#?}");
}

#[test]
fn every_documented_key_is_read_by_some_code_path() {
    let doc = std::fs::read_to_string(repo_root().join("docs/configuration.md")).unwrap();
    let structs = config_structs();
    let sources = production_sources();
    assert!(sources.len() > 50, "only {} source files found", sources.len());
    let mut unread = Vec::new();
    let mut read_after_all = Vec::new();
    for key in documented_keys(&doc) {
        // walk the struct declarations from JobConfig to the key's own struct and field
        let mut owner = "JobConfig".to_string();
        let mut field = None;
        for part in &key.path {
            let fields = structs.get(&owner).unwrap_or_else(|| panic!("no struct {owner} for {}", key.path.join(".")));
            let f = fields.get(part).unwrap_or_else(|| panic!("{owner} has no field {part} ({})", key.path.join(".")));
            field = Some((owner.clone(), f.clone()));
            owner = f.ty.clone();
        }
        let (owner, field) = field.unwrap();
        let parent = if key.path.len() >= 2 { key.path[key.path.len() - 2].clone() } else { String::new() };
        let read = sources.iter().any(|(_, source)| reads_field_of(source, &field.rust_name, &parent, &owner));
        let dotted = key.path.join(".");
        if let Some((_, values)) = single_valued().into_iter().find(|(k, _)| *k == dotted) {
            assert_eq!(values, 1, "{dotted} has {values} values now: something must read it");
            continue;
        }
        match (read, NOT_READ_YET.iter().any(|(k, _)| *k == dotted)) {
            (false, false) => unread.push(format!("{dotted} (line {}, field {owner}.{})", key.line, field.rust_name)),
            (true, true) => read_after_all.push(dotted),
            _ => {}
        }
    }
    assert!(unread.is_empty(), "documented keys no code path reads (see this file's doc for the rule): {unread:#?}");
    assert!(read_after_all.is_empty(), "read now, remove from NOT_READ_YET: {read_after_all:?}");
}

/// The heuristic itself: declarations, defaults, assignments and method calls are not reads; test modules do not
/// count; a chain split over lines does.
#[test]
fn the_read_heuristic_ignores_declarations_assignments_calls_and_tests() {
    let source = without_test_items(
        "pub struct A {\n    pub alpha: u32,\n}\nfn f(a: &mut A) {\n    a.alpha = 3;\n    a.alpha += 1;\n    \
         x.alpha();\n    // a.alpha\n}\n#[cfg(test)]\nmod tests {\n    fn t(a: A) { let _ = a.alpha; }\n}\n",
    );
    assert!(!reads(&source, "alpha", None), "{source}");
    let literals =
        code_only("let s = \"x.alpha\"; let r = r#\"a \"q\" .alpha\"#; let c = '\"'; // .alpha\nlet d = y.beta;");
    assert!(!reads(&literals, "alpha", None) && reads(&literals, "beta", None), "{literals}");
    assert!(reads("let b = cfg\n    .nats\n    .alpha == 2;", "alpha", None));
    let joined = Regex::new(r"\s*\n\s*\.").unwrap().replace_all("cfg\n    .nats\n    .alpha", ".").into_owned();
    assert!(reads(&joined, "alpha", Some("nats")));
    assert!(!reads("cfg.run.alpha", "alpha", Some("nats")));
    let aliased = "fn f(cfg: &JobConfig) {\n    let kw = &cfg.rollout.val_kwargs;\n    let k = kw.top_k;\n}\n";
    assert!(reads_field_of(aliased, "top_k", "val_kwargs", "ValKwargs"));
    assert!(!reads_field_of(aliased, "top_k", "rollout", "RolloutConfig"));
    let scoped = "impl Other {\n    fn g(&self) { self.top_k }\n}\nfn h(v: &ValKwargs) -> i32 {\n    v.top_k\n}\n";
    assert!(reads_field_of(scoped, "top_k", "val_kwargs", "ValKwargs"));
    assert!(!reads_field_of(scoped, "top_k", "rollout", "RolloutConfig"), "Other's top_k is not RolloutConfig's");
}
