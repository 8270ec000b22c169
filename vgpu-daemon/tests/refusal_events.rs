//! Gate refusals become one pod event per process across a restart of the device plugin
//! (issue 39, ADR 0055): the daemon in this process (its API served on a unix socket, the
//! gate's refusals published into its event hub as the ring-buffer reader does), the
//! device plugin following it on the fake API server, then a second follower with nothing
//! remembered (the plugin restarted) replaying what the daemon kept. Before, a refusal was
//! posted with a generated name, so the restarted plugin posted it again; now it is named
//! from its pod, container and process, and the replay meets it (409).

#![allow(clippy::unwrap_used)] // test code: a failed step is the failure

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use vgpu_daemon::gate_events::{Attribution, GateEvent, GateEventKind, RECENT};
use vgpu_device_plugin::gate_events::{EVENT_REFUSED, GateWatchState, follow};
use vgpu_testkit::node::TestNode;

use super::common;

const POD_UID: &str = "7e57ab1e-0000-4000-8000-0000000e7e39";
const CONTAINER_ID: &str = "7e57ab1e00000000000000000000000000000000000000000000000000000e39";

/// A refusal by the gate of process `pid` of the pod's container.
fn refused(pid: u32) -> GateEvent {
    let who = Attribution {
        cgroup: format!("/kubepods/burstable/pod{POD_UID}/{CONTAINER_ID}"),
        pod_uid: POD_UID.to_owned(),
        container_id: CONTAINER_ID.to_owned(),
        ..Attribution::default()
    };
    let mut e = GateEvent::now(GateEventKind::Refused, pid, "escaper".to_owned(), who);
    e.device = Some((195, 0));
    e
}

fn refusal_events(node: &TestNode) -> Vec<serde_json::Value> {
    node.api
        .events()
        .into_iter()
        .filter(|e| e["reason"] == EVENT_REFUSED)
        .collect()
}

/// Polls `ok` (at most 10 s).
async fn wait_until(what: &str, mut ok: impl FnMut() -> bool) {
    let end = Instant::now() + Duration::from_secs(10);
    while !ok() {
        assert!(Instant::now() < end, "timed out: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_process_is_one_event_across_a_restart_of_the_plugin() {
    let daemon = common::daemon();
    let dir = tempfile::tempdir().unwrap();
    let api = dir.path().join("api.sock");
    let listener = vgpu_daemon::api::bind_unix(&api).unwrap();
    let server = tokio::spawn(vgpu_daemon::api::serve_unix(Arc::clone(&daemon), listener));

    // The plugin, following the daemon's API socket, with the pod in its watch.
    let api_for_plugin = api.clone();
    let node = TestNode::start_with(vgpu_testkit::node::gpus(1, 8192), |c| {
        c.daemon_api_socket = Some(api_for_plugin);
    })
    .await
    .expect("the plugin's node");
    let mut pod =
        vgpu_testkit::node::pod_json("ml", "escaper", POD_UID, 0, &[("main", false, vec![])]);
    pod["status"]["containerStatuses"] = serde_json::json!([{
        "name": "main", "containerID": format!("containerd://{CONTAINER_ID}"),
        "image": "x", "imageID": "x", "ready": true, "restartCount": 0,
    }]);
    node.put_pod(pod).await.unwrap();
    wait_until("the plugin follows the daemon's events", || {
        daemon.events().subscribers() > 0
    })
    .await;

    // A process refused, then refused again and again (it retries its open): more
    // refusals than the daemon keeps, so its first is gone from what a new follower is
    // replayed.
    let hub = daemon.events();
    hub.publish(refused(4242));
    wait_until("the plugin's event", || refusal_events(&node).len() == 1).await;
    for _ in 0..RECENT + 100 {
        hub.publish(refused(4242));
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(refusal_events(&node).len(), 1, "one event per process");
    let first = refusal_events(&node).remove(0);
    assert_eq!(first["involvedObject"]["uid"], POD_UID);
    assert!(
        first["message"]
            .as_str()
            .unwrap()
            .contains("process 4242 (escaper) of container \"main\" was refused"),
        "{first:#?}"
    );

    // The plugin restarts: a follower that remembers nothing is replayed every refusal
    // the daemon kept (all of the same process).
    let state = Arc::new(Mutex::new(GateWatchState::default()));
    let restarted = tokio::spawn(follow(
        node.handshake.clone(),
        api.clone(),
        Arc::clone(&state),
    ));
    let st = || state.lock().unwrap().clone();
    wait_until("the restarted plugin's replay", || {
        st().refusals >= RECENT as u64
    })
    .await;
    // Its post is done before it counts the next refusal; give the last one time.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let replay = st();
    assert_eq!(
        refusal_events(&node).len(),
        1,
        "the replay posted again: {replay:?}\n{:#?}",
        node.api.events()
    );
    assert_eq!((replay.posted, replay.already_posted), (0, 1), "{replay:?}");

    // Another process of the pod: its own event, once (both followers see it).
    hub.publish(refused(4343));
    wait_until("the second process's event", || {
        refusal_events(&node).len() == 2
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let events = refusal_events(&node);
    assert_eq!(events.len(), 2, "{events:#?}");
    assert!(
        events[1]["message"]
            .as_str()
            .unwrap()
            .contains("process 4343 (escaper)"),
        "{events:#?}"
    );
    println!(
        "FIGURE refusal events: {} refusals of one process, a restarted plugin replayed {}: \
         it posted {}, met {} already posted (409); 1 event for the process",
        RECENT + 101,
        replay.refusals,
        replay.posted,
        replay.already_posted
    );
    restarted.abort();
    server.abort();
}
