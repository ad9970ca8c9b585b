//! Compiles the C++ shim (`csrc/`) against libtorch with the flags torch-sys compiles its own C++ with
//! (`-std=c++17`, `-D_GLIBCXX_USE_CXX11_ABI`, `$LIBTORCH/include`, `$LIBTORCH/include/torch/csrc/api/include`),
//! plus the vendored gloo headers. The NCCL process group is compiled in when libtorch_cuda, `nccl.h` and the CUDA
//! headers are all found (`JETRL_TORCH_EXT_NCCL=0` turns it off, `=1` makes a missing piece a build error;
//! `JETRL_CUDA_INCLUDE`, a `:`-separated list, adds folders to look in first).

use std::path::{Path, PathBuf};

const SOURCES: &[&str] = &["csrc/c10d_shim.cpp", "csrc/attention.cpp", "csrc/cuda_graph.cpp", "csrc/optim.cpp"];
const NCCL_SOURCES: &[&str] = &["csrc/c10d_nccl.cpp", "csrc/cuda_memory.cpp"];
/// Headers `ATen/cuda/CUDAContextLight.h` and `c10d/NCCLUtils.hpp` pull in. The torch wheel's own dependencies
/// ship all but `crt/` (PyPI `nvidia-cuda-crt`) and `nv/target` (PyPI `nvidia-cuda-cccl`).
const CUDA_HEADERS: &[&str] = &[
    "cuda_runtime_api.h",
    "crt/host_defines.h",
    "nv/target",
    "cusparse.h",
    "cublas_v2.h",
    "cublasLt.h",
    "cusolverDn.h",
];

fn main() {
    jetrl_build_support::link_libtorch();

    println!("cargo:rerun-if-changed=csrc");
    println!("cargo:rerun-if-changed=third_party/gloo");
    for var in ["LIBTORCH", "LIBTORCH_CXX11_ABI", "JETRL_TORCH_EXT_NCCL", "JETRL_CUDA_INCLUDE", "CUDA_HOME"] {
        println!("cargo:rerun-if-env-changed={var}");
    }

    let Some(root) = std::env::var_os("LIBTORCH") else {
        panic!("LIBTORCH is not set: run scripts/setup.sh (or set LIBTORCH to a libtorch 2.11 folder)");
    };
    let root = match std::fs::canonicalize(&root) {
        Ok(path) => path,
        Err(err) => panic!("libtorch not found at {}: {err}", PathBuf::from(root).display()),
    };
    let abi = std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".to_string());
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_default());

    let nccl = match nccl_setup(&root) {
        Ok(includes) => {
            println!("cargo:rustc-env=JETRL_TORCH_EXT_NCCL_STATUS=built");
            Some(includes)
        }
        Err(why) => {
            // Not a cargo warning (it would repeat on every build of the workspace): the crate's NotBuilt error
            // carries it instead.
            println!("cargo:rustc-env=JETRL_TORCH_EXT_NCCL_STATUS={why}");
            None
        }
    };

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .pic(true)
        .warnings(false)
        .debug(false)
        .include(root.join("include"))
        .include(root.join("include/torch/csrc/api/include"))
        .include(manifest.join("third_party/gloo"))
        .include(manifest.join("csrc"))
        .flag("-std=c++17")
        .flag(format!("-D_GLIBCXX_USE_CXX11_ABI={abi}"))
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .define("USE_C10D_GLOO", None)
        .files(SOURCES.iter().map(|s| manifest.join(s)));
    if let Some(includes) = &nccl {
        build.define("USE_C10D_NCCL", None).define("JETRL_WITH_NCCL", None).includes(includes);
        build.files(NCCL_SOURCES.iter().map(|s| manifest.join(s)));
    }
    build.compile("jetrl_torch_ext");

    if nccl.is_some() {
        // ProcessGroupNCCL lives in libtorch_cuda (and calls into libc10_cuda); they come after the static shim.
        let lib = root.join("lib");
        println!("cargo:rustc-link-search=native={}", lib.display());
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
}

/// The extra include folders the NCCL path needs, or why it is not built.
fn nccl_setup(root: &Path) -> Result<Vec<PathBuf>, String> {
    let wanted = std::env::var("JETRL_TORCH_EXT_NCCL").ok();
    if wanted.as_deref() == Some("0") {
        return Err("disabled by JETRL_TORCH_EXT_NCCL=0 at build time".into());
    }
    let required = wanted.as_deref() == Some("1");
    let mut missing = Vec::new();
    if !root.join("lib/libtorch_cuda.so").exists() {
        missing.push("libtorch_cuda.so".to_string());
    }
    // The wheel's CUDA dependencies sit beside torch/ in site-packages: nvidia/<package>/include.
    let mut candidates: Vec<PathBuf> = match std::env::var_os("JETRL_CUDA_INCLUDE") {
        Some(dirs) => std::env::split_paths(&dirs).collect(),
        None => Vec::new(),
    };
    if let Some(site) = root.parent() {
        if let Ok(entries) = std::fs::read_dir(site.join("nvidia")) {
            let mut dirs: Vec<PathBuf> =
                entries.flatten().map(|e| e.path().join("include")).filter(|p| p.is_dir()).collect();
            dirs.sort();
            candidates.extend(dirs);
        }
    }
    if let Some(cuda_home) = std::env::var_os("CUDA_HOME") {
        candidates.push(PathBuf::from(cuda_home).join("include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    // headers installed later (scripts/setup.sh adds nvidia-cuda-crt and nvidia-cuda-cccl) change these folders
    for dir in candidates.iter().filter(|d| d.is_dir()) {
        println!("cargo:rerun-if-changed={}", dir.display());
    }

    let mut includes = Vec::new();
    for header in CUDA_HEADERS.iter().chain(std::iter::once(&"nccl.h")) {
        match candidates.iter().find(|dir| dir.join(header).exists()) {
            Some(dir) => {
                if !includes.contains(dir) {
                    includes.push(dir.clone());
                }
            }
            None => missing.push((*header).to_string()),
        }
    }
    if missing.is_empty() {
        return Ok(includes);
    }
    let message = format!("not found at build time: {}", missing.join(", "));
    if required {
        panic!("jetrl-torch-ext: cannot build the NCCL process group: {message} (JETRL_TORCH_EXT_NCCL=1)");
    }
    Err(message)
}
