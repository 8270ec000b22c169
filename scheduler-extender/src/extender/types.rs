//! kube-scheduler extender v1 wire types (`k8s.io/kube-scheduler/extender/v1`).
//!
//! The Go structs carry no JSON tags, so every key is the Go field name in
//! PascalCase (`Pod`, `NodeNames`, `FailedNodes`, ...). The embedded `Pod` and
//! `Node` objects are ordinary camelCase Kubernetes JSON, parsed with
//! `k8s-openapi`. Optional Go pointers are `Option`s that serialise as `null`
//! (kube-scheduler sends `"NodeNames":null` when the node cache is off and
//! `"Nodes":null` when it is on), and unknown keys are ignored so that a newer
//! kube-scheduler can add fields.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{Node, Pod};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ListMeta;
use serde::{Deserialize, Serialize};

/// The highest score prioritize may give (`extenderv1.MaxExtenderPriority`).
pub const MAX_EXTENDER_PRIORITY: i64 = 10;

/// A `v1.NodeList` as embedded in extender messages: `metadata` and `items`
/// (kube-scheduler sends no `apiVersion`/`kind` here).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct NodeList {
    /// List metadata; kube-scheduler sends `{}`.
    #[serde(default)]
    pub metadata: ListMeta,
    /// The nodes.
    #[serde(default)]
    pub items: Vec<Node>,
}

/// The body of a filter or prioritize request (`ExtenderArgs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgs {
    /// The pod being scheduled.
    #[serde(default)]
    pub pod: Option<Pod>,
    /// Candidate nodes as full objects (when `nodeCacheCapable: false`).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names (when `nodeCacheCapable: true`).
    #[serde(default)]
    pub node_names: Option<Vec<String>>,
}

/// [`ExtenderArgs`] parsed without copying the node names out of the body (the hot
/// path of filter and prioritize at thousands of nodes). Node names are DNS names
/// and never contain JSON escapes; a body where one does fails this parse and is
/// read as [`ExtenderArgs`] instead.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderArgsRef<'a> {
    /// The pod being scheduled.
    #[serde(default)]
    pub pod: Option<Pod>,
    /// Candidate nodes as full objects (when `nodeCacheCapable: false`).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Candidate node names (when `nodeCacheCapable: true`), borrowed from the body.
    #[serde(default, borrow)]
    pub node_names: Option<Vec<&'a str>>,
}

/// A [`NodeList`] written from borrowed nodes.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct NodeListRef<'a> {
    /// List metadata, as received.
    pub metadata: &'a ListMeta,
    /// The nodes.
    pub items: Vec<&'a Node>,
}

/// [`ExtenderFilterResult`] as written, borrowing names and nodes from the request.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterAnswer<'a> {
    /// Feasible nodes as full objects (answer form when the request had `Nodes`).
    pub nodes: Option<NodeListRef<'a>>,
    /// Feasible node names (answer form when the request had `NodeNames`).
    pub node_names: Option<Vec<&'a str>>,
    /// Rejected nodes whose verdict preemption could change, with the reason.
    pub failed_nodes: ReasonsRef<'a>,
    /// Rejected nodes that preemption cannot help, with the reason.
    pub failed_and_unresolvable_nodes: ReasonsRef<'a>,
    /// A failure of the whole request; empty on success.
    pub error: String,
}

/// A `FailedNodesMap` as written: `(candidate index, reason)` pairs over the
/// request's node names, serialised as a JSON object keyed by node name.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ReasonsRef<'a> {
    /// The request's node names, by candidate index.
    pub names: &'a [&'a str],
    /// The rejected candidates and their reasons.
    pub reasons: &'a [(usize, std::sync::Arc<str>)],
}

impl Serialize for ReasonsRef<'_> {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(
            self.reasons
                .iter()
                .map(|(i, reason)| (self.names.get(*i).copied().unwrap_or(""), &**reason)),
        )
    }
}

/// Reasons keyed by node name (`FailedNodesMap`).
pub type FailedNodesMap = BTreeMap<String, String>;

/// The answer to a filter request (`ExtenderFilterResult`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderFilterResult {
    /// Feasible nodes as full objects (answer form when the request had `Nodes`).
    #[serde(default)]
    pub nodes: Option<NodeList>,
    /// Feasible node names (answer form when the request had `NodeNames`).
    #[serde(default)]
    pub node_names: Option<Vec<String>>,
    /// Rejected nodes whose verdict preemption could change, with the reason.
    #[serde(default)]
    pub failed_nodes: FailedNodesMap,
    /// Rejected nodes that preemption cannot help, with the reason.
    #[serde(default)]
    pub failed_and_unresolvable_nodes: FailedNodesMap,
    /// A failure of the whole request; empty on success.
    #[serde(default)]
    pub error: String,
}

/// One node's score (`HostPriority`); prioritize answers a list of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriority {
    /// Node name.
    pub host: String,
    /// Score in `0..=MAX_EXTENDER_PRIORITY`.
    pub score: i64,
}

/// The answer to a prioritize request (`HostPriorityList`).
pub type HostPriorityList = Vec<HostPriority>;

/// [`HostPriority`] as written, borrowing the node name from the request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "PascalCase")]
pub struct HostPriorityRef<'a> {
    /// Node name.
    pub host: &'a str,
    /// Score in `0..=MAX_EXTENDER_PRIORITY`.
    pub score: i64,
}

/// The body of a bind request (`ExtenderBindingArgs`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingArgs {
    /// Pod name.
    pub pod_name: String,
    /// Pod namespace.
    pub pod_namespace: String,
    /// Pod UID.
    #[serde(rename = "PodUID")]
    pub pod_uid: String,
    /// The node kube-scheduler chose.
    pub node: String,
}

/// The answer to a bind request (`ExtenderBindingResult`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderBindingResult {
    /// A failure; empty on success.
    #[serde(default)]
    pub error: String,
}

/// Victims on one node, as full pods (`Victims`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct Victims {
    /// The pods kube-scheduler would evict.
    #[serde(default)]
    pub pods: Vec<Pod>,
    /// How many PodDisruptionBudgets the eviction would violate.
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// A victim named by UID only (`MetaPod`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct MetaPod {
    /// Pod UID.
    #[serde(rename = "UID")]
    pub uid: String,
}

/// Victims on one node, by UID (`MetaVictims`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct MetaVictims {
    /// The pods kube-scheduler would evict.
    #[serde(default)]
    pub pods: Vec<MetaPod>,
    /// How many PodDisruptionBudgets the eviction would violate.
    #[serde(default, rename = "NumPDBViolations")]
    pub num_pdb_violations: i64,
}

/// The body of a preempt request (`ExtenderPreemptionArgs`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionArgs {
    /// The pod that wants to preempt.
    #[serde(default)]
    pub pod: Option<Pod>,
    /// Victims per node as full pods (when `nodeCacheCapable: false`).
    #[serde(default)]
    pub node_name_to_victims: Option<BTreeMap<String, Victims>>,
    /// Victims per node by UID (when `nodeCacheCapable: true`).
    #[serde(default)]
    pub node_name_to_meta_victims: Option<BTreeMap<String, MetaVictims>>,
}

/// The answer to a preempt request (`ExtenderPreemptionResult`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "PascalCase")]
pub struct ExtenderPreemptionResult {
    /// The nodes (and victims on them) the extender agrees with.
    #[serde(default)]
    pub node_name_to_meta_victims: BTreeMap<String, MetaVictims>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filter_result_uses_pascal_case_keys() {
        let result = ExtenderFilterResult {
            node_names: Some(vec!["a".into()]),
            failed_nodes: [("b".to_string(), "why".to_string())].into(),
            ..Default::default()
        };
        let json = serde_json::to_value(&result).expect("serialises");
        assert_eq!(json["NodeNames"][0], "a");
        assert_eq!(json["FailedNodes"]["b"], "why");
        assert!(json["Nodes"].is_null());
        assert_eq!(json["Error"], "");
    }

    #[test]
    fn binding_args_use_go_names() {
        let args: ExtenderBindingArgs =
            serde_json::from_str(r#"{"PodName":"p","PodNamespace":"ns","PodUID":"u","Node":"n"}"#)
                .expect("parses");
        assert_eq!(args.pod_uid, "u");
        assert_eq!(args.node, "n");
    }

    #[test]
    fn host_priority_round_trips() {
        let list: HostPriorityList = vec![HostPriority {
            host: "n".into(),
            score: 7,
        }];
        let json = serde_json::to_string(&list).expect("serialises");
        assert_eq!(json, r#"[{"Host":"n","Score":7}]"#);
        let borrowed = [HostPriorityRef {
            host: "n",
            score: 7,
        }];
        assert_eq!(serde_json::to_string(&borrowed).expect("serialises"), json);
    }
}
