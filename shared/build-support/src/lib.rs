//! One file: the crate is these few helpers.
//!
//! Helpers for `build.rs` scripts of crates that link libtorch through `tch`.
//!
//! `.cargo/config.toml` points `LIBTORCH` at `.venv/libtorch` (a link to the PyTorch wheel that
//! `scripts/setup.sh` installs). [`link_libtorch`] gives every binary, test, example and benchmark of the calling
//! package an rpath to that `lib/` folder, so nothing needs `LD_LIBRARY_PATH`, and keeps `libtorch_cuda` linked
//! in all of them when the wheel has it: without `--no-as-needed` the linker drops it (no symbol of it is used
//! directly) and `tch::Cuda::is_available()` is then false even on a GPU host — a test of the RL math run on a
//! GPU machine would silently run on the CPU.

use std::path::PathBuf;

/// The rpath, and `libtorch_cuda` kept linked, for every target of the package that is linked (binaries,
/// tests, examples, benchmarks; a library alone is not linked).
pub fn link_libtorch() {
    let lib = libtorch_lib_dir();
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg=-L{}", lib.display());
        println!("cargo:rustc-link-arg=-ltorch_cuda");
        println!("cargo:rustc-link-arg=-Wl,--as-needed");
    }
}

/// Finds libtorch's `lib/` folder and emits the rpath for every target of the package.
///
/// Panics with an actionable message when libtorch cannot be found: a build script has no better way
/// to report it.
fn libtorch_lib_dir() -> PathBuf {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    let Some(root) = std::env::var_os("LIBTORCH") else {
        panic!("LIBTORCH is not set: run scripts/setup.sh (or set LIBTORCH to a libtorch 2.11 folder)");
    };
    let lib = PathBuf::from(root).join("lib");
    let lib = match std::fs::canonicalize(&lib) {
        Ok(path) => path,
        Err(err) => panic!(
            "libtorch not found at {}: {err}. Run scripts/setup.sh to install torch 2.11.0 into .venv",
            lib.display()
        ),
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib.display());
    lib
}
