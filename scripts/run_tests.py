#!/usr/bin/env python3
"""Runs every test of the workspace from one build, in two lanes at once.

`cargo test --workspace --all-features` runs its test binaries one after the other. Most of
them keep the CPU busy (the model and stress suites), but the Redis ledger's mostly wait on
real `redis-server` processes that they kill, stall and restart. So this builds every test
once (`cargo test --workspace --all-features --no-run`, the same build and features), runs
the ledger's test binaries in one lane beside everyone else's in another, then the doc tests
(`cargo test --workspace --all-features --doc`, nothing rebuilt). Each binary runs from its
package's directory, as cargo runs it. A binary's output is printed when it ends; the run
fails (exit 1) if any binary or doc test does, naming them at the end.

    python3 scripts/run_tests.py
"""

import json
import os
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CARGO = ["cargo", "test", "--workspace", "--all-features"]
# The packages (directories) whose binaries mostly wait on other processes: their own lane.
WAITING = {"redis-ledger"}


def build():
    """Every test binary: (its package's directory, from the root; that directory; the
    target's name; the executable)."""
    out = subprocess.run(CARGO + ["--no-run", "--message-format=json-render-diagnostics"],
                         cwd=ROOT, stdout=subprocess.PIPE, check=True, text=True).stdout
    binaries = []
    for line in out.splitlines():
        message = json.loads(line)
        if (message.get("reason") != "compiler-artifact" or not message.get("executable")
                or not message["profile"]["test"]):
            continue
        directory = os.path.dirname(message["manifest_path"])
        binaries.append((os.path.relpath(directory, ROOT), directory,
                         message["target"]["name"], message["executable"]))
    return binaries


def lane(binaries, results, lock):
    for package, directory, name, executable in binaries:
        started = time.monotonic()
        run = subprocess.run([executable], cwd=directory, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
        took = time.monotonic() - started
        with lock:
            print(f"\n     Running {name} ({package}: {os.path.relpath(executable, ROOT)}), "
                  f"{took:.1f} s", flush=True)
            sys.stdout.write(run.stdout)
            sys.stdout.flush()
            results.append((f"{package} {name}", run.returncode))


def main():
    binaries = build()
    waiting = [b for b in binaries if b[0] in WAITING]
    busy = [b for b in binaries if b not in waiting]
    results, lock = [], threading.Lock()
    lanes = [threading.Thread(target=lane, args=(group, results, lock))
             for group in (waiting, busy)]
    for thread in lanes:
        thread.start()
    for thread in lanes:
        thread.join()
    doc = subprocess.run(CARGO + ["--doc"], cwd=ROOT)
    results.append(("doc tests", doc.returncode))
    failed = [name for name, code in results if code != 0]
    ran = len(results) - 1
    if len(binaries) != ran:
        failed.append(f"{len(binaries) - ran} binaries never ran")
    print(f"\n{ran} test binaries and the doc tests: "
          + ("all passed" if not failed else "FAILED: " + ", ".join(failed)))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
