//! Gives the library the soname of NVIDIA's driver, so that programs linked against it
//! record `libcuda.so.1`, as they would against the real one.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libcuda.so.1");
}
