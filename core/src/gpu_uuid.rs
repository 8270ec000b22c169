//! GPU UUIDs as NVIDIA prints them, `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`: the one
//! formatter and parser of the 16 bytes that `cuDeviceGetUuid` and NVML carry, for the
//! shim, cuda-sim and the test probes alike.

use std::fmt::Write as _;

/// Formats a UUID as NVIDIA prints it: `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lower
/// case hex.
pub fn format_uuid(u: &[u8; 16]) -> String {
    let mut s = String::with_capacity(40);
    s.push_str("GPU-");
    for (i, b) in u.iter().enumerate() {
        if matches!(i, 4 | 6 | 8 | 10) {
            s.push('-');
        }
        // Writing to a String cannot fail.
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Parses `GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx` (the `GPU-` prefix is optional;
/// surrounding space and the dashes' places are not checked; hex in either case).
pub fn parse_uuid(s: &str) -> Option<[u8; 16]> {
    let hex: String = s
        .trim()
        .strip_prefix("GPU-")
        .unwrap_or(s.trim())
        .chars()
        .filter(|&c| c != '-')
        .collect();
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_as_nvidia_prints_it() {
        let u = [
            0x11, 0x11, 0x11, 0x11, 0x22, 0x22, 0x33, 0x33, 0x44, 0x44, 0x55, 0x55, 0x55, 0x55,
            0x55, 0x55,
        ];
        assert_eq!(format_uuid(&u), "GPU-11111111-2222-3333-4444-555555555555");
        let mut v = [0u8; 16];
        v[0] = 0xab;
        v[15] = 0x0c;
        assert_eq!(format_uuid(&v), "GPU-ab000000-0000-0000-0000-00000000000c");
    }

    #[test]
    fn parses_with_or_without_prefix_and_refuses_other_lengths() {
        let want = Some([0x5a; 16]);
        assert_eq!(parse_uuid("GPU-5a5a5a5a-5a5a-5a5a-5a5a-5a5a5a5a5a5a"), want);
        assert_eq!(parse_uuid(" 5A5A5A5A-5A5A-5A5A-5A5A-5A5A5A5A5A5A "), want);
        assert_eq!(parse_uuid("GPU-5a5a5a5a"), None);
        assert_eq!(parse_uuid("GPU-5a5a5a5a-5a5a-5a5a-5a5a-5a5a5a5a5a5g"), None);
    }

    proptest::proptest! {
        #[test]
        fn round_trips(u: [u8; 16]) {
            let s = format_uuid(&u);
            proptest::prop_assert_eq!(s.len(), 40);
            proptest::prop_assert_eq!(parse_uuid(&s), Some(u));
        }
    }
}
