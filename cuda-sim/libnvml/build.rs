//! Gives the shared library the soname of NVIDIA's NVML, so that programs linked against
//! it record `libnvidia-ml.so.1` as the real library does.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnvidia-ml.so.1");
    println!("cargo:rerun-if-changed=build.rs");
}
