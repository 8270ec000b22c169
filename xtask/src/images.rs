//! `cargo xtask images`: the node and extender images as OCI archives, built from the
//! repository without pulling a base image (issue 40), and `cargo xtask glibc-floor`,
//! the check that `libvgpu.so` needs no glibc newer than [`GLIBC_FLOOR`].
//!
//! - The shim is built with `cargo zigbuild` for `x86_64-unknown-linux-gnu.2.28` (the
//!   `ziglang` and `cargo-zigbuild` PyPI packages, installed into `target/zig-venv`), so
//!   that it loads in the images users run (UBI 8, Debian 10 and newer); its highest
//!   `GLIBC_` symbol version is read with `objdump -T` and must not pass the floor.
//! - Each image's root filesystem is its binaries plus the shared libraries `ldd` says
//!   they load, copied from the build machine at the same paths; one uncompressed layer;
//!   an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/…`) with a docker
//!   `manifest.json` beside it, in one tar that `ctr images import`, `podman load` and
//!   `docker load` read. The eBPF objects are inside `vgpu-daemon` (`include_bytes`).

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};

/// The highest glibc symbol version `libvgpu.so` may need (docs/install.md, "glibc floor").
pub const GLIBC_FLOOR: (u32, u32) = (2, 28);
/// The zig target that gives that floor.
const ZIG_TARGET: &str = "x86_64-unknown-linux-gnu.2.28";
/// The images' version tag.
pub const TAG: &str = "0.1.0";

/// The highest `GLIBC_x.y` version in `objdump -T` output, if any.
pub fn highest_glibc(objdump: &str) -> Option<(u32, u32)> {
    objdump
        .split(|c: char| c.is_whitespace() || c == '(' || c == ')')
        .filter_map(|w| w.strip_prefix("GLIBC_"))
        .filter_map(|v| {
            let mut it = v.split('.');
            let major = it.next()?.parse().ok()?;
            let minor = it.next().unwrap_or("0").parse().ok()?;
            Some((major, minor))
        })
        .max()
}

/// Checks `lib`'s glibc requirement against [`GLIBC_FLOOR`]; returns the version found.
pub fn check_floor(lib: &Path) -> Result<(u32, u32)> {
    let out = Command::new("objdump")
        .arg("-T")
        .arg(lib)
        .output()
        .context("run objdump -T (binutils)")?;
    if !out.status.success() {
        bail!(
            "objdump -T {} failed: {}",
            lib.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let found = highest_glibc(&String::from_utf8_lossy(&out.stdout))
        .with_context(|| format!("{} names no GLIBC_ symbol version", lib.display()))?;
    if found > GLIBC_FLOOR {
        bail!(
            "{} needs GLIBC_{}.{}, above the documented floor {}.{} (docs/install.md): build it with `cargo xtask images` (cargo zigbuild --target {ZIG_TARGET})",
            lib.display(),
            found.0,
            found.1,
            GLIBC_FLOOR.0,
            GLIBC_FLOOR.1
        );
    }
    Ok(found)
}

fn run(cmd: &mut Command) -> Result<()> {
    let st = cmd.status().with_context(|| format!("run {cmd:?}"))?;
    if !st.success() {
        bail!("{cmd:?} failed ({st})");
    }
    Ok(())
}

/// Builds the shim at the floor with cargo-zigbuild (installed from PyPI where missing).
fn build_shim(root: &Path) -> Result<PathBuf> {
    let venv = root.join("target/zig-venv");
    let bin = venv.join("bin");
    if !bin.join("cargo-zigbuild").exists() || !bin.join("python-zig").exists() {
        run(Command::new("python3").arg("-m").arg("venv").arg(&venv))?;
        run(Command::new(bin.join("pip")).args(["install", "-q", "ziglang", "cargo-zigbuild"]))?;
    }
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    run(Command::new(bin.join("cargo-zigbuild"))
        .args([
            "zigbuild",
            "--release",
            "-p",
            "vgpu-shim",
            "--lib",
            "--target",
            ZIG_TARGET,
        ])
        .env("PATH", path)
        .env("CARGO_TARGET_DIR", root.join("target/zig"))
        .current_dir(root))?;
    Ok(root.join("target/zig/x86_64-unknown-linux-gnu/release/libvgpu.so"))
}

/// The shared libraries `ldd` says `bin` loads (absolute paths, the interpreter too).
pub fn linked_libraries(bin: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd").arg(bin).output().context("run ldd")?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text
        .lines()
        .filter_map(|l| {
            let l = l.trim();
            let path = match l.split_once("=>") {
                Some((_, rest)) => rest.split_whitespace().next()?,
                None => l.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| PathBuf::from(path))
        })
        .collect())
}

/// One file of a layer: its path in the image, its content, its mode.
struct Entry {
    path: String,
    data: Vec<u8>,
    mode: u32,
}

/// A ustar header block for `path` (a directory when `data` is `None`).
fn tar_header(path: &str, size: usize, mode: u32, dir: bool) -> Result<[u8; 512]> {
    let mut h = [0u8; 512];
    let (prefix, name) = if path.len() <= 100 {
        ("", path)
    } else {
        let cut = path[..path.len().min(155)]
            .rfind('/')
            .with_context(|| format!("path {path} too long for ustar"))?;
        (&path[..cut], &path[cut + 1..])
    };
    if name.len() > 100 {
        bail!("path {path} too long for ustar");
    }
    h[..name.len()].copy_from_slice(name.as_bytes());
    let octal = |h: &mut [u8; 512], at: usize, len: usize, v: u64| {
        let s = format!("{v:0width$o}\0", width = len - 1);
        h[at..at + len].copy_from_slice(s.as_bytes());
    };
    octal(&mut h, 100, 8, u64::from(mode));
    octal(&mut h, 108, 8, 0);
    octal(&mut h, 116, 8, 0);
    octal(&mut h, 124, 12, size as u64);
    octal(&mut h, 136, 12, 0);
    h[156] = if dir { b'5' } else { b'0' };
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[345..345 + prefix.len()].copy_from_slice(prefix.as_bytes());
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|&b| u32::from(b)).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    Ok(h)
}

/// A tar of `entries` (directories made for every parent), deterministic.
fn tar(entries: &[Entry]) -> Result<Vec<u8>> {
    let mut dirs = std::collections::BTreeSet::new();
    for e in entries {
        let mut p = Path::new(&e.path).parent();
        while let Some(d) = p.filter(|d| !d.as_os_str().is_empty()) {
            dirs.insert(format!("{}/", d.display()));
            p = d.parent();
        }
    }
    let mut out = Vec::new();
    for d in &dirs {
        out.extend_from_slice(&tar_header(d, 0, 0o755, true)?);
    }
    for e in entries {
        out.extend_from_slice(&tar_header(&e.path, e.data.len(), e.mode, false)?);
        out.extend_from_slice(&e.data);
        out.resize(out.len().div_ceil(512) * 512, 0);
    }
    out.resize(out.len() + 1024, 0);
    Ok(out)
}

fn sha256(data: &[u8]) -> Result<String> {
    let mut child = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("run sha256sum")?;
    child
        .stdin
        .take()
        .context("sha256sum's stdin")?
        .write_all(data)?;
    let out = child.wait_with_output()?;
    let hex = String::from_utf8_lossy(&out.stdout);
    Ok(hex.split_whitespace().next().unwrap_or("").to_owned())
}

/// Writes an OCI archive of one image with `files` (path in image → file on disk, mode),
/// `env` and `cmd` (the image's `Cmd`; empty: none); returns its size in bytes.
pub fn oci_archive(
    out: &Path,
    reference: &str,
    files: &BTreeMap<String, (PathBuf, u32)>,
    env: &[&str],
    cmd: &[&str],
) -> Result<u64> {
    let mut entries = Vec::new();
    for (path, (src, mode)) in files {
        let data = std::fs::read(src).with_context(|| format!("read {}", src.display()))?;
        entries.push(Entry {
            path: path.trim_start_matches('/').to_owned(),
            data,
            mode: *mode,
        });
    }
    let layer = tar(&entries)?;
    let layer_digest = sha256(&layer)?;
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": if cmd.is_empty() {
            serde_json::json!({"Env": env, "User": "0"})
        } else {
            serde_json::json!({"Env": env, "User": "0", "Cmd": cmd})
        },
        "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
        "history": [{"created_by": "cargo xtask images"}]
    });
    let config = serde_json::to_vec(&config)?;
    let config_digest = sha256(&config)?;
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": format!("sha256:{config_digest}"), "size": config.len()},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest": format!("sha256:{layer_digest}"), "size": layer.len()}]
    });
    let manifest = serde_json::to_vec(&manifest)?;
    let manifest_digest = sha256(&manifest)?;
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": format!("sha256:{manifest_digest}"),
            "size": manifest.len(),
            "annotations": {"io.containerd.image.name": reference, "org.opencontainers.image.ref.name": TAG}
        }]
    });
    let docker = serde_json::json!([{
        "Config": format!("blobs/sha256/{config_digest}"),
        "RepoTags": [reference.trim_start_matches("docker.io/")],
        "Layers": [format!("blobs/sha256/{layer_digest}")]
    }]);
    let blob = |digest: &str, data: Vec<u8>| Entry {
        path: format!("blobs/sha256/{digest}"),
        data,
        mode: 0o644,
    };
    let archive = tar(&[
        Entry {
            path: "oci-layout".into(),
            data: br#"{"imageLayoutVersion":"1.0.0"}"#.to_vec(),
            mode: 0o644,
        },
        Entry {
            path: "index.json".into(),
            data: serde_json::to_vec(&index)?,
            mode: 0o644,
        },
        Entry {
            path: "manifest.json".into(),
            data: serde_json::to_vec(&docker)?,
            mode: 0o644,
        },
        blob(&config_digest, config),
        blob(&manifest_digest, manifest),
        blob(&layer_digest, layer),
    ])?;
    std::fs::write(out, &archive).with_context(|| format!("write {}", out.display()))?;
    Ok(archive.len() as u64)
}

/// `cargo xtask glibc-floor [LIB]`: checks LIB (default: the zig-built shim).
pub fn glibc_floor(root: &Path, args: &[String]) -> Result<()> {
    let lib = match args.first() {
        Some(p) => PathBuf::from(p),
        None => build_shim(root)?,
    };
    let v = check_floor(&lib)?;
    println!(
        "{}: highest GLIBC_{}.{} (floor {}.{})",
        lib.display(),
        v.0,
        v.1,
        GLIBC_FLOOR.0,
        GLIBC_FLOOR.1
    );
    Ok(())
}

/// `cargo xtask images`: builds the binaries and the shim, checks the floor, writes
/// `target/images/*.oci.tar` and prints their sizes.
pub fn images(root: &Path) -> Result<()> {
    run(Command::new(env!("CARGO"))
        .args([
            "build",
            "--release",
            "-p",
            "vgpu-daemon",
            "-p",
            "vgpu-device-plugin",
        ])
        .args(["-p", "vgpu-scheduler-extender", "--bins"])
        .current_dir(root))?;
    let shim = build_shim(root)?;
    let found = check_floor(&shim)?;
    let release = root.join("target/release");
    let dir = root.join("target/images");
    std::fs::create_dir_all(&dir)?;
    let with_libs = |bins: &[&str]| -> Result<BTreeMap<String, (PathBuf, u32)>> {
        let mut files = BTreeMap::new();
        for b in bins {
            let p = release.join(b);
            for lib in linked_libraries(&p)? {
                let real = std::fs::canonicalize(&lib)?;
                files.insert(lib.display().to_string(), (real, 0o755));
            }
            files.insert(format!("/usr/bin/{b}"), (p, 0o755));
        }
        Ok(files)
    };
    let mut node = with_libs(&["vgpu-daemon", "vgpu-device-plugin", "vgpuctl"])?;
    node.insert("/usr/lib/vgpu/libvgpu.so".into(), (shim, 0o755));
    let extender = with_libs(&["vgpu-scheduler-extender"])?;
    let env = ["PATH=/usr/bin:/bin"];
    for (name, files) in [("node", node), ("scheduler-extender", extender)] {
        let reference = format!("docker.io/vgpu/{name}:{TAG}");
        let out = dir.join(format!("vgpu-{name}-{TAG}.oci.tar"));
        let size = oci_archive(&out, &reference, &files, &env, &[])?;
        println!(
            "{reference}: {} ({:.1} MiB, {} files)",
            out.display(),
            size as f64 / (1 << 20) as f64,
            files.len()
        );
    }
    println!(
        "libvgpu.so: highest GLIBC_{}.{} (floor {}.{}); load with `ctr -n k8s.io images import FILE`, `podman load -i FILE` or `docker load -i FILE`",
        found.0, found.1, GLIBC_FLOOR.0, GLIBC_FLOOR.1
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_glibc_version_is_found() {
        let dump = "0000 DF *UND* 0000 (GLIBC_2.2.5) free\n0000 w DF *UND* 0000 (GLIBC_2.34) dlopen\n0000 DF *UND* (GLIBC_2.28) statx\n0000 DF *UND* (GLIBC_PRIVATE) x\n";
        assert_eq!(highest_glibc(dump), Some((2, 34)));
        assert_eq!(highest_glibc("nothing"), None);
        assert!(highest_glibc(dump) > Some(GLIBC_FLOOR));
        assert!(highest_glibc("(GLIBC_2.28) statx") <= Some(GLIBC_FLOOR));
    }

    #[test]
    fn a_tar_of_one_file_has_its_directories_and_a_valid_checksum() {
        let t = tar(&[Entry {
            path: "usr/bin/x".into(),
            data: b"hi".to_vec(),
            mode: 0o755,
        }])
        .expect("tar");
        // usr/, usr/bin/, the file (header + 1 block), two zero blocks.
        assert_eq!(t.len(), 512 * 6);
        assert_eq!(&t[..4], b"usr/");
        let h = &t[1024..1536];
        let stored = u32::from_str_radix(std::str::from_utf8(&h[148..154]).expect("octal"), 8)
            .expect("checksum");
        let mut copy = h.to_vec();
        copy[148..156].copy_from_slice(b"        ");
        assert_eq!(stored, copy.iter().map(|&b| u32::from(b)).sum::<u32>());
    }

    /// The images are named as the manifests name them.
    #[test]
    fn deploy_names_the_images_this_task_builds() {
        let deploy = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy");
        for (file, image) in [
            ("30-node-agent.yaml", format!("image: vgpu/node:{TAG}")),
            (
                "40-scheduler-extender.yaml",
                format!("image: vgpu/scheduler-extender:{TAG}"),
            ),
        ] {
            let text = std::fs::read_to_string(deploy.join(file)).expect("manifest");
            assert!(text.contains(&image), "{file} does not name {image}");
            for line in text
                .lines()
                .filter(|l| l.trim_start().starts_with("image:"))
            {
                assert!(line.contains(&image), "{file}: {line} is not {image}");
            }
        }
    }
}
