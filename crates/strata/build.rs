//! Lets this crate's tests and examples find libtorch at run time without any environment
//! variable: an rpath to the libtorch folder strata-ext reports, and `-ltorch` kept even
//! though no symbol of it is used directly (it registers the CPU and CUDA kernels).
fn main() {
    let lib = std::env::var("DEP_STRATA_EXT_LIBTORCH_LIB").expect("strata-ext reports libtorch");
    println!("cargo:rustc-link-arg=-Wl,-rpath={lib}");
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}
