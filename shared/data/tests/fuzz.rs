//! Fuzzing the Arrow IPC reader (`jetrl_data::arrow_ipc`, which reads the `.arrow` files of HF `datasets`) with
//! proptest. Inputs are random bytes and valid streams mutated byte by byte and structurally: the
//! `save_to_disk` shards of `tests/fixtures` and `every_type.arrow` (every column type the reader decodes, several
//! record batches; `tests/fixtures/make_fixtures.py` writes them all).
//!
//! Properties: no panic and no unbounded work, whatever the bytes; every strict prefix of a valid stream is an
//! error (the end-of-stream marker is required, so a truncated file never loads as a shorter dataset).

#![allow(clippy::unwrap_used)] // test code: a failed unwrap is a failed test

#[path = "../../wire/tests/fuzz_support/bytes.rs"]
mod mutate;

use jetrl_data::arrow_ipc::read_all;
use proptest::prelude::*;

fn config() -> ProptestConfig {
    mutate::fuzz_config(concat!(env!("CARGO_MANIFEST_DIR"), "/proptest-regressions/fuzz.txt"))
}

fn seeds() -> Vec<Vec<u8>> {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    [
        "every_type.arrow",
        "gsm8k_hf/data-00000-of-00002.arrow",
        "gsm8k_hf/data-00001-of-00002.arrow",
        "hf_dict/train/data-00000-of-00001.arrow",
    ]
    .iter()
    .map(|name| std::fs::read(fixtures.join(name)).unwrap())
    .collect()
}

/// Words that matter to the format: the continuation and end-of-stream markers, the file magic, lengths and
/// offsets at the edges of their types, all-ones validity bytes.
const IPC_TOKENS: &[&[u8]] = &[
    b"\xff\xff\xff\xff",
    b"\xff\xff\xff\xff\x00\x00\x00\x00",
    b"ARROW1\x00\x00",
    b"\x00\x00\x00\x00",
    b"\x01\x00\x00\x00",
    b"\x00\x00\x00\x80",
    b"\xff\xff\xff\x7f",
    b"\x00\x00\x00\x00\x00\x00\x00\x80",
    b"\xff\xff\xff\xff\xff\xff\xff\x7f",
    b"\x08\x00\x00\x00\x00\x00\x00\x00",
    b"\xff",
];

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arrow_ipc_reader_never_panics(input in mutate::random_or_mutated(seeds(), IPC_TOKENS, 512)) {
        if let Err(err) = read_all(&input) {
            prop_assert!(!err.is_empty());
        }
    }
}

#[test]
fn valid_streams_read_and_every_strict_prefix_is_an_error() {
    for seed in seeds() {
        let (schema, rows) = read_all(&seed).unwrap();
        assert!(!schema.is_empty() && !rows.is_empty());
        for cut in 0..seed.len() {
            assert!(read_all(&seed[..cut]).is_err(), "a prefix of {cut} of {} bytes read", seed.len());
        }
    }
}
