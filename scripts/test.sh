#!/usr/bin/env bash
# The README's test command: every test of the workspace, as `cargo test --workspace
# --all-features` builds them (the crate's own suites and doc tests, the stress and model
# suites, the benches' allocation test, the loom-free build of the loom models, the Redis
# ledger's tests) on a fresh machine, by itself.
#
# The Redis ledger's tests start their own `redis-server` processes on free loopback ports (and
# kill, stall and restart them; `redis-cli` joins six of them into a Redis Cluster): this
# installs `redis-server` (which brings `redis-cli`) first when either is missing (with apt-get,
# as root or through sudo), and says so when it cannot.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v redis-server >/dev/null 2>&1 || ! command -v redis-cli >/dev/null 2>&1; then
  echo "redis-server is missing: installing it (the Redis ledger's tests start their own)"
  if [ "$(id -u)" -eq 0 ]; then
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
  elif command -v sudo >/dev/null 2>&1; then
    sudo apt-get update -qq && sudo apt-get install -y -qq redis-server >/dev/null
  else
    echo "cannot install redis-server (not root, no sudo): install it, then run this again" >&2
    exit 1
  fi
fi

# With arguments (a filter, `-- --nocapture`, ...): cargo's own run. Without: the same tests
# from the same build, with the Redis ledger's binaries (which mostly wait on the servers they
# kill, stall and restart) run beside the others (scripts/run_tests.py).
if [ "$#" -gt 0 ] || ! command -v python3 >/dev/null 2>&1; then
  exec cargo test --workspace --all-features "$@"
fi
exec python3 scripts/run_tests.py
