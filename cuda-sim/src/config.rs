//! The simulated node's configuration: which GPUs it has and how they behave.
//!
//! Read from the TOML file named by `VGPU_SIM_CONFIG`; without it the node has one
//! H100-like GPU. The configuration is applied when a state directory is first created;
//! later processes attach to the state as it is (see [`crate::node_state`]).

use serde::Deserialize;
use vgpu_core::bytes::parse_bytes;
use vgpu_core::gpu_uuid::{format_uuid, parse_uuid};

pub use crate::config_error::ConfigError;
pub use crate::device::{DeviceConfig, default_device};
use crate::topology::Topology;

/// Most devices one simulated node can have.
pub const MAX_DEVICES: usize = 8;

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    preset: Option<String>,
    #[serde(default)]
    device: Vec<RawDevice>,
    topology: Option<crate::topology::RawTopology>,
    #[serde(default)]
    engine: RawEngine,
    #[serde(default)]
    faults: RawFaults,
    #[serde(default)]
    host: RawHost,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawHost {
    memory: Option<String>,
    copy_gbps: Option<u32>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawDevice {
    name: Option<String>,
    uuid: Option<String>,
    pci_bus_id: Option<String>,
    memory: Option<String>,
    sm_count: Option<u32>,
    compute_capability: Option<String>,
    context_overhead: Option<String>,
    alloc_granularity: Option<String>,
    memory_bandwidth_gbps: Option<u32>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawEngine {
    timeslice_us: Option<u64>,
}

#[derive(Debug, Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RawFaults {
    fail_alloc_nth: Option<u64>,
    accounting_mode: Option<bool>,
    #[serde(default)]
    lost_devices: Vec<u32>,
}

/// Execution-engine settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineConfig {
    /// How long one context may hold the engine while others wait, in microseconds.
    pub timeslice_us: u64,
}

/// The host side of the node, as the checkpoint API uses it: checkpointed device memory
/// is held in host memory, copied over the host link.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostConfig {
    /// Host memory that checkpoints may hold, bytes (`[host] memory`, default 512 GiB).
    pub memory: u64,
    /// Device-to-host and host-to-device copy bandwidth of a checkpoint or restore,
    /// GB/s (`[host] copy_gbps`, default 25: PCIe 4.0 x16 in practice).
    pub copy_gbps: u32,
}

impl Default for HostConfig {
    fn default() -> Self {
        HostConfig {
            memory: 512 << 30,
            copy_gbps: 25,
        }
    }
}

/// Faults injected from the configuration.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct FaultConfig {
    /// Fail the Nth device allocation on the node (1-based; 0 = never).
    pub fail_alloc_nth: u64,
    /// Devices that are lost (fallen off the bus) from the start.
    pub lost_devices: Vec<u32>,
    /// NVML accounting mode enabled from the start.
    pub accounting_mode: bool,
}

/// The whole configuration of a simulated node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SimConfig {
    /// The GPUs, in index order.
    pub devices: Vec<DeviceConfig>,
    /// Execution engine.
    pub engine: EngineConfig,
    /// Injected faults.
    pub faults: FaultConfig,
    /// Where the GPUs sit and how they are connected (see [`crate::topology`]).
    pub topology: Topology,
    /// Host memory and copy bandwidth for checkpoints.
    pub host: HostConfig,
}

impl Default for SimConfig {
    fn default() -> Self {
        SimConfig {
            devices: vec![default_device(0)],
            engine: EngineConfig { timeslice_us: 2000 },
            faults: FaultConfig::default(),
            topology: Topology::default_for(1),
            host: HostConfig::default(),
        }
    }
}

/// Normalises a PCI bus id to NVML's `DDDDDDDD:BB:DD.F` form, upper case.
pub fn normalize_pci_bus_id(s: &str) -> Option<String> {
    let s = s.trim();
    let (domain, rest) = match s.matches(':').count() {
        2 => s.split_once(':')?,
        1 => ("0", s),
        _ => return None,
    };
    let (bus, rest) = rest.split_once(':')?;
    let (dev, func) = rest.split_once('.')?;
    let domain = u32::from_str_radix(domain, 16).ok()?;
    let bus = u8::from_str_radix(bus, 16).ok()?;
    let dev = u8::from_str_radix(dev, 16).ok()?;
    let func = u8::from_str_radix(func, 16).ok()?;
    if dev > 0x1f || func > 7 {
        return None;
    }
    Some(format!("{domain:08X}:{bus:02X}:{dev:02X}.{func:X}"))
}

impl SimConfig {
    /// Parses a configuration from TOML text; `path` is only used in error messages.
    pub fn from_toml(text: &str, path: &str) -> Result<SimConfig, ConfigError> {
        let raw: RawConfig = toml::from_str(text).map_err(|source| ConfigError::Toml {
            path: path.to_owned(),
            source,
        })?;
        let bad = |field: String, value: &str, why: &str| ConfigError::Value {
            path: path.to_owned(),
            field,
            value: value.to_owned(),
            why: why.to_owned(),
        };
        let preset = match &raw.preset {
            Some(name) => {
                if !raw.device.is_empty() || raw.topology.is_some() {
                    return Err(bad(
                        "preset".into(),
                        name,
                        "a preset gives the devices and topology: drop [[device]] and [topology]",
                    ));
                }
                Some(crate::presets::preset(name).ok_or_else(|| {
                    bad(
                        "preset".into(),
                        name,
                        &format!(
                            "unknown preset (known: {})",
                            crate::presets::NAMES.join(", ")
                        ),
                    )
                })?)
            }
            None => None,
        };
        let raw_devices = if raw.device.is_empty() {
            vec![RawDevice::default()]
        } else {
            raw.device
        };
        if raw_devices.len() > MAX_DEVICES {
            return Err(bad(
                "device".into(),
                &raw_devices.len().to_string(),
                &format!("at most {MAX_DEVICES} devices"),
            ));
        }
        let mut devices = Vec::with_capacity(raw_devices.len());
        for (i, d) in raw_devices.into_iter().enumerate() {
            let idx = u32::try_from(i).expect("at most MAX_DEVICES devices");
            let mut dev = default_device(idx);
            let key = |k: &str| format!("device[{i}].{k}");
            if let Some(n) = d.name {
                if n.is_empty() || n.len() > 95 {
                    return Err(bad(key("name"), &n, "must be 1 to 95 bytes"));
                }
                dev.name = n;
            }
            if let Some(u) = d.uuid {
                dev.uuid = parse_uuid(&u).ok_or_else(|| {
                    bad(
                        key("uuid"),
                        &u,
                        "expected GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx",
                    )
                })?;
            }
            if let Some(p) = d.pci_bus_id {
                dev.pci_bus_id = normalize_pci_bus_id(&p)
                    .ok_or_else(|| bad(key("pci_bus_id"), &p, "expected DDDDDDDD:BB:DD.F"))?;
            }
            let bytes =
                |k: &str, v: &str| parse_bytes(v).map_err(|e| bad(key(k), v, &e.to_string()));
            if let Some(m) = d.memory {
                dev.memory = bytes("memory", &m)?;
                if dev.memory < (64 << 20) {
                    return Err(bad(key("memory"), &m, "must be at least 64Mi"));
                }
            }
            if let Some(c) = d.context_overhead {
                dev.context_overhead = bytes("context_overhead", &c)?;
            }
            if let Some(g) = d.alloc_granularity {
                let v = bytes("alloc_granularity", &g)?;
                if !v.is_power_of_two() || !(512..=(1 << 30)).contains(&v) {
                    return Err(bad(
                        key("alloc_granularity"),
                        &g,
                        "must be a power of two from 512 to 1Gi",
                    ));
                }
                dev.alloc_granularity = v;
            }
            if let Some(s) = d.sm_count {
                if s == 0 || s > 1024 {
                    return Err(bad(key("sm_count"), &s.to_string(), "must be 1 to 1024"));
                }
                dev.sm_count = s;
            }
            if let Some(cc) = d.compute_capability {
                let (ma, mi) = cc
                    .split_once('.')
                    .and_then(|(a, b)| Some((a.parse::<u32>().ok()?, b.parse::<u32>().ok()?)))
                    .filter(|&(a, b)| (3..=12).contains(&a) && b <= 9)
                    .ok_or_else(|| {
                        bad(
                            key("compute_capability"),
                            &cc,
                            "expected MAJOR.MINOR, e.g. 9.0",
                        )
                    })?;
                dev.cc_major = ma;
                dev.cc_minor = mi;
            }
            if let Some(bw) = d.memory_bandwidth_gbps {
                if bw == 0 {
                    return Err(bad(key("memory_bandwidth_gbps"), "0", "must be positive"));
                }
                dev.memory_bandwidth_gbps = bw;
            }
            if dev.context_overhead >= dev.memory {
                return Err(bad(
                    key("context_overhead"),
                    &dev.context_overhead.to_string(),
                    "must be smaller than the device memory",
                ));
            }
            devices.push(dev);
        }
        for i in 0..devices.len() {
            for j in 0..i {
                if devices[i].uuid == devices[j].uuid {
                    return Err(bad(
                        format!("device[{i}].uuid"),
                        &format_uuid(&devices[i].uuid),
                        "duplicate UUID",
                    ));
                }
                if devices[i].pci_bus_id == devices[j].pci_bus_id {
                    return Err(bad(
                        format!("device[{i}].pci_bus_id"),
                        &devices[i].pci_bus_id,
                        "duplicate PCI bus id",
                    ));
                }
            }
        }
        let topology = match preset {
            Some((preset_devices, topology)) => {
                devices = preset_devices;
                topology
            }
            None => match raw.topology {
                Some(t) => Topology::from_raw(t, devices.len(), path)?,
                None => Topology::default_for(devices.len()),
            },
        };
        let timeslice_us = raw.engine.timeslice_us.unwrap_or(2000);
        if !(100..=1_000_000).contains(&timeslice_us) {
            return Err(bad(
                "engine.timeslice_us".into(),
                &timeslice_us.to_string(),
                "must be 100 to 1000000",
            ));
        }
        for &l in &raw.faults.lost_devices {
            if l as usize >= devices.len() {
                return Err(bad(
                    "faults.lost_devices".into(),
                    &l.to_string(),
                    "no such device index",
                ));
            }
        }
        let mut host = HostConfig::default();
        if let Some(m) = &raw.host.memory {
            host.memory =
                parse_bytes(m).map_err(|e| bad("host.memory".into(), m, &e.to_string()))?;
        }
        if let Some(g) = raw.host.copy_gbps {
            if g == 0 || g > 10_000 {
                return Err(bad(
                    "host.copy_gbps".into(),
                    &g.to_string(),
                    "must be 1 to 10000",
                ));
            }
            host.copy_gbps = g;
        }
        Ok(SimConfig {
            devices,
            engine: EngineConfig { timeslice_us },
            faults: FaultConfig {
                fail_alloc_nth: raw.faults.fail_alloc_nth.unwrap_or(0),
                lost_devices: raw.faults.lost_devices,
                accounting_mode: raw.faults.accounting_mode.unwrap_or(false),
            },
            topology,
            host,
        })
    }

    /// Loads the configuration named by `VGPU_SIM_CONFIG`, or the default one.
    pub fn from_env() -> Result<SimConfig, ConfigError> {
        match std::env::var_os("VGPU_SIM_CONFIG") {
            Some(p) if !p.is_empty() => {
                let path = p.to_string_lossy().into_owned();
                let text = std::fs::read_to_string(&p).map_err(|source| ConfigError::Read {
                    path: path.clone(),
                    source,
                })?;
                SimConfig::from_toml(&text, &path)
            }
            _ => Ok(SimConfig::default()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_one_h100() {
        let c = SimConfig::from_toml("", "x").expect("empty config is valid");
        assert_eq!(c.devices.len(), 1);
        let d = &c.devices[0];
        assert_eq!(d.memory, 80 << 30);
        assert_eq!(d.sm_count, 132);
        assert_eq!((d.cc_major, d.cc_minor), (9, 0));
        assert_eq!(c, SimConfig::default());
    }

    #[test]
    fn parses_devices() {
        let c = SimConfig::from_toml(
            r#"
            [[device]]
            name = "NVIDIA A100-SXM4-40GB"
            memory = "40GiB"
            sm_count = 108
            compute_capability = "8.0"
            context_overhead = "416Mi"
            pci_bus_id = "0000:07:00.0"
            [[device]]
            uuid = "GPU-11111111-2222-3333-4444-555555555555"
            [engine]
            timeslice_us = 1000
            [faults]
            fail_alloc_nth = 3
            "#,
            "t.toml",
        )
        .expect("valid");
        assert_eq!(c.devices.len(), 2);
        assert_eq!(c.devices[0].memory, 40 << 30);
        assert_eq!(c.devices[0].pci_bus_id, "00000000:07:00.0");
        assert_eq!(c.devices[0].context_overhead, 416 << 20);
        assert_eq!(
            format_uuid(&c.devices[1].uuid),
            "GPU-11111111-2222-3333-4444-555555555555"
        );
        assert_eq!(c.engine.timeslice_us, 1000);
        assert_eq!(c.faults.fail_alloc_nth, 3);
    }

    #[test]
    fn errors_name_the_bad_value() {
        let e = SimConfig::from_toml("[[device]]\nmemory = \"8G\"", "t.toml").unwrap_err();
        let s = e.to_string();
        assert!(s.contains("device[0].memory") && s.contains("8G"), "{s}");
        let e = SimConfig::from_toml("[[device]]\ncompute_capability = \"nine\"", "t.toml")
            .unwrap_err();
        assert!(e.to_string().contains("nine"));
        let e = SimConfig::from_toml("[[device]]\nbogus = 1", "t.toml").unwrap_err();
        assert!(matches!(e, ConfigError::Toml { .. }));
        let e = SimConfig::from_toml(
            "[[device]]\n[[device]]\nuuid = \"GPU-51570000-0000-4000-8000-000000000000\"",
            "t.toml",
        )
        .unwrap_err();
        assert!(e.to_string().contains("duplicate UUID"), "{e}");
    }

    #[test]
    fn presets_give_devices_and_topology() {
        let c = SimConfig::from_toml(
            "preset = \"dgx-a100\"\n[engine]\ntimeslice_us = 1000",
            "t.toml",
        )
        .expect("valid");
        assert_eq!(c.devices.len(), 8);
        assert_eq!(c.topology.gpu_count(), 8);
        assert_eq!(c.devices[7].pci_bus_id, "00000000:BD:00.0");
        let e = SimConfig::from_toml("preset = \"dgx-z\"", "t.toml").unwrap_err();
        assert!(e.to_string().contains("preset = \"dgx-z\""), "{e}");
        let e = SimConfig::from_toml("preset = \"t4-4gpu\"\n[[device]]", "t.toml").unwrap_err();
        assert!(e.to_string().contains("drop [[device]]"), "{e}");
        let e = SimConfig::from_toml(
            "[[device]]\n[topology]\n[[topology.gpu]]\nnuma = 1",
            "t.toml",
        )
        .unwrap_err();
        assert!(e.to_string().contains("topology.gpu[0].numa"), "{e}");
    }

    #[test]
    fn uuid_and_pci_round_trip() {
        let d = default_device(3);
        assert_eq!(parse_uuid(&format_uuid(&d.uuid)), Some(d.uuid));
        assert_eq!(
            normalize_pci_bus_id("0000:18:00.0").as_deref(),
            Some("00000000:18:00.0")
        );
        assert_eq!(
            normalize_pci_bus_id("18:00.0").as_deref(),
            Some("00000000:18:00.0")
        );
        assert_eq!(normalize_pci_bus_id("zz:00.0"), None);
    }

    #[test]
    fn host_memory_and_copy_bandwidth() {
        let c = SimConfig::from_toml("[host]\nmemory = \"2Gi\"\ncopy_gbps = 10", "x")
            .expect("a valid host table");
        assert_eq!(c.host.memory, 2 << 30);
        assert_eq!(c.host.copy_gbps, 10);
        let e = SimConfig::from_toml("[host]\ncopy_gbps = 0", "x").unwrap_err();
        assert!(e.to_string().contains("host.copy_gbps"), "{e}");
        let e = SimConfig::from_toml("[host]\nmemory = \"lots\"", "x").unwrap_err();
        assert!(e.to_string().contains("host.memory"), "{e}");
    }
}
