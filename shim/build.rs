//! Gives the library its own soname (`libvgpu.so`), so that its `dlopen("libcuda.so.1")`
//! finds the real (or simulated) driver and never itself.

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libvgpu.so");
}
