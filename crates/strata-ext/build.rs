//! Compiles `csrc/strata_ext.cpp` against the headers of the libtorch that torch-sys found,
//! with `csrc/cuda_kernels.cpp` and the CUDA code paths whenever that libtorch carries CUDA
//! (PyPI's Linux wheel does, and `scripts/setup.sh` installs it): one build then serves a
//! machine with a GPU and one without. It makes this crate's own test binaries find libtorch,
//! NCCL and the CUDA runtime at run time, and reports the folders as `DEP_STRATA_EXT_RPATH`
//! for dependents to do the same.
use std::path::{Path, PathBuf};

fn main() {
    let lib = PathBuf::from(std::env::var("DEP_TCH_LIBTORCH_LIB").expect("torch-sys reports where libtorch is"));
    let root = lib.parent().expect("libtorch lib folder has a parent").to_path_buf();
    let include = root.join("include");
    let cuda = cuda_beside(&root);
    // Folders the binaries load shared libraries from, libtorch's first.
    let mut rpath = vec![lib.clone()];

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
    if let Some(cuda) = &cuda {
        build
            .define("STRATA_CUDA", None)
            .file("csrc/cuda_kernels.cpp")
            .include(cuda.runtime.join("include"))
            .include(cuda.nccl.join("include"));
        println!("cargo:rustc-link-search=native={}", cuda.nccl.join("lib").display());
        println!("cargo:rustc-link-lib=dylib:+verbatim=libnccl.so.2");
        println!("cargo:rustc-link-search=native={}", cuda.runtime.join("lib").display());
        println!("cargo:rustc-link-lib=dylib:+verbatim=libcudart.so.13");
        // Linear layers' weight and bias gradients in one product (cuBLASLt's epilogues).
        println!("cargo:rustc-link-lib=dylib:+verbatim=libcublasLt.so.13");
        // NVRTC compiles Strata's CUDA kernels at run time (csrc/cuda_kernels.cpp).
        println!("cargo:rustc-link-lib=dylib:+verbatim=libnvrtc.so.13");
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
        println!("cargo:rustc-link-lib=dylib=torch_cuda");
        rpath.push(cuda.nccl.join("lib"));
        rpath.push(cuda.runtime.join("lib"));
    } else {
        println!(
            "cargo:warning=Strata builds without CUDA: the libtorch at {} carries none (or the nvidia headers scripts/setup.sh installs are missing)",
            root.display()
        );
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

    println!("cargo:rerun-if-changed={}", lib.display());
    for source in ["csrc/strata_ext.cpp", "csrc/cuda_kernels.cpp", "csrc/cuda_kernels.h"] {
        println!("cargo:rerun-if-changed={source}");
    }
    println!("cargo:rustc-link-search=native={}", lib.display());
    println!("cargo:rustc-link-lib=dylib=c10");
    let rpath = std::env::join_paths(&rpath).expect("library folders hold no ':'");
    let rpath = rpath.to_string_lossy();
    // Dependents read this as DEP_STRATA_EXT_RPATH to set their own.
    println!("cargo:rpath={rpath}");
    println!("cargo:rustc-link-arg=-Wl,-rpath={rpath}");
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

/// Where the CUDA pieces beside a libtorch live: the runtime (headers, `libcudart`, cuBLASLt,
/// NVRTC) and NCCL.
struct CudaFolders {
    runtime: PathBuf,
    nccl: PathBuf,
}

/// The CUDA folders of a libtorch installed from PyPI's CUDA wheel, when it is one: its
/// `libtorch_cuda`, and the nvidia wheels beside it in site-packages with the headers
/// `scripts/setup.sh` adds. `None` for a CPU-only libtorch.
fn cuda_beside(root: &Path) -> Option<CudaFolders> {
    if !root.join("lib/libtorch_cuda.so").exists() {
        return None;
    }
    let torch = std::fs::canonicalize(root).ok()?;
    let nvidia = torch.parent()?.join("nvidia");
    let folders = CudaFolders { runtime: nvidia.join("cu13"), nccl: nvidia.join("nccl") };
    let complete = ["include/cuda_runtime.h", "include/crt/host_defines.h", "lib/libcudart.so.13"]
        .iter()
        .all(|file| folders.runtime.join(file).exists())
        && folders.nccl.join("include/nccl.h").exists();
    complete.then_some(folders)
}
