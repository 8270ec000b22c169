//! Device IDs: `<gpu-uuid>-<slot>`, so that kubelet's own ledger (checkpoint, PodResources
//! API) names the physical GPU of every slice it hands out (10 per GPU, or up to 100 on a
//! node configured for fine sharing, ADR 0023).

use std::collections::BTreeSet;

use sha2::{Digest, Sha256};
use vgpu_core::resources::FINE_SLICES_PER_GPU;

/// Longest device ID kubelet accepts in practice (a DNS label).
pub const MAX_ID_LEN: usize = 63;

/// Why a device ID could not be made or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IdError {
    /// The GPU UUID makes IDs longer than kubelet accepts.
    #[error("GPU {uuid}: device IDs would be {len} characters, at most {MAX_ID_LEN}")]
    TooLong {
        /// The GPU UUID.
        uuid: String,
        /// The resulting length.
        len: usize,
    },
    /// Not of the form `<gpu-uuid>-<slot>`.
    #[error("device ID {0:?} is not of the form <gpu-uuid>-<slot>")]
    Malformed(String),
}

/// The device ID of `slot` (0..10, or up to 0..100 on a fine node, ADR 0023) on GPU
/// `uuid`.
pub fn device_id(uuid: &str, slot: u32) -> String {
    format!("{uuid}-{slot}")
}

/// Checks that every ID of GPU `uuid` fits kubelet's limit.
pub fn check_uuid(uuid: &str) -> Result<(), IdError> {
    // The longest ID any configuration advertises (slot 99).
    let len = device_id(uuid, FINE_SLICES_PER_GPU - 1).len();
    if len > MAX_ID_LEN || uuid.is_empty() {
        return Err(IdError::TooLong {
            uuid: uuid.to_owned(),
            len,
        });
    }
    Ok(())
}

/// Splits a device ID into its GPU UUID and slot.
pub fn parse_device_id(id: &str) -> Result<(&str, u32), IdError> {
    let malformed = || IdError::Malformed(id.to_owned());
    let (uuid, slot) = id.rsplit_once('-').ok_or_else(malformed)?;
    let slot: u32 = slot.parse().map_err(|_| malformed())?;
    if uuid.is_empty() || slot >= FINE_SLICES_PER_GPU {
        return Err(malformed());
    }
    Ok((uuid, slot))
}

/// The distinct GPUs named by a set of device IDs, sorted, with the slices held on each.
pub fn gpus_of<'a>(ids: impl IntoIterator<Item = &'a str>) -> Result<Vec<(String, u32)>, IdError> {
    let mut out: Vec<(String, u32)> = Vec::new();
    let mut seen = BTreeSet::new();
    for id in ids {
        if !seen.insert(id) {
            continue;
        }
        let (uuid, _) = parse_device_id(id)?;
        match out.iter_mut().find(|(u, _)| u == uuid) {
            Some((_, n)) => *n += 1,
            None => out.push((uuid.to_owned(), 1)),
        }
    }
    out.sort();
    Ok(out)
}

/// The name of the per-allocation directory of a set of device IDs: the hex SHA-256 of
/// the sorted, distinct IDs joined by newlines. `Allocate` and `PreStartContainer` both
/// derive it from the IDs kubelet sends, so no state passes between them. Kubelet never
/// gives one device to two running containers, so two live allocations never share it.
pub fn allocation_key<'a>(ids: impl IntoIterator<Item = &'a str>) -> String {
    let set: BTreeSet<&str> = ids.into_iter().collect();
    let mut h = Sha256::new();
    for id in set {
        h.update(id.as_bytes());
        h.update(b"\n");
    }
    h.finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_fit() {
        let uuid = "GPU-8c1f3a2e-0b6d-4f7e-9a1c-2d3e4f5a6b7c";
        check_uuid(uuid).unwrap();
        let id = device_id(uuid, 7);
        assert!(id.len() <= MAX_ID_LEN);
        assert_eq!(parse_device_id(&id).unwrap(), (uuid, 7));
        // Slots 0..100: a fine node advertises 100 per GPU (ADR 0023).
        assert_eq!(parse_device_id("GPU-x-99").unwrap(), ("GPU-x", 99));
        assert!(parse_device_id("GPU-x-100").is_err());
        // A UUID is checked against the longest ID any node advertises (slot 99).
        assert!(check_uuid(&"x".repeat(61)).is_err());
        check_uuid(&"x".repeat(60)).unwrap();
        assert!(parse_device_id("nodash").is_err());
        assert!(check_uuid(&"x".repeat(62)).is_err());
    }

    #[test]
    fn gpus_and_keys_ignore_order_and_duplicates() {
        let a = ["GPU-b-1", "GPU-a-0", "GPU-a-3", "GPU-a-0"];
        let b = ["GPU-a-3", "GPU-b-1", "GPU-a-0"];
        assert_eq!(
            gpus_of(a).unwrap(),
            vec![("GPU-a".to_owned(), 2), ("GPU-b".to_owned(), 1)]
        );
        assert_eq!(allocation_key(a), allocation_key(b));
        assert_ne!(allocation_key(a), allocation_key(["GPU-a-3"]));
        assert_eq!(allocation_key(a).len(), 64);
    }
}
