//! Arbitrary bytes in the quota file (`vgpu.conf`) crash nothing: the shim's own parser,
//! in-process (issue 16). The same files under real processes are
//! `tests/tests/shim_fuzz.rs` of `vgpu-tests`; the region's in-process property test is
//! `region::tests::arbitrary_region_contents_crash_nothing`.
//!
//! Its own test binary: linking the shim into a program puts the shim's `dlsym` hook in
//! front of libc's for the whole program, which no other test should run under.

use std::path::Path;

use proptest::prelude::*;
use vgpu::config::Config;

const A: &str = "GPU-00000000-0000-0000-0000-000000000001";
const B: &str = "GPU-00000000-0000-0000-0000-000000000002";

fn valid(mib: u64) -> String {
    format!(
        r#"{{"version":1,"namespace":"ns","pod":"p","uid":"u","container":"c","init":false,"gpus":[{{"uuid":"{A}","memory_mib":{mib},"compute_milli":100,"slices":1}}],"device_ids":[]}}"#
    )
}

fn check(text: &str) -> Result<(), TestCaseError> {
    let path = Path::new("/c/vgpu.conf");
    let mut cfg = Config::from_vars(Vec::<(String, String)>::new()).expect("defaults");
    match cfg.apply_quota_file(path, text, &[A.to_owned(), B.to_owned()]) {
        // A file that applies decides every visible device: none is left unlimited.
        Ok(_) => {
            prop_assert!(cfg.limit(0).is_some() && cfg.limit(1).is_some());
        }
        Err(e) => prop_assert!(e.contains("/c/vgpu.conf"), "{e}"),
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn arbitrary_quota_files_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        check(&String::from_utf8_lossy(&bytes))?;
    }

    /// Valid files with bytes flipped, cut or spliced: near misses of the real format.
    #[test]
    fn mutated_quota_files_never_panic(
        mib in any::<u64>(),
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 0..8),
        cut in any::<usize>(),
    ) {
        let mut b = valid(mib).into_bytes();
        for (at, v) in edits {
            let n = b.len();
            b[at % n] = v;
        }
        let n = b.len();
        b.truncate(cut % (n + 1));
        check(&String::from_utf8_lossy(&b))?;
    }
}
