//! Compiles the eBPF programs in `bpf/` with clang (`-target bpf -O2 -g`) into OUT_DIR; the
//! crate embeds `vgpu.bpf.o`, the layout test reads `layout.bpf.o`. A missing clang or
//! missing libbpf headers fail the build with the Debian packages to install.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail};

const INSTALL: &str = "install them with `apt-get install clang libbpf-dev` (Debian 12), \
                       or set CLANG to a clang that can target bpf";

fn main() -> anyhow::Result<()> {
    let out = PathBuf::from(std::env::var("OUT_DIR").context("OUT_DIR is not set")?);
    let clang = std::env::var("CLANG").unwrap_or_else(|_| "clang".to_owned());
    println!("cargo:rerun-if-env-changed=CLANG");
    for file in ["bpf/vgpu.bpf.c", "bpf/layout.bpf.c", "bpf/vgpu_ebpf.h"] {
        println!("cargo:rerun-if-changed={file}");
    }
    if !Path::new("/usr/include/bpf/bpf_helpers.h").exists() {
        bail!("the libbpf headers (/usr/include/bpf/bpf_helpers.h) are missing: {INSTALL}");
    }
    let mut include = vec!["-I/usr/include".to_owned()];
    // `-target bpf` does not search the multiarch directory that holds <asm/types.h>.
    if let Ok(output) = Command::new("gcc").arg("-print-multiarch").output() {
        let arch = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        if !arch.is_empty() {
            include.push(format!("-I/usr/include/{arch}"));
        }
    }
    for name in ["vgpu", "layout"] {
        let object = out.join(format!("{name}.bpf.o"));
        let status = Command::new(&clang)
            .args(["-target", "bpf", "-O2", "-g", "-Wall", "-Werror"])
            .args(&include)
            .arg("-c")
            .arg(format!("bpf/{name}.bpf.c"))
            .arg("-o")
            .arg(&object)
            .status();
        match status {
            Ok(status) if status.success() => {}
            Ok(status) => bail!("{clang} failed to compile bpf/{name}.bpf.c ({status})"),
            Err(error) => bail!("cannot run `{clang}` ({error}): {INSTALL}"),
        }
    }
    Ok(())
}
