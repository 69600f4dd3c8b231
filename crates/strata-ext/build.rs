//! Compiles `csrc/strata_ext.cpp` (and, with the cuda feature, `csrc/cuda_kernels.cpp`)
//! against the headers of the libtorch that torch-sys found, and makes this crate's own test
//! binaries find libtorch at run time.
use std::path::PathBuf;

fn main() {
    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports where libtorch is"));
    let root = lib.parent().expect("libtorch lib folder has a parent").to_path_buf();
    let include = root.join("include");
    let cuda = std::env::var_os("CARGO_FEATURE_CUDA").is_some();

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("csrc/strata_ext.cpp")
        .include(&include)
        .include(include.join("torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        // Optimised in every profile: the file's CPU kernels rely on the loop vectoriser.
        .opt_level(3)
        .warnings(false);
    if cuda {
        // The CUDA runtime (and, through scripts/setup.sh, the crt/ and nv/ headers it
        // needs) ship in the nvidia wheels beside torch: follow the .libtorch link there.
        let torch = std::fs::canonicalize(&root).expect("libtorch folder exists");
        let cu13 = torch.parent().expect("torch lives in site-packages").join("nvidia/cu13");
        let nccl = cu13.parent().expect("nvidia folder").join("nccl");
        build
            .define("STRATA_CUDA", None)
            .file("csrc/cuda_kernels.cpp")
            .include(cu13.join("include"))
            .include(nccl.join("include"));
        let cuda_lib = cu13.join("lib");
        println!("cargo:rustc-link-search=native={}", nccl.join("lib").display());
        println!("cargo:rustc-link-lib=dylib:+verbatim=libnccl.so.2");
        println!("cargo:rustc-link-arg=-Wl,-rpath={}", nccl.join("lib").display());
        println!("cargo:rustc-link-search=native={}", cuda_lib.display());
        println!("cargo:rustc-link-lib=dylib:+verbatim=libcudart.so.13");
        // Linear layers' weight and bias gradients in one product (cuBLASLt's epilogues).
        println!("cargo:rustc-link-lib=dylib:+verbatim=libcublasLt.so.13");
        // NVRTC compiles Strata's CUDA kernels at run time (csrc/cuda_kernels.cpp).
        println!("cargo:rustc-link-lib=dylib:+verbatim=libnvrtc.so.13");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        println!("cargo:rustc-link-arg=-Wl,-rpath={}", cuda_lib.display());
    }
    // The CPU kernels split their work with `at::parallel_for`, which in libtorch's builds
    // is OpenMP compiled into the caller: with libtorch's own GNU OpenMP runtime (shipped
    // beside it) they share its thread pool and thread count. Without one, or with a
    // compiler other than GCC (whose OpenMP calls libgomp would not answer), they run on one
    // thread.
    match openmp_runtime(&lib) {
        Some(openmp) if build.get_compiler().is_like_gnu() => {
            build.flag("-fopenmp");
            println!("cargo:rustc-link-lib=dylib:+verbatim={openmp}");
        }
        _ => println!(
            "cargo:warning=Strata's CPU kernels run on one thread: no GNU OpenMP beside libtorch for this compiler"
        ),
    }
    build.compile("strata_ext");

    for source in ["csrc/strata_ext.cpp", "csrc/cuda_kernels.cpp", "csrc/cuda_kernels.h"] {
        println!("cargo:rerun-if-changed={source}");
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10");
    // Dependents read this as DEP_STRATA_EXT_LIBTORCH_LIB to set their own rpath.
    println!("cargo:libtorch_lib={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,-rpath={}", lib.display());
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
}

/// The file name of the GNU OpenMP runtime in libtorch's library folder (`libgomp.so.1`, or
/// a hashed name such as `libgomp-a34b3233.so.1` in libtorch's own archives).
fn openmp_runtime(lib: &std::path::Path) -> Option<String> {
    let mut names: Vec<String> = std::fs::read_dir(lib)
        .ok()?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.starts_with("libgomp") && name.contains(".so"))
        .collect();
    names.sort();
    names.into_iter().next()
}
