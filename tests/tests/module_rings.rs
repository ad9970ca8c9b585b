//! No import rings: inside every crate of the workspace, no module reaches (through `crate::` paths in non-test
//! code, followed through any number of modules) a module that reaches it. A module and its own submodules may
//! name each other (`mod.rs` re-exports, `super::`); siblings may not go round in a circle.
//!
//! The scan needs no Rust parser: non-test code is a file up to its first `#[cfg(test)]` (test modules come last
//! by convention; files named `tests.rs`, `tests/` and `bin/` directories are test or binary code), with comments
//! and string literals dropped. Every `crate::a::b::C` path, including those inside `use crate::{..}` trees,
//! is an edge to the longest module prefix it names. The rings are the strongly connected components with more
//! than one module.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// A crate's modules by path (`schedule::sync`; the crate root is ""), each with its non-test source.
type Modules = BTreeMap<String, String>;
type Edges = BTreeMap<String, BTreeSet<String>>;

/// The source with comments and string/char literals replaced by a space, up to the first `#[cfg(test)]`.
fn non_test_code(src: &str) -> String {
    let s: Vec<char> = src.chars().collect();
    let (n, mut i) = (s.len(), 0usize);
    let mut out = String::with_capacity(src.len());
    while i < n {
        let c = s[i];
        let next = s.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < n && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0usize;
            while i < n {
                if s[i] == '/' && s.get(i + 1) == Some(&'*') {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && s.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if c == 'r' && matches!(next, Some('#') | Some('"')) && !ident_before(&s, i) {
            // raw string: r"..." or r#"..."#
            let mut j = i + 1;
            let mut hashes = 0;
            while j < n && s[j] == '#' {
                hashes += 1;
                j += 1;
            }
            if j < n && s[j] == '"' {
                j += 1;
                loop {
                    if j >= n {
                        break;
                    }
                    if s[j] == '"' && (0..hashes).all(|k| s.get(j + 1 + k) == Some(&'#')) {
                        j += 1 + hashes;
                        break;
                    }
                    j += 1;
                }
                out.push(' ');
                i = j;
            } else {
                out.push(c);
                i += 1;
            }
        } else if c == '"' {
            i += 1;
            while i < n && s[i] != '"' {
                i += if s[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push(' ');
        } else if c == '\'' && char_literal_end(&s, i).is_some() {
            i = char_literal_end(&s, i).unwrap_or(i + 1);
            out.push(' ');
        } else {
            out.push(c);
            i += 1;
        }
    }
    match out.find("#[cfg(test)]") {
        Some(at) => out[..at].to_string(),
        None => out,
    }
}

fn ident_before(s: &[char], i: usize) -> bool {
    i > 0 && (s[i - 1].is_alphanumeric() || s[i - 1] == '_')
}

/// The index after a char literal starting at `i` (`'a'`, `'\n'`, `'\u{1F600}'`), or None for a lifetime.
fn char_literal_end(s: &[char], i: usize) -> Option<usize> {
    match (s.get(i + 1), s.get(i + 2)) {
        (Some('\\'), _) => {
            let mut j = i + 2;
            while j < s.len() && s[j] != '\'' {
                j += 1;
            }
            Some(j + 1)
        }
        (Some(_), Some('\'')) => Some(i + 3),
        _ => None,
    }
}

/// Every path a `crate::` reference names: `crate::a::b` gives `a::b`; `crate::{a::{X, Y}, b}` gives `a::X`,
/// `a::Y` and `b`.
fn crate_paths(code: &str) -> Vec<String> {
    let s: Vec<char> = code.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(at) = find(&s, i, "crate::") {
        i = at + "crate::".len();
        if at > 0 && (s[at - 1].is_alphanumeric() || s[at - 1] == '_') {
            continue;
        }
        let (paths, end) = use_tree(&s, i, "");
        out.extend(paths);
        i = end.max(i);
    }
    out
}

fn find(s: &[char], from: usize, needle: &str) -> Option<usize> {
    let needle: Vec<char> = needle.chars().collect();
    (from..s.len().saturating_sub(needle.len() - 1)).find(|&k| s[k..k + needle.len()] == needle[..])
}

/// The paths of a use tree starting at `i` under `prefix`, and the index after it.
fn use_tree(s: &[char], mut i: usize, prefix: &str) -> (Vec<String>, usize) {
    let skip_ws = |mut i: usize| {
        while i < s.len() && s[i].is_whitespace() {
            i += 1;
        }
        i
    };
    let mut path = prefix.to_string();
    loop {
        i = skip_ws(i);
        if s.get(i) == Some(&'{') {
            let mut out = Vec::new();
            i += 1;
            loop {
                i = skip_ws(i);
                match s.get(i) {
                    None => return (out, i),
                    Some('}') => return (out, i + 1),
                    Some(',') => i += 1,
                    Some(_) => {
                        let (paths, end) = use_tree(s, i, &path);
                        out.extend(paths);
                        if end == i {
                            i += 1;
                        } else {
                            i = end;
                        }
                    }
                }
            }
        }
        let start = i;
        while i < s.len() && (s[i].is_alphanumeric() || s[i] == '_') {
            i += 1;
        }
        if i == start {
            return (if path.is_empty() { vec![] } else { vec![path] }, i);
        }
        let segment: String = s[start..i].iter().collect();
        path = if path.is_empty() { segment } else { format!("{path}::{segment}") };
        if s.get(i) == Some(&':') && s.get(i + 1) == Some(&':') {
            i += 2;
        } else {
            return (vec![path], i);
        }
    }
}

/// Each module's edges: the modules its `crate::` paths name, the longest module prefix of each, leaving out
/// itself, its ancestors and its descendants.
fn edges(modules: &Modules) -> Edges {
    let related = |a: &str, b: &str| a == b || a.starts_with(&format!("{b}::")) || b.starts_with(&format!("{a}::"));
    let mut out = Edges::new();
    for (name, src) in modules {
        let targets = out.entry(name.clone()).or_default();
        if name.is_empty() {
            continue; // the crate root declares and re-exports every module
        }
        for path in crate_paths(&non_test_code(src)) {
            let parts: Vec<&str> = path.split("::").collect();
            let target = (1..=parts.len()).rev().map(|k| parts[..k].join("::")).find(|c| modules.contains_key(c));
            if let Some(target) = target.filter(|t| !related(name, t)) {
                targets.insert(target);
            }
        }
    }
    out
}

/// The strongly connected components of more than one module (Tarjan), each sorted.
fn rings(edges: &Edges) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a Edges,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on_stack: BTreeSet<&'a str>,
        out: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let n = self.index.len();
            self.index.insert(v, n);
            self.low.insert(v, n);
            self.stack.push(v);
            self.on_stack.insert(v);
            for w in self.edges.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w]);
                    self.low.insert(v, low);
                } else if self.on_stack.contains(w) {
                    let low = self.low[v].min(self.index[w]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on_stack.remove(w);
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.out.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        out: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.out
}

/// The modules of the crate whose `src/` is `src`.
fn modules_of(src: &Path) -> Modules {
    fn walk(dir: &Path, src: &Path, out: &mut Modules) {
        let mut entries: Vec<PathBuf> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        entries.sort();
        for path in entries {
            let name = path.file_name().unwrap().to_string_lossy().to_string();
            if path.is_dir() {
                if name != "bin" && name != "tests" {
                    walk(&path, src, out);
                }
                continue;
            }
            if !name.ends_with(".rs") || name == "main.rs" || name == "tests.rs" {
                continue;
            }
            let rel = path.strip_prefix(src).unwrap().with_extension("");
            let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().to_string()).collect();
            if matches!(parts.last().map(String::as_str), Some("mod") | Some("lib")) {
                parts.pop();
            }
            out.insert(parts.join("::"), std::fs::read_to_string(&path).unwrap());
        }
    }
    let mut out = Modules::new();
    walk(src, src, &mut out);
    out
}

/// Every crate of the workspace: directories with a `Cargo.toml` and a `src/`.
fn crates(dir: &Path, out: &mut Vec<PathBuf>) {
    if dir.join("Cargo.toml").is_file() && dir.join("src").is_dir() {
        out.push(dir.to_path_buf());
    }
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        let skipped = name.starts_with('.') || matches!(name.as_str(), "target" | "third_party" | "node_modules");
        if path.is_dir() && !skipped {
            crates(&path, out);
        }
    }
}

#[test]
fn no_module_of_any_crate_imports_a_module_that_imports_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut found = Vec::new();
    crates(root, &mut found);
    assert!(found.len() >= 10, "the scan found only {} crates under {}", found.len(), root.display());
    let mut report = Vec::new();
    for krate in &found {
        let modules = modules_of(&krate.join("src"));
        for ring in rings(&edges(&modules)) {
            report.push(format!("{}: {}", krate.strip_prefix(root).unwrap().display(), ring.join(" <-> ")));
        }
    }
    assert!(report.is_empty(), "modules that import each other (directly or round a ring):\n{}", report.join("\n"));
}

#[test]
fn the_scan_finds_a_ring_of_any_length_and_nothing_in_tests_comments_strings_or_family() {
    let module = |name: &str, src: &str| (name.to_string(), src.to_string());
    let modules: Modules = [
        module("", "pub mod a; pub mod b; pub mod c; use crate::a::X;"),
        module("a", "use crate::{b::{Y, Z}, util};\npub struct X;"),
        module("b", "pub fn y() -> crate::c::W { todo!() }"),
        module("c", "pub(crate) use crate::a::X as W;"),
        module(
            "util",
            "// crate::a::X\nconst S: &str = \"crate::a::X\";\n/* crate::b */\n#[cfg(test)]\nmod t { use crate::a; }",
        ),
        module("c::inner", "use crate::c::W; use crate::util;"),
    ]
    .into_iter()
    .collect();
    let e = edges(&modules);
    assert_eq!(e["a"], BTreeSet::from(["b".to_string(), "util".to_string()]));
    assert!(e["util"].is_empty(), "comments, strings and test code are not edges: {:?}", e["util"]);
    assert_eq!(e["c::inner"], BTreeSet::from(["util".to_string()]), "a submodule may name its parent");
    assert!(e[""].is_empty(), "the crate root is not a module of any ring");
    assert_eq!(rings(&e), vec![vec!["a".to_string(), "b".to_string(), "c".to_string()]]);

    let without: Modules = modules.into_iter().filter(|(name, _)| name != "c").collect();
    assert!(rings(&edges(&without)).is_empty());
}
