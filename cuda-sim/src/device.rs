//! One simulated GPU as configured: what the driver and NVML report about it, and the
//! default (H100-like) device. Below the configuration and the presets, which both build
//! devices.

/// One simulated GPU.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceConfig {
    /// Marketing name, as `cuDeviceGetName` and `nvmlDeviceGetName` report it.
    pub name: String,
    /// The 16 bytes of the GPU UUID (`GPU-xxxxxxxx-xxxx-...` in text form).
    pub uuid: [u8; 16],
    /// PCI bus id, `DDDDDDDD:BB:DD.F` (NVML's 8-digit domain form).
    pub pci_bus_id: String,
    /// Device memory in bytes.
    pub memory: u64,
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Compute capability major.
    pub cc_major: u32,
    /// Compute capability minor.
    pub cc_minor: u32,
    /// Device memory each context costs, in bytes.
    pub context_overhead: u64,
    /// Allocation granularity: every allocation is charged in multiples of this.
    pub alloc_granularity: u64,
    /// Copy bandwidth used by the cost model, in GB/s.
    pub memory_bandwidth_gbps: u32,
}

/// The default device at index `i`: an H100-like GPU (80 GiB, 132 SMs, 9.0).
pub fn default_device(i: u32) -> DeviceConfig {
    let mut uuid = [0u8; 16];
    // A fixed, recognisable pattern: "5157" ("SIM" in leetspeak-ish hex) then the index.
    uuid[..4].copy_from_slice(&[0x51, 0x57, 0x00, 0x00]);
    uuid[12..16].copy_from_slice(&i.to_be_bytes());
    uuid[6] = 0x40; // version 4 nibble, as real GPU UUIDs look
    uuid[8] = 0x80;
    DeviceConfig {
        name: "NVIDIA H100 80GB HBM3".to_owned(),
        uuid,
        pci_bus_id: format!("00000000:{:02X}:00.0", 0x18 + i * 0x10),
        memory: 80 << 30,
        sm_count: 132,
        cc_major: 9,
        cc_minor: 0,
        context_overhead: 300 << 20,
        alloc_granularity: 2 << 20,
        memory_bandwidth_gbps: 3350,
    }
}
