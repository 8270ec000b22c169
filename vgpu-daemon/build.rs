//! Compiles the daemon's gRPC API with protox (pure Rust: no protoc needed) and generates
//! the tonic server (the daemon) and client (`vgpuctl`, tests).

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let protos = ["proto/vgpu_daemon_v1.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"]).context("parse the daemon's protos")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .context("generate the daemon's gRPC code")?;
    Ok(())
}
