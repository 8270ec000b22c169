//! A `VgpuQuotaPolicy` read and checked (no I/O): the spec validated into [`Rules`]
//! (a bad field is a [`PolicyError`] naming it), defaults applied to a pod's request,
//! and the pure checks of a pod against a namespace's rules and use
//! ([`Violation`] names the policy, the limit and the figures).

use std::collections::BTreeMap;
use std::fmt;

use vgpu_core::pod_request::PodGpuRequest;
use vgpu_core::resources::{
    MemoryDemand, RESOURCE_GPU_COMPUTE, RESOURCE_GPU_MEMORY, parse_quantity,
};
use vgpu_core::sched_proto::{ComputePolicy, Priority};

use super::crd::VgpuQuotaPolicySpec;

const MIB: u64 = 1 << 20;

/// A policy field that is negative, unparseable or contradicts another.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("policy {policy}: {field} = {value}: {reason}")]
pub struct PolicyError {
    /// `namespace/name` of the policy.
    pub policy: String,
    /// The field's path in the object, e.g. `spec.limits.memory`.
    pub field: String,
    /// The value as written.
    pub value: String,
    /// What is wrong with it.
    pub reason: String,
}

/// A valid policy in the extender's units (MiB, milli-GPU).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    /// `namespace/name` of the policy.
    pub policy: String,
    /// Default memory per GPU for a container without `vgpu.io/gpu-memory`, MiB.
    pub default_memory_mib: Option<u64>,
    /// Default compute per GPU for a container without `vgpu.io/gpu-compute`, milli-GPU.
    pub default_compute_milli: Option<u32>,
    /// Most memory per GPU per container, MiB.
    pub limit_memory_mib: Option<u64>,
    /// Most compute per GPU per container, milli-GPU.
    pub limit_compute_milli: Option<u32>,
    /// Allowed compute policies (`None`: any).
    pub compute_policies: Option<Vec<ComputePolicy>>,
    /// Allowed priority classes (`None`: any).
    pub priority_classes: Option<Vec<Priority>>,
    /// Namespace total of memory, MiB.
    pub total_memory_mib: Option<u64>,
    /// Namespace total of compute, milli-GPU.
    pub total_compute_milli: Option<u64>,
    /// Namespace total of distinct GPUs.
    pub total_gpus: Option<u64>,
}

/// What a namespace holds, or what a pod asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Usage {
    /// GPU memory, MiB.
    pub memory_mib: u64,
    /// Compute over all GPUs, milli-GPU.
    pub compute_milli: u64,
    /// Distinct GPUs (for a pod: GPUs the namespace does not hold yet).
    pub gpus: u64,
    /// Pods.
    pub pods: u64,
}

/// Why a pod may not be placed under a policy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// `namespace/name` of the policy.
    pub policy: String,
    /// What is exceeded or not allowed, with the figures.
    pub what: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "quota policy {}: {}", self.policy, self.what)
    }
}

fn memory_field(policy: &str, field: &str, text: &str) -> Result<u64, PolicyError> {
    let err = |reason: String| PolicyError {
        policy: policy.to_owned(),
        field: field.to_owned(),
        value: format!("{text:?}"),
        reason,
    };
    let bytes = parse_quantity(field, text).map_err(|e| err(e.to_string()))?;
    if bytes > 0 && bytes < MIB {
        return Err(err(format!(
            "{bytes} bytes is less than 1 MiB: write a unit (8Gi, 8192Mi)"
        )));
    }
    if !bytes.is_multiple_of(MIB) {
        return Err(err("not a whole number of MiB".into()));
    }
    Ok(bytes / MIB)
}

fn number_field(
    policy: &str,
    field: &str,
    v: i64,
    range: std::ops::RangeInclusive<i64>,
) -> Result<u64, PolicyError> {
    if !range.contains(&v) {
        let reason = if v < 0 {
            "negative".to_owned()
        } else {
            format!("must be {} to {}", range.start(), range.end())
        };
        return Err(PolicyError {
            policy: policy.to_owned(),
            field: field.to_owned(),
            value: v.to_string(),
            reason,
        });
    }
    Ok(u64::try_from(v).expect("checked non-negative"))
}

fn list_field<T: std::str::FromStr<Err = String>>(
    policy: &str,
    field: &str,
    list: &[String],
) -> Result<Vec<T>, PolicyError> {
    if list.is_empty() {
        return Err(PolicyError {
            policy: policy.to_owned(),
            field: field.to_owned(),
            value: "[]".into(),
            reason: "empty: no pod could run; omit the field to allow any".into(),
        });
    }
    list.iter()
        .enumerate()
        .map(|(i, s)| {
            s.trim().parse().map_err(|reason| PolicyError {
                policy: policy.to_owned(),
                field: format!("{field}[{i}]"),
                value: format!("{s:?}"),
                reason,
            })
        })
        .collect()
}

impl Rules {
    /// Validates a spec: every value parses, none is negative, and none contradicts
    /// another (a per-container limit above the namespace total, a default above a limit
    /// or a total).
    pub fn from_spec(policy: &str, spec: &VgpuQuotaPolicySpec) -> Result<Rules, PolicyError> {
        let mut r = Rules {
            policy: policy.to_owned(),
            ..Rules::default()
        };
        let per_gpu = 1..=100;
        if let Some(d) = &spec.defaults {
            if let Some(m) = &d.memory {
                let v = memory_field(policy, "spec.defaults.memory", m)?;
                if v == 0 {
                    return Err(contradiction(
                        policy,
                        "spec.defaults.memory",
                        m,
                        "must be at least 1Mi",
                    ));
                }
                r.default_memory_mib = Some(v);
            }
            if let Some(c) = d.compute_percent {
                let v = number_field(policy, "spec.defaults.computePercent", c, per_gpu.clone())?;
                r.default_compute_milli = Some(u32::try_from(v * 10).expect("at most 1000"));
            }
        }
        if let Some(l) = &spec.limits {
            if let Some(m) = &l.memory {
                let v = memory_field(policy, "spec.limits.memory", m)?;
                if v == 0 {
                    return Err(contradiction(
                        policy,
                        "spec.limits.memory",
                        m,
                        "must be at least 1Mi",
                    ));
                }
                r.limit_memory_mib = Some(v);
            }
            if let Some(c) = l.compute_percent {
                let v = number_field(policy, "spec.limits.computePercent", c, per_gpu.clone())?;
                r.limit_compute_milli = Some(u32::try_from(v * 10).expect("at most 1000"));
            }
            if let Some(list) = &l.compute_policies {
                r.compute_policies = Some(list_field(policy, "spec.limits.computePolicies", list)?);
            }
            if let Some(list) = &l.priority_classes {
                r.priority_classes = Some(list_field(policy, "spec.limits.priorityClasses", list)?);
            }
        }
        if let Some(t) = &spec.totals {
            if let Some(m) = &t.memory {
                r.total_memory_mib = Some(memory_field(policy, "spec.totals.memory", m)?);
            }
            if let Some(c) = t.compute_percent {
                let v = number_field(policy, "spec.totals.computePercent", c, 0..=i64::MAX / 10)?;
                r.total_compute_milli = Some(v * 10);
            }
            if let Some(g) = t.gpus {
                r.total_gpus = Some(number_field(policy, "spec.totals.gpus", g, 0..=i64::MAX)?);
            }
        }
        r.check_consistent(spec)?;
        Ok(r)
    }

    fn check_consistent(&self, spec: &VgpuQuotaPolicySpec) -> Result<(), PolicyError> {
        let text = |v: Option<&String>| v.cloned().unwrap_or_default();
        let d = spec.defaults.clone().unwrap_or_default();
        let l = spec.limits.clone().unwrap_or_default();
        let over = |field: &str, value: String, other: &str, a: u64, b: u64, unit: &str| {
            (a > b).then(|| {
                contradiction(
                    &self.policy,
                    field,
                    &value,
                    &format!("{a} {unit} is above {other} ({b} {unit})"),
                )
            })
        };
        let checks = [
            self.limit_memory_mib
                .zip(self.total_memory_mib)
                .and_then(|(a, b)| {
                    over(
                        "spec.limits.memory",
                        text(l.memory.as_ref()),
                        "spec.totals.memory",
                        a,
                        b,
                        "MiB",
                    )
                }),
            self.limit_compute_milli
                .zip(self.total_compute_milli)
                .and_then(|(a, b)| {
                    over(
                        "spec.limits.computePercent",
                        format!("{}", a / 10),
                        "spec.totals.computePercent",
                        u64::from(a) / 10,
                        b / 10,
                        "%",
                    )
                }),
            self.default_memory_mib
                .zip(self.limit_memory_mib)
                .and_then(|(a, b)| {
                    over(
                        "spec.defaults.memory",
                        text(d.memory.as_ref()),
                        "spec.limits.memory",
                        a,
                        b,
                        "MiB",
                    )
                }),
            self.default_memory_mib
                .zip(self.total_memory_mib)
                .and_then(|(a, b)| {
                    over(
                        "spec.defaults.memory",
                        text(d.memory.as_ref()),
                        "spec.totals.memory",
                        a,
                        b,
                        "MiB",
                    )
                }),
            self.default_compute_milli
                .zip(self.limit_compute_milli)
                .and_then(|(a, b)| {
                    over(
                        "spec.defaults.computePercent",
                        format!("{}", a / 10),
                        "spec.limits.computePercent",
                        u64::from(a) / 10,
                        u64::from(b) / 10,
                        "%",
                    )
                }),
            self.default_compute_milli
                .zip(self.total_compute_milli)
                .and_then(|(a, b)| {
                    over(
                        "spec.defaults.computePercent",
                        format!("{}", a / 10),
                        "spec.totals.computePercent",
                        u64::from(a) / 10,
                        b / 10,
                        "%",
                    )
                }),
        ];
        match checks.into_iter().flatten().next() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Whether the pod's compute policy and priority class are allowed.
    pub fn check_class(&self, policy: ComputePolicy, priority: Priority) -> Result<(), Violation> {
        let names = |v: &[String]| v.join(", ");
        if let Some(allowed) = &self.compute_policies
            && !allowed.contains(&policy)
        {
            return Err(self.violation(format!(
                "vgpu.io/compute-policy {policy} is not allowed (spec.limits.computePolicies: {})",
                names(&allowed.iter().map(ToString::to_string).collect::<Vec<_>>())
            )));
        }
        if let Some(allowed) = &self.priority_classes
            && !allowed.contains(&priority)
        {
            return Err(self.violation(format!(
                "vgpu.io/priority {priority} is not allowed (spec.limits.priorityClasses: {})",
                names(&allowed.iter().map(ToString::to_string).collect::<Vec<_>>())
            )));
        }
        Ok(())
    }

    /// Whether one container's share of each of its GPUs is within the limits.
    pub fn check_container(
        &self,
        container: &str,
        compute_milli: u32,
        memory_mib: u64,
    ) -> Result<(), Violation> {
        if let Some(limit) = self.limit_memory_mib
            && memory_mib > limit
        {
            return Err(self.violation(format!(
                "container {container:?} asks {memory_mib} MiB of GPU memory per GPU, above spec.limits.memory ({limit} MiB)"
            )));
        }
        if let Some(limit) = self.limit_compute_milli
            && compute_milli > limit
        {
            return Err(self.violation(format!(
                "container {container:?} asks {} of compute per GPU, above spec.limits.computePercent ({})",
                percent(u64::from(compute_milli)),
                percent(u64::from(limit))
            )));
        }
        Ok(())
    }

    /// Whether the namespace's use plus what the pod asks stays within the totals.
    pub fn check_totals(&self, used: &Usage, asked: &Usage) -> Result<(), Violation> {
        if let Some(total) = self.total_memory_mib
            && used.memory_mib + asked.memory_mib > total
        {
            return Err(self.violation(format!(
                "namespace GPU memory {} MiB in use + {} MiB asked > spec.totals.memory {total} MiB",
                used.memory_mib, asked.memory_mib
            )));
        }
        if let Some(total) = self.total_compute_milli
            && used.compute_milli + asked.compute_milli > total
        {
            return Err(self.violation(format!(
                "namespace compute {} in use + {} asked > spec.totals.computePercent {}",
                percent(used.compute_milli),
                percent(asked.compute_milli),
                percent(total)
            )));
        }
        if let Some(total) = self.total_gpus
            && used.gpus + asked.gpus > total
        {
            return Err(self.violation(format!(
                "namespace GPUs {} in use + {} more asked > spec.totals.gpus {total}",
                used.gpus, asked.gpus
            )));
        }
        Ok(())
    }

    fn violation(&self, what: String) -> Violation {
        Violation {
            policy: self.policy.clone(),
            what,
        }
    }
}

fn contradiction(policy: &str, field: &str, value: &str, reason: &str) -> PolicyError {
    PolicyError {
        policy: policy.to_owned(),
        field: field.to_owned(),
        value: format!("{value:?}"),
        reason: reason.to_owned(),
    }
}

/// Milli-GPU as a percent of one GPU (`1250` → `125%`, `5` → `0.5%`).
#[must_use]
pub fn percent(milli: u64) -> String {
    if milli.is_multiple_of(10) {
        format!("{}%", milli / 10)
    } else {
        format!("{}.{}%", milli / 10, milli % 10)
    }
}

/// Applies a namespace's defaults to a pod's request: a fractional container whose
/// `requests` (or `limits`) give no `vgpu.io/gpu-memory` gets the default memory per
/// GPU, one without `vgpu.io/gpu-compute` the default compute. Whole-GPU containers keep
/// their GPUs whole. `given` lists, per container name, the resource names it sets.
pub fn apply_defaults(
    rules: &Rules,
    given: &BTreeMap<String, Vec<String>>,
    request: &mut PodGpuRequest,
) {
    for c in &mut request.containers {
        if c.demand.is_whole() {
            continue;
        }
        let set = |name: &str| {
            given
                .get(&c.name)
                .is_some_and(|v| v.iter().any(|n| n == name))
        };
        if let Some(mib) = rules.default_memory_mib
            && !set(RESOURCE_GPU_MEMORY)
        {
            c.demand.memory = MemoryDemand::Mib(mib);
        }
        if let Some(milli) = rules.default_compute_milli
            && !set(RESOURCE_GPU_COMPUTE)
        {
            c.demand.compute_milli = milli;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::crd::{ContainerLimits, NamespaceTotals, QuotaDefaults};
    use super::*;

    fn spec(d: QuotaDefaults, l: ContainerLimits, t: NamespaceTotals) -> VgpuQuotaPolicySpec {
        VgpuQuotaPolicySpec {
            defaults: Some(d),
            limits: Some(l),
            totals: Some(t),
        }
    }

    #[test]
    fn a_valid_policy_reads_in_mib_and_milli() {
        let r = Rules::from_spec(
            "team/q",
            &spec(
                QuotaDefaults {
                    memory: Some("4Gi".into()),
                    compute_percent: Some(20),
                },
                ContainerLimits {
                    memory: Some("16Gi".into()),
                    compute_percent: Some(50),
                    compute_policies: Some(vec!["cap".into()]),
                    priority_classes: Some(vec!["best-effort".into()]),
                },
                NamespaceTotals {
                    memory: Some("64Gi".into()),
                    compute_percent: Some(250),
                    gpus: Some(4),
                },
            ),
        )
        .expect("valid");
        assert_eq!(r.default_memory_mib, Some(4096));
        assert_eq!(r.default_compute_milli, Some(200));
        assert_eq!(r.limit_memory_mib, Some(16384));
        assert_eq!(r.limit_compute_milli, Some(500));
        assert_eq!(r.total_memory_mib, Some(65536));
        assert_eq!(r.total_compute_milli, Some(2500));
        assert_eq!(r.total_gpus, Some(4));
        assert_eq!(r.compute_policies, Some(vec![ComputePolicy::Cap]));
        assert_eq!(r.priority_classes, Some(vec![Priority::BestEffort]));
    }

    #[test]
    fn bad_policies_name_the_field_and_the_value() {
        let cases: Vec<(VgpuQuotaPolicySpec, &str, &str)> = vec![
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits::default(),
                    NamespaceTotals {
                        memory: Some("-1Gi".into()),
                        ..Default::default()
                    },
                ),
                "spec.totals.memory",
                "negative",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits::default(),
                    NamespaceTotals {
                        memory: Some("16GB".into()),
                        ..Default::default()
                    },
                ),
                "spec.totals.memory",
                "\"16GB\"",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits::default(),
                    NamespaceTotals {
                        memory: Some("8192".into()),
                        ..Default::default()
                    },
                ),
                "spec.totals.memory",
                "less than 1 MiB",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits::default(),
                    NamespaceTotals {
                        gpus: Some(-2),
                        ..Default::default()
                    },
                ),
                "spec.totals.gpus",
                "negative",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits {
                        compute_percent: Some(150),
                        ..Default::default()
                    },
                    NamespaceTotals::default(),
                ),
                "spec.limits.computePercent",
                "1 to 100",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits {
                        priority_classes: Some(vec!["best-effort".into(), "urgent".into()]),
                        ..Default::default()
                    },
                    NamespaceTotals::default(),
                ),
                "spec.limits.priorityClasses[1]",
                "\"urgent\"",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits {
                        compute_policies: Some(vec![]),
                        ..Default::default()
                    },
                    NamespaceTotals::default(),
                ),
                "spec.limits.computePolicies",
                "empty",
            ),
            (
                spec(
                    QuotaDefaults::default(),
                    ContainerLimits {
                        memory: Some("32Gi".into()),
                        ..Default::default()
                    },
                    NamespaceTotals {
                        memory: Some("16Gi".into()),
                        ..Default::default()
                    },
                ),
                "spec.limits.memory",
                "32768 MiB is above spec.totals.memory (16384 MiB)",
            ),
            (
                spec(
                    QuotaDefaults {
                        compute_percent: Some(60),
                        ..Default::default()
                    },
                    ContainerLimits {
                        compute_percent: Some(50),
                        ..Default::default()
                    },
                    NamespaceTotals::default(),
                ),
                "spec.defaults.computePercent",
                "60 % is above spec.limits.computePercent (50 %)",
            ),
            (
                spec(
                    QuotaDefaults {
                        memory: Some("20Gi".into()),
                        ..Default::default()
                    },
                    ContainerLimits {
                        memory: Some("16Gi".into()),
                        ..Default::default()
                    },
                    NamespaceTotals::default(),
                ),
                "spec.defaults.memory",
                "above spec.limits.memory",
            ),
        ];
        for (s, field, needle) in cases {
            let e = Rules::from_spec("team/q", &s).expect_err(field);
            assert_eq!(e.field, field, "{e}");
            let text = e.to_string();
            assert!(
                text.contains("policy team/q") && text.contains(field) && text.contains(needle),
                "{text}"
            );
        }
    }

    #[test]
    fn checks_name_the_policy_the_limit_and_the_figures() {
        let r = Rules {
            policy: "team/q".into(),
            limit_memory_mib: Some(8192),
            total_memory_mib: Some(20480),
            total_compute_milli: Some(1000),
            total_gpus: Some(2),
            priority_classes: Some(vec![Priority::BestEffort]),
            ..Rules::default()
        };
        let e = r
            .check_container("main", 300, 10240)
            .expect_err("memory")
            .to_string();
        assert_eq!(
            e,
            "quota policy team/q: container \"main\" asks 10240 MiB of GPU memory per GPU, above spec.limits.memory (8192 MiB)"
        );
        let used = Usage {
            memory_mib: 16384,
            compute_milli: 800,
            gpus: 2,
            pods: 3,
        };
        let e = r
            .check_totals(
                &used,
                &Usage {
                    memory_mib: 8192,
                    ..Usage::default()
                },
            )
            .expect_err("total")
            .to_string();
        assert_eq!(
            e,
            "quota policy team/q: namespace GPU memory 16384 MiB in use + 8192 MiB asked > spec.totals.memory 20480 MiB"
        );
        let e = r
            .check_totals(
                &used,
                &Usage {
                    compute_milli: 205,
                    ..Usage::default()
                },
            )
            .expect_err("compute")
            .to_string();
        assert!(
            e.contains("80% in use + 20.5% asked > spec.totals.computePercent 100%"),
            "{e}"
        );
        let e = r
            .check_totals(
                &used,
                &Usage {
                    gpus: 1,
                    ..Usage::default()
                },
            )
            .expect_err("gpus")
            .to_string();
        assert!(
            e.contains("GPUs 2 in use + 1 more asked > spec.totals.gpus 2"),
            "{e}"
        );
        assert!(
            r.check_totals(
                &used,
                &Usage {
                    memory_mib: 4096,
                    compute_milli: 200,
                    ..Usage::default()
                }
            )
            .is_ok()
        );
        let e = r
            .check_class(ComputePolicy::Burst, Priority::LatencySensitive)
            .expect_err("class")
            .to_string();
        assert!(e.contains("vgpu.io/priority latency-sensitive is not allowed (spec.limits.priorityClasses: best-effort)"), "{e}");
    }

    #[test]
    fn defaults_apply_only_to_what_a_fractional_container_leaves_out() {
        use vgpu_core::resources::{ContainerDemand, ContainerKind, GpuDemand};
        let r = Rules {
            default_memory_mib: Some(2048),
            default_compute_milli: Some(150),
            ..Rules::default()
        };
        let share = |slices: u32| GpuDemand {
            count: 1,
            compute_milli: slices * 100,
            memory: MemoryDemand::FractionMilli(slices * 100),
            slices,
        };
        let mut req = PodGpuRequest {
            containers: vec![
                ContainerDemand {
                    name: "a".into(),
                    demand: share(3),
                    kind: ContainerKind::App,
                },
                ContainerDemand {
                    name: "b".into(),
                    demand: share(3),
                    kind: ContainerKind::App,
                },
                ContainerDemand {
                    name: "w".into(),
                    demand: GpuDemand::whole(1),
                    kind: ContainerKind::App,
                },
            ],
            ..PodGpuRequest::default()
        };
        let given = BTreeMap::from([("b".to_owned(), vec![RESOURCE_GPU_MEMORY.to_owned()])]);
        apply_defaults(&r, &given, &mut req);
        assert_eq!(req.containers[0].demand.memory, MemoryDemand::Mib(2048));
        assert_eq!(req.containers[0].demand.compute_milli, 150);
        assert_eq!(
            req.containers[1].demand.memory,
            MemoryDemand::FractionMilli(300),
            "set by the pod"
        );
        assert_eq!(req.containers[1].demand.compute_milli, 150);
        assert_eq!(req.containers[2].demand, GpuDemand::whole(1));
    }
}
