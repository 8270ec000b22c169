//! The CI check of the shipped manifests without kubectl or helm (issue 40, ADR 0052):
//! every object in `deploy/` parses strictly into its Kubernetes type (a field the type
//! does not know fails, found by a round trip through the type); the files are in an
//! order `kubectl apply -f deploy/` can apply (namespace, CRD, RBAC, node agent,
//! scheduler: nothing is used before it is created); what the objects name exists (the
//! device plugin's flags in its `--help`, the sockets the daemon and plugin share, the
//! volumes mounted, the ConfigMaps, Secrets and ServiceAccounts referred to, the node
//! label, the extender's Service in the scheduler configurations). The daemon's and the
//! extender's flags are checked by their own crates (`deploy_flags`).

use std::collections::BTreeSet;
use std::process::Command;

use k8s_openapi::Resource;
use serde_json::Value;
use vgpu_testkit::deploy::{self, Object};

/// Parses `o` into `K`, checks its apiVersion and kind, and that serializing it gives
/// back what was written (a field `K` does not know would be dropped).
fn strict<K>(o: &Object) -> Result<(), String>
where
    K: Resource + serde::de::DeserializeOwned + serde::Serialize,
{
    if o.value["apiVersion"] != K::API_VERSION {
        return Err(format!(
            "{}: apiVersion {} is not {}",
            o.id(),
            o.value["apiVersion"],
            K::API_VERSION
        ));
    }
    let typed: K =
        serde_json::from_value(o.value.clone()).map_err(|e| format!("{}: {e}", o.id()))?;
    let back = serde_json::to_value(&typed).map_err(|e| format!("{}: {e}", o.id()))?;
    match first_difference(&o.value, &back, "") {
        None => Ok(()),
        Some(path) => Err(format!(
            "{}: {path} is not a field of {} (or not of its type)",
            o.id(),
            K::KIND
        )),
    }
}

/// The first path where `written` has something `typed` does not (or differs).
fn first_difference(written: &Value, typed: &Value, at: &str) -> Option<String> {
    match (written, typed) {
        (Value::Object(a), Value::Object(b)) => a.iter().find_map(|(k, v)| match b.get(k) {
            None => Some(format!("{at}.{k}")),
            Some(w) => first_difference(v, w, &format!("{at}.{k}")),
        }),
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => a
            .iter()
            .zip(b)
            .enumerate()
            .find_map(|(i, (v, w))| first_difference(v, w, &format!("{at}[{i}]"))),
        (a, b) if a == b => None,
        _ => Some(at.to_owned()),
    }
}

fn check_strict(o: &Object) -> Result<(), String> {
    use k8s_openapi::api::{apps, core, networking, rbac};
    use k8s_openapi::apiextensions_apiserver::pkg::apis::apiextensions::v1 as apiext;
    match o.kind() {
        "Namespace" => strict::<core::v1::Namespace>(o),
        "ServiceAccount" => strict::<core::v1::ServiceAccount>(o),
        "Service" => strict::<core::v1::Service>(o),
        "ConfigMap" => strict::<core::v1::ConfigMap>(o),
        "ClusterRole" => strict::<rbac::v1::ClusterRole>(o),
        "ClusterRoleBinding" => strict::<rbac::v1::ClusterRoleBinding>(o),
        "Role" => strict::<rbac::v1::Role>(o),
        "RoleBinding" => strict::<rbac::v1::RoleBinding>(o),
        "DaemonSet" => strict::<apps::v1::DaemonSet>(o),
        "Deployment" => strict::<apps::v1::Deployment>(o),
        "NetworkPolicy" => strict::<networking::v1::NetworkPolicy>(o),
        "CustomResourceDefinition" => strict::<apiext::CustomResourceDefinition>(o),
        other => Err(format!(
            "{}: kind {other:?} is not checked by this test",
            o.id()
        )),
    }
}

#[test]
fn every_object_parses_strictly_into_its_kubernetes_type() {
    let objects = deploy::objects();
    assert!(objects.len() >= 15, "only {} objects", objects.len());
    let errors: Vec<String> = objects
        .iter()
        .filter_map(|o| check_strict(o).err())
        .collect();
    assert!(errors.is_empty(), "{}", errors.join("\n"));
}

/// The string formats Kubernetes knows (apiextensions-apiserver
/// `pkg/apiserver/validation/formats.go`, `supportedVersionedFormats`, 1.0 and 1.34).
const STRING_FORMATS: [&str; 26] = [
    "bsonobjectid",
    "uri",
    "email",
    "hostname",
    "ipv4",
    "ipv6",
    "cidr",
    "mac",
    "uuid",
    "uuid3",
    "uuid4",
    "uuid5",
    "isbn",
    "isbn10",
    "isbn13",
    "creditcard",
    "ssn",
    "hexcolor",
    "rgbcolor",
    "byte",
    "password",
    "date",
    "duration",
    "datetime",
    "k8s-short-name",
    "k8s-long-name",
];

/// Whether the API server knows `format` for a schema of `type_`: its
/// `GetUnrecognizedFormats` rule (integers int32/int64, numbers float/double, strings the
/// list above with `-` removed, nothing else).
fn format_known(type_: &str, format: &str) -> bool {
    match type_ {
        "integer" => matches!(format, "int32" | "int64"),
        "number" => matches!(format, "float" | "double"),
        "" | "string" => {
            let norm = format.replace('-', "");
            STRING_FORMATS.iter().any(|f| f.replace('-', "") == norm)
        }
        _ => false,
    }
}

/// Every schema with a `format` in `v`: (JSON path, type, format), recursively.
fn formats(v: &Value, at: &str, out: &mut Vec<(String, String, String)>) {
    match v {
        Value::Object(m) => {
            if let Some(f) = m.get("format").and_then(Value::as_str) {
                let t = m.get("type").and_then(Value::as_str).unwrap_or("");
                out.push((at.to_owned(), t.to_owned(), f.to_owned()));
            }
            for (k, x) in m {
                formats(x, &format!("{at}.{k}"), out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                formats(x, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

/// Issue 40: the quota-policy CRD said `format: uint64` (schemars' name for a `u64`), which
/// the API server does not know: every install printed `unrecognized format "uint64"`.
#[test]
fn crds_use_only_formats_the_api_server_knows() {
    assert!(format_known("integer", "int64") && !format_known("integer", "uint64"));
    assert!(format_known("string", "date-time") && !format_known("string", "int64"));
    let mut seen = 0;
    for o in deploy::objects()
        .iter()
        .filter(|o| o.kind() == "CustomResourceDefinition")
    {
        let mut found = Vec::new();
        formats(&o.value["spec"], "spec", &mut found);
        seen += found.len();
        let bad: Vec<String> = found
            .iter()
            .filter(|(_, t, f)| !format_known(t, f))
            .map(|(at, t, f)| format!("{}: {at}: type {t:?} format {f:?}", o.id()))
            .collect();
        assert!(
            bad.is_empty(),
            "formats the API server does not know (it warns at every apply):\n{}",
            bad.join("\n")
        );
    }
    assert!(
        seen > 0,
        "no CRD with a format in deploy/: the check checked nothing"
    );
}

#[test]
fn the_strict_check_finds_a_misspelt_field() {
    let o = Object {
        file: "test".into(),
        value: serde_json::json!({
            "apiVersion": "v1", "kind": "ServiceAccount",
            "metadata": {"name": "x", "namespace": "y", "lables": {"a": "b"}}
        }),
    };
    let e = check_strict(&o).expect_err("misspelt field");
    assert!(e.contains(".metadata.lables"), "{e}");
}

/// Role names Kubernetes itself provides (not created by the manifests).
fn builtin_role(kind: &str, name: &str) -> bool {
    name.starts_with("system:")
        || (kind == "Role" && name == "extension-apiserver-authentication-reader")
}

/// The Secrets the manifests mount but do not create: made by deploy/tls/make-certs.sh.
const SECRETS_MADE_BY_THE_CERT_SCRIPT: [&str; 2] =
    ["vgpu-extender-tls", "vgpu-scheduler-client-tls"];

#[test]
fn files_are_in_an_order_kubectl_apply_can_apply() {
    let objects = deploy::objects();
    let mut created: BTreeSet<(String, String, String)> = BTreeSet::new();
    let key = |kind: &str, ns: &str, name: &str| (kind.to_owned(), ns.to_owned(), name.to_owned());
    let mut errors = Vec::new();
    let script =
        std::fs::read_to_string(deploy::dir().join("tls/make-certs.sh")).expect("make-certs.sh");
    for o in &objects {
        let ns = o.value["metadata"]["namespace"].as_str().unwrap_or("");
        let mut problems = Vec::new();
        let mut need = |what: (String, String, String)| {
            let builtin = what.1 == "kube-system" && what.0 == "Namespace"
                || builtin_role(&what.0, &what.2)
                || what.0 == "Namespace" && ["kube-system", "default"].contains(&what.2.as_str());
            if !builtin && !created.contains(&what) {
                errors.push(format!("{} uses {what:?} before it is created", o.id()));
            }
        };
        if !ns.is_empty() {
            need(key("Namespace", "", ns));
        }
        if let "RoleBinding" | "ClusterRoleBinding" = o.kind() {
            let r = &o.value["roleRef"];
            let rk = r["kind"].as_str().unwrap_or("");
            let rns = if rk == "Role" { ns } else { "" };
            need(key(rk, rns, r["name"].as_str().unwrap_or("")));
            for s in o.value["subjects"].as_array().into_iter().flatten() {
                if s["kind"] == "ServiceAccount" {
                    need(key(
                        "ServiceAccount",
                        s["namespace"].as_str().unwrap_or(ns),
                        s["name"].as_str().unwrap_or(""),
                    ));
                }
            }
        }
        if let Some(spec) = deploy::pod_spec(o) {
            if let Some(sa) = spec["serviceAccountName"].as_str() {
                need(key("ServiceAccount", ns, sa));
            }
            for v in spec["volumes"].as_array().into_iter().flatten() {
                if let Some(cm) = v["configMap"]["name"].as_str() {
                    need(key("ConfigMap", ns, cm));
                }
                if let Some(s) = v["secret"]["secretName"].as_str()
                    && !(SECRETS_MADE_BY_THE_CERT_SCRIPT.contains(&s) && script.contains(s))
                {
                    problems.push(format!(
                        "{} mounts Secret {s}, which nothing creates",
                        o.id()
                    ));
                }
            }
            // Every mount names a volume of the pod.
            let volumes: BTreeSet<&str> = spec["volumes"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|v| v["name"].as_str())
                .collect();
            for list in ["initContainers", "containers"] {
                for c in spec[list].as_array().into_iter().flatten() {
                    for m in c["volumeMounts"].as_array().into_iter().flatten() {
                        let n = m["name"].as_str().unwrap_or("");
                        if !volumes.contains(n) {
                            problems.push(format!(
                                "{}: container {} mounts unknown volume {n}",
                                o.id(),
                                c["name"]
                            ));
                        }
                    }
                }
            }
        }
        let name = o.value["metadata"]["name"].as_str().unwrap_or("");
        created.insert(key(o.kind(), ns, name));
        errors.append(&mut problems);
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // The install order the docs promise: namespace, CRD, RBAC, node agent, scheduler.
    let first = |kind: &str| {
        objects
            .iter()
            .position(|o| o.kind() == kind)
            .unwrap_or_else(|| panic!("no {kind}"))
    };
    assert!(first("Namespace") < first("CustomResourceDefinition"));
    assert!(first("CustomResourceDefinition") < first("ClusterRole"));
    assert!(first("ClusterRole") < first("DaemonSet"));
    assert!(first("DaemonSet") < first("Deployment"));
}

fn node_agent(objects: &[Object]) -> &Object {
    objects
        .iter()
        .find(|o| o.kind() == "DaemonSet" && o.value["metadata"]["name"] == "vgpu-node-agent")
        .expect("the node agent DaemonSet")
}

fn container<'a>(ds: &'a Object, name: &str) -> &'a Value {
    ds.value["spec"]["template"]["spec"]["containers"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|c| c["name"] == name)
        .unwrap_or_else(|| panic!("no container {name}"))
}

fn help(args: &[&str]) -> String {
    let out = Command::new(crate::plugin_bin())
        .args(args)
        .arg("--help")
        .output()
        .expect("run vgpu-device-plugin --help");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_plugins_flags_exist() {
    let objects = deploy::objects();
    let found = deploy::containers_running(&objects, "vgpu-device-plugin");
    assert!(found.len() >= 2, "{found:?}");
    let mut errors = Vec::new();
    for (id, c) in found {
        let args = deploy::arguments(c);
        let sub: Vec<&str> = args
            .iter()
            .take_while(|a| !a.starts_with('-'))
            .map(String::as_str)
            .collect();
        let unknown = deploy::unknown_flags(&args, &help(&sub));
        if !unknown.is_empty() {
            errors.push(format!(
                "{id}: vgpu-device-plugin {sub:?} has no {unknown:?}"
            ));
        }
    }
    assert!(errors.is_empty(), "{}", errors.join("\n"));
    // The check catches a flag the binary lacks.
    assert_eq!(
        deploy::unknown_flags(&["--no-such-flag".into()], &help(&[])),
        ["--no-such-flag"]
    );
}

#[test]
fn plugin_daemon_and_vgpuctl_agree_on_sockets_paths_and_the_node_label() {
    let objects = deploy::objects();
    let ds = node_agent(&objects);
    let plugin = deploy::arguments(container(ds, "device-plugin"));
    let daemon_c = container(ds, "vgpu-daemon");
    let daemon = deploy::arguments(daemon_c);
    let flag =
        |args: &[String], f: &str| deploy::flag_value(args, f).unwrap_or_else(|| panic!("no {f}"));
    // The shims' socket the plugin hands containers is the daemon's.
    assert_eq!(flag(&plugin, "--daemon-socket"), flag(&daemon, "--socket"));
    // The API socket: the daemon and vgpuctl (exec'd in its container) read
    // VGPU_API_SOCKET; the plugin follows the same socket.
    let api =
        deploy::env_value(daemon_c, "VGPU_API_SOCKET").expect("VGPU_API_SOCKET on the daemon");
    assert_eq!(flag(&plugin, "--daemon-api-socket"), api);
    assert!(
        deploy::flag_value(&daemon, "--api-socket").is_none(),
        "--api-socket and VGPU_API_SOCKET both set"
    );
    // Both sockets' directories are in the state volume both containers mount.
    let state = "/var/lib/vgpu/";
    for p in [
        &api,
        &flag(&daemon, "--socket"),
        &flag(&plugin, "--shim-host-path"),
    ] {
        assert!(
            p.starts_with(state),
            "{p} is not under the state mount {state}"
        );
    }
    for c in [container(ds, "device-plugin"), daemon_c] {
        assert!(
            c["volumeMounts"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|m| m["name"] == "state" && m["mountPath"] == "/var/lib/vgpu"),
            "container {} lacks the state mount",
            c["name"]
        );
    }
    // The init container installs the shim where the plugin hands it out.
    let init = &ds.value["spec"]["template"]["spec"]["initContainers"][0];
    let to = flag(&deploy::arguments(init), "--to");
    assert_eq!(
        to.strip_prefix("/host"),
        Some(flag(&plugin, "--shim-host-path").as_str())
    );
    // The node label, and that the install guide tells operators to set it.
    let selector = &ds.value["spec"]["template"]["spec"]["nodeSelector"];
    assert_eq!(selector["vgpu.io/enabled"], "true");
    let install =
        std::fs::read_to_string(deploy::dir().join("../docs/install.md")).expect("docs/install.md");
    assert!(
        install.contains("vgpu.io/enabled=true"),
        "docs/install.md does not name the node label"
    );
    // NVML through the NVIDIA container toolkit (documented in the DaemonSet and the guide).
    assert_eq!(
        ds.value["spec"]["template"]["spec"]["runtimeClassName"],
        "nvidia"
    );
    assert!(install.contains("runtimeClassName"));
}

/// The extender's Service, as a scheduler configuration must name it.
fn extender_url(objects: &[Object]) -> String {
    let svc = objects
        .iter()
        .find(|o| o.kind() == "Service" && o.value["metadata"]["name"] == "vgpu-scheduler-extender")
        .expect("the extender's Service");
    let d = objects
        .iter()
        .find(|o| {
            o.kind() == "Deployment" && o.value["metadata"]["name"] == "vgpu-scheduler-extender"
        })
        .expect("the extender's Deployment");
    let args = deploy::arguments(&d.value["spec"]["template"]["spec"]["containers"][0]);
    let prefix = deploy::flag_value(&args, "--url-prefix").unwrap_or_else(|| "/scheduler".into());
    format!(
        "https://{}.{}.svc:{}{}",
        svc.value["metadata"]["name"].as_str().expect("name"),
        svc.value["metadata"]["namespace"]
            .as_str()
            .expect("namespace"),
        svc.value["spec"]["ports"][0]["port"],
        prefix
    )
}

#[test]
fn both_scheduler_configurations_call_the_extender_over_tls() {
    let objects = deploy::objects();
    let url = extender_url(&objects);
    let mut seen = 0;
    for o in objects.iter().filter(|o| o.kind() == "ConfigMap") {
        for (key, text) in o.value["data"].as_object().into_iter().flatten() {
            let text = text.as_str().expect("ConfigMap data is text");
            if key.ends_with(".json") {
                serde_json::from_str::<Value>(text)
                    .unwrap_or_else(|e| panic!("{} {key}: {e}", o.id()));
                continue;
            }
            let cfg: Value = serde_saphyr_value(text, &o.id());
            if cfg["kind"] != "KubeSchedulerConfiguration" {
                continue;
            }
            seen += 1;
            assert_eq!(
                cfg["apiVersion"],
                "kubescheduler.config.k8s.io/v1",
                "{}",
                o.id()
            );
            let e = &cfg["extenders"][0];
            assert_eq!(e["urlPrefix"], url.as_str(), "{}", o.id());
            assert_eq!(e["enableHTTPS"], true, "{}", o.id());
            for f in ["certFile", "keyFile", "caFile"] {
                assert!(
                    e["tlsConfig"][f].is_string(),
                    "{}: no tlsConfig.{f}",
                    o.id()
                );
            }
            assert_eq!(e["bindVerb"], "bind");
            assert_eq!(e["ignorable"], false);
            let managed: BTreeSet<&str> = e["managedResources"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|r| r["name"].as_str())
                .collect();
            use vgpu_core::resources::{
                RESOURCE_GPU, RESOURCE_GPU_COMPUTE, RESOURCE_GPU_COUNT, RESOURCE_GPU_MEMORY,
            };
            for r in [
                RESOURCE_GPU,
                RESOURCE_GPU_COUNT,
                RESOURCE_GPU_MEMORY,
                RESOURCE_GPU_COMPUTE,
            ] {
                assert!(managed.contains(r), "{}: {r} not managed", o.id());
            }
        }
    }
    assert_eq!(
        seen, 2,
        "scheduler modes (a) and (b) each ship one configuration"
    );
    // Mode (a)'s scheduler mounts its configuration and the client certificate where
    // the configuration says.
    let sched = objects
        .iter()
        .find(|o| o.kind() == "Deployment" && o.value["metadata"]["name"] == "vgpu-scheduler")
        .expect("the vgpu-scheduler Deployment");
    let c = &sched.value["spec"]["template"]["spec"]["containers"][0];
    let cfg_path = deploy::flag_value(&deploy::arguments(c), "--config").expect("--config");
    let mounts: Vec<&str> = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["mountPath"].as_str())
        .collect();
    assert!(
        mounts.iter().any(|m| cfg_path.starts_with(m)),
        "{cfg_path} not mounted: {mounts:?}"
    );
}

fn serde_saphyr_value(text: &str, id: &str) -> Value {
    let docs = deploy::parse_yaml(text).unwrap_or_else(|e| panic!("{id}: {e}"));
    docs.into_iter().next().unwrap_or(Value::Null)
}

/// The Helm chart (`charts/vgpu`). Nothing here renders it (no helm binary can be installed
/// here; the cluster run renders it where `VGPU_K8S_BIN` has helm, docs/cluster.md): these
/// checks are of its static structure only.
mod chart {
    use super::*;
    use std::path::{Path, PathBuf};

    fn chart_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../charts/vgpu")
    }

    fn templates() -> Vec<(String, String)> {
        let dir = chart_dir().join("templates");
        let mut out: Vec<(String, String)> = std::fs::read_dir(&dir)
            .unwrap_or_else(|e| panic!("read {}: {e}", dir.display()))
            .map(|e| {
                let p = e.expect("entry").path();
                let text = std::fs::read_to_string(&p).expect("template");
                (
                    p.file_name().expect("name").to_string_lossy().into_owned(),
                    text,
                )
            })
            .collect();
        out.sort();
        out
    }

    /// Every `.Values.a.b` path named in `text`.
    fn value_refs(text: &str) -> BTreeSet<String> {
        let mut out = BTreeSet::new();
        let mut rest = text;
        while let Some(i) = rest.find(".Values.") {
            rest = &rest[i + ".Values.".len()..];
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '.' || c == '_'))
                .unwrap_or(rest.len());
            out.insert(rest[..end].trim_end_matches('.').to_owned());
        }
        out
    }

    /// Every path of `v` (`a`, `a.b`, ...), objects only.
    fn value_paths(v: &Value, at: &str, out: &mut BTreeSet<String>) {
        if let Value::Object(m) = v {
            for (k, x) in m {
                let p = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                out.insert(p.clone());
                value_paths(x, &p, out);
            }
        }
    }

    fn values() -> Value {
        let text = std::fs::read_to_string(chart_dir().join("values.yaml")).expect("values.yaml");
        serde_saphyr_value(&text, "values.yaml")
    }

    #[test]
    fn every_value_a_template_names_exists_and_every_value_is_used() {
        let mut defined = BTreeSet::new();
        value_paths(&values(), "", &mut defined);
        let mut used = BTreeSet::new();
        for (name, text) in templates() {
            for r in value_refs(&text) {
                assert!(
                    defined.contains(&r),
                    "{name} names .Values.{r}, not in values.yaml"
                );
                used.insert(r);
            }
        }
        // A value is used when it or a path below it is named.
        let leaves: Vec<&String> = defined
            .iter()
            .filter(|d| !defined.iter().any(|e| e.starts_with(&format!("{d}."))))
            .collect();
        let unused: Vec<&&String> = leaves
            .iter()
            .filter(|l| !used.iter().any(|u| l.starts_with(u.as_str())))
            .collect();
        assert!(unused.is_empty(), "values no template uses: {unused:?}");
        for key in [
            "nodeAgent.nodeSelector",
            "slicesPerGpu",
            "ebpf.mode",
            "scheduler.mode",
        ] {
            assert!(used.contains(key), "the chart has no value {key}");
        }
    }

    #[test]
    fn template_actions_are_closed_and_blocks_end() {
        for (name, text) in templates() {
            // Every action closes before the next opens (a YAML flow map may end in `}}`
            // outside any action, so the two counts need not agree).
            for piece in text.split("{{").skip(1) {
                assert!(
                    piece.contains("}}"),
                    "{name}: an action is not closed: {{{{{}",
                    piece.chars().take(40).collect::<String>()
                );
            }
            let opens = [
                "{{- if ",
                "{{ if ",
                "{{- with ",
                "{{ with ",
                "{{- range ",
                "{{ range ",
            ]
            .iter()
            .map(|o| text.matches(o).count())
            .sum::<usize>();
            let ends = text.matches("{{- end }}").count() + text.matches("{{ end }}").count();
            assert_eq!(opens, ends, "{name}: {opens} blocks opened, {ends} ended");
        }
    }

    /// Every plain manifest has its template (the chart is those manifests with values), the
    /// CRD is the same file, and the dashboard JSON is the ConfigMap's.
    #[test]
    fn the_chart_covers_every_plain_manifest() {
        let names: BTreeSet<String> = templates().into_iter().map(|(n, _)| n).collect();
        for file in deploy::files() {
            let base = file.rsplit('/').next().expect("name").to_owned();
            if file.starts_with("control-plane/") {
                assert!(names.contains("50-control-plane-scheduler-config.yaml"));
            } else if file.ends_with(".json") {
                let chart = std::fs::read(chart_dir().join("crds").join(&base)).expect("crds/");
                let plain = std::fs::read(deploy::dir().join(&file)).expect("deploy/");
                assert!(
                    chart == plain,
                    "charts/vgpu/crds/{base} differs from deploy/{file}"
                );
            } else {
                assert!(names.contains(&base), "no template for deploy/{file}");
            }
        }
        let dash = deploy::objects()
            .into_iter()
            .find(|o| o.value["metadata"]["name"] == "vgpu-grafana-dashboard")
            .expect("the dashboard ConfigMap");
        let plain = dash.value["data"]["vgpu-dashboard.json"]
            .as_str()
            .expect("JSON")
            .to_owned();
        let chart =
            std::fs::read_to_string(chart_dir().join("files/vgpu-dashboard.json")).expect("files/");
        assert_eq!(
            chart, plain,
            "charts/vgpu/files/vgpu-dashboard.json differs from the ConfigMap"
        );
    }
}
