//! The documents stay true to the tree: every repository path that the README and
//! `docs/*.md` name in backticks (`host/src/layout.rs`, `scripts/`, …) exists.

use std::path::Path;

/// Top-level entries a named path may start with (anything else in backticks — crate
/// names, commands, `.tools/` — is not a path of this repository).
const ROOTS: &[&str] = &[
    "kernels-rs/",
    "host/",
    "server/",
    "validation/",
    "benches/",
    "src/",
    "tests/",
    "scripts/",
    "docs/",
    "python/",
    ".ci/",
    "build.rs",
];

/// The backticked spans of `text` that name a repository path.
fn named_paths(text: &str) -> Vec<String> {
    text.split('`')
        .skip(1)
        .step_by(2)
        .filter(|s| ROOTS.iter().any(|r| s.starts_with(r)))
        .filter(|s| !s.contains(char::is_whitespace) && !s.contains('*') && !s.contains('<'))
        .map(|s| {
            s.split(':')
                .next()
                .unwrap_or(s)
                .trim_end_matches([',', '.'])
                .to_string()
        })
        .collect()
}

#[test]
fn every_path_the_documents_name_exists() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut docs = vec![root.join("README.md")];
    let entries = std::fs::read_dir(root.join("docs")).unwrap_or_else(|e| panic!("docs/: {e}"));
    for e in entries.flatten() {
        if e.path().extension().is_some_and(|x| x == "md") {
            docs.push(e.path());
        }
    }
    let mut missing = Vec::new();
    let mut checked = 0;
    for doc in &docs {
        let text = std::fs::read_to_string(doc).unwrap_or_else(|e| panic!("{doc:?}: {e}"));
        for p in named_paths(&text) {
            checked += 1;
            if !root.join(&p).exists() {
                missing.push(format!("{}: `{p}`", doc.display()));
            }
        }
    }
    assert!(
        checked > 50,
        "only {checked} paths found: is the extraction broken?"
    );
    assert!(
        missing.is_empty(),
        "paths named but absent:\n{}",
        missing.join("\n")
    );
}

#[test]
fn the_extraction_finds_paths_and_only_paths() {
    let t = "see `host/src/layout.rs`, `cargo test`, `docs/`, `src/cli/repro.rs:12` and `x/y`";
    assert_eq!(
        named_paths(t),
        ["host/src/layout.rs", "docs/", "src/cli/repro.rs"]
    );
}
