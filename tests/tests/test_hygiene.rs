//! Test hygiene: no test may end as a *pass* by `return`ing before it checked what it is named for (a CUDA test
//! on a machine without a GPU, a test whose race went the other way, a missing program). Such a test either forces
//! its condition, is compiled only where it can run (a cargo feature, `required-features`), or fails under
//! `CI=true` before it returns (tests/tests/deploy.rs's systemd-analyze test).
//!
//! The scan needs no Rust parser: a lexer that drops comments and keeps string/char literals as single tokens,
//! `#[test]` / `#[<path>::test(...)]` attributes, the next `fn`'s body by brace matching, and in it every `return`,
//! `return Ok(())` or `return Ok::<..>(())` that is not inside a closure, an async block or a nested item.
//! `return Err(..)` fails the test, `?` is not a return: neither is flagged.

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

use std::path::{Path, PathBuf};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Ident,
    Punct,
    Str,
    Char,
    Lifetime,
    Num,
}

#[derive(Debug)]
struct Tok {
    kind: Kind,
    text: String,
    line: usize,
}

impl Tok {
    fn is(&self, text: &str) -> bool {
        self.kind != Kind::Str && self.text == text
    }
}

const TWO_CHAR: [&str; 16] =
    ["::", "=>", "->", "||", "&&", "==", "!=", "<=", ">=", "+=", "-=", "*=", "/=", "|=", "&=", ".."];

fn is_ident_start(c: char) -> bool {
    c == '_' || c.is_alphabetic()
}
fn is_ident_char(c: char) -> bool {
    c == '_' || c.is_alphanumeric()
}

/// Comments dropped; strings (all prefixes, raw or not) and char literals one token each; lifetimes kept apart from
/// char literals.
fn lex(src: &str) -> Vec<Tok> {
    let s: Vec<char> = src.chars().collect();
    let (n, mut i, mut line) = (s.len(), 0usize, 1usize);
    let mut out = Vec::new();
    let count_lines = |from: usize, to: usize| s[from..to.min(n)].iter().filter(|&&c| c == '\n').count();
    while i < n {
        let c = s[i];
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && s.get(i + 1) == Some(&'/') {
            while i < n && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && s.get(i + 1) == Some(&'*') {
            let (start, mut depth, mut j) = (i, 1, i + 2);
            while j < n && depth > 0 {
                if s[j] == '/' && s.get(j + 1) == Some(&'*') {
                    depth += 1;
                    j += 2;
                } else if s[j] == '*' && s.get(j + 1) == Some(&'/') {
                    depth -= 1;
                    j += 2;
                } else {
                    j += 1;
                }
            }
            line += count_lines(start, j);
            i = j;
        } else if let Some((body_start, hashes)) = raw_string_start(&s, i) {
            // r"..", r#".."#, br"..", cr#".."#: ends at a quote followed by as many hashes
            let mut j = body_start;
            while j < n && !(s[j] == '"' && (0..hashes).all(|h| s.get(j + 1 + h) == Some(&'#'))) {
                j += 1;
            }
            out.push(Tok { kind: Kind::Str, text: s[body_start..j.min(n)].iter().collect(), line });
            line += count_lines(i, j);
            i = (j + 1 + hashes).min(n);
        } else if c == '"' || ((c == 'b' || c == 'c') && s.get(i + 1) == Some(&'"')) {
            let start = if c == '"' { i + 1 } else { i + 2 };
            let mut j = start;
            while j < n && s[j] != '"' {
                j += if s[j] == '\\' { 2 } else { 1 };
            }
            out.push(Tok { kind: Kind::Str, text: s[start..j.min(n)].iter().collect(), line });
            line += count_lines(i, j);
            i = (j + 1).min(n);
        } else if c == '\'' || (c == 'b' && s.get(i + 1) == Some(&'\'')) {
            let k = if c == '\'' { i + 1 } else { i + 2 };
            if s.get(k) == Some(&'\\') {
                // escaped char literal: to the closing quote
                let mut j = k + 2;
                while j < n && s[j] != '\'' {
                    j += 1;
                }
                out.push(Tok { kind: Kind::Char, text: String::new(), line });
                i = (j + 1).min(n);
            } else if s.get(k + 1) == Some(&'\'') {
                out.push(Tok { kind: Kind::Char, text: String::new(), line });
                i = k + 2;
            } else {
                let mut j = k;
                while j < n && is_ident_char(s[j]) {
                    j += 1;
                }
                out.push(Tok { kind: Kind::Lifetime, text: s[k..j].iter().collect(), line });
                i = j;
            }
        } else if is_ident_start(c) {
            let mut j = i;
            if c == 'r' && s.get(i + 1) == Some(&'#') {
                j += 2; // raw identifier r#name
            }
            let start = j;
            while j < n && is_ident_char(s[j]) {
                j += 1;
            }
            out.push(Tok { kind: Kind::Ident, text: s[start..j].iter().collect(), line });
            i = j;
        } else if c.is_ascii_digit() {
            let mut j = i;
            while j < n && (is_ident_char(s[j]) || (s[j] == '.' && s.get(j + 1).is_some_and(char::is_ascii_digit))) {
                j += 1;
            }
            out.push(Tok { kind: Kind::Num, text: s[i..j].iter().collect(), line });
            i = j;
        } else {
            let two: String = s[i..(i + 2).min(n)].iter().collect();
            let len = if TWO_CHAR.contains(&two.as_str()) { 2 } else { 1 };
            out.push(Tok { kind: Kind::Punct, text: s[i..i + len].iter().collect(), line });
            i += len;
        }
    }
    out
}

/// `r"`, `r#"`, `br##"`, `cr"`: the index after the opening quote and the number of hashes.
fn raw_string_start(s: &[char], i: usize) -> Option<(usize, usize)> {
    let mut j = i;
    if matches!(s[j], 'b' | 'c') {
        j += 1;
    }
    if s.get(j) != Some(&'r') {
        return None;
    }
    j += 1;
    let hashes = s[j..].iter().take_while(|&&c| c == '#').count();
    (s.get(j + hashes) == Some(&'"')).then_some((j + hashes + 1, hashes))
}

fn is_open(t: &Tok) -> bool {
    t.kind == Kind::Punct && matches!(t.text.as_str(), "(" | "[" | "{")
}
fn is_close(t: &Tok) -> bool {
    t.kind == Kind::Punct && matches!(t.text.as_str(), ")" | "]" | "}")
}

/// Index of the bracket that closes `toks[open]`.
fn closing(toks: &[Tok], open: usize) -> usize {
    let mut depth = 0i32;
    for (j, t) in toks.iter().enumerate().skip(open) {
        if is_open(t) {
            depth += 1;
        } else if is_close(t) {
            depth -= 1;
            if depth == 0 {
                return j;
            }
        }
    }
    toks.len() - 1
}

struct TestFn {
    name: String,
    line: usize,
    /// indices of the body's `{` and `}`
    body: (usize, usize),
}

/// Every fn carrying `#[test]` or `#[<path>::test...]` (tokio, async_std, test_log), proptest!'s and macro-made
/// ones included.
fn tests_in(toks: &[Tok]) -> Vec<TestFn> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < toks.len() {
        if !(toks[i].is("#") && toks.get(i + 1).is_some_and(|t| t.is("["))) {
            i += 1;
            continue;
        }
        let (mut k, mut is_test) = (i, false);
        while toks.get(k).is_some_and(|t| t.is("#")) && toks.get(k + 1).is_some_and(|t| t.is("[")) {
            let end = closing(toks, k + 1);
            let path: String =
                toks[k + 2..end].iter().take_while(|t| !t.is("(") && !t.is("=")).map(|t| t.text.as_str()).collect();
            is_test |= path == "test" || path.ends_with("::test");
            k = end + 1;
        }
        while toks.get(k).is_some_and(|t| ["pub", "async", "unsafe", "const", "extern"].contains(&t.text.as_str())) {
            k += 1;
        }
        if is_test && toks.get(k).is_some_and(|t| t.is("fn")) {
            // the body: the first `{` outside the signature's (...) and [...]
            let mut depth = 0i32;
            let mut b = k + 2;
            while b < toks.len() {
                let t = &toks[b];
                if t.is("(") || t.is("[") {
                    depth += 1;
                } else if t.is(")") || t.is("]") {
                    depth -= 1;
                } else if depth == 0 && (t.is("{") || t.is(";")) {
                    break;
                }
                b += 1;
            }
            if toks.get(b).is_some_and(|t| t.is("{")) {
                let e = closing(toks, b);
                out.push(TestFn { name: toks[k + 1].text.clone(), line: toks[k].line, body: (b, e) });
                i = e + 1;
                continue;
            }
        }
        i = k.max(i + 1);
    }
    out
}

/// Token ranges of the body whose `return`s do not end the test: closures, async blocks, nested items.
fn not_the_tests_own(toks: &[Tok], (b, e): (usize, usize)) -> Vec<(usize, usize)> {
    const EXPR_START: [&str; 17] =
        ["(", "[", "{", ",", "=", ";", "=>", "move", "return", ":", "&&", "||", "!", "+=", "-=", "in", "else"];
    let mut out = Vec::new();
    let mut i = b + 1;
    while i < e {
        let t = &toks[i];
        let prev = toks[i - 1].text.as_str();
        if t.kind == Kind::Ident && ["fn", "impl", "mod", "trait"].contains(&t.text.as_str()) {
            let mut j = i;
            while j < e && !toks[j].is("{") && !toks[j].is(";") {
                j += 1;
            }
            if toks[j].is("{") {
                let c = closing(toks, j);
                out.push((i, c));
                i = c + 1;
                continue;
            }
        }
        if t.is("async") {
            let j = if toks[i + 1].is("move") { i + 2 } else { i + 1 };
            if toks[j].is("{") {
                let c = closing(toks, j);
                out.push((i, c));
                i = c + 1;
                continue;
            }
        }
        // a `|` in expression position opens a closure (`a | b`, `A | B =>` follow an operand and are not)
        if (t.is("|") || t.is("||")) && toks[i - 1].kind != Kind::Str && EXPR_START.contains(&prev) {
            let mut j = i + 1;
            if t.is("|") {
                while j < e && !toks[j].is("|") {
                    j += 1;
                }
                j += 1;
            }
            if toks[j].is("->") {
                while j < e && !toks[j].is("{") {
                    j += 1;
                }
            }
            let c = if toks[j].is("{") {
                closing(toks, j)
            } else {
                // expression body: up to a `,` `;` or unmatched closer at its own depth
                let (mut depth, mut c) = (0i32, j);
                while c < e {
                    if is_open(&toks[c]) {
                        depth += 1;
                    } else if is_close(&toks[c]) {
                        if depth == 0 {
                            break;
                        }
                        depth -= 1;
                    } else if depth == 0 && (toks[c].is(",") || toks[c].is(";")) {
                        break;
                    }
                    c += 1;
                }
                c - 1
            };
            out.push((i, c));
            i = c + 1;
            continue;
        }
        i += 1;
    }
    out
}

/// `assert*!`, `prop_assert*!`, `panic!`, `unreachable!`, `todo!`, `unimplemented!`, and calls of helpers named
/// `assert_*` / `check_*` / `require_*` / `expect_*`. `.unwrap()` / `.expect(..)` are set-up, not assertions.
fn is_assertion(toks: &[Tok], i: usize) -> bool {
    let t = &toks[i];
    if t.kind != Kind::Ident {
        return false;
    }
    let name = t.text.trim_start_matches("debug_").trim_start_matches("prop_");
    let next = toks.get(i + 1);
    let called = next.is_some_and(|n| n.is("(")) && !toks[i - 1].is("fn") && !toks[i - 1].is(".");
    (next.is_some_and(|n| n.is("!"))
        && (name == "assert"
            || name.starts_with("assert_")
            || ["panic", "unreachable", "todo", "unimplemented"].contains(&name)))
        || (called && ["assert_", "check_", "require_", "expect_"].iter().any(|p| t.text.starts_with(p)))
}

/// `return`, `return Ok(())`, `return Ok::<..>(())`: the test ends as a pass.
fn is_pass_return(toks: &[Tok], i: usize) -> bool {
    let next = &toks[i + 1];
    if next.is(";") || next.is("}") {
        return true;
    }
    if !next.is("Ok") {
        return false;
    }
    let mut k = i + 2;
    if toks[k].is("::") && toks[k + 1].is("<") {
        let mut depth = 0i32;
        loop {
            if toks[k].is("<") {
                depth += 1;
            } else if toks[k].is(">") {
                depth -= 1;
                if depth == 0 {
                    k += 1;
                    break;
                }
            }
            k += 1;
        }
    }
    toks[k].is("(") && toks[k + 1].is("(") && toks[k + 2].is(")") && toks[k + 3].is(")")
}

/// The block around `toks[i]` asserts on `CI` before it: `assert!(std::env::var("CI").as_deref() != Ok("true"), ..)`.
fn ci_guarded(toks: &[Tok], body_open: usize, i: usize) -> bool {
    let (mut depth, mut o) = (0i32, i);
    while o > body_open {
        o -= 1;
        if is_close(&toks[o]) {
            depth += 1;
        } else if is_open(&toks[o]) {
            if depth == 0 && toks[o].is("{") {
                break;
            }
            depth -= 1;
        }
    }
    (o..i).filter(|&q| is_assertion(toks, q)).any(|q| {
        let end = closing(toks, q + 2);
        (q..end).any(|r| {
            (toks[r].is("var") || toks[r].is("var_os")) && toks[r + 2].kind == Kind::Str && toks[r + 2].text == "CI"
        })
    })
}

/// Findings for one file: `file:line: test: what`.
fn check(rel: &str, src: &str, tests_seen: &mut usize) -> Vec<String> {
    let toks = lex(src);
    let mut out = Vec::new();
    for test in tests_in(&toks) {
        *tests_seen += 1;
        let (b, e) = test.body;
        let skip = not_the_tests_own(&toks, test.body);
        let first_assert = (b..e).find(|&k| is_assertion(&toks, k));
        for k in b + 1..e {
            if !toks[k].is("return") || skip.iter().any(|&(s, c)| (s..=c).contains(&k)) || !is_pass_return(&toks, k) {
                continue;
            }
            let line = toks[k].line;
            if ci_guarded(&toks, b, k) {
                continue;
            }
            let when = if first_assert.is_none_or(|a| k < a) {
                "before its first assertion"
            } else {
                "after set-up assertions"
            };
            out.push(format!("{rel}:{line}: {} (fn at line {}) returns as a pass {when}", test.name, test.line));
        }
    }
    out
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            if !["target", ".git", ".venv", "node_modules"].contains(&name.as_str()) {
                rust_files(&path, out);
            }
        } else if name.ends_with(".rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_test_returns_as_a_pass_without_checking_what_it_is_named_for() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").canonicalize().unwrap();
    let mut files = Vec::new();
    rust_files(&root, &mut files);
    files.sort();
    let (mut findings, mut tests) = (Vec::new(), 0);
    for path in &files {
        let src = std::fs::read_to_string(path).unwrap();
        let rel = path.strip_prefix(&root).unwrap().display().to_string();
        findings.extend(check(&rel, &src, &mut tests));
    }
    // a scanner that finds no tests finds no problems either
    assert!(tests > 500, "the scan found only {tests} tests in {} files: the scanner is broken", files.len());
    assert!(
        findings.is_empty(),
        "tests that end as a pass without checking anything (force the condition, compile the test only where it can \
         run, or fail under CI=true first):\n{}",
        findings.join("\n")
    );
}

#[test]
fn the_scanner_flags_early_passes_and_nothing_inside_closures_strings_or_comments() {
    let fixture = r##"
// #[test] fn in_comment() { return; }
const S: &str = "#[test] fn in_string() { return; }";
#[test]
fn bare() { if !ready() { return; } assert!(true); }
#[test]
fn let_else() { let Some(x) = helper() else { return }; assert_eq!(x, 1); }
#[tokio::test(flavor = "multi_thread")]
async fn turbofish() -> anyhow::Result<()> { if skip() { return Ok::<(), anyhow::Error>(()); } assert!(true); Ok(()) }
#[test]
fn after_setup() { assert!(setup()); if raced() { return; } assert!(real()); }
#[test]
fn closures() { let f = |x: u32| { if x == 0 { return 1; } x }; let g = move || return; assert_eq!(f(0), 1); }
#[test]
fn nested() { fn inner() -> u32 { return 3; } let t = async move { return; }; let c = 'a'; let l: &'static str = "'"; assert!(inner() == 3); }
#[test]
fn err_and_question_mark() -> Result<(), String> { let x = thing()?; if bad() { return Err("bad".into()); } assert!(x); Ok(()) }
#[test]
fn ci_guard() { if missing() { assert!(std::env::var("CI").as_deref() != Ok("true"), "needed in CI"); return; } assert!(run()); }
#[test]
fn binary_or() { let a = b | c; match v { A | B => return_value(), _ => {} } assert!(a); }
"##;
    let mut tests = 0;
    let found = check("fixture.rs", fixture, &mut tests);
    let names: Vec<&str> = found.iter().map(|f| f.split(": ").nth(1).unwrap().split(' ').next().unwrap()).collect();
    assert_eq!(tests, 9);
    assert_eq!(names, ["bare", "let_else", "turbofish", "after_setup"], "{found:#?}");
}
