//! `vgpuctl`: lists tenants and their usage (placeholder until the API lands).

fn main() {
    eprintln!("vgpuctl: not built yet");
    std::process::exit(2);
}
