//! Compiles `proto/` with protox (pure Rust), so no system `protoc` is needed.
use std::path::PathBuf;

fn main() {
    let root =
        PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR")).join("../../proto");
    let file = root.join("jetrl/v1/jetrl.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    let descriptors = protox::compile([&file], [&root]).expect("proto/jetrl/v1/jetrl.proto does not compile");
    // A reward's extra values stay ordered maps, as the scorers produce them: moved into the message, not rehashed.
    prost_build::Config::new()
        .bytes(["."])
        .btree_map([".jetrl.v1.Reward"])
        .compile_fds(descriptors)
        .expect("prost-build failed");
}
