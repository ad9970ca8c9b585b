fn main() {
    jetrl_build_support::link_libtorch();
    keep_libtorch_cuda_in_tests();
}

/// The GPU tests need `libtorch_cuda` loaded, but no symbol of it is referenced directly, so the linker drops it
/// (and `tch::Cuda::is_available()` is then false on a GPU host). Keep it linked in test binaries when the
/// libtorch in use has it; on a CPU-only host those tests skip.
fn keep_libtorch_cuda_in_tests() {
    let Some(root) = std::env::var_os("LIBTORCH") else { return };
    let lib = std::path::PathBuf::from(root).join("lib");
    let Ok(lib) = std::fs::canonicalize(&lib) else { return };
    if lib.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-arg-tests=-Wl,--no-as-needed");
        println!("cargo:rustc-link-arg-tests=-L{}", lib.display());
        println!("cargo:rustc-link-arg-tests=-ltorch_cuda");
        println!("cargo:rustc-link-arg-tests=-Wl,--as-needed");
    }
}
