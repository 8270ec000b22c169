//! Compiles kubelet's protos with protox (pure Rust: no protoc needed) and generates the
//! tonic clients and servers for both sides (the plugin and the fake kubelet in tests).

use anyhow::{Context, Result};

fn main() -> Result<()> {
    let protos = [
        "proto/deviceplugin_v1beta1.proto",
        "proto/podresources_v1.proto",
    ];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    let fds = protox::compile(protos, ["proto"]).context("parse kubelet protos")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(fds)
        .context("generate kubelet gRPC code")?;
    Ok(())
}
