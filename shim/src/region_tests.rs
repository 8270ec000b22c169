//! Tests of the accounting region: the charge arithmetic, liveness and reaping, NVML PID
//! mapping, a tenant's tampering, and a property test over arbitrary region contents.

use super::*;

/// The region's words, as a tenant who attached it sees them.
fn words(r: &Region) -> &[AtomicU64] {
    // SAFETY: the attachment is size_of::<Layout>() bytes, a multiple of 8, aligned
    // to a page; every field is an atomic, so any word view is valid.
    unsafe { std::slice::from_raw_parts(r.base.cast::<AtomicU64>(), size_of::<Layout>() / 8) }
}

#[test]
fn no_file_of_the_directory_is_needed_nor_touched() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::open(dir.path()).unwrap();
    r.init_quota(0, Some(8 << 20));
    let s = r.claim_slot().unwrap();
    assert!(r.try_charge(s, 0, 6 << 20, None));
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    // A second process of the container attaches the same accounts.
    let r2 = Region::open(dir.path()).unwrap();
    assert!(r2.notes().is_empty(), "{:?}", r2.notes());
    assert_eq!(r2.used(0), 6 << 20);
    let s2 = r2.claim_slot().unwrap();
    assert_ne!(s, s2);
    assert!(!r2.try_charge(s2, 0, 4 << 20, None));
    assert!(r2.try_charge(s2, 0, 2 << 20, None));
    // Another directory has its own.
    let other = tempfile::tempdir().unwrap();
    assert_eq!(Region::open(other.path()).unwrap().used(0), 0);
}

#[test]
fn a_damaged_header_is_reported_and_repaired_or_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::open(dir.path()).unwrap();
    r.init_quota(0, Some(8 << 20));
    let s = r.claim_slot().unwrap();
    assert!(r.try_charge(s, 0, 6 << 20, None));
    // The tenant zeroes the header and forges the device total.
    for w in &words(&r)[..4] {
        w.store(0, Ordering::Relaxed);
    }
    r.layout().devs[0].used.store(u64::MAX, Ordering::Relaxed);
    // In use by `r`: repaired in place, the total rebuilt from the live slot.
    let r2 = Region::open(dir.path()).unwrap();
    assert_eq!(r2.notes().len(), 1, "{:?}", r2.notes());
    let note = &r2.notes()[0];
    assert!(note.contains(&dir.path().display().to_string()), "{note}");
    assert!(note.contains("bad magic number"), "{note}");
    assert_eq!(r2.used(0), 6 << 20);
    assert_eq!(r.used(0), 6 << 20, "one budget for both");
    drop(r2);
    drop(r);
    // Nobody attached: a damaged region is replaced by a fresh one.
    let r = Region::open(dir.path()).unwrap();
    for w in &words(&r)[..2] {
        w.store(7, Ordering::Relaxed);
    }
    let keep = r.shmid;
    drop(r);
    let r = Region::open(dir.path()).unwrap();
    assert_ne!(r.shmid, keep);
    assert!(
        r.notes()[0].contains("replaced by a fresh region"),
        "{:?}",
        r.notes()
    );
    assert_eq!(r.used(0), 0);
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(64))]
    /// Whatever a tenant writes into the region, at any word, no operation of a
    /// process already attached, nor of one attaching afterwards, panics or hangs;
    /// a process that brings its own quota never charges past it.
    #[test]
    fn arbitrary_region_contents_crash_nothing(
        writes in proptest::collection::vec((0usize..(size_of::<Layout>() / 8), proptest::num::u64::ANY), 0..400),
        fill in proptest::option::of(proptest::num::u64::ANY),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        let s = r.claim_slot().unwrap();
        let w = words(&r);
        if let Some(f) = fill {
            for x in w {
                x.store(f, Ordering::Relaxed);
            }
        }
        for (i, v) in writes {
            w[i].store(v, Ordering::Relaxed);
        }
        let exercise = |r: &Region, s: usize| {
            for d in [0, MAX_DEVICES - 1, MAX_DEVICES] {
                let before = r.slot_used(s, d);
                let _ = r.try_charge(s, d, 4096, Some(1 << 20));
                r.uncharge(s, d, 4096);
                r.count_context(s, d, true);
                r.count_context(s, d, false);
                let _ = (r.quota(d), r.used(d), r.contexts(d), before);
                let _ = (r.pid_used(std::process::id(), d), r.container_pid(1));
            }
            r.reap(Some(s));
        };
        exercise(&r, s);
        let r2 = Region::open(dir.path()).unwrap();
        let s2 = r2.claim_slot().unwrap();
        exercise(&r2, s2);
        // Its own quota holds whatever the region says.
        let mut n = 0u64;
        while r2.try_charge(s2, 1, 1 << 20, Some(4 << 20)) {
            n += 1;
            proptest::prop_assert!(n <= 4);
        }
        r2.release_slot(s2);
        r.release_slot(s);
    }
}

/// A tenant removes the region (`IPC_RMID`) while a process uses it, and may put a
/// segment of its own under the key: a new process joins the removed region, whose
/// charges are the container's, and says so; once nobody uses it, a fresh one is made.
#[test]
fn a_removed_region_in_use_is_joined_not_replaced() {
    for blank_under_key in [false, true] {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        r.init_quota(0, Some(8 << 20));
        let s = r.claim_slot().unwrap();
        assert!(r.try_charge(s, 0, 6 << 20, None));
        segment::remove(r.shmid).unwrap();
        if blank_under_key {
            let k = segment::create_or_attach(r.key, size_of::<Layout>())
                .unwrap()
                .expect("the key is free");
            assert!(k.created);
            // SAFETY: the test's own attachment, not used after this.
            unsafe { segment::detach(k.base) };
        }
        let r2 = Region::open(dir.path()).unwrap();
        assert_eq!(r2.shmid, r.shmid, "{blank_under_key}: {:?}", r2.notes());
        let note = r2.notes().join("; ");
        assert!(
            note.contains("removed (IPC_RMID)") && note.contains(&dir.path().display().to_string()),
            "{note}"
        );
        // One budget: the second process sees the first one's charge and cannot take
        // more than the 2 MiB left.
        assert_eq!(r2.used(0), 6 << 20);
        let s2 = r2.claim_slot().unwrap();
        assert!(!r2.try_charge(s2, 0, 4 << 20, None));
        assert!(r2.try_charge(s2, 0, 2 << 20, None));
        drop(r2);
        drop(r);
        // Nobody uses it any more: it is gone, and the next process starts afresh.
        let r3 = Region::open(dir.path()).unwrap();
        assert_eq!(r3.used(0), 0);
        assert!(
            !r3.notes().iter().any(|n| n.contains("IPC_RMID")),
            "{:?}",
            r3.notes()
        );
    }
}

#[test]
fn charges_are_all_or_nothing_under_the_quota() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::open(dir.path()).unwrap();
    assert_eq!(r.init_quota(0, Some(10 << 20)), Some(10 << 20));
    // A second process cannot raise it.
    assert_eq!(r.init_quota(0, Some(1 << 30)), Some(10 << 20));
    let s = r.claim_slot().unwrap();
    assert!(r.try_charge(s, 0, 6 << 20, None));
    assert!(!r.try_charge(s, 0, (4 << 20) + 1, None));
    assert!(r.try_charge(s, 0, 4 << 20, None));
    assert_eq!(r.used(0), 10 << 20);
    assert!(!r.try_charge(s, 0, 1, None));
    assert!(!r.try_charge(s, 0, u64::MAX, None));
    r.uncharge(s, 0, 4 << 20);
    r.uncharge(s, 0, u64::MAX);
    assert_eq!(r.used(0), 0);
    // Unlimited device: charges always fit, saturating.
    assert!(r.try_charge(s, 1, u64::MAX - 1, None));
    assert!(!r.try_charge(s, 1, 2, None));
}

#[test]
fn a_tampered_region_cannot_raise_a_process_quota() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::open(dir.path()).unwrap();
    assert_eq!(r.init_quota(0, Some(8 << 20)), Some(8 << 20));
    // The tenant (who can write the file) sets the quota to unlimited, then higher.
    for forged in [0, 1 << 40] {
        r.layout().devs[0].quota.store(forged, Ordering::Release);
        let s = r.claim_slot().unwrap();
        // A process that brought an 8 MiB quota still stops at 8 MiB.
        assert!(r.try_charge(s, 0, 8 << 20, Some(8 << 20)));
        assert!(!r.try_charge(s, 0, 1, Some(8 << 20)), "forged {forged}");
        r.release_slot(s);
    }
    // A process that comes later lowers a forged quota again, never raises it.
    r.layout().devs[0].quota.store(1 << 40, Ordering::Release);
    assert_eq!(r.init_quota(0, Some(8 << 20)), Some(8 << 20));
    assert_eq!(
        r.init_quota(0, Some(4 << 20)),
        Some(4 << 20),
        "a lower quota wins"
    );
}

#[test]
fn nvml_pids_map_to_the_container_pids_once_the_host_pid_is_known() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::open(dir.path()).unwrap();
    let me = std::process::id();
    let s = r.claim_slot().unwrap();
    assert!(r.try_charge(s, 0, 4096, None));
    // Same PID namespace as NVML: matched on its own PID.
    assert_eq!(r.container_pid(me), Some(me));
    assert_eq!(r.pid_used(me, 0), Some(4096));
    // In a container's PID namespace the daemon tells the host PID; NVML's host PID
    // then maps to the container's, and the container PID alone no longer matches
    // (it could be another process's host PID).
    r.set_host_pid(s, 4_000_000);
    assert_eq!(r.container_pid(4_000_000), Some(me));
    assert_eq!(r.pid_used(4_000_000, 0), Some(4096));
    assert_eq!(r.container_pid(me), None);
    assert_eq!(r.container_pid(0), None);
    r.release_slot(s);
    assert_eq!(r.container_pid(4_000_000), None);
}

#[test]
fn racing_threads_never_exceed() {
    let dir = tempfile::tempdir().unwrap();
    let r = std::sync::Arc::new(Region::open(dir.path()).unwrap());
    r.init_quota(0, Some(1000));
    let s = r.claim_slot().unwrap();
    let hs: Vec<_> = (0..8)
        .map(|_| {
            let r = r.clone();
            std::thread::spawn(move || (0..1000).filter(|_| r.try_charge(s, 0, 7, None)).count())
        })
        .collect();
    let n: usize = hs.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(n, 1000 / 7);
    assert_eq!(r.used(0), (1000 / 7) * 7);
}

#[test]
fn released_slot_returns_its_charges() {
    let dir = tempfile::tempdir().unwrap();
    let r = Region::open(dir.path()).unwrap();
    let s = r.claim_slot().unwrap();
    assert!(r.try_charge(s, 2, 4096, None));
    r.count_context(s, 2, true);
    assert_eq!(
        r.container_pid(std::process::id()),
        Some(std::process::id())
    );
    r.release_slot(s);
    assert_eq!(r.used(2), 0);
    assert_eq!(r.contexts(2), 0);
    assert_eq!(r.container_pid(std::process::id()), None);
}

proptest::proptest! {
    /// Any interleaving of charges and uncharges from several slots keeps the
    /// container at or under its quota, equal to the sum of its slots, and never
    /// wraps; releasing every slot brings it back to zero.
    #[test]
    fn accounting_never_exceeds_or_wraps(
        quota in 1u64..(1 << 40),
        ops in proptest::collection::vec((0usize..4, proptest::bool::ANY, 0u64..(1 << 38)), 1..200),
    ) {
        let dir = tempfile::tempdir().unwrap();
        let r = Region::open(dir.path()).unwrap();
        r.init_quota(0, Some(quota));
        let slots: Vec<usize> = (0..4).map(|_| r.claim_slot().unwrap()).collect();
        let mut model = [0u64; 4];
        for (i, charge, bytes) in ops {
            let s = slots[i];
            if charge {
                let fits = model.iter().sum::<u64>().checked_add(bytes).is_some_and(|n| n <= quota);
                proptest::prop_assert_eq!(r.try_charge(s, 0, bytes, None), fits);
                if fits {
                    model[i] += bytes;
                }
            } else {
                let b = bytes.min(model[i]);
                r.uncharge(s, 0, b);
                model[i] -= b;
            }
            proptest::prop_assert!(r.used(0) <= quota);
            proptest::prop_assert_eq!(r.used(0), model.iter().sum::<u64>());
            proptest::prop_assert_eq!(r.slot_used(s, 0), model[i]);
        }
        for s in slots {
            r.release_slot(s);
        }
        proptest::prop_assert_eq!(r.used(0), 0);
    }
}
