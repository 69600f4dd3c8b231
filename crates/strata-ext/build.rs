//! Compiles `csrc/strata_ext.cpp` against the headers of the libtorch that torch-sys found,
//! and makes this crate's own test binaries find libtorch at run time.
use std::path::PathBuf;

fn main() {
    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports where libtorch is"));
    let root = lib.parent().expect("libtorch lib folder has a parent").to_path_buf();
    let include = root.join("include");

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("csrc/strata_ext.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .flag_if_supported("-Wno-deprecated-declarations")
        .warnings(false);
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        build.define("STRATA_CUDA", None);
        // The CUDA runtime headers ship in the nvidia wheel beside torch.
        let site = root.parent().expect("torch lives in site-packages");
        for sub in ["nvidia/cu13/include", "nvidia/cuda_runtime/include"] {
            let dir = site.join(sub);
            if dir.exists() {
                build.include(dir);
            }
        }
    }
    build.compile("strata_ext");

    println!("cargo:rerun-if-changed=csrc/strata_ext.cpp");
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_some() {
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
    }
    // Dependents read this as DEP_STRATA_EXT_LIBTORCH_LIB to set their own rpath.
    println!("cargo:libtorch_lib={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}
