//! The shipped manifests (`deploy/`) as the CI check reads them without kubectl or helm
//! (issue 40, ADR 0052): every object of every `.yaml`/`.json` file, in the order
//! `kubectl apply -f deploy/` applies them (file names sorted, documents in order;
//! subdirectories after, each applied on its own), and the containers that run a binary
//! with the flags they pass, to be checked against that binary's `--help`.

use std::path::{Path, PathBuf};

use serde_json::Value;

/// One object of a manifest file.
#[derive(Debug, Clone)]
pub struct Object {
    /// The file, relative to `deploy/`.
    pub file: String,
    /// The object as written.
    pub value: Value,
}

impl Object {
    /// `kind/namespace/name` (namespace empty for cluster objects), for messages.
    pub fn id(&self) -> String {
        format!(
            "{}/{}/{} ({})",
            self.kind(),
            self.value["metadata"]["namespace"].as_str().unwrap_or(""),
            self.value["metadata"]["name"].as_str().unwrap_or("?"),
            self.file
        )
    }

    /// The object's `kind`.
    pub fn kind(&self) -> &str {
        self.value["kind"].as_str().unwrap_or("")
    }
}

/// The repository's `deploy/` directory.
pub fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// Every manifest file under `deploy/` (relative paths), in apply order: the top
/// directory's files sorted by name, then each subdirectory's the same way.
pub fn files() -> Vec<String> {
    fn walk(root: &Path, rel: &str, out: &mut Vec<String>) {
        let here = root.join(rel);
        let mut entries: Vec<_> = std::fs::read_dir(&here)
            .unwrap_or_else(|e| panic!("read {}: {e}", here.display()))
            .map(|e| {
                e.expect("a directory entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        entries.sort();
        let mut dirs = Vec::new();
        for name in entries {
            let path = if rel.is_empty() {
                name.clone()
            } else {
                format!("{rel}/{name}")
            };
            if root.join(&path).is_dir() {
                dirs.push(path);
            } else if [".yaml", ".yml", ".json"].iter().any(|x| name.ends_with(x)) {
                out.push(path);
            }
        }
        for d in dirs {
            walk(root, &d, out);
        }
    }
    let mut out = Vec::new();
    walk(&dir(), "", &mut out);
    out
}

/// Every object of every manifest file, in apply order. Panics naming the file that
/// does not parse.
pub fn objects() -> Vec<Object> {
    let mut out = Vec::new();
    for file in files() {
        let path = dir().join(&file);
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("read {}: {e}", path.display()));
        let docs: Vec<Value> = if file.ends_with(".json") {
            vec![serde_json::from_str(&text).unwrap_or_else(|e| panic!("{file}: {e}"))]
        } else {
            parse_yaml(&text).unwrap_or_else(|e| panic!("{file}: {e}"))
        };
        for value in docs.into_iter().filter(|v| !v.is_null()) {
            out.push(Object {
                file: file.clone(),
                value,
            });
        }
    }
    out
}

/// The documents of a YAML text (an embedded configuration, a manifest file).
pub fn parse_yaml(text: &str) -> Result<Vec<Value>, String> {
    serde_saphyr::from_multiple(text).map_err(|e| e.to_string())
}

/// The pod template's spec of a workload (DaemonSet, Deployment), else `None`.
pub fn pod_spec(o: &Object) -> Option<&Value> {
    match o.kind() {
        "DaemonSet" | "Deployment" | "StatefulSet" | "Job" => {
            o.value.pointer("/spec/template/spec")
        }
        "Pod" => o.value.get("spec"),
        _ => None,
    }
}

/// Every container (init containers too) whose command runs `binary`: (object id,
/// container, the subcommand if the first argument is one from `subcommands`).
pub fn containers_running<'a>(objects: &'a [Object], binary: &str) -> Vec<(String, &'a Value)> {
    let mut out = Vec::new();
    for o in objects {
        let Some(spec) = pod_spec(o) else { continue };
        for list in ["initContainers", "containers"] {
            for c in spec[list].as_array().into_iter().flatten() {
                if c["command"][0].as_str() == Some(binary) {
                    out.push((
                        format!("{} container {}", o.id(), c["name"].as_str().unwrap_or("?")),
                        c,
                    ));
                }
            }
        }
    }
    out
}

/// The container's arguments: `command[1..]` then `args`.
pub fn arguments(c: &Value) -> Vec<String> {
    let command = c["command"].as_array().into_iter().flatten().skip(1);
    let args = c["args"].as_array().into_iter().flatten();
    command
        .chain(args)
        .filter_map(|a| a.as_str().map(str::to_owned))
        .collect()
}

/// The value of `--flag=value` (or `--flag value`) among `args`.
pub fn flag_value(args: &[String], flag: &str) -> Option<String> {
    let eq = format!("{flag}=");
    args.iter().enumerate().find_map(|(i, a)| {
        a.strip_prefix(&eq)
            .map(str::to_owned)
            .or_else(|| (a == flag).then(|| args.get(i + 1).cloned()).flatten())
    })
}

/// The flags among `args` (`--name`, without a value) that `help` (a binary's `--help`
/// output) does not list.
pub fn unknown_flags(args: &[String], help: &str) -> Vec<String> {
    args.iter()
        .filter_map(|a| a.strip_prefix("--"))
        .map(|a| format!("--{}", a.split('=').next().unwrap_or(a)))
        .filter(|f| {
            !help
                .split(|c: char| {
                    c.is_whitespace() || c == ',' || c == '=' || c == '[' || c == ']' || c == '<'
                })
                .any(|w| w == f)
        })
        .collect()
}

/// A container's environment variable's literal value.
pub fn env_value(c: &Value, name: &str) -> Option<String> {
    c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|e| e["name"] == name)
        .and_then(|e| e["value"].as_str().map(str::to_owned))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_are_found_in_help_and_unknown_ones_named() {
        let help = "Options:\n      --socket <SOCKET>  The socket [env: X=]\n  -q, --quiet\n";
        let args: Vec<String> = ["--socket=/a", "--quiet", "--sockets=/b", "-v"]
            .iter()
            .map(|s| (*s).to_owned())
            .collect();
        assert_eq!(unknown_flags(&args, help), ["--sockets"]);
        assert_eq!(flag_value(&args, "--socket").as_deref(), Some("/a"));
        let spaced: Vec<String> = ["--socket", "/c"].iter().map(|s| (*s).to_owned()).collect();
        assert_eq!(flag_value(&spaced, "--socket").as_deref(), Some("/c"));
    }
}
