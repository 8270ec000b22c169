//! Which container a `PreStartContainer` call is for: pure decisions over kubelet's
//! `List`, the pod (spec and status) and the quota files written before (ADR 0009, steps
//! 1–4). The I/O around them (the `List`, the pod reads, the wait for a lagging status)
//! is `handshake::Handshake::prestart`.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use k8s_openapi::api::core::v1::Pod;
use vgpu_core::resources::{ANNOTATION_ASSIGNMENT, Assignment, ContainerAssignment};

use crate::error::HandshakeError;
use crate::podresources::Listed;

/// Whether the pod has finished (`Succeeded` or `Failed`).
pub fn is_terminal(pod: &Pod) -> bool {
    matches!(
        pod.status.as_ref().and_then(|s| s.phase.as_deref()),
        Some("Succeeded" | "Failed")
    )
}

/// The pod's assignment record (`vgpu.io/assignment`), if any.
pub fn assignment_of(pod: &Pod) -> Option<&str> {
    pod.metadata
        .annotations
        .as_ref()?
        .get(ANNOTATION_ASSIGNMENT)
        .map(String::as_str)
}

/// The slices a container's grant holds on all its GPUs.
pub fn total_slices(c: &ContainerAssignment) -> u32 {
    c.gpus.iter().map(|g| g.slices).sum()
}

/// How long `PreStartContainer` waits for the pod status to tell whether an init
/// container finished, when the same devices serve it and then an app container.
pub const INIT_STATUS_WAIT: Duration = Duration::from_secs(2);

/// An init container's state per the pod's status in the API server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitState {
    /// Finished successfully (or the pod is `Initialized`).
    Done,
    /// Its last run failed: kubelet will run it again.
    Failed,
    /// Not started, running, or the status does not say.
    Unknown,
}

/// An init container's state per the pod's status.
pub fn init_state(pod: &Pod, name: &str) -> InitState {
    let initialized = pod
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| {
            cs.iter()
                .any(|c| c.type_ == "Initialized" && c.status == "True")
        });
    if initialized {
        return InitState::Done;
    }
    let Some(st) = pod
        .status
        .as_ref()
        .and_then(|s| s.init_container_statuses.as_ref())
        .and_then(|ss| ss.iter().find(|s| s.name == name))
    else {
        return InitState::Unknown;
    };
    match st.state.as_ref() {
        Some(s) if s.terminated.as_ref().is_some_and(|t| t.exit_code == 0) => InitState::Done,
        Some(s) if s.terminated.is_some() => InitState::Failed,
        Some(s)
            if s.waiting.is_some()
                && st
                    .last_state
                    .as_ref()
                    .and_then(|l| l.terminated.as_ref())
                    .is_some_and(|t| t.exit_code != 0) =>
        {
            InitState::Failed
        }
        _ => InitState::Unknown,
    }
}

/// The pod a call's devices belong to (ADR 0009 steps 1–2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// The pod's namespace.
    pub namespace: String,
    /// The pod's name.
    pub pod: String,
    /// The listed container holding exactly the call's devices; `None` when only an
    /// overlap names the pod (an init container: kubelet 1.28 does not list them).
    pub exact: Option<String>,
}

/// Finds the pod whose listed container holds exactly `ids`, else the one pod whose
/// listed containers overlap `ids` (an init container whose devices the pod's later
/// containers reuse). Refused when none or several match.
pub fn find_pod(ids: &BTreeSet<String>, listed: &[Listed]) -> Result<Found, HandshakeError> {
    let ids_text = || ids.iter().cloned().collect::<Vec<_>>().join(",");
    let exact: Vec<&Listed> = listed.iter().filter(|l| l.ids == *ids).collect();
    match exact.as_slice() {
        [one] => Ok(Found {
            namespace: one.namespace.clone(),
            pod: one.pod.clone(),
            exact: Some(one.container.clone()),
        }),
        [] => {
            let pods: BTreeSet<(&str, &str)> = listed
                .iter()
                .filter(|l| !l.ids.is_disjoint(ids))
                .map(|l| (l.namespace.as_str(), l.pod.as_str()))
                .collect();
            let mut it = pods.iter();
            match (it.next(), it.next()) {
                (Some((ns, p)), None) => Ok(Found {
                    namespace: (*ns).to_owned(),
                    pod: (*p).to_owned(),
                    exact: None,
                }),
                (None, _) => Err(HandshakeError::NoContainer { ids: ids_text() }),
                _ => Err(HandshakeError::Ambiguous {
                    ids: ids_text(),
                    who: pods
                        .iter()
                        .map(|(n, p)| format!("{n}/{p}"))
                        .collect::<Vec<_>>()
                        .join(", "),
                }),
            }
        }
        many => Err(HandshakeError::Ambiguous {
            ids: ids_text(),
            who: many
                .iter()
                .map(|l| format!("{}/{}:{}", l.namespace, l.pod, l.container))
                .collect::<Vec<_>>()
                .join(", "),
        }),
    }
}

/// One init container of the pod's spec, as the decision needs it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InitContainer {
    /// Its name.
    pub name: String,
    /// `restartPolicy: Always`: a sidecar keeps running and never shares its devices.
    pub sidecar: bool,
    /// Its state per the pod's status.
    pub state: InitState,
}

/// The pod's init containers in spec order, with their states.
pub fn init_containers(pod: &Pod) -> Vec<InitContainer> {
    pod.spec
        .as_ref()
        .and_then(|s| s.init_containers.as_ref())
        .map(|v| {
            v.iter()
                .map(|c| InitContainer {
                    name: c.name.clone(),
                    sidecar: c.restart_policy.as_deref() == Some("Always"),
                    state: init_state(pod, &c.name),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Which container of the pod a call is for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision<'a> {
    /// This container's grant; `init`: it is an init container.
    Container {
        /// Its grant in the assignment.
        grant: &'a ContainerAssignment,
        /// Whether it is an init container (sidecars included).
        init: bool,
    },
    /// The pod status does not yet say whether this init container, which ran on exactly
    /// these devices, finished: the call is its re-run or the next container's.
    Wait {
        /// The init container.
        init: String,
    },
    /// The exactly matching container has no grant in the assignment.
    NoGrant {
        /// The container.
        container: String,
    },
    /// No container of the pod is this call's.
    NoContainer,
}

/// ADR 0009 step 4. Kubelet starts init containers one by one, in order, before any app
/// container, and reuses their devices later. So, in spec order, an init container of
/// this size (`ids.len()` slices) that is not done is this call's when it never started
/// (no devices in `prior`, the quota files written before), or when it ran on exactly
/// these devices and is a sidecar or its status says it failed (kubelet re-runs it);
/// when it ran on them and its status does not say yet, [`Decision::Wait`]. An init
/// container that ran on other devices is not this call's. When no init container is,
/// it is the exactly matching container (`exact`), if any.
pub fn decide<'a>(
    assignment: &'a Assignment,
    inits: &[InitContainer],
    exact: Option<&str>,
    ids: &BTreeSet<String>,
    prior: &BTreeMap<String, BTreeSet<String>>,
) -> Decision<'a> {
    let n = u32::try_from(ids.len()).unwrap_or(u32::MAX);
    let exact_is_init = exact.is_some_and(|c| inits.iter().any(|i| i.name == c));
    if !exact_is_init {
        for ic in inits {
            let Some(a) = assignment.container(&ic.name) else {
                continue;
            };
            if total_slices(a) != n || (ic.state == InitState::Done && !ic.sidecar) {
                continue;
            }
            match prior.get(&ic.name) {
                None => {
                    return Decision::Container {
                        grant: a,
                        init: true,
                    };
                }
                Some(p) if p == ids => {
                    return if ic.sidecar || ic.state == InitState::Failed {
                        Decision::Container {
                            grant: a,
                            init: true,
                        }
                    } else {
                        Decision::Wait {
                            init: ic.name.clone(),
                        }
                    };
                }
                Some(_) => {}
            }
        }
    }
    match exact {
        Some(c) => match assignment.container(c) {
            Some(grant) => Decision::Container {
                grant,
                init: exact_is_init,
            },
            None => Decision::NoGrant {
                container: c.to_owned(),
            },
        },
        None => Decision::NoContainer,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vgpu_core::resources::{ASSIGNMENT_VERSION, GpuGrant};

    fn set(v: &[&str]) -> BTreeSet<String> {
        v.iter().map(|s| (*s).to_owned()).collect()
    }

    fn listed(ns: &str, pod: &str, c: &str, ids: &[&str]) -> Listed {
        Listed {
            namespace: ns.into(),
            pod: pod.into(),
            container: c.into(),
            ids: set(ids),
        }
    }

    fn assignment(cs: &[(&str, u32)]) -> Assignment {
        Assignment {
            version: ASSIGNMENT_VERSION,
            node: "n".into(),
            containers: cs
                .iter()
                .map(|(name, slices)| ContainerAssignment {
                    name: (*name).into(),
                    gpus: vec![GpuGrant {
                        uuid: "GPU-a".into(),
                        memory_mib: 100 * u64::from(*slices),
                        compute_milli: 100 * slices,
                        slices: *slices,
                    }],
                })
                .collect(),
        }
    }

    fn init(name: &str, sidecar: bool, state: InitState) -> InitContainer {
        InitContainer {
            name: name.into(),
            sidecar,
            state,
        }
    }

    fn name_of(d: &Decision<'_>) -> String {
        match d {
            Decision::Container { grant, init } => {
                format!("{}{}", grant.name, if *init { "(init)" } else { "" })
            }
            other => format!("{other:?}"),
        }
    }

    #[test]
    fn the_pod_is_found_by_an_exact_match_else_by_one_overlapping_pod() {
        let l = [
            listed("ns", "a", "main", &["x-0", "x-1"]),
            listed("ns", "b", "main", &["x-2"]),
            listed("ns", "b", "side", &["x-3"]),
        ];
        let f = find_pod(&set(&["x-0", "x-1"]), &l).unwrap();
        assert_eq!((f.pod.as_str(), f.exact.as_deref()), ("a", Some("main")));
        // An init container (not listed) whose devices pod a's app reuses in part.
        let f = find_pod(&set(&["x-0", "x-5"]), &l).unwrap();
        assert_eq!((f.pod.as_str(), f.exact), ("a", None));
        let e = find_pod(&set(&["x-9"]), &l).unwrap_err();
        assert!(matches!(e, HandshakeError::NoContainer { .. }), "{e}");
        // Overlapping two pods: never guessed.
        let e = find_pod(&set(&["x-1", "x-2"]), &l).unwrap_err();
        assert!(e.to_string().contains("ns/a, ns/b"), "{e}");
        let dup = [
            listed("ns", "a", "m", &["x-0"]),
            listed("ns", "c", "m", &["x-0"]),
        ];
        let e = find_pod(&set(&["x-0"]), &dup).unwrap_err();
        assert!(e.to_string().contains("ns/a:m, ns/c:m"), "{e}");
    }

    #[test]
    fn an_app_container_is_its_exact_match_when_no_init_container_of_its_size_is_pending() {
        let a = assignment(&[("setup", 2), ("main", 3)]);
        let ids = set(&["x-0", "x-1", "x-2"]);
        let inits = [init("setup", false, InitState::Done)];
        let d = decide(&a, &inits, Some("main"), &ids, &BTreeMap::new());
        assert_eq!(name_of(&d), "main");
        // A listed container without a grant is named, not guessed.
        let d = decide(&a, &[], Some("other"), &ids, &BTreeMap::new());
        assert_eq!(
            d,
            Decision::NoGrant {
                container: "other".into()
            }
        );
        assert_eq!(
            decide(&a, &[], None, &ids, &BTreeMap::new()),
            Decision::NoContainer
        );
    }

    #[test]
    fn an_init_container_that_never_started_is_the_call_for_its_size() {
        let a = assignment(&[("setup", 2), ("main", 2)]);
        let ids = set(&["x-0", "x-1"]);
        let inits = [init("setup", false, InitState::Unknown)];
        // Its devices are reused by "main", which kubelet lists with exactly these.
        let d = decide(&a, &inits, Some("main"), &ids, &BTreeMap::new());
        assert_eq!(name_of(&d), "setup(init)");
    }

    #[test]
    fn devices_an_init_container_ran_on_wait_for_its_status_then_go_to_the_next_container() {
        let a = assignment(&[("setup", 2), ("main", 2)]);
        let ids = set(&["x-0", "x-1"]);
        let prior: BTreeMap<String, BTreeSet<String>> = [("setup".to_owned(), ids.clone())].into();
        let with = |state| {
            decide(
                &a,
                &[init("setup", false, state)],
                Some("main"),
                &ids,
                &prior,
            )
        };
        assert_eq!(
            with(InitState::Unknown),
            Decision::Wait {
                init: "setup".into()
            }
        );
        assert_eq!(
            name_of(&with(InitState::Failed)),
            "setup(init)",
            "kubelet re-runs it"
        );
        assert_eq!(name_of(&with(InitState::Done)), "main");
        // On other devices: not this call's, whatever its status.
        let other: BTreeMap<String, BTreeSet<String>> =
            [("setup".to_owned(), set(&["x-7", "x-8"]))].into();
        let d = decide(
            &a,
            &[init("setup", false, InitState::Unknown)],
            Some("main"),
            &ids,
            &other,
        );
        assert_eq!(name_of(&d), "main");
    }

    #[test]
    fn a_sidecar_keeps_its_devices_and_an_init_of_another_size_is_skipped() {
        let a = assignment(&[("proxy", 1), ("setup", 3), ("main", 1)]);
        let ids = set(&["x-0"]);
        let prior: BTreeMap<String, BTreeSet<String>> = [("proxy".to_owned(), ids.clone())].into();
        let inits = [
            init("proxy", true, InitState::Done),
            init("setup", false, InitState::Unknown),
        ];
        // The sidecar restarting on its own devices, even though its status says done.
        let d = decide(&a, &inits, None, &ids, &prior);
        assert_eq!(name_of(&d), "proxy(init)");
        // A listed sidecar (kubelet 1.29+) is its own exact match.
        let d = decide(&a, &inits, Some("proxy"), &ids, &BTreeMap::new());
        assert_eq!(name_of(&d), "proxy(init)");
        // "setup" (3 slices) is never the call of a 1-slice container.
        let d = decide(&a, &inits[1..], Some("main"), &ids, &BTreeMap::new());
        assert_eq!(name_of(&d), "main");
    }
}
