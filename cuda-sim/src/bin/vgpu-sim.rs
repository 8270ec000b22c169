//! `vgpu-sim`: inspect the simulated node and inject faults into it.

use std::sync::atomic::Ordering;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use vgpu_core::bytes::Bytes;
use vgpu_core::gpu_uuid::format_uuid;
use vgpu_cuda_sim::node_state::{State, event_type};

#[derive(Parser, Debug)]
#[command(
    about = "Inspect the simulated GPU node and inject faults (uses VGPU_SIM_DIR and VGPU_SIM_CONFIG)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Show devices, memory, utilization and processes.
    Status,
    /// Raise an XID error event on a device (as the driver reports it to NVML).
    Xid {
        /// Device index.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// The XID, e.g. 48 (double-bit ECC), 79 (fallen off the bus), 13 (application).
        xid: u64,
    },
    /// Raise a double-bit ECC error event on a device.
    Ecc {
        /// Device index.
        #[arg(long, default_value_t = 0)]
        device: usize,
    },
    /// Mark a device lost (fallen off the bus), or bring it back with --restore.
    Lost {
        /// Device index.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Bring the device back.
        #[arg(long)]
        restore: bool,
    },
    /// Make the Nth next device allocation on the node fail (0 turns it off).
    FailAlloc {
        /// Which allocation (1 = the next one).
        nth: u64,
    },
    /// Reclaim the slots of dead processes now.
    Reap,
}

fn check_dev(st: &State, d: usize) -> Result<()> {
    if d >= st.device_count() {
        bail!(
            "no device {d}: the node has {} device(s)",
            st.device_count()
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let st = State::open_from_env()
        .map_err(anyhow::Error::msg)
        .context("open simulated node")?;
    match cli.cmd {
        Cmd::Status => {
            println!("state: {}", st.dir().display());
            for d in 0..st.device_count() {
                let i = st.info(d);
                let (free, total) = st.mem_info(d);
                println!(
                    "GPU {d}: {} {} {} mem {}/{} used, util {}%{}",
                    i.name(),
                    format_uuid(&i.uuid),
                    i.pci_bus_id(),
                    Bytes(total - free),
                    Bytes(total),
                    st.utilization_pct(d, std::time::Duration::from_secs(1)),
                    if st.is_lost(d) { " LOST" } else { "" }
                );
                for p in st.processes(d) {
                    println!(
                        "  pid {:>7}  {:>10}  contexts {}  busy {:.3}s",
                        p.pid,
                        Bytes(p.used).to_string(),
                        p.contexts,
                        st.slot(p.slot).devs[d].busy_ns.load(Ordering::Relaxed) as f64 / 1e9
                    );
                }
            }
        }
        Cmd::Xid { device, xid } => {
            check_dev(&st, device)?;
            let seq = st.push_event(device, event_type::XID_CRITICAL, xid);
            println!("raised XID {xid} on GPU {device} (event {seq})");
        }
        Cmd::Ecc { device } => {
            check_dev(&st, device)?;
            let seq = st.push_event(device, event_type::DOUBLE_BIT_ECC, 0);
            println!("raised a double-bit ECC error on GPU {device} (event {seq})");
        }
        Cmd::Lost { device, restore } => {
            check_dev(&st, device)?;
            st.set_lost(device, !restore);
            println!("GPU {device} is {}", if restore { "back" } else { "lost" });
        }
        Cmd::FailAlloc { nth } => {
            st.fail_nth_alloc(nth);
            println!("allocation #{nth} from now will fail");
        }
        Cmd::Reap => println!("reclaimed {} dead process(es)", st.reap(None)),
    }
    Ok(())
}
