//! Hydra's command-line override syntax, as `python3 -m verl.trainer.main_ppo key=value …` takes it, applied to a
//! JSON tree: `a.b=v` sets, `+a.b=v` adds, `++a.b=v` adds or sets, `~a.b` (or `~a.b=v`) deletes. Values are read
//! as Hydra reads them: `null`, booleans in any case (`True`), numbers (`1e-6`), quoted strings, lists
//! (`[console,wandb]`, `['a','b']`), dicts (`{a:1}`), and anything else as a plain string; `${…}` interpolations
//! are resolved after every override is applied ([`resolve_interpolations`]).

use serde_json::{Map, Value};

use crate::ConfigError;

/// One parsed override.
#[derive(Debug, Clone, PartialEq)]
pub enum Override {
    /// `a.b=v`, `+a.b=v`, `++a.b=v`
    Set { path: Vec<String>, value: Value },
    /// `~a.b`, `~a.b=v`
    Delete { path: Vec<String> },
}

impl Override {
    pub fn path(&self) -> &[String] {
        match self {
            Override::Set { path, .. } | Override::Delete { path } => path,
        }
    }
}

/// Parses one command-line override.
pub fn parse_override(item: &str) -> Result<Override, ConfigError> {
    let bad = || ConfigError::BadOverride(item.to_string());
    let (delete, rest) = match item.strip_prefix('~') {
        Some(rest) => (true, rest),
        None => (false, item.trim_start_matches('+')),
    };
    if !delete && item.starts_with("+++") {
        return Err(bad());
    }
    let (key, raw) = match rest.split_once('=') {
        Some((key, raw)) => (key.trim(), Some(raw)),
        None if delete => (rest.trim(), None),
        None => return Err(bad()),
    };
    let path: Vec<String> = key.split('.').map(str::to_string).collect();
    if key.is_empty() || path.iter().any(|p| p.is_empty() || p.contains(char::is_whitespace)) {
        return Err(bad());
    }
    if delete {
        return Ok(Override::Delete { path });
    }
    Ok(Override::Set { path, value: parse_value(raw.unwrap_or_default()) })
}

/// A Hydra override value as JSON.
pub fn parse_value(raw: &str) -> Value {
    let text = raw.trim();
    if text.is_empty() {
        return Value::String(String::new());
    }
    match text.to_ascii_lowercase().as_str() {
        "null" | "~" => return Value::Null,
        "true" => return Value::Bool(true),
        "false" => return Value::Bool(false),
        _ => {}
    }
    // Interpolations stay strings until the tree is complete.
    if text.starts_with("${") && text.ends_with('}') {
        return Value::String(text.to_string());
    }
    if let Ok(i) = text.parse::<i64>() {
        return Value::from(i);
    }
    if let Ok(f) = text.parse::<f64>() {
        if f.is_finite() {
            return Value::from(f);
        }
    }
    let quoted = |q: char| text.len() >= 2 && text.starts_with(q) && text.ends_with(q);
    if quoted('\'') || quoted('"') {
        return Value::String(text[1..text.len() - 1].to_string());
    }
    if (text.starts_with('[') && text.ends_with(']')) || (text.starts_with('{') && text.ends_with('}')) {
        if let Some(value) = parse_collection(text) {
            return value;
        }
    }
    Value::String(text.to_string())
}

/// `[a, 'b', 3]` and `{k: v}` with Hydra's element rules (each element read by [`parse_value`]).
fn parse_collection(text: &str) -> Option<Value> {
    let inner = &text[1..text.len() - 1];
    let items = split_top_level(inner)?;
    if text.starts_with('[') {
        let values = items.iter().filter(|s| !s.trim().is_empty()).map(|s| parse_value(s)).collect();
        return Some(Value::Array(values));
    }
    let mut map = Map::new();
    for item in items.iter().filter(|s| !s.trim().is_empty()) {
        let (k, v) = item.split_once(':')?;
        let key = match parse_value(k) {
            Value::String(s) => s,
            other => other.to_string(),
        };
        map.insert(key, parse_value(v));
    }
    Some(Value::Object(map))
}

/// Splits on commas outside brackets and quotes; `None` when brackets or quotes do not balance.
fn split_top_level(text: &str) -> Option<Vec<String>> {
    let mut items = Vec::new();
    let mut depth = 0i32;
    let mut quote: Option<char> = None;
    let mut current = String::new();
    for c in text.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), _) => {}
            (None, '\'' | '"') => quote = Some(c),
            (None, '[' | '{') => depth += 1,
            (None, ']' | '}') => depth -= 1,
            (None, ',') if depth == 0 => {
                items.push(std::mem::take(&mut current));
                continue;
            }
            _ => {}
        }
        if depth < 0 {
            return None;
        }
        current.push(c);
    }
    if depth != 0 || quote.is_some() {
        return None;
    }
    items.push(current);
    Some(items)
}

/// Applies `item` to `tree`.
pub fn apply(tree: &mut Value, item: &Override) {
    match item {
        Override::Set { path, value } => set_path(tree, path, value.clone()),
        Override::Delete { path } => {
            let (last, parents) = path.split_last().expect("an override path has a key");
            let mut node = &mut *tree;
            for part in parents {
                match node.get_mut(part.as_str()) {
                    Some(next) => node = next,
                    None => return,
                }
            }
            if let Some(map) = node.as_object_mut() {
                map.remove(last.as_str());
            }
        }
    }
}

/// Sets `path` in `tree`, making objects of whatever lies on the way (a null or a scalar included).
pub fn set_path(tree: &mut Value, path: &[String], value: Value) {
    let mut node = tree;
    for part in path {
        if !node.is_object() {
            *node = Value::Object(Map::new());
        }
        node = node.as_object_mut().expect("made an object above").entry(part.clone()).or_insert(Value::Null);
    }
    *node = value;
}

/// Merges `over` into `base`: objects key by key, everything else replaced.
pub fn merge(base: &mut Value, over: Value) {
    match (base, over) {
        (Value::Object(base), Value::Object(over)) => {
            for (key, value) in over {
                match base.get_mut(&key) {
                    Some(slot) if slot.is_object() && value.is_object() => merge(slot, value),
                    _ => {
                        base.insert(key, value);
                    }
                }
            }
        }
        (base, over) => *base = over,
    }
}

/// Every leaf of `tree` (a scalar, a list, or an empty object) with its dotted path.
pub fn leaves(tree: &Value) -> Vec<(String, Value)> {
    fn walk(prefix: &str, node: &Value, out: &mut Vec<(String, Value)>) {
        match node {
            Value::Object(map) if !map.is_empty() => {
                for (key, value) in map {
                    let path = if prefix.is_empty() { key.clone() } else { format!("{prefix}.{key}") };
                    walk(&path, value, out);
                }
            }
            _ => out.push((prefix.to_string(), node.clone())),
        }
    }
    let mut out = Vec::new();
    walk("", tree, &mut out);
    out
}

/// The value at a dotted path.
pub fn get<'a>(tree: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(tree, |node, part| node.get(part))
}

/// Resolves `${a.b}` (absolute), `${.b}` (relative to the key's section), `${oc.select:a.b,default}` and
/// `${oc.env:VAR,default}` in every string of `tree`. A whole-string interpolation takes the referenced value
/// with its type; one inside a longer string is substituted as text.
pub fn resolve_interpolations(tree: &mut Value) -> Result<(), ConfigError> {
    for _ in 0..8 {
        let snapshot = tree.clone();
        let mut changed = false;
        let mut error = None;
        for (path, value) in leaves(&snapshot) {
            let Value::String(text) = &value else { continue };
            if !text.contains("${") {
                continue;
            }
            match interpolate(&snapshot, &path, text) {
                Ok(resolved) => {
                    if resolved != value {
                        let parts: Vec<String> = path.split('.').map(str::to_string).collect();
                        set_path(tree, &parts, resolved);
                        changed = true;
                    }
                }
                Err(message) => error = Some(ConfigError::Invalid { path: path.clone(), message }),
            }
        }
        if let Some(err) = error {
            return Err(err);
        }
        if !changed {
            return Ok(());
        }
    }
    Err(ConfigError::Merge("interpolations nest more than 8 deep (a cycle?)".into()))
}

fn interpolate(tree: &Value, key: &str, text: &str) -> Result<Value, String> {
    let mut out = String::new();
    let mut rest = text;
    let whole = text.starts_with("${") && text.ends_with('}') && text.matches("${").count() == 1;
    while let Some(start) = rest.find("${") {
        out.push_str(&rest[..start]);
        let end = rest[start..].find('}').ok_or_else(|| format!("unterminated interpolation in {text:?}"))? + start;
        let expr = &rest[start + 2..end];
        let value = evaluate(tree, key, expr)?;
        // a reference to a key that is itself still an interpolation waits for the next pass
        if value.as_str().is_some_and(|s| s.contains("${")) {
            return Ok(Value::String(text.to_string()));
        }
        if whole {
            return Ok(value);
        }
        match value {
            Value::String(s) => out.push_str(&s),
            Value::Null => out.push_str("None"),
            other => out.push_str(&other.to_string()),
        }
        rest = &rest[end + 1..];
    }
    out.push_str(rest);
    Ok(Value::String(out))
}

fn evaluate(tree: &Value, key: &str, expr: &str) -> Result<Value, String> {
    let lookup = |path: &str| -> Option<Value> {
        let absolute = match path.strip_prefix('.') {
            Some(relative) => match key.rsplit_once('.') {
                Some((section, _)) => format!("{section}.{relative}"),
                None => relative.to_string(),
            },
            None => path.to_string(),
        };
        get(tree, &absolute).cloned()
    };
    if let Some(args) = expr.strip_prefix("oc.select:") {
        let (path, default) = args.split_once(',').map_or((args, None), |(p, d)| (p, Some(d)));
        return Ok(lookup(path.trim()).unwrap_or_else(|| default.map_or(Value::Null, parse_value)));
    }
    if let Some(args) = expr.strip_prefix("oc.env:") {
        let (var, default) = args.split_once(',').map_or((args, None), |(v, d)| (v, Some(d)));
        return match std::env::var(var.trim()) {
            Ok(v) => Ok(Value::String(v)),
            Err(_) => default
                .map(parse_value)
                .ok_or_else(|| format!("environment variable {} is not set and has no default", var.trim())),
        };
    }
    if expr.contains(':') {
        return Err(format!(
            "the interpolation ${{{expr}}} uses a resolver jetrl does not have (it has oc.select and oc.env)"
        ));
    }
    lookup(expr.trim()).ok_or_else(|| format!("the interpolation ${{{expr}}} names a key that is not set"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::json;

    use super::*;

    #[test]
    fn values_read_as_hydra_reads_them() {
        assert_eq!(parse_value("1e-6"), json!(1e-6));
        assert_eq!(parse_value("True"), json!(true));
        assert_eq!(parse_value("null"), Value::Null);
        assert_eq!(parse_value("256"), json!(256));
        assert_eq!(parse_value("'verl_grpo_example_gsm8k'"), json!("verl_grpo_example_gsm8k"));
        assert_eq!(parse_value("[console,wandb]"), json!(["console", "wandb"]));
        assert_eq!(parse_value("['console','wandb']"), json!(["console", "wandb"]));
        assert_eq!(parse_value("[]"), json!([]));
        assert_eq!(parse_value("{a:1,b:[x,y]}"), json!({"a": 1, "b": ["x", "y"]}));
        assert_eq!(parse_value("/home/u/data/train.parquet"), json!("/home/u/data/train.parquet"));
        assert_eq!(parse_value("[unbalanced"), json!("[unbalanced"));
    }

    #[test]
    fn overrides_set_add_and_delete() {
        let mut tree = json!({"a": {"b": 1, "c": 2}});
        for item in ["a.b=3", "+a.d=x", "++a.e=[1,2]", "~a.c"] {
            apply(&mut tree, &parse_override(item).unwrap());
        }
        assert_eq!(tree, json!({"a": {"b": 3, "d": "x", "e": [1, 2]}}));
        for bad in ["a.b", "=1", "a..b=1", "+++a=1", ".a=1"] {
            assert!(matches!(parse_override(bad), Err(ConfigError::BadOverride(_))), "{bad}");
        }
    }

    #[test]
    fn interpolations_resolve_absolute_relative_selected_and_embedded() {
        let mut tree = json!({
            "trainer": {"project_name": "p", "experiment_name": "${.project_name}_e", "dir": "ck/${trainer.project_name}/${trainer.experiment_name}"},
            "critic": {"mini": "${oc.select:actor.mini,256}", "n": "${actor.n}"},
            "actor": {"n": 5},
        });
        resolve_interpolations(&mut tree).unwrap();
        assert_eq!(tree["trainer"]["dir"], "ck/p/p_e");
        assert_eq!(tree["critic"]["mini"], 256);
        assert_eq!(tree["critic"]["n"], 5);
        let mut bad = json!({"a": {"b": "${nope.x}"}});
        let err = resolve_interpolations(&mut bad).unwrap_err().to_string();
        assert!(err.contains("a.b") && err.contains("nope.x"), "{err}");
    }
}
