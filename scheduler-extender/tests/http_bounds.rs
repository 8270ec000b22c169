//! The extender's HTTP server against hostile and broken clients, over real sockets:
//! answers and memory stay bounded whatever the body (size limit, no echo of the
//! input, a shared budget for bodies in flight) and half-sent requests are closed at
//! their deadline; ordinary traffic is unaffected.

use super::common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};
use std::io::{Read, Write};
use std::net::TcpStream;
use vgpu_core::packing::PolicyName;
use vgpu_scheduler_extender::extender::limits::HttpLimits;
use vgpu_scheduler_extender::extender::policy::ExtenderPolicy;
use vgpu_scheduler_extender::extender::sync::WatchKind;
use vgpu_scheduler_extender::extender::{Extender, State, StateConfig};

use common::Served;

/// Small limits, so that the tests need little memory: 1 MiB bodies, 2 MiB in flight.
fn small_limits() -> HttpLimits {
    HttpLimits {
        max_body_bytes: 1 << 20,
        body_memory_bytes: 2 << 20,
        header_timeout: Duration::from_millis(500),
        body_timeout: Duration::from_millis(800),
    }
}

async fn served(limits: HttpLimits) -> Served {
    let state = Arc::new(State::new(
        StateConfig::default(),
        ExtenderPolicy::new(PolicyName::Vgpu),
    ));
    let node = common::gpu_node("node-a", 2, "A100", 81920);
    state.replace_nodes(&[serde_json::from_value(node).expect("node")]);
    state.replace_pods(&[]);
    state.mark_synced(WatchKind::Nodes);
    state.mark_synced(WatchKind::Pods);
    Served::start_with(Extender::new(state, common::recording_binder()), limits).await
}

fn filter_body() -> Value {
    let pod = common::gpu_pod("p", "uid-p", json!({"vgpu.io/gpu": "3"}));
    json!({"Pod": pod, "NodeNames": ["node-a"]})
}

/// Reads everything the server sends until it closes the connection (or `limit`);
/// whether it closed. Blocking, on a thread of its own (the server runs on the test's
/// runtime).
async fn read_until_closed(mut stream: TcpStream, limit: Duration) -> (Vec<u8>, bool) {
    tokio::task::spawn_blocking(move || {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return (out, false);
            }
            stream.set_read_timeout(Some(left)).expect("timeout");
            match stream.read(&mut buf) {
                Ok(0) => return (out, true),
                Ok(n) => out.extend_from_slice(&buf[..n]),
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    return (out, false);
                }
                Err(_) => return (out, true),
            }
        }
    })
    .await
    .expect("reader")
}

/// Connects and sends `bytes` (blocking, on a thread of its own).
async fn send(addr: std::net::SocketAddr, bytes: Vec<u8>) -> TcpStream {
    tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream.write_all(&bytes).expect("send");
        stream
    })
    .await
    .expect("sender")
}

#[tokio::test]
async fn a_huge_body_is_refused_by_its_size_without_being_read() {
    let s = served(small_limits()).await;
    // Declared: refused from Content-Length.
    let (status, body) = s.post("/scheduler/filter", vec![b' '; 3 << 20]).await;
    assert_eq!(status, 413);
    let text = String::from_utf8_lossy(&body);
    assert!(
        text.contains("too large") && text.contains("3145728") && text.contains("1048576"),
        "{text}"
    );
    assert!(body.len() < 512, "{} bytes", body.len());

    // Chunked (no Content-Length): refused once the received bytes pass the limit.
    let addr = s.addr;
    let stream = tokio::task::spawn_blocking(move || {
        let mut stream = TcpStream::connect(addr).expect("connect");
        stream
            .write_all(
                b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
            )
            .expect("headers");
        let chunk = vec![b'A'; 64 << 10];
        let mut sent = 0usize;
        while sent < (4 << 20) {
            let head = format!("{:x}\r\n", chunk.len());
            let ok = stream.write_all(head.as_bytes()).is_ok()
                && stream.write_all(&chunk).is_ok()
                && stream.write_all(b"\r\n").is_ok();
            if !ok {
                break; // the server stopped reading: expected
            }
            sent += chunk.len();
        }
        stream
    })
    .await
    .expect("sender");
    let (answer, _) = read_until_closed(stream, Duration::from_secs(10)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 413"), "{answer}");
    assert!(answer.len() < 1024, "{} bytes", answer.len());
}

#[tokio::test]
async fn a_malformed_body_is_named_never_echoed() {
    let s = served(small_limits()).await;
    let filler = "A".repeat(900 << 10);
    for (verb, body) in [
        ("filter", format!("{{\"Pod\": \"{filler}\"}}")),
        ("prioritize", format!("{{\"Pod\": \"{filler}\"}}")),
        ("bind", format!("{{\"PodName\": 7, \"x\": \"{filler}\"")),
        ("preempt", format!("[\"{filler}\"]")),
        ("filter", format!("{{\"{filler}")),
    ] {
        let (status, answer) = s
            .post(&format!("/scheduler/{verb}"), body.into_bytes())
            .await;
        let text = String::from_utf8_lossy(&answer).into_owned();
        assert!(
            answer.len() < 1024,
            "{verb}: {} bytes answered",
            answer.len()
        );
        assert!(
            !text.contains(&"A".repeat(33)),
            "{verb}: the answer echoes the body: {text}"
        );
        assert!(
            text.contains(&format!("parse {verb} request body")) && text.contains("line 1"),
            "{verb}: {text}"
        );
        assert!(status == 200 || status == 400, "{verb}: {status}");
    }
}

#[tokio::test]
async fn a_stalled_half_sent_request_is_closed_at_its_deadline() {
    let limits = small_limits();
    let s = served(limits).await;
    // Headers never finished.
    let start = Instant::now();
    let stream = send(
        s.addr,
        b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\n".to_vec(),
    )
    .await;
    let (_, closed) = read_until_closed(stream, Duration::from_secs(10)).await;
    let waited = start.elapsed();
    assert!(closed, "still open after 10 s");
    assert!(
        waited >= limits.header_timeout - Duration::from_millis(50),
        "closed after {waited:?}, before the {:?} deadline",
        limits.header_timeout
    );

    // Headers complete, body stalled after 10 of 1000 bytes: 408, then closed.
    let start = Instant::now();
    let stream = send(
        s.addr,
        b"POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"Pod\": {"
            .to_vec(),
    )
    .await;
    let (answer, closed) = read_until_closed(stream, Duration::from_secs(10)).await;
    let waited = start.elapsed();
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("9 of 1000 bytes"), "{answer}");
    assert!(closed, "still open after the 408");
    assert!(
        waited >= limits.body_timeout - Duration::from_millis(50),
        "answered after {waited:?}, before the {:?} deadline",
        limits.body_timeout
    );

    // The server still answers, and a keep-alive connection serves several requests.
    let (status, ans) = s.post_json("/scheduler/filter", &filter_body()).await;
    assert_eq!(status, 200);
    assert_eq!(ans["NodeNames"], json!(["node-a"]), "{ans}");
}

#[tokio::test]
async fn concurrent_large_bodies_share_a_bounded_budget() {
    let limits = small_limits();
    let s = served(limits).await;
    // Two stalled clients each declare a 1 MiB body: together they hold the whole
    // 2 MiB budget until their deadline.
    let stalled_at = Instant::now();
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let st = send(
            s.addr,
            format!(
                "POST /scheduler/filter HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{{",
                1 << 20
            )
            .into_bytes(),
        )
        .await;
        stalled.push(st);
    }
    tokio::time::sleep(Duration::from_millis(200)).await;
    // A third large body waits for room: it is read and answered only once the
    // stalled ones were refused at their deadline, so at no time were more than the
    // 2 MiB budget held. (Waiting past its own deadline gives 503 naming the budget:
    // unit `limits::tests::a_full_budget_refuses_at_the_deadline`.)
    let (status, body) = s.post("/scheduler/filter", vec![b' '; 1 << 20]).await;
    let answered = stalled_at.elapsed();
    let text = String::from_utf8_lossy(&body);
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("EOF while parsing"), "{text}");
    assert!(
        answered >= limits.body_timeout - Duration::from_millis(50),
        "answered after {answered:?}, while the stalled bodies still held the budget"
    );
    // The stalled ones were answered 408.
    for st in stalled {
        let (answer, _) = read_until_closed(st, Duration::from_secs(10)).await;
        assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 408"));
    }
    // Then many concurrent bodies near the limit are all answered: each either
    // decided or told the server is busy, never more than the budget in flight.
    let body = serde_json::to_vec(&filter_body()).expect("json");
    let mut padded = body.clone();
    padded.truncate(padded.len() - 1);
    padded.extend(std::iter::repeat_n(b' ', (600 << 10) - body.len()));
    padded.push(b'}');
    let client = Arc::new(common::ServedClient::new(s.addr));
    let tasks: Vec<_> = (0..16)
        .map(|_| {
            let c = client.clone();
            let b = padded.clone();
            tokio::spawn(async move { c.post("/scheduler/filter", b).await })
        })
        .collect();
    let mut ok = 0;
    for t in tasks {
        let (status, answer) = t.await.expect("task");
        match status {
            200 => {
                let v: Value = serde_json::from_slice(&answer).expect("json");
                assert_eq!(v["NodeNames"], json!(["node-a"]), "{v}");
                ok += 1;
            }
            503 => {}
            other => panic!("{other}: {}", String::from_utf8_lossy(&answer)),
        }
    }
    assert!(ok >= 1, "no request got through");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_hundred_concurrent_filters_are_all_answered() {
    let s = served(HttpLimits::default()).await;
    let client = Arc::new(common::ServedClient::new(s.addr));
    let body = serde_json::to_vec(&filter_body()).expect("json");
    let tasks: Vec<_> = (0..500)
        .map(|_| {
            let c = client.clone();
            let b = body.clone();
            tokio::spawn(async move { c.post("/scheduler/filter", b).await })
        })
        .collect();
    for t in tasks {
        let (status, answer) = t.await.expect("task");
        assert_eq!(status, 200);
        let v: Value = serde_json::from_slice(&answer).expect("json");
        assert_eq!(v["NodeNames"], json!(["node-a"]), "{v}");
    }
}
