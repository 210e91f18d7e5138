//! What an agent compiles when it links our crates. The wire contract (`protocol`) depends on
//! serde, serde_json, sha2 and thiserror only; the publisher library without its `cli` feature
//! (`default-features = false`) brings none of the binary's crates: no clap, no HTTP server, no
//! MCP SDK, no JSON Schema validator, no Prometheus exporter, no log subscriber. Read from
//! `cargo tree` on the locked dependency graph; `scripts/test.sh` also checks that this library
//! builds alone.

use std::collections::BTreeSet;
use std::process::Command;

fn tree(args: &[&str]) -> BTreeSet<String> {
    let out = Command::new(option_env!("CARGO").unwrap_or("cargo"))
        .args([
            "tree",
            "--locked",
            "--offline",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .args(args)
        .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "cargo tree {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
        .collect()
}

#[test]
fn the_contract_crate_depends_on_four_crates() {
    let direct = tree(&["-p", "intent-protocol", "--depth", "1"]);
    let expected: BTreeSet<String> = [
        "intent-protocol",
        "serde",
        "serde_json",
        "sha2",
        "thiserror",
    ]
    .into_iter()
    .map(String::from)
    .collect();
    assert_eq!(direct, expected);
}

#[test]
fn the_publisher_library_compiles_none_of_the_binarys_crates() {
    let library = tree(&["-p", "intent-publisher", "--no-default-features"]);
    for heavy in [
        "clap",
        "axum",
        "rmcp",
        "jsonschema",
        "metrics-exporter-prometheus",
        "tracing-subscriber",
        "toml",
    ] {
        assert!(
            !library.contains(heavy),
            "the publisher library pulls in {heavy}"
        );
    }
    // The binary's own graph does have them: the check above looks at the right thing.
    let binary = tree(&["-p", "intent-publisher"]);
    assert!(
        binary.contains("clap") && binary.contains("rmcp"),
        "{binary:?}"
    );
}

/// The file-level modules of a crate's `src/` (`ledger/mod.rs` is `ledger`,
/// `ledger/claim.rs` is `ledger::claim`) and their code, comments and unit tests left out.
fn modules(src: &std::path::Path) -> std::collections::BTreeMap<String, String> {
    fn walk(dir: &std::path::Path, base: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
        for entry in std::fs::read_dir(dir).expect("read src") {
            let path = entry.expect("entry").path();
            if path.is_dir() {
                walk(&path, base, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path.strip_prefix(base).unwrap().to_path_buf());
            }
        }
    }
    let mut files = Vec::new();
    walk(src, src, &mut files);
    let mut out = std::collections::BTreeMap::new();
    for rel in files {
        let mut parts: Vec<String> = rel
            .with_extension("")
            .components()
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .collect();
        if matches!(
            parts.last().map(String::as_str),
            Some("mod" | "lib" | "main")
        ) {
            parts.pop();
        }
        let text = std::fs::read_to_string(src.join(&rel)).unwrap();
        let code = match text.find("#[cfg(test)]\nmod tests") {
            Some(i) => text[..i].to_string(),
            None => text,
        };
        let code: String = code
            .lines()
            .map(|l| l.split("//").next().unwrap_or(""))
            .collect::<Vec<_>>()
            .join("\n");
        out.insert(parts.join("::"), code);
    }
    out
}

/// The modules `code` (of module `me`) names through `crate::` paths (`use` lists included)
/// and `super::` paths, each resolved to the longest module that exists.
fn imports(
    me: &str,
    code: &str,
    known: &std::collections::BTreeMap<String, String>,
) -> BTreeSet<String> {
    let resolve = |path: &str| -> Option<String> {
        let segs: Vec<&str> = path.split("::").filter(|s| !s.is_empty()).collect();
        (1..=segs.len())
            .rev()
            .map(|n| segs[..n].join("::"))
            .find(|m| known.contains_key(m))
    };
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut out = BTreeSet::new();
    for (anchor, base) in [("crate::", String::new()), ("super::", parent(me))] {
        let mut rest = code;
        while let Some(at) = rest.find(anchor) {
            let before_ok = at == 0 || !rest[..at].ends_with(ident);
            rest = &rest[at + anchor.len()..];
            if !before_ok {
                continue;
            }
            // `a::b::{c, d::e}` or `a::b::c`.
            let path: String = rest
                .chars()
                .take_while(|c| ident(*c) || *c == ':')
                .collect();
            let prefix = if base.is_empty() {
                path.clone()
            } else {
                format!("{base}::{path}")
            };
            let mut targets = vec![prefix.clone()];
            if path.ends_with("::") && rest[path.len()..].starts_with('{') {
                let inner = &rest[path.len() + 1..];
                let mut depth = 1;
                let end = inner
                    .char_indices()
                    .find(|(_, c)| {
                        match c {
                            '{' => depth += 1,
                            '}' => depth -= 1,
                            _ => {}
                        }
                        depth == 0
                    })
                    .map_or(inner.len(), |(i, _)| i);
                for item in inner[..end].split([',', '{', '}']) {
                    let item: String = item
                        .trim()
                        .chars()
                        .take_while(|c| ident(*c) || *c == ':')
                        .collect();
                    if !item.is_empty() {
                        targets.push(format!("{prefix}{item}"));
                    }
                }
            }
            for t in targets {
                if let Some(m) = resolve(&t) {
                    out.insert(m);
                }
            }
        }
    }
    out.remove(me);
    out
}

/// `a::b::c` → `a::b`; a top module → "".
fn parent(module: &str) -> String {
    module
        .rsplit_once("::")
        .map_or(String::new(), |(p, _)| p.to_string())
}

/// Groups of modules that import one another, directly or around a circle (a module's own
/// parent and children do not count: a parent declares and re-exports its children).
fn circles(src: &std::path::Path) -> Vec<Vec<String>> {
    let known = modules(src);
    let related = |a: &str, b: &str| {
        a.is_empty()
            || b.is_empty()
            || a.starts_with(&format!("{b}::"))
            || b.starts_with(&format!("{a}::"))
    };
    let edges: std::collections::BTreeMap<String, BTreeSet<String>> = known
        .iter()
        .map(|(m, code)| {
            let to = imports(m, code, &known)
                .into_iter()
                .filter(|t| !related(m, t))
                .collect();
            (m.clone(), to)
        })
        .collect();
    let reach = |from: &str| -> BTreeSet<String> {
        let mut seen = BTreeSet::new();
        let mut stack = vec![from.to_string()];
        while let Some(m) = stack.pop() {
            for t in edges.get(&m).into_iter().flatten() {
                if seen.insert(t.clone()) {
                    stack.push(t.clone());
                }
            }
        }
        seen
    };
    let reachable: std::collections::BTreeMap<String, BTreeSet<String>> =
        known.keys().map(|m| (m.clone(), reach(m))).collect();
    let mut groups: Vec<Vec<String>> = Vec::new();
    for m in known.keys() {
        if !reachable[m].contains(m) || groups.iter().any(|g| g.contains(m)) {
            continue;
        }
        let group: Vec<String> = known
            .keys()
            .filter(|o| *o == m || (reachable[m].contains(*o) && reachable[*o].contains(m)))
            .cloned()
            .collect();
        groups.push(group);
    }
    groups
}

/// Layers only point down: no module of the worker, the publisher, the reference downstream,
/// kit or the contract imports a module that imports it back, directly or around a circle. A
/// module owns the names it records (metric handles) and takes what it shares from below.
#[test]
fn no_module_imports_one_that_imports_it_back() {
    let root = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    for krate in ["worker", "publisher", "downstream", "kit", "protocol"] {
        let found = circles(&root.join(krate).join("src"));
        assert!(
            found.is_empty(),
            "{krate}/src has import circles: {found:?}"
        );
    }
}

#[test]
fn the_circle_finder_finds_a_circle() {
    let dir = std::env::temp_dir().join(format!("circles-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(dir.join("b")).unwrap();
    std::fs::write(dir.join("lib.rs"), "pub mod a;\npub mod b;\npub mod c;\n").unwrap();
    std::fs::write(dir.join("a.rs"), "use crate::b::{inner::Thing, other};\n").unwrap();
    std::fs::write(
        dir.join("b/mod.rs"),
        "pub mod inner;\nuse super::c::X; // crate::a\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("b/inner.rs"),
        "use crate::a::f;\nfn g() { super::super::c::x(); }\n",
    )
    .unwrap();
    std::fs::write(
        dir.join("c.rs"),
        "fn x() {}\n#[cfg(test)]\nmod tests {\n    use crate::a::f;\n}\n",
    )
    .unwrap();
    let found = circles(&dir);
    std::fs::remove_dir_all(&dir).unwrap();
    assert_eq!(found, vec![vec!["a".to_string(), "b::inner".to_string()]]);
}
