//! The shipped manifests run `vgpu-scheduler-extender` only with flags it has (the CI
//! check of `deploy/`, ADR 0052; the objects themselves: the device plugin's
//! `deploy_manifests`), and its TLS files where the Secret is mounted.

use std::process::Command;

use vgpu_testkit::deploy;

fn help(sub: &[&str]) -> String {
    let out = Command::new(crate::extender_bin())
        .args(sub)
        .arg("--help")
        .output()
        .expect("run vgpu-scheduler-extender --help");
    assert!(out.status.success());
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn the_extenders_flags_and_tls_files_exist() {
    let objects = deploy::objects();
    let found = deploy::containers_running(&objects, "vgpu-scheduler-extender");
    assert_eq!(found.len(), 1, "{found:?}");
    for (id, c) in found {
        let args = deploy::arguments(c);
        let sub: Vec<&str> = args
            .iter()
            .take_while(|a| !a.starts_with('-'))
            .map(String::as_str)
            .collect();
        assert_eq!(sub, ["serve"], "{id}");
        let unknown = deploy::unknown_flags(&args, &help(&sub));
        assert!(unknown.is_empty(), "{id}: no {unknown:?} in `serve --help`");
        let mounts: Vec<&str> = c["volumeMounts"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|m| m["mountPath"].as_str())
            .collect();
        for f in ["--tls-cert-file", "--tls-key-file", "--client-ca-file"] {
            let path = deploy::flag_value(&args, f).unwrap_or_else(|| panic!("{id}: no {f}"));
            assert!(
                mounts.iter().any(|m| path.starts_with(&format!("{m}/"))),
                "{id}: {f} {path} is not in a mounted volume ({mounts:?})"
            );
        }
    }
    assert_eq!(
        deploy::unknown_flags(&["--no-such-flag".into()], &help(&["serve"])),
        ["--no-such-flag"]
    );
}
