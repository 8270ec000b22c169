//! Compiles kubelet's DRA and plugin-registration protos with protox (pure Rust: no
//! protoc) and generates tonic servers (the driver) and clients (kubelet's fakes in tests).

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let protos = ["proto/dra_v1.proto", "proto/pluginregistration_v1.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"]).context("parse kubelet's DRA protos")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .context("generate kubelet's DRA gRPC code")?;
    Ok(())
}
