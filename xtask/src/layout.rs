//! `cargo xtask layout`: the code base's structure counts that issue 12 tracks, so that
//! anyone can re-run them: import cycles among the files of each crate, the largest
//! files, and the OS primitives and formats that are defined in more than one place.
//!
//! It reads sources as text (no compiler): a file's module is its top-level module under
//! `src/` (`src/a.rs` and `src/a/**` are module `a`), and an edge `a → b` is a
//! `crate::b` path in the non-test part of a file of `a`. A cycle is a strongly connected
//! component of two or more modules.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

/// Source files (`.rs`) under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("read {}", d.display()))? {
            let p = e?.path();
            if p.is_dir() {
                let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
                if !matches!(name, "target" | ".git" | "fuzz") {
                    stack.push(p);
                }
            } else if p.extension().is_some_and(|x| x == "rs") {
                out.push(p);
            }
        }
    }
    out.sort();
    Ok(out)
}

/// The part of a source file before its unit-test module.
fn non_test(text: &str) -> &str {
    match text.find("#[cfg(test)]\nmod tests") {
        Some(i) => &text[..i],
        None => text,
    }
}

/// Top-level modules named by `crate::…` paths in `text` (grouped imports included).
fn crate_refs(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let ident = |s: &str| -> String {
        s.chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect()
    };
    let mut rest = text;
    while let Some(i) = rest.find("crate::") {
        let after = &rest[i + "crate::".len()..];
        if let Some(group) = after.strip_prefix('{') {
            // `crate::{a, b::c, d::{e, f}}`: the names at depth one.
            let mut depth = 1;
            let mut at_start = true;
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' => {
                        depth -= 1;
                        if depth == 0 {
                            break;
                        }
                    }
                    ',' if depth == 1 => at_start = true,
                    c if depth == 1 && at_start && (c.is_ascii_alphabetic() || c == '_') => {
                        out.insert(ident(&group[j..]));
                        at_start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(after);
            if !name.is_empty() {
                out.insert(name);
            }
        }
        rest = after;
    }
    out
}

/// Strongly connected components of two or more nodes (Tarjan's algorithm).
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    struct T<'a> {
        g: &'a BTreeMap<String, BTreeSet<String>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        on: BTreeSet<&'a str>,
        next: usize,
        out: Vec<Vec<String>>,
    }
    impl<'a> T<'a> {
        fn visit(&mut self, v: &'a str) {
            self.index.insert(v, self.next);
            self.low.insert(v, self.next);
            self.next += 1;
            self.stack.push(v);
            self.on.insert(v);
            let g = self.g;
            for w in g.get(v).into_iter().flatten() {
                let w = w.as_str();
                if !g.contains_key(w) {
                    continue;
                }
                if !self.index.contains_key(w) {
                    self.visit(w);
                    let lw = self.low[w];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(lw));
                } else if self.on.contains(w) {
                    let iw = self.index[w];
                    let lv = self.low[v];
                    self.low.insert(v, lv.min(iw));
                }
            }
            if self.low[v] == self.index[v] {
                let mut scc = Vec::new();
                while let Some(w) = self.stack.pop() {
                    self.on.remove(w);
                    scc.push(w.to_owned());
                    if w == v {
                        break;
                    }
                }
                if scc.len() > 1 {
                    scc.sort();
                    self.out.push(scc);
                }
            }
        }
    }
    let mut t = T {
        g: graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        on: BTreeSet::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in graph.keys() {
        if !t.index.contains_key(v.as_str()) {
            t.visit(v);
        }
    }
    t.out
}

/// The module graph of one crate's `src/`.
fn module_graph(src: &Path) -> Result<BTreeMap<String, BTreeSet<String>>> {
    let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for f in rust_files(src)? {
        let rel = f.strip_prefix(src).expect("listed under src");
        let first = rel
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or("");
        let module = first.trim_end_matches(".rs").to_owned();
        if matches!(module.as_str(), "lib" | "main" | "bin") {
            continue;
        }
        let text = std::fs::read_to_string(&f).with_context(|| format!("read {}", f.display()))?;
        // Doc links (`[`crate::x`]`) are not imports: comment lines are left out.
        let code: String = non_test(&text)
            .lines()
            .filter(|l| !l.trim_start().starts_with("//"))
            .collect::<Vec<_>>()
            .join("\n");
        let refs = crate_refs(&code);
        let e = g.entry(module.clone()).or_default();
        e.extend(refs.into_iter().filter(|r| *r != module));
    }
    Ok(g)
}

/// Definitions and uses of primitives and formats that should exist once: (what, needles).
/// A file counts when any needle occurs in its code (comment lines left out); a needle
/// with `&&` counts when every part of it occurs in the file.
const ONCE: &[(&str, &[&str])] = &[
    // A clock read (not a sleep on the clock: `clock_nanosleep` is another primitive).
    ("monotonic clock", &["fn mono_ns(", "clock_gettime("]),
    // Waiting and waking alike: a wake-only copy is a copy too.
    ("futex", &["SYS_futex", "FUTEX_WAIT", "FUTEX_WAKE"]),
    ("OFD lock", &["F_OFD_SETLK", "F_OFD_GETLK"]),
    (
        "publish by link(2)",
        &["libc::link(", "hard_link(", "linkat("],
    ),
    // `format!` with five groups, or a `push_str` / `write!` loop over the bytes.
    ("GPU UUID formatting", &["\"GPU-{}-{}", "\"GPU-\" && :02x}"]),
    // Packing (`generation << 1 | held`) and unpacking (`w & 1`, `w >> 1`) by hand.
    (
        "grant word packing",
        &["<< 1) |", "<< 1 |", "& 1 == 1", ">> 1) !="],
    ),
    // Shared memory set up by hand: an anonymous file, its size, a shared mapping at an
    // address the kernel picks. (cuda-sim's VMM maps `MAP_SHARED | MAP_FIXED` into its own
    // address reservations: the simulated device's address space, another primitive.)
    (
        "shared mapping",
        &["memfd_create(", "ftruncate(", "libc::MAP_SHARED,"],
    ),
    // kubelet's cgroup names: a systemd `….slice` unit or a `pod<uid>` component read apart.
    (
        "kubelet cgroup names",
        &["strip_suffix(\".slice\")", "rsplit_once(\"-pod\")"],
    ),
];

/// Whether `code` holds `needle` (each `&&`-separated part of it).
fn holds(code: &str, needle: &str) -> bool {
    needle.split(" && ").all(|part| code.contains(part))
}

/// Prints the counts for the workspace at `root`.
pub fn layout(root: &Path) -> Result<()> {
    let crates: Vec<PathBuf> = {
        let mut v = Vec::new();
        for dir in rust_files(root)?
            .iter()
            .filter_map(|f| {
                let s = f.to_str()?;
                let i = s.find("/src/")?;
                Some(PathBuf::from(&s[..i]))
            })
            .collect::<BTreeSet<_>>()
        {
            if dir.join("Cargo.toml").exists() {
                v.push(dir);
            }
        }
        v
    };
    println!(
        "== import cycles among the files of each crate (crate::module paths, tests left out)"
    );
    let mut total = 0;
    for c in &crates {
        let g = module_graph(&c.join("src"))?;
        for scc in cycles(&g) {
            total += 1;
            let name = c.strip_prefix(root).unwrap_or(c).display().to_string();
            println!("{name}: {}", scc.join(" ↔ "));
        }
    }
    println!("{total} cycle(s)");

    println!("\n== files over 800 lines");
    let mut big: Vec<(usize, String)> = Vec::new();
    for f in rust_files(root)? {
        let n = std::fs::read_to_string(&f)
            .map(|t| t.lines().count())
            .unwrap_or(0);
        if n > 800 {
            big.push((n, f.strip_prefix(root).unwrap_or(&f).display().to_string()));
        }
    }
    big.sort_by(|a, b| b.cmp(a));
    for (n, f) in &big {
        println!("{n:>6} {f}");
    }
    println!("{} file(s)", big.len());

    println!("\n== primitives and formats defined in more than one file (non-test code)");
    let mut copies = 0;
    for (what, needles) in ONCE {
        let mut files = Vec::new();
        for f in rust_files(root)? {
            let shown = f.strip_prefix(root).unwrap_or(&f).display().to_string();
            // Tests (a crate's `tests/`, `*tests.rs`), test fakes and benches build their
            // own fixtures; this file names the needles. The test-support crate's own
            // code (`tests/src/`, e.g. `device-probe`) is production code of the tests
            // and counts.
            if shown.starts_with("tests/tests/")
                || shown.contains("/tests/")
                || shown.ends_with("tests.rs")
                || shown.contains("testkit")
                || shown.contains("bench")
                || shown == "xtask/src/layout.rs"
            {
                continue;
            }
            let text = std::fs::read_to_string(&f).unwrap_or_default();
            let code: String = non_test(&text)
                .lines()
                .filter(|l| !l.trim_start().starts_with("//"))
                .collect::<Vec<_>>()
                .join("\n");
            if needles.iter().any(|n| holds(&code, n)) {
                files.push(shown);
            }
        }
        if files.len() > 1 {
            copies += 1;
            println!(
                "{what} ({}): {} files: {}",
                needles.join(" | "),
                files.len(),
                files.join(", ")
            );
        }
    }
    println!("{copies} primitive(s) or format(s) in more than one file");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crate_paths_are_found_in_plain_and_grouped_imports() {
        let r = crate_refs(
            "use crate::a::X;\nuse crate::{b, c::{D, E}, d::F};\nlet x = crate::e::f();",
        );
        let want: BTreeSet<String> = ["a", "b", "c", "d", "e"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(r, want);
    }

    #[test]
    fn needles_catch_the_copies_they_name() {
        let found = |what: &str, code: &str| {
            let (_, needles) = ONCE.iter().find(|(w, _)| *w == what).expect("listed");
            needles.iter().any(|n| holds(code, n))
        };
        assert!(found(
            "grant word packing",
            "w.store((generation << 1) | u32::from(held))"
        ));
        assert!(found("grant word packing", "w & 1 == 1 && (w >> 1) != y"));
        assert!(found(
            "futex",
            "libc::syscall(libc::SYS_futex, w, libc::FUTEX_WAKE, 1)"
        ));
        assert!(found(
            "GPU UUID formatting",
            "let mut s = String::from(\"GPU-\");\ns.push_str(&format!(\"{b:02x}\"));"
        ));
        assert!(!found("GPU UUID formatting", "uuid: format!(\"GPU-{i}\")"));
        assert!(found(
            "OFD lock",
            "ofd_lock(f, i, libc::F_OFD_GETLK, libc::F_WRLCK)"
        ));
        assert!(found(
            "shared mapping",
            "libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC)"
        ));
        assert!(found(
            "kubelet cgroup names",
            "let comp = comp.strip_suffix(\".slice\").unwrap_or(comp);"
        ));
        assert!(!found(
            "monotonic clock",
            "libc::clock_nanosleep(libc::CLOCK_MONOTONIC)"
        ));
    }

    #[test]
    fn a_loop_is_one_component_and_a_chain_none() {
        let mut g: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
        let mut edge = |a: &str, b: &str| {
            g.entry(a.into()).or_default().insert(b.into());
            g.entry(b.into()).or_default();
        };
        edge("a", "b");
        edge("b", "c");
        edge("c", "a");
        edge("c", "d");
        edge("d", "e");
        assert_eq!(
            cycles(&g),
            vec![vec!["a".to_string(), "b".into(), "c".into()]]
        );
    }
}
