#!/usr/bin/env python3
"""Licences and bans of every dependency (what `cargo deny check licenses bans` checks, on
`cargo metadata --locked --offline` of the workspace; on a fresh machine the lock file's
packages are fetched first).

Licences: every package outside the workspace must declare a licence expression (SPDX: `OR`,
`AND`, `WITH`, parentheses; the old `/` read as `OR`) that the allowed licences satisfy. The two
published crates must declare `MIT OR Apache-2.0` and ship both licence texts.

Bans: no package from a git or path source outside the workspace, no wildcard version
requirement in our manifests, none of the banned crates (OpenSSL: the crate needs no TLS of its
own, and a system library would break the stand-alone build).

    python3 scripts/check_deps.py        # exit 1 and a list of findings if anything fails
"""
import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ALLOWED = {
    "MIT", "Apache-2.0", "Apache-2.0 WITH LLVM-exception", "BSD-2-Clause", "BSD-3-Clause",
    "ISC", "Unicode-3.0", "Unicode-DFS-2016", "Zlib", "BSL-1.0", "Unlicense", "CC0-1.0",
}
BANNED = {"openssl", "openssl-sys", "native-tls"}
PUBLISHED = {"async-bulkhead-llm": ".", "async-bulkhead-llm-redis": "redis-ledger"}
OUR_LICENCE = "MIT OR Apache-2.0"


def tokens(expression):
    return re.findall(r"\(|\)|[A-Za-z0-9.+-]+(?:\s+WITH\s+[A-Za-z0-9.+-]+)?", expression)


def satisfiable(expression):
    """Whether the allowed licences satisfy `expression` (OR: either side; AND: both)."""
    items = tokens(expression.replace("/", " OR "))
    position = 0

    def parse_or():
        nonlocal position
        value = parse_and()
        while position < len(items) and items[position] == "OR":
            position += 1
            value = parse_and() or value
        return value

    def parse_and():
        nonlocal position
        value = parse_atom()
        while position < len(items) and items[position] == "AND":
            position += 1
            value = parse_atom() and value
        return value

    def parse_atom():
        nonlocal position
        item = items[position]
        position += 1
        if item == "(":
            value = parse_or()
            position += 1  # ")"
            return value
        return re.sub(r"\s+", " ", item) in ALLOWED

    value = parse_or()
    if position != len(items):
        raise ValueError(f"cannot read licence expression {expression!r}")
    return value


def read_metadata():
    """`cargo metadata` of the workspace, every platform's packages included, read offline.
    Offline, cargo needs every package of the lock file in its cache, the other platforms'
    too (wasm's, Windows'), which a build on this one does not download: on a fresh machine
    they are fetched first (`cargo fetch --locked`, from the lock file, nothing resolved)."""
    command = ["cargo", "metadata", "--format-version", "1", "--locked", "--offline"]
    run = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if run.returncode != 0:
        subprocess.run(["cargo", "fetch", "--locked"], cwd=ROOT, check=True,
                       stdout=subprocess.DEVNULL)
        run = subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True)
    return json.loads(run.stdout)


def main():
    metadata = read_metadata()
    members = set(metadata["workspace_members"])
    findings = []
    checked = 0
    for package in metadata["packages"]:
        name, version = package["name"], package["version"]
        if package["id"] in members:
            if name in PUBLISHED:
                if package.get("license") != OUR_LICENCE:
                    findings.append(f"{name}: licence {package.get('license')!r}, not {OUR_LICENCE!r}")
                folder = os.path.join(ROOT, PUBLISHED[name])
                for text in ("LICENSE-MIT", "LICENSE-APACHE"):
                    if not os.path.isfile(os.path.join(folder, text)):
                        findings.append(f"{name}: {text} missing")
            for dependency in package["dependencies"]:
                # A path dependency inside the workspace needs no version.
                if dependency["req"] == "*" and not dependency.get("path"):
                    findings.append(f"{name}: wildcard requirement on {dependency['name']}")
            continue
        checked += 1
        source = package.get("source") or ""
        if not source.startswith("registry+"):
            findings.append(f"{name} {version}: not from a registry ({source or 'a path'})")
        if name in BANNED:
            findings.append(f"{name} {version}: banned")
        licence = package.get("license")
        if not licence:
            findings.append(f"{name} {version}: no licence expression")
        elif not satisfiable(licence):
            findings.append(f"{name} {version}: licence {licence!r} not allowed")
    for finding in findings:
        print("  " + finding)
    print(f"{checked} dependencies checked: "
          + ("every licence allowed, nothing banned" if not findings else f"{len(findings)} findings"))
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
