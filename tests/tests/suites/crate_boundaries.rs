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
