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
        "import these through crate::sync (or crate::sync::unmodeled):\n{}",
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
