//! Compiles kubelet's protos with protox (pure Rust: no protoc needed) and generates the
//! tonic clients and servers for both sides (the plugin and the fake kubelet in tests), and
//! the client of the node daemon's API (its eBPF gate events and allocations refused over
//! quota).

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
    // The node daemon's API (client only; the proto has one home, in the daemon's crate):
    // its eBPF gate events and the allocations it saw refused over quota.
    let daemon = "../vgpu-daemon/proto/vgpu_daemon_v1.proto";
    println!("cargo:rerun-if-changed={daemon}");
    let fds =
        protox::compile([daemon], ["../vgpu-daemon/proto"]).context("parse the daemon's proto")?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(false)
        .compile_fds(fds)
        .context("generate the daemon's gRPC client")?;
    Ok(())
}
