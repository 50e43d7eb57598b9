//! Link flags of libnccl.so: NCCL's SONAME, and the same symbol binding as libcomm.so.

fn main() {
    // The library's calls into its own nccl* symbols must never bind to another NCCL loaded in
    // the same process.
    println!("cargo:rustc-link-arg-cdylib=-Wl,-Bsymbolic-functions");
    // Major version 2 of the NCCL ABI, as NVIDIA's libnccl.so.2.
    println!("cargo:rustc-link-arg-cdylib=-Wl,-soname,libnccl.so.2");
    println!("cargo:rerun-if-changed=build.rs");
}
