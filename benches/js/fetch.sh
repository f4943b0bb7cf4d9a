#!/bin/sh
# Unpacks the JavaScript original into benches/js/node_modules (git-ignored).
#
# `npm install async-bulkhead-llm@3.17.0` fails: it declares a dependency
# (async-bulkhead-ts) that is not published. Its shipped dist/esm code never loads it, so
# the tarball from `npm pack` is all the benchmark needs.
set -eu
cd "$(dirname "$0")"
target=node_modules/async-bulkhead-llm
if [ -f "$target/dist/esm/index.js" ]; then
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent async-bulkhead-llm@3.17.0 >/dev/null)
mkdir -p "$target"
tar -xzf "$work"/async-bulkhead-llm-3.17.0.tgz -C "$target" --strip-components=1
test -f "$target/dist/esm/index.js"
