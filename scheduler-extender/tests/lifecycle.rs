//! The real `vgpu-scheduler-extender serve` process as the install runs it (ADR 0053):
//! TLS with client certificates verified against `--client-ca-file` (the test CA in
//! `tests/tls/`), against the scripted fake API server. Only a client with a certificate
//! from that CA may call filter or bind; anyone may GET the probes and metrics; a
//! certificate from another CA fails the handshake; plain HTTP gets no answer. SIGTERM
//! ends the process with exit 0.

use super::common;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use vgpu_testkit::fake_api::FakeApi;

use common::{CALL_TIMEOUT, gpu_node, gpu_pod};

/// Longest a SIGTERM may take to end the extender (open connections are drained).
const STOP: Duration = Duration::from_secs(5);

fn tls_file(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tls").join(name)
}

struct Kill(Child);
impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A TLS client trusting the test CA, with the client certificate `identity`
/// (`client` or `rogue`) or none.
fn connector(identity: Option<&str>) -> tokio_rustls::TlsConnector {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_file_iter(tls_file("ca.crt")).expect("ca.crt") {
        roots.add(c.expect("a CA certificate")).expect("add the CA");
    }
    let b = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .expect("protocol versions")
        .with_root_certificates(roots);
    let config = match identity {
        None => b.with_no_client_auth(),
        Some(name) => {
            let chain = CertificateDer::pem_file_iter(tls_file(&format!("{name}.crt")))
                .expect("client certificate")
                .collect::<Result<Vec<_>, _>>()
                .expect("client certificate");
            let key =
                PrivateKeyDer::from_pem_file(tls_file(&format!("{name}.key"))).expect("client key");
            b.with_client_auth_cert(chain, key).expect("client auth")
        }
    };
    tokio_rustls::TlsConnector::from(Arc::new(config))
}

/// One HTTP/1.1 request over TLS; the status and the body, or the error that ended
/// the exchange (a refused handshake).
async fn call(
    addr: SocketAddr,
    identity: Option<&str>,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, String), String> {
    let exchange = async {
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| format!("connect: {e}"))?;
        let name = ServerName::try_from("localhost").expect("server name");
        let mut tls = connector(identity)
            .connect(name, tcp)
            .await
            .map_err(|e| format!("handshake: {e}"))?;
        let body = body.map(Value::to_string).unwrap_or_default();
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        tls.write_all(req.as_bytes())
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut out = Vec::new();
        tls.read_to_end(&mut out)
            .await
            .map_err(|e| format!("read: {e}"))?;
        let text = String::from_utf8_lossy(&out).into_owned();
        let status = text
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format!("no HTTP status in {text:?}"))?;
        let body = text
            .split_once("\r\n\r\n")
            .map(|(_, b)| b.to_owned())
            .unwrap_or_default();
        Ok((status, body))
    };
    tokio::time::timeout(CALL_TIMEOUT, exchange)
        .await
        .unwrap_or_else(|_| Err(format!("no answer within {CALL_TIMEOUT:?}")))
}

/// A JSON body from a chunked or plain HTTP body (the verbs answer small JSON objects).
fn json_of(body: &str) -> Value {
    let start = body.find('{').expect("a JSON object");
    let end = body.rfind('}').expect("a JSON object");
    serde_json::from_str(&body[start..=end]).expect("JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_schedulers_certificate_may_filter_and_bind_and_sigterm_exits_zero() {
    let fake = FakeApi::start().await.expect("fake API");
    fake.put_node(gpu_node("node-a", 2, "A100", 81920));
    let pod = gpu_pod("p1", "uid-p1", json!({"vgpu.io/gpu": "5"}));
    fake.put_pod(pod.clone());
    let dir = tempfile::tempdir().expect("temporary directory");
    let kubeconfig = dir.path().join("kubeconfig");
    std::fs::write(
        &kubeconfig,
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            fake.addr
        ),
    )
    .expect("kubeconfig");
    // A free port (bound and released; the extender binds it at once).
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port");
    let child = Command::new(crate::extender_bin())
        .arg("serve")
        .arg(format!("--listen={addr}"))
        .arg("--tls-cert-file")
        .arg(tls_file("server.crt"))
        .arg("--tls-key-file")
        .arg(tls_file("server.key"))
        .arg("--client-ca-file")
        .arg(tls_file("ca.crt"))
        .env("KUBECONFIG", &kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn vgpu-scheduler-extender");
    let mut child = Kill(child);

    // Probes need no certificate (kubelet's HTTPS probes present none).
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        if let Ok((200, _)) = call(addr, None, "GET", "/readyz", None).await {
            break;
        }
        if let Ok(Some(st)) = child.0.try_wait() {
            panic!("the extender exited ({st})");
        }
        assert!(Instant::now() < end, "never ready over TLS");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (status, _) = call(addr, None, "GET", "/metrics", None)
        .await
        .expect("metrics");
    assert_eq!(status, 200);

    let filter = json!({"Pod": pod, "NodeNames": ["node-a"]});
    let bind =
        json!({"PodName": "p1", "PodNamespace": "default", "PodUID": "uid-p1", "Node": "node-a"});
    // No certificate: refused, and nothing bound.
    for (path, body) in [("/scheduler/filter", &filter), ("/scheduler/bind", &bind)] {
        let (status, text) = call(addr, None, "POST", path, Some(body))
            .await
            .expect("an answer");
        assert_eq!(status, 403, "{path} without a certificate: {text}");
    }
    assert!(
        fake.pod("default", "p1").expect("pod")["spec"]["nodeName"].is_null(),
        "bound by an unauthenticated call"
    );
    // A certificate from another CA: the handshake fails (or the first read does, in
    // TLS 1.3, where the server checks the certificate after the client's Finished).
    let rogue = call(addr, Some("rogue"), "POST", "/scheduler/bind", Some(&bind)).await;
    assert!(rogue.is_err(), "a rogue certificate was served: {rogue:?}");
    // Plain HTTP to the TLS port: no HTTP answer.
    let mut plain = tokio::net::TcpStream::connect(addr).await.expect("connect");
    plain
        .write_all(b"GET /readyz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .await
        .expect("write");
    let mut out = Vec::new();
    let _ = tokio::time::timeout(CALL_TIMEOUT, plain.read_to_end(&mut out)).await;
    assert!(
        !String::from_utf8_lossy(&out).starts_with("HTTP/1.1 200"),
        "plain HTTP was answered"
    );

    // kube-scheduler's certificate: filter and bind work.
    let (status, text) = call(
        addr,
        Some("client"),
        "POST",
        "/scheduler/filter",
        Some(&filter),
    )
    .await
    .expect("filter");
    assert_eq!(status, 200, "{text}");
    assert_eq!(json_of(&text)["NodeNames"], json!(["node-a"]), "{text}");
    let (status, text) = call(addr, Some("client"), "POST", "/scheduler/bind", Some(&bind))
        .await
        .expect("bind");
    assert_eq!(status, 200, "{text}");
    assert_eq!(json_of(&text), json!({"Error": ""}));
    assert_eq!(
        fake.pod("default", "p1").expect("pod")["spec"]["nodeName"],
        "node-a"
    );

    // SIGTERM (kubelet stopping the pod): exit 0.
    let sent = Command::new("kill")
        .args(["-TERM", &child.0.id().to_string()])
        .status()
        .expect("run kill");
    assert!(sent.success());
    let end = Instant::now() + STOP;
    let st = loop {
        if let Some(st) = child.0.try_wait().expect("wait") {
            break st;
        }
        assert!(Instant::now() < end, "still running {STOP:?} after SIGTERM");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!(st.code(), Some(0), "exit status {st}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_tls_flags_are_refused_naming_the_flag() {
    for (args, needle) in [
        (vec!["--tls-cert-file", "/x.crt"], "--tls-key-file"),
        (vec!["--client-ca-file", "/ca.crt"], "--tls-cert-file"),
    ] {
        let fake = FakeApi::start().await.expect("fake API");
        let dir = tempfile::tempdir().expect("temporary directory");
        let kubeconfig = dir.path().join("kubeconfig");
        std::fs::write(
            &kubeconfig,
            format!(
                "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\ncontexts:\n- name: fake\n  context: {{cluster: fake, user: fake}}\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
                fake.addr
            ),
        )
        .expect("kubeconfig");
        let mut cmd = Command::new(crate::extender_bin());
        cmd.args(["serve", "--listen=127.0.0.1:0"])
            .args(&args)
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST");
        let out = tokio::time::timeout(
            Duration::from_secs(20),
            tokio::task::spawn_blocking(move || cmd.output()),
        )
        .await
        .expect("exits at once")
        .expect("the waiting task")
        .expect("run the extender");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} accepted");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}
