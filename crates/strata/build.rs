//! Lets this crate's binaries, tests and examples (and, through `package.build`, the CLI's)
//! find libtorch, NCCL and the CUDA runtime at run time without any environment variable: an
//! rpath to the folders strata-ext reports, and `-ltorch` kept even though no symbol of it is
//! used directly (it registers the CPU and CUDA kernels).
fn main() {
    let rpath = std::env::var("DEP_STRATA_EXT_RPATH").expect("strata-ext reports its library folders");
    println!("cargo:rustc-link-arg=-Wl,-rpath={rpath}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}
