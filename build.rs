//! Build script: link flags for libcomm.so. (The CUDA kernels are compiled here too once the GPU
//! path lands.)

fn main() {
    // The library's calls into its own nccl* symbols must never bind to another NCCL loaded in
    // the same process (PyTorch loads its own libnccl globally).
    println!("cargo:rustc-cdylib-link-arg=-Wl,-Bsymbolic-functions");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcomm.so");
    println!("cargo:rerun-if-changed=build.rs");
}
