//! The memory limit of a pod's GPU containers (ADR 0066): the pod annotation
//! [`ANNOTATION_GPU_MEMORY_LIMIT`], parsed here once for the scheduler extender (which
//! refuses a bad one before the pod is placed) and the device plugin (which writes each
//! container's limit per GPU into its quota file).
//!
//! `vgpu.io/gpu-memory` is the *request*: memory the container is guaranteed on each of
//! its GPUs. The limit is what it may reach by bursting into memory no request holds.
//! Kubernetes forbids a request below the limit for an extended resource, so the limit is
//! an annotation, in one of two forms:
//!
//! - `MiB`: the limit of every GPU container of the pod (`16384`);
//! - `name=MiB,name=MiB`: per container (`main=16384,sidecar=2048`); a container the list
//!   does not name has limit = request.
//!
//! Values are MiB per GPU, read as Kubernetes quantities like `vgpu.io/gpu-memory` (so
//! `16k` is 16000 MiB, and `16Gi` is refused as a unit mistake). A limit is at least the
//! request (checked by [`MemoryLimits::check_pod`] where the request is given in MiB, and
//! by [`MemoryLimits::limit_mib`] against the MiB a GPU was granted); without the
//! annotation the limit is the request. A container with limit = request is
//! *guaranteed*, above it *burstable*. Limits never enter the scheduler's fit.

use std::collections::BTreeMap;

use crate::resources::{
    ContainerDemand, MAX_GPU_MEMORY_MIB, MemoryDemand, ResourceError, parse_quantity,
};

/// Pod annotation: the memory limit of the pod's GPU containers, MiB per GPU (`MiB`, or
/// `name=MiB,name=MiB` per container); at least the request (ADR 0066).
pub const ANNOTATION_GPU_MEMORY_LIMIT: &str = "vgpu.io/gpu-memory-limit";

/// Longest part of a bad value quoted in an error (the annotation may be large).
const QUOTE_MAX: usize = 64;

/// A pod's memory limits, as its annotation gives them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum MemoryLimits {
    /// No annotation: every container's limit is its request.
    #[default]
    Unset,
    /// One limit, MiB per GPU, for every GPU container of the pod.
    Every(u64),
    /// Limits by container name, MiB per GPU; other containers' limit is their request.
    Named(BTreeMap<String, u64>),
}

fn quote(text: &str) -> String {
    if text.chars().count() <= QUOTE_MAX {
        text.to_owned()
    } else {
        let mut s: String = text.chars().take(QUOTE_MAX).collect();
        s.push('…');
        s
    }
}

fn bad(value: &str, reason: impl Into<String>) -> ResourceError {
    ResourceError::BadMemoryLimit {
        value: quote(value),
        reason: reason.into(),
    }
}

/// One limit in MiB: a Kubernetes quantity, 1 to [`MAX_GPU_MEMORY_MIB`]; the reason
/// where it is not.
fn parse_mib(text: &str) -> Result<u64, String> {
    let v = parse_quantity(ANNOTATION_GPU_MEMORY_LIMIT, text).map_err(|e| match e {
        ResourceError::BadQuantity { reason, .. } => reason.to_owned(),
        other => other.to_string(),
    })?;
    if v == 0 {
        return Err("a limit is at least 1 MiB".to_owned());
    }
    if v > MAX_GPU_MEMORY_MIB {
        return Err(format!(
            "MiB per GPU, at most {MAX_GPU_MEMORY_MIB}: the unit is MiB, so write 16384 for 16 GiB, not 16Gi"
        ));
    }
    Ok(v)
}

/// Whether `name` can be a container's name (a DNS label: lower-case letters, digits and
/// `-`, at most 63 characters, not starting or ending with `-`).
fn is_container_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 63
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && !name.starts_with('-')
        && !name.ends_with('-')
}

/// Parses the annotation's value (see the module's documentation). Surrounding spaces
/// are ignored; an empty value, an empty entry, a name given twice, a name that is not a
/// container name, a value that is not a whole number of MiB from 1 to
/// [`MAX_GPU_MEMORY_MIB`] are errors that quote the bad part.
pub fn parse_memory_limit_value(text: &str) -> Result<MemoryLimits, ResourceError> {
    let t = text.trim();
    if t.is_empty() {
        return Err(bad(text, "empty (write MiB, or name=MiB,name=MiB)"));
    }
    if !t.contains('=') {
        if t.contains(',') {
            return Err(bad(
                text,
                "a list must name each container (name=MiB,name=MiB)",
            ));
        }
        return parse_mib(t)
            .map(MemoryLimits::Every)
            .map_err(|r| bad(text, r));
    }
    let mut out = BTreeMap::new();
    for entry in t.split(',') {
        let e = entry.trim();
        if e.is_empty() {
            return Err(bad(text, "empty entry in the list"));
        }
        let Some((name, value)) = e.split_once('=') else {
            return Err(bad(
                e,
                "expected name=MiB (a single MiB value applies to every container, without names)",
            ));
        };
        let name = name.trim();
        if !is_container_name(name) {
            return Err(bad(
                e,
                "expected name=MiB where name is a container's name (lower-case letters, digits, '-')",
            ));
        }
        let mib = parse_mib(value.trim()).map_err(|r| bad(e, r))?;
        if out.insert(name.to_owned(), mib).is_some() {
            return Err(bad(e, format!("container {name:?} is named twice")));
        }
    }
    Ok(MemoryLimits::Named(out))
}

/// Reads a pod's [`ANNOTATION_GPU_MEMORY_LIMIT`] from its annotations; absent is
/// [`MemoryLimits::Unset`].
pub fn parse_memory_limits(
    annotations: &BTreeMap<String, String>,
) -> Result<MemoryLimits, ResourceError> {
    annotations
        .get(ANNOTATION_GPU_MEMORY_LIMIT)
        .map_or(Ok(MemoryLimits::Unset), |v| parse_memory_limit_value(v))
}

impl MemoryLimits {
    /// The limit the annotation gives `container`, MiB per GPU; `None` where its limit is
    /// its request.
    pub fn of(&self, container: &str) -> Option<u64> {
        match self {
            MemoryLimits::Unset => None,
            MemoryLimits::Every(mib) => Some(*mib),
            MemoryLimits::Named(m) => m.get(container).copied(),
        }
    }

    /// Checks the limits against the pod's GPU containers (as `parse_pod_request` found
    /// them): every name must be one of them, and a limit must be at least a request
    /// given in MiB (`vgpu.io/gpu-memory`). A request in tenths of a GPU is known in MiB
    /// only on a GPU: [`MemoryLimits::limit_mib`] checks it there.
    pub fn check_pod(&self, containers: &[ContainerDemand]) -> Result<(), ResourceError> {
        if let MemoryLimits::Named(m) = self {
            for name in m.keys() {
                if !containers.iter().any(|c| c.name == *name) {
                    let known: Vec<String> =
                        containers.iter().map(|c| format!("{:?}", c.name)).collect();
                    return Err(bad(
                        &format!("{name}={}", m[name]),
                        format!(
                            "{name:?} is not a GPU container of the pod (its GPU containers: {})",
                            if known.is_empty() {
                                "none".to_owned()
                            } else {
                                known.join(", ")
                            }
                        ),
                    ));
                }
            }
        }
        for c in containers {
            if let MemoryDemand::Mib(request) = c.demand.memory {
                self.limit_mib(&c.name, request)?;
            }
        }
        Ok(())
    }

    /// The limit of `container` on a GPU where its request is `request_mib`: the
    /// annotation's limit, or the request where it gives none; an error naming the
    /// container, the limit and the request where the limit is below the request.
    pub fn limit_mib(&self, container: &str, request_mib: u64) -> Result<u64, ResourceError> {
        match self.of(container) {
            None => Ok(request_mib),
            Some(limit) if limit >= request_mib => Ok(limit),
            Some(limit) => Err(ResourceError::LimitBelowRequest {
                container: container.to_owned(),
                limit_mib: limit,
                request_mib,
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::resources::{ContainerKind, GpuDemand};
    use proptest::prelude::*;

    fn ann(v: &str) -> BTreeMap<String, String> {
        BTreeMap::from([(ANNOTATION_GPU_MEMORY_LIMIT.to_owned(), v.to_owned())])
    }

    fn demand(name: &str, memory: MemoryDemand) -> ContainerDemand {
        ContainerDemand {
            name: name.into(),
            demand: GpuDemand {
                count: 1,
                compute_milli: 100,
                memory,
                slices: 1,
            },
            kind: ContainerKind::App,
        }
    }

    #[test]
    fn absent_is_unset_and_the_limit_is_the_request() {
        let l = parse_memory_limits(&BTreeMap::new()).expect("absent is fine");
        assert_eq!(l, MemoryLimits::Unset);
        assert_eq!(l.limit_mib("main", 4096).expect("no limit"), 4096);
    }

    #[test]
    fn one_value_is_every_containers_limit() {
        let l = parse_memory_limits(&ann(" 16384 ")).expect("valid");
        assert_eq!(l, MemoryLimits::Every(16384));
        assert_eq!(l.limit_mib("a", 4096).expect("above"), 16384);
        assert_eq!(l.limit_mib("b", 16384).expect("equal"), 16384);
        assert_eq!(
            parse_memory_limit_value("16k").expect("quantity"),
            MemoryLimits::Every(16000)
        );
    }

    #[test]
    fn named_values_are_per_container_and_others_keep_their_request() {
        let l = parse_memory_limits(&ann("main=16384, side = 2048")).expect("valid");
        assert_eq!(l.of("main"), Some(16384));
        assert_eq!(l.of("side"), Some(2048));
        assert_eq!(l.of("other"), None);
        assert_eq!(l.limit_mib("other", 1000).expect("unnamed"), 1000);
    }

    #[test]
    fn a_limit_below_the_request_is_refused_naming_both() {
        let l = MemoryLimits::Every(2048);
        let e = l.limit_mib("main", 4096).expect_err("below").to_string();
        assert!(
            e.contains("\"main\"") && e.contains("2048") && e.contains("4096"),
            "{e}"
        );
        let pod = [demand("main", MemoryDemand::Mib(4096))];
        assert!(l.check_pod(&pod).is_err());
        assert!(MemoryLimits::Every(4096).check_pod(&pod).is_ok());
        // A request in tenths is only known in MiB on a GPU: not refused here.
        let tenths = [demand("main", MemoryDemand::FractionMilli(300))];
        assert!(l.check_pod(&tenths).is_ok());
    }

    #[test]
    fn a_name_that_is_no_gpu_container_of_the_pod_is_refused_naming_it() {
        let l = parse_memory_limit_value("mian=8192").expect("syntax is fine");
        let pod = [demand("main", MemoryDemand::Mib(1024))];
        let e = l.check_pod(&pod).expect_err("typo").to_string();
        assert!(
            e.contains(ANNOTATION_GPU_MEMORY_LIMIT)
                && e.contains("\"mian\"")
                && e.contains("\"main\""),
            "{e}"
        );
        let e = l.check_pod(&[]).expect_err("no GPU container").to_string();
        assert!(e.contains("none"), "{e}");
    }

    #[test]
    fn garbage_is_refused_quoting_the_bad_part() {
        for (value, quoted) in [
            ("", ""),
            ("   ", "   "),
            ("0", "0"),
            ("-1", "-1"),
            ("16Gi", "16Gi"),
            ("1.5", "1.5"),
            ("abc", "abc"),
            ("1e99", "1e99"),
            ("99999999999999999999999", "99999999999999999999999"),
            ("8192,4096", "8192,4096"),
            ("main=", "main="),
            ("main=1Gi", "main=1Gi"),
            ("=8192", "=8192"),
            ("main=8192,", "main=8192,"),
            ("main=8192,,b=1", "main=8192,,b=1"),
            ("main=8192,4096", "4096"),
            ("main=1=2", "main=1=2"),
            ("Main=8192", "Main=8192"),
            ("-main=8192", "-main=8192"),
            ("ma in=8192", "ma in=8192"),
            ("main=8192,main=9000", "main=9000"),
            ("main=0", "main=0"),
            ("main=-5", "main=-5"),
            ("main=\u{feff}5", "main=\u{feff}5"),
            ("ü=5", "ü=5"),
        ] {
            let e = parse_memory_limit_value(value)
                .expect_err(value)
                .to_string();
            assert!(
                e.contains(ANNOTATION_GPU_MEMORY_LIMIT) && e.contains(&format!("{quoted:?}")),
                "{value:?}: {e}"
            );
        }
    }

    #[test]
    fn a_huge_value_is_quoted_only_in_part() {
        let v = "x".repeat(100_000);
        let e = parse_memory_limit_value(&v)
            .expect_err("garbage")
            .to_string();
        assert!(e.len() < 400, "{} bytes", e.len());
        let name = format!("{}=5", "a".repeat(64));
        assert!(parse_memory_limit_value(&name).is_err());
        assert!(parse_memory_limit_value(&format!("{}=5", "a".repeat(63))).is_ok());
    }

    proptest! {
        #[test]
        fn never_panics_and_values_are_in_range(s in "\\PC{0,40}") {
            if let Ok(l) = parse_memory_limit_value(&s) {
                let values: Vec<u64> = match l {
                    MemoryLimits::Unset => vec![],
                    MemoryLimits::Every(v) => vec![v],
                    MemoryLimits::Named(m) => m.into_values().collect(),
                };
                for v in values {
                    prop_assert!((1..=MAX_GPU_MEMORY_MIB).contains(&v));
                }
            }
        }

        #[test]
        fn lists_of_names_round_trip(
            entries in proptest::collection::btree_map("[a-z][a-z0-9-]{0,8}[a-z0-9]", 1u64..=MAX_GPU_MEMORY_MIB, 1..6)
        ) {
            let text = entries
                .iter()
                .map(|(n, v)| format!("{n}={v}"))
                .collect::<Vec<_>>()
                .join(",");
            prop_assert_eq!(parse_memory_limit_value(&text).unwrap(), MemoryLimits::Named(entries));
        }
    }
}
