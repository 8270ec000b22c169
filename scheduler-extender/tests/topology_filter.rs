//! The pod annotation `vgpu.io/gpu-topology` over HTTP: filter keeps only nodes whose
//! best free set meets it, refuses the others with a reason naming the class, a bad
//! value is an error naming it, and bind grants the best-connected set.

use super::common;

use common::Served;
use serde_json::{Value, json};
use vgpu_core::inventory::ANNOTATION_GPU_INVENTORY;
use vgpu_scheduler_extender::extender::{Extender, StateConfig};

/// An 8-GPU node: `nvlink` = two NVLink quads (0–3, 4–7); otherwise a PCIe server
/// with two GPUs per switch and four per socket.
fn node(name: &str, nvlink: bool) -> Value {
    let mut node = common::gpu_node(name, 8, "A100", 81_920);
    let text = node["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY]
        .as_str()
        .expect("inventory")
        .to_string();
    let mut inv: Value = serde_json::from_str(&text).expect("json");
    for (i, g) in inv["gpus"]
        .as_array_mut()
        .expect("gpus")
        .iter_mut()
        .enumerate()
    {
        let i = i as u64;
        let quad = i / 4 * 4;
        g["topology"] = if nvlink {
            let peers: Vec<Value> = (quad..quad + 4)
                .filter(|&j| j != i)
                .map(|j| json!({"index": j, "links": 2}))
                .collect();
            json!({"numa_node": i / 4, "switch_peers": [i ^ 1], "nvlink_peers": peers})
        } else {
            json!({"numa_node": i / 4, "switch_peers": [i ^ 1]})
        };
    }
    node["metadata"]["annotations"][ANNOTATION_GPU_INVENTORY] = json!(inv.to_string());
    node
}

fn pod(name: &str, requests: Value, topology: Option<&str>) -> Value {
    let mut pod = common::gpu_pod(name, &format!("uid-{name}"), requests);
    if let Some(t) = topology {
        pod["metadata"]["annotations"] = json!({"vgpu.io/gpu-topology": t});
    }
    pod
}

async fn served() -> Served {
    let state = common::synced_state(
        StateConfig::default(),
        vgpu_core::packing::PolicyName::Vgpu,
        vec![node("pcie", false), node("nvl", true)],
    );
    Served::start(Extender::new(state, common::recording_binder())).await
}

async fn filter(served: &Served, pod: &Value) -> Value {
    let (status, ans) = served
        .post_json(
            "/scheduler/filter",
            &json!({"Pod": pod, "NodeNames": ["pcie", "nvl"]}),
        )
        .await;
    assert_eq!(status, 200, "{ans}");
    ans
}

#[tokio::test]
async fn a_required_class_filters_nodes_and_names_itself() {
    let served = served().await;
    // Four whole GPUs over NVLink: only the NVLink node; the PCIe node is refused
    // for good (it never has such a set), naming the class.
    let p = pod("a", json!({"vgpu.io/gpu": "40"}), Some("nvlink"));
    let ans = filter(&served, &p).await;
    assert_eq!(ans["NodeNames"], json!(["nvl"]), "{ans}");
    let why = ans["FailedAndUnresolvableNodes"]["pcie"]
        .as_str()
        .expect("a reason");
    assert!(
        why.contains("requires nvlink") && why.contains("numa"),
        "{why}"
    );
    // A share spread over two GPUs on one switch: both nodes can.
    let p = pod(
        "b",
        json!({"vgpu.io/gpu": "6", "vgpu.io/gpu-count": "2"}),
        Some("switch"),
    );
    let ans = filter(&served, &p).await;
    assert_eq!(ans["NodeNames"], json!(["pcie", "nvl"]), "{ans}");
    // No requirement, or `any`: both.
    for t in [None, Some("any")] {
        let p = pod("c", json!({"vgpu.io/gpu": "40"}), t);
        assert_eq!(
            filter(&served, &p).await["NodeNames"],
            json!(["pcie", "nvl"])
        );
    }
    // A single-GPU pod is not concerned by the requirement.
    let p = pod("d", json!({"vgpu.io/gpu": "5"}), Some("nvlink"));
    assert_eq!(
        filter(&served, &p).await["NodeNames"],
        json!(["pcie", "nvl"])
    );
}

#[tokio::test]
async fn a_bad_value_is_an_error_naming_it() {
    let served = served().await;
    let p = pod("e", json!({"vgpu.io/gpu": "20"}), Some("nvswitch"));
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &json!({"Pod": p, "NodeNames": ["pcie", "nvl"]}),
        )
        .await;
    let err = ans["Error"].as_str().expect("an error");
    assert!(
        err.contains("\"nvswitch\"") && err.contains("vgpu.io/gpu-topology"),
        "{err}"
    );
}

#[tokio::test]
async fn bind_grants_the_best_connected_sets() {
    let served = served().await;
    let bind = |name: &str| json!({"PodName": name, "PodNamespace": "default", "PodUID": format!("uid-{name}"), "Node": "pcie"});
    let grants = |served: &Served, name: &str| -> Vec<u16> {
        let (ledger, _) = served.extender.state().snapshot();
        let mut g: Vec<u16> = ledger
            .placement(&format!("uid-{name}"))
            .expect("placed")
            .containers
            .iter()
            .flatten()
            .map(|g| g.gpu)
            .collect();
        g.sort_unstable();
        g
    };
    // One whole GPU first: it takes GPU 0; the next takes its switch peer, GPU 1
    // (a widow), not GPU 2, which would break a second pair.
    for (name, want) in [("w0", vec![0]), ("w1", vec![1])] {
        let p = pod(name, json!({"vgpu.io/gpu": "10"}), None);
        filter(&served, &p).await;
        let (_, ans) = served.post_json("/scheduler/bind", &bind(name)).await;
        assert_eq!(ans, json!({"Error": ""}));
        assert_eq!(grants(&served, name), want);
    }
    // Two GPUs on one switch: a whole pair (2, 3), not 2 and 4.
    let p = pod("pair", json!({"vgpu.io/gpu": "20"}), Some("switch"));
    filter(&served, &p).await;
    let (_, ans) = served.post_json("/scheduler/bind", &bind("pair")).await;
    assert_eq!(ans, json!({"Error": ""}));
    assert_eq!(grants(&served, "pair"), vec![2, 3]);
    // Four on one NUMA node: socket 1 (4–7) is whole.
    let p = pod("four", json!({"vgpu.io/gpu": "40"}), Some("numa"));
    assert_eq!(
        filter(&served, &p).await["NodeNames"],
        json!(["pcie", "nvl"])
    );
    let (_, ans) = served.post_json("/scheduler/bind", &bind("four")).await;
    assert_eq!(ans, json!({"Error": ""}));
    assert_eq!(grants(&served, "four"), vec![4, 5, 6, 7]);
    // The PCIe node is full; take the NVLink node's quad 0–3 apart with shares, then a
    // pair over NVLink is still there (4–7), but not on the PCIe node.
    let p = pod("again", json!({"vgpu.io/gpu": "20"}), Some("switch"));
    let ans = filter(&served, &p).await;
    assert_eq!(ans["NodeNames"], json!(["nvl"]), "{ans}");
    assert!(
        ans["FailedNodes"]["pcie"]
            .as_str()
            .is_some_and(|r| r.contains("whole GPUs")),
        "{ans}"
    );
}
