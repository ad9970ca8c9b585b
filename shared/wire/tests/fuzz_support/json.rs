//! Structure-aware mutations of JSON documents (config.json, tokenizer.json, safetensors headers, answer
//! lines, job YAML read as JSON): a value replaced by one of another type or at the edge of its range, a key
//! removed or renamed, two values swapped, a subtree duplicated or nested deeply. Byte edits (`super::mutate`)
//! then break the syntax as well. Included with `#[path]` by the suites of crates that depend on serde_json.
#![allow(dead_code)] // each suite uses the part it needs

use proptest::prelude::*;
use proptest::sample::Index;
use serde_json::{json, Value};

/// One structural edit; nodes are picked by [`Index`] over a depth-first list of the document's nodes.
#[derive(Debug, Clone)]
pub enum JsonEdit {
    Replace(Index, Value),
    RemoveKey(Index),
    RenameKey(Index, String),
    SwapValues(Index, Index),
    /// A node's value copied over another node.
    CopyOver(Index, Index),
    /// A node wrapped in `depth` arrays.
    Nest(Index, usize),
}

/// Values that break assumptions: other types, integers and floats at the edges, empty and long strings and
/// containers, strings that look like templates or other formats.
pub fn edge_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        prop_oneof![
            Just(json!(0)),
            Just(json!(-1)),
            Just(json!(1)),
            Just(json!(2)),
            Just(json!(3)),
            Just(json!(i64::MIN)),
            Just(json!(i64::MAX)),
            Just(json!(u64::MAX)),
            Just(json!(u32::MAX)),
            Just(json!(u64::from(u32::MAX) + 1)),
            Just(json!(1u64 << 53)),
            any::<i64>().prop_map(|v| json!(v)),
            (0u64..100_000).prop_map(|v| json!(v)),
        ],
        prop_oneof![
            Just(json!(0.0)),
            Just(json!(-0.0)),
            Just(json!(0.5)),
            Just(json!(1e-300)),
            Just(json!(1e300)),
            Just(json!(f64::MAX)),
            Just(json!(f64::MIN_POSITIVE)),
            any::<f64>().prop_filter_map("finite", |v| v.is_finite().then(|| json!(v))),
        ],
        prop_oneof![
            Just(json!("")),
            Just(json!("x".repeat(1000))),
            Just(json!("é\u{0}\u{ffff}🦀")),
            Just(json!("{{ x }}")),
            Just(json!("{% for x in y %}")),
            Just(json!("../../etc/passwd")),
            Just(json!("a_b_1_2")),
            Just(json!("1e400")),
            Just(json!("NaN")),
            "[a-z_]{0,12}".prop_map(Value::String),
            any::<String>().prop_map(Value::String),
        ],
        Just(json!([])),
        Just(json!({})),
        proptest::collection::vec(any::<i32>(), 0..8).prop_map(|v| json!(v)),
        Just((0..32).fold(json!(1), |inner, _| json!([inner]))),
        Just(json!({"": null, "a": {"b": {"c": {}}}})),
    ]
}

pub fn json_edit() -> impl Strategy<Value = JsonEdit> {
    let index = any::<Index>;
    prop_oneof![
        6 => (index(), edge_value()).prop_map(|(at, v)| JsonEdit::Replace(at, v)),
        2 => index().prop_map(JsonEdit::RemoveKey),
        1 => (index(), "[a-z_]{0,10}").prop_map(|(at, k)| JsonEdit::RenameKey(at, k)),
        2 => (index(), index()).prop_map(|(a, b)| JsonEdit::SwapValues(a, b)),
        1 => (index(), index()).prop_map(|(a, b)| JsonEdit::CopyOver(a, b)),
        1 => (index(), prop_oneof![1usize..8, 120usize..140, 200usize..300]).prop_map(|(at, d)| JsonEdit::Nest(at, d)),
    ]
}

/// JSON pointers of every node, depth first (the root is `""`).
pub fn pointers(value: &Value) -> Vec<String> {
    fn walk(value: &Value, at: String, out: &mut Vec<String>) {
        out.push(at.clone());
        match value {
            Value::Object(map) => {
                for (key, child) in map {
                    let escaped = key.replace('~', "~0").replace('/', "~1");
                    walk(child, format!("{at}/{escaped}"), out);
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    walk(child, format!("{at}/{i}"), out);
                }
            }
            _ => {}
        }
    }
    let mut out = Vec::new();
    walk(value, String::new(), &mut out);
    out
}

/// The parent pointer and the last token of `pointer` (`None` for the root).
fn split_last(pointer: &str) -> Option<(&str, String)> {
    let (parent, last) = pointer.rsplit_once('/')?;
    Some((parent, last.replace("~1", "/").replace("~0", "~")))
}

pub fn apply(doc: &mut Value, edit: &JsonEdit) {
    let nodes = pointers(doc);
    let pick = |i: &Index| nodes[i.index(nodes.len())].clone();
    match edit {
        JsonEdit::Replace(at, value) => {
            if let Some(node) = doc.pointer_mut(&pick(at)) {
                *node = value.clone();
            }
        }
        JsonEdit::RemoveKey(at) => {
            let at = pick(at);
            if let Some((parent, last)) = split_last(&at) {
                match doc.pointer_mut(parent) {
                    Some(Value::Object(map)) => {
                        map.remove(&last);
                    }
                    Some(Value::Array(items)) => {
                        if let Ok(i) = last.parse::<usize>() {
                            if i < items.len() {
                                items.remove(i);
                            }
                        }
                    }
                    _ => {}
                }
            }
        }
        JsonEdit::RenameKey(at, new_key) => {
            let at = pick(at);
            if let Some((parent, last)) = split_last(&at) {
                if let Some(Value::Object(map)) = doc.pointer_mut(parent) {
                    if let Some(value) = map.remove(&last) {
                        map.insert(new_key.clone(), value);
                    }
                }
            }
        }
        JsonEdit::SwapValues(a, b) => {
            let (a, b) = (pick(a), pick(b));
            // Only disjoint nodes: swapping a node with its own ancestor has no meaning.
            if a.starts_with(&b) || b.starts_with(&a) {
                return;
            }
            let (Some(va), Some(vb)) = (doc.pointer(&a).cloned(), doc.pointer(&b).cloned()) else { return };
            if let Some(node) = doc.pointer_mut(&a) {
                *node = vb;
            }
            if let Some(node) = doc.pointer_mut(&b) {
                *node = va;
            }
        }
        JsonEdit::CopyOver(from, to) => {
            let (from, to) = (pick(from), pick(to));
            let Some(value) = doc.pointer(&from).cloned() else { return };
            if let Some(node) = doc.pointer_mut(&to) {
                *node = value;
            }
        }
        JsonEdit::Nest(at, depth) => {
            if let Some(node) = doc.pointer_mut(&pick(at)) {
                let mut value = node.take();
                for _ in 0..*depth {
                    value = Value::Array(vec![value]);
                }
                *node = value;
            }
        }
    }
}

/// One of `seeds` with 1 to 6 structural edits applied.
pub fn json_mutated(seeds: Vec<Value>) -> impl Strategy<Value = Value> {
    (proptest::sample::select(seeds), proptest::collection::vec(json_edit(), 1..=6)).prop_map(|(mut doc, edits)| {
        for edit in &edits {
            apply(&mut doc, edit);
        }
        doc
    })
}

/// JSON text for a decoder: random bytes, byte-mutated seeds, structurally mutated seeds, or both mutations.
pub fn json_bytes(seeds: Vec<Value>, max_random_len: usize) -> impl Strategy<Value = Vec<u8>> {
    let texts: Vec<Vec<u8>> = seeds.iter().map(|v| v.to_string().into_bytes()).collect();
    let dictionary = super::mutate::JSON_TOKENS;
    prop_oneof![
        1 => super::mutate::random_bytes(max_random_len),
        3 => super::mutate::mutated(texts, dictionary),
        4 => json_mutated(seeds.clone()).prop_map(|v| v.to_string().into_bytes()),
        2 => (json_mutated(seeds), proptest::collection::vec(super::mutate::byte_edit(), 1..=3)).prop_map(
            move |(v, edits)| {
                let mut bytes = v.to_string().into_bytes();
                for edit in &edits {
                    super::mutate::apply(&mut bytes, edit, dictionary);
                }
                bytes
            }
        ),
    ]
}
