//! Rules of the repository that its docs state and no compiler checks, checked on its files:
//! the crate takes atomics, locks and `Arc` only through `src/support/sync.rs` (so that `--cfg loom`
//! swaps every modelled one at once), and its code reads without the project's history (no
//! issue numbers, no documents outside the repository).

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let Ok(entries) = fs::read_dir(dir) else {
        return files;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files.sort();
    files
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Lines of code (not comments) of `text`, with their numbers.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    text.lines()
        .enumerate()
        .map(|(i, line)| (i + 1, line))
        .filter(|(_, line)| !line.trim_start().starts_with("//"))
}

#[test]
fn atomics_locks_and_arcs_come_from_the_sync_module() {
    let src = root().join("src");
    let forbidden = [concat!("std::", "sync"), concat!("core::", "sync::atomic")];
    let mut found = Vec::new();
    for file in rust_files(&src) {
        let relative = file.strip_prefix(&src).unwrap();
        // The shim itself; and the integrations, ordinary users of the public API.
        if relative == Path::new("support/sync.rs") || relative.starts_with("integrations") {
            continue;
        }
        let text = fs::read_to_string(&file).unwrap();
        for (number, line) in code_lines(&text) {
            if forbidden.iter().any(|f| line.contains(f)) {
                found.push(format!(
                    "src/{}:{number}: {}",
                    relative.display(),
                    line.trim()
                ));
            }
        }
    }
    assert!(
        found.is_empty(),
        "import these through crate::support::sync (or crate::support::sync::unmodeled):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_code_cites_no_issue_numbers_and_no_document_outside_the_repository() {
    let issue = cites_an_issue;
    let outside = [
        concat!("RUST-", "DESIGN"),
        concat!("shared/", "spec"),
        concat!("upstream ", "§"),
    ];
    let mut found = Vec::new();
    for dir in [
        "src",
        "tests",
        "benches",
        "examples",
        "loom-tests",
        "redis-ledger",
    ] {
        for file in rust_files(&root().join(dir)) {
            if file.ends_with("house_rules.rs") {
                continue;
            }
            let text = fs::read_to_string(&file).unwrap();
            for (number, line) in text.lines().enumerate() {
                if issue(line) || outside.iter().any(|o| line.contains(o)) {
                    let relative = file.strip_prefix(root()).unwrap();
                    found.push(format!(
                        "{}:{}: {}",
                        relative.display(),
                        number + 1,
                        line.trim()
                    ));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "history in the code:\n{}",
        found.join("\n")
    );
}

/// Whether `line` says "issue #N" or "issue N" (any case), N a number.
fn cites_an_issue(line: &str) -> bool {
    let lower = line.to_lowercase();
    let mut rest = lower.as_str();
    while let Some(at) = rest.find("issue") {
        let after = rest[at + "issue".len()..].trim_start_matches(['s', ' ']);
        let after = after.strip_prefix('#').unwrap_or(after);
        if after.starts_with(|c: char| c.is_ascii_digit()) {
            return true;
        }
        rest = &rest[at + "issue".len()..];
    }
    false
}

#[test]
fn the_issue_reference_check_sees_what_it_must() {
    assert!(cites_an_issue("fixed in Issue #11, item 5"));
    assert!(cites_an_issue("see issue 17"));
    assert!(!cites_an_issue("a known issue with the clock"));
    assert!(!cites_an_issue("issues of timing"));
}

/// The layers of `src/`, bottom up: a file may import (`crate::x`) only from its own layer's
/// folder or from a lower layer. `ARCHITECTURE.md` says what each layer owns.
const LAYERS: &[&[&str]] = &[
    &["support"],
    &["vocabulary"],
    &["engine"],
    &["events", "stats"],
    &["bulkhead", "llm"],
    &["http"],
    &["integrations"],
];

/// The layer of a top-level module of `src/` (a folder or a file), if it has one.
fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|layer| layer.contains(&module))
}

/// The top-level module a file of `src/` belongs to (`src/engine/state.rs` -> `engine`).
fn top_module(file: &Path) -> String {
    let relative = file.strip_prefix(root().join("src")).expect("under src/");
    let first = relative.components().next().expect("a component");
    let name = first.as_os_str().to_string_lossy();
    name.trim_end_matches(".rs").to_owned()
}

/// The names `x` of every `crate::x` a line of code mentions.
fn crate_paths(line: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = line;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        rest = &rest[at + "crate::".len()..];
        if before.is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            continue;
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        found.push(name);
    }
    found
}

#[test]
fn imports_point_down_the_layers() {
    let mut found = Vec::new();
    for file in rust_files(&root().join("src")) {
        let own = top_module(&file);
        if own == "lib" {
            continue; // the root declares and re-exports every layer
        }
        let own_layer = layer_of(&own).unwrap_or_else(|| panic!("{own} has no layer"));
        let text = fs::read_to_string(&file).expect("readable");
        for (number, line) in code_lines(&text) {
            for target in crate_paths(line) {
                let Some(target_layer) = layer_of(&target) else {
                    // A root re-export (`crate::LlmBulkhead`, `crate::tower::...`) from below
                    // the root is an import that points up.
                    found.push(format!("{}:{number}: crate::{target}", file.display()));
                    continue;
                };
                if target_layer > own_layer || (target_layer == own_layer && target != own) {
                    found.push(format!("{}:{number}: crate::{target}", file.display()));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "imports that point up (or sideways) the layers:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_layer_check_sees_what_it_must() {
    assert_eq!(crate_paths("use crate::engine::Grant;"), ["engine"]);
    assert_eq!(
        crate_paths("let x = crate::vocabulary::a(); $crate::x; mycrate::y;"),
        ["vocabulary"]
    );
    assert_eq!(layer_of("integrations"), Some(6));
    assert!(layer_of("llm") > layer_of("engine"));
}
