fn main() {
    jetrl_build_support::link_libtorch();
}
