//! `serve` as the binary runs it (watches, HTTP server, kube binder, graceful
//! shutdown), against the scripted fake API server.

use super::common;

use std::time::Duration;

use serde_json::json;
use vgpu_core::packing::PolicyName;
use vgpu_core::resources::ANNOTATION_ASSIGNMENT;
use vgpu_scheduler_extender::extender::run::{ServeArgs, run_with_client};

use common::{gpu_node, gpu_pod};
use vgpu_testkit::fake_api::FakeApi;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_becomes_ready_decides_binds_and_shuts_down() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 2, "A100", 81920));
    let pod = gpu_pod("p1", "uid-p1", json!({"vgpu.io/gpu": "5"}));
    fake.put_pod(pod.clone());

    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let args = ServeArgs {
        listen: addr,
        url_prefix: "/scheduler".into(),
        policy: PolicyName::Vgpu,
        assume_ttl: Duration::from_secs(60),
        pending_ttl: Duration::from_secs(60),
        page_size: 100,
        context_reserve_mib: Default::default(),
        max_body_mib: 64,
        body_memory_mib: 256,
        header_timeout: Duration::from_secs(10),
        body_timeout: Duration::from_secs(10),
        tls_cert_file: None,
        tls_key_file: None,
        client_ca_file: None,
    };
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run_with_client(
        fake.client().expect("client"),
        args,
        listener,
        async {
            let _ = stopped.await;
        },
    ));
    let served = common::ServedClient::new(addr);
    // Ready once both lists are in.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let status = served.get("/readyz").await;
        if status == 200 {
            break;
        }
        assert_eq!(status, 503);
        assert!(tokio::time::Instant::now() < deadline, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let (_, ans) = served
        .post_json(
            "/scheduler/filter",
            &json!({"Pod": pod, "NodeNames": ["node-a"]}),
        )
        .await;
    assert_eq!(ans["NodeNames"], json!(["node-a"]), "{ans}");
    let (_, ans) = served
        .post_json(
            "/scheduler/bind",
            &json!({"PodName": "p1", "PodNamespace": "default", "PodUID": "uid-p1", "Node": "node-a"}),
        )
        .await;
    assert_eq!(ans, json!({"Error": ""}));
    let stored = fake.pod("default", "p1").expect("pod");
    assert_eq!(stored["spec"]["nodeName"], "node-a");
    assert!(stored["metadata"]["annotations"][ANNOTATION_ASSIGNMENT].is_string());

    stop.send(()).expect("server still running");
    let result = tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("shuts down in time")
        .expect("task");
    assert!(result.is_ok(), "{result:?}");
}
