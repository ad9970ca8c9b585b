//! Inputs for the proptest fuzz suites of every crate that decodes outside bytes (included with `#[path]` by
//! each crate's `tests/fuzz.rs`, so the mutation engine exists once): random bytes, and valid examples
//! mutated by byte flips, truncations, insertions, deletions, duplicated and swapped ranges, and tokens of the
//! format spliced in. Random bytes alone rarely get past a decoder's first check; mutated examples do.
#![allow(dead_code)] // each suite uses the part it needs

use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence};

/// Cases per decoder in the normal test suite. `PROPTEST_CASES` raises it for a longer local run.
pub const CASES: u32 = 10_000;

/// The suite's proptest configuration: [`CASES`] cases (or more from `PROPTEST_CASES`), failures persisted
/// in `regressions` (committed, replayed first on every run), shrinking bounded in steps and in time (a slow
/// failing case, a near-hang, would otherwise be re-run thousands of times).
pub fn fuzz_config(regressions: &'static str) -> Config {
    let env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse().ok());
    Config {
        cases: env("PROPTEST_CASES").unwrap_or(CASES).max(CASES),
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct(regressions))),
        max_shrink_iters: env("PROPTEST_MAX_SHRINK_ITERS").unwrap_or(4096),
        max_shrink_time: env("PROPTEST_MAX_SHRINK_TIME").unwrap_or(30_000),
        ..Config::default()
    }
}

/// One edit of a byte string. Positions are [`Index`]es, scaled to the length when applied.
#[derive(Debug, Clone)]
pub enum ByteEdit {
    FlipBit(Index, u8),
    SetByte(Index, u8),
    Truncate(Index),
    Insert(Index, Vec<u8>),
    Delete(Index, usize),
    Duplicate(Index, usize),
    SwapRanges(Index, Index, usize),
    /// A token of the format (from the suite's dictionary) inserted at a position.
    InsertToken(Index, Index),
    /// A range replaced by a token of the format.
    ReplaceWithToken(Index, usize, Index),
}

pub fn byte_edit() -> impl Strategy<Value = ByteEdit> {
    let index = any::<Index>;
    prop_oneof![
        3 => (index(), 0u8..8).prop_map(|(at, bit)| ByteEdit::FlipBit(at, bit)),
        2 => (index(), prop_oneof![Just(0u8), Just(0xff), Just(0x7f), Just(0x80), any::<u8>()])
            .prop_map(|(at, value)| ByteEdit::SetByte(at, value)),
        1 => index().prop_map(ByteEdit::Truncate),
        2 => (index(), proptest::collection::vec(any::<u8>(), 1..8)).prop_map(|(at, b)| ByteEdit::Insert(at, b)),
        2 => (index(), 1usize..16).prop_map(|(at, len)| ByteEdit::Delete(at, len)),
        1 => (index(), 1usize..32).prop_map(|(at, len)| ByteEdit::Duplicate(at, len)),
        1 => (index(), index(), 1usize..16).prop_map(|(a, b, len)| ByteEdit::SwapRanges(a, b, len)),
        3 => (index(), index()).prop_map(|(at, token)| ByteEdit::InsertToken(at, token)),
        2 => (index(), 1usize..12, index()).prop_map(|(at, len, token)| ByteEdit::ReplaceWithToken(at, len, token)),
    ]
}

/// A position in `0..len` (or 0 for an empty string).
fn position(index: &Index, len: usize) -> usize {
    if len == 0 {
        0
    } else {
        index.index(len)
    }
}

/// A position in `0..=len`: where an insertion may go.
fn gap(index: &Index, len: usize) -> usize {
    index.index(len + 1)
}

pub fn apply(bytes: &mut Vec<u8>, edit: &ByteEdit, dictionary: &[&[u8]]) {
    let len = bytes.len();
    let token = |index: &Index| -> &[u8] {
        if dictionary.is_empty() {
            b""
        } else {
            dictionary[index.index(dictionary.len())]
        }
    };
    match edit {
        ByteEdit::FlipBit(at, bit) if len > 0 => bytes[position(at, len)] ^= 1 << bit,
        ByteEdit::SetByte(at, value) if len > 0 => bytes[position(at, len)] = *value,
        ByteEdit::Truncate(at) => bytes.truncate(position(at, len)),
        ByteEdit::Insert(at, new) => {
            let at = gap(at, len);
            bytes.splice(at..at, new.iter().copied());
        }
        ByteEdit::Delete(at, n) if len > 0 => {
            let at = position(at, len);
            bytes.drain(at..(at + n).min(len));
        }
        ByteEdit::Duplicate(at, n) if len > 0 => {
            let at = position(at, len);
            let copy = bytes[at..(at + n).min(len)].to_vec();
            bytes.splice(at..at, copy);
        }
        ByteEdit::SwapRanges(a, b, n) if len > 0 => {
            let (a, b) = (position(a, len), position(b, len));
            let (first, second) = (a.min(b), a.max(b));
            let n = (*n).min(second - first).min(len - second);
            for i in 0..n {
                bytes.swap(first + i, second + i);
            }
        }
        ByteEdit::InsertToken(at, which) => {
            let at = gap(at, len);
            bytes.splice(at..at, token(which).iter().copied());
        }
        ByteEdit::ReplaceWithToken(at, n, which) => {
            let at = gap(at, len);
            let end = (at + n).min(len);
            bytes.splice(at..end, token(which).iter().copied());
        }
        // edits of a position in an empty string
        ByteEdit::FlipBit(..)
        | ByteEdit::SetByte(..)
        | ByteEdit::Delete(..)
        | ByteEdit::Duplicate(..)
        | ByteEdit::SwapRanges(..) => {}
    }
}

/// Bytes of any value, up to `max_len` long.
pub fn random_bytes(max_len: usize) -> impl Strategy<Value = Vec<u8>> {
    proptest::collection::vec(any::<u8>(), 0..=max_len)
}

/// One of `seeds` with 1 to 8 edits applied.
pub fn mutated(seeds: Vec<Vec<u8>>, dictionary: &'static [&'static [u8]]) -> impl Strategy<Value = Vec<u8>> {
    (proptest::sample::select(seeds), proptest::collection::vec(byte_edit(), 1..=8)).prop_map(
        move |(mut bytes, edits)| {
            for edit in &edits {
                apply(&mut bytes, edit, dictionary);
            }
            bytes
        },
    )
}

/// What most suites feed a decoder: a quarter random bytes, the rest mutated valid examples.
pub fn random_or_mutated(
    seeds: Vec<Vec<u8>>,
    dictionary: &'static [&'static [u8]],
    max_random_len: usize,
) -> impl Strategy<Value = Vec<u8>> {
    prop_oneof![1 => random_bytes(max_random_len), 3 => mutated(seeds, dictionary)]
}

/// Bytes as text the way a reader that accepts only UTF-8 would get them after a lossy conversion.
pub fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Tokens that matter to JSON parsers and to the code reading the JSON: delimiters, literals, numbers at the
/// edges of every integer and float type, escapes, and Python's non-finite spellings.
pub const JSON_TOKENS: &[&[u8]] = &[
    b"{",
    b"}",
    b"[",
    b"]",
    b",",
    b":",
    b"\"",
    b"\\",
    b"null",
    b"true",
    b"false",
    b"0",
    b"-1",
    b"-0",
    b"1e999",
    b"-1e999",
    b"1.5",
    b"1e-320",
    b"4294967295",
    b"4294967296",
    b"9223372036854775807",
    b"9223372036854775808",
    b"18446744073709551615",
    b"18446744073709551616",
    b"-9223372036854775809",
    b"NaN",
    b"Infinity",
    b"-Infinity",
    b"\\u0000",
    b"\\ud800",
    b"\\u00e9",
    b"\"\"",
    b"[]",
    b"{}",
    b"[[[[[[[[[[[[[[[[",
    b"\xff",
    b"\xc3\x28",
    b"\n",
];

/// Files for decoders that read from disk, one fresh directory per case, in memory (`/dev/shm`) where the
/// system has it: 10,000 cases of file and directory writes on a busy disk waited 31 s for 6 s of work.
pub struct Scratch {
    root: std::path::PathBuf,
    case: std::cell::Cell<u64>,
}

impl Scratch {
    pub fn new() -> Self {
        static SUITES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let suite = SUITES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shm = std::path::Path::new("/dev/shm");
        let base = if shm.is_dir() { shm.to_path_buf() } else { std::env::temp_dir() };
        let root = base.join(format!("jetrl-fuzz-{}-{suite}", std::process::id()));
        std::fs::create_dir_all(&root).expect("creating a scratch directory");
        Scratch { root, case: std::cell::Cell::new(0) }
    }

    /// An empty directory for the next case; the previous case's is removed.
    pub fn next_dir(&self) -> std::path::PathBuf {
        let case = self.case.get();
        let _ = std::fs::remove_dir_all(self.root.join(case.to_string()));
        self.case.set(case + 1);
        let dir = self.root.join((case + 1).to_string());
        std::fs::create_dir_all(&dir).expect("creating a case directory");
        dir
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}
