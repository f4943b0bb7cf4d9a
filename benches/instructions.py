#!/usr/bin/env python3
"""Counts instructions and locked instructions per admission + release, ours and our peers'.

Instruction counts do not move with the host's load or its atomics' speed (the same binary,
inputs and environment give the same count), so they are what CI gates on; nanoseconds are
judged by the full `targets.py` run only.

How: `benches/cycles.rs` runs one case's iteration in a loop (`count CASE N`); valgrind's
callgrind counts what the loop function executes (`--toggle-collect`), once with N iterations
and once with 2N, and the difference divided by N is one iteration's cost (start-up and the
warm-up cancel out). With `--dump-instr=yes` it gives the count of every instruction address;
the locked ones (a `lock` prefix, or `xchg` with memory, which locks without one) are found
in the binary's disassembly (`objdump -d`), so their executions are counted too.

    python3 benches/instructions.py                   # every case, a table
    python3 benches/instructions.py budget ...        # only these cases
    python3 benches/instructions.py --write-ceilings  # record ours in instructions.json

`targets.py` imports `measure()` for its TARGET lines, and gates CI on `instructions.json`:
the counts of our cases as last recorded, which a change may lower but not raise (they are
deterministic, so the gate is exact).
"""
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Iterations of the shorter run; the longer one runs twice as many.
ITERATIONS = 20_000

# Every case of `benches/cycles.rs` the targets read, in the order the table shows them.
CASES = [
    "raw_cas",
    "no_budget", "tokio_try_acquire", "async_lock_try_acquire",
    "budget", "budget_sampled", "tokio_two_semaphores",
    "classes", "classes_owned", "classes_await", "classes_owned_await",
    "classes_default", "classes_default_await",
    "await_budget", "await_no_budget", "tokio_acquire_await",
    "bulkhead_try_acquire", "bulkhead_await",
    "rejection_full", "rejection_closed", "rejection_rate", "tokio_rejection",
    "budget_owned", "await_owned", "within", "within_await", "rate_window", "rate_window_owned", "rate_window_await", "one_requests_window", "one_tokens_window",
]


def build():
    """Builds `benches/cycles.rs` (release, as `cargo bench` does); its executable's path."""
    out = subprocess.run(
        ["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "cycles", "--no-run", "--message-format=json"],
        cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        message = json.loads(line)
        if (message.get("reason") == "compiler-artifact"
                and message["target"]["name"] == "cycles" and message.get("executable")):
            return message["executable"]
    raise SystemExit("benches/cycles.rs built no executable")


def locked_addresses(exe):
    """The addresses of the locked instructions in `exe`'s code."""
    listing = subprocess.run(["objdump", "-d", "--no-show-raw-insn", exe], check=True,
                             capture_output=True, text=True).stdout
    addresses = set()
    for line in listing.splitlines():
        match = re.match(r"\s*([0-9a-f]+):\s+(.*)", line)
        if not match:
            continue
        code = match.group(2)
        if re.match(r"lock\b", code) or (re.match(r"xchg", code) and "(" in code):
            addresses.add(int(match.group(1), 16))
    return addresses


def callgrind(exe, case, iterations):
    """`(instructions, locked instructions)` executed by the measured loop of `case`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "callgrind.out")
        subprocess.run(
            ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
             "--toggle-collect=*cycles::measured*", "--dump-instr=yes",
             exe, "count", case, str(iterations)],
            cwd=ROOT, check=True, capture_output=True)
        return costs(out, exe)


def costs(path, exe):
    """Sums a callgrind output's self costs: all of them, and those at locked instructions of
    `exe`. The format compresses names (`ob=(3) name`, then `ob=(3)`) and positions (an
    address may be absolute, `+n`/`-n` from the previous, or `*` for the same); the line after
    `calls=` is a call's inclusive cost, not the calling instruction's own, and is skipped."""
    locked = LOCKED[exe]
    objects = {}
    in_exe = False
    address = 0
    total = 0
    at_locked = 0
    skip_next = False
    with open(path) as f:
        for line in f:
            if not line or line[0] in "#\n":
                continue
            if line.startswith(("ob=", "cob=")):
                # Both define names (one numbering); only `ob=` says where costs are.
                match = re.match(r"c?ob=\((\d+)\)(?: (.*))?", line.strip())
                if match:
                    number, name = match.groups()
                    if name is not None:
                        objects[number] = name
                    if line.startswith("ob="):
                        in_exe = objects.get(number) == exe
                continue
            if line.startswith("calls="):
                skip_next = True
                continue
            if "=" in line.split(" ")[0]:
                continue
            first = line.split()
            if not first or not (first[0][0] in "+-*" or first[0].startswith("0x")):
                continue
            position = first[0]
            if position.startswith("0x"):
                address = int(position, 16)
            elif position[0] in "+-":
                address += int(position)
            if skip_next:
                skip_next = False
                continue
            cost = int(first[2]) if len(first) > 2 else 0
            total += cost
            if in_exe and address in locked:
                at_locked += cost
    return total, at_locked


LOCKED = {}


def measure(cases=CASES, iterations=ITERATIONS):
    """`{case: (instructions, locked instructions)}` per iteration."""
    exe = build()
    LOCKED[exe] = locked_addresses(exe)
    # The runs are independent processes and their counts do not depend on the load: one per
    # core at a time.
    runs = [(case, n) for case in cases for n in (iterations, 2 * iterations)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        counted = dict(zip(runs, pool.map(lambda run: callgrind(exe, *run), runs)))
    return {
        case: tuple((b - a) / iterations
                    for a, b in zip(counted[(case, iterations)], counted[(case, 2 * iterations)]))
        for case in cases
    }


# Our cases (the others are peers): the ones CI holds to their recorded counts.
OURS = [c for c in CASES if not c.startswith(("tokio", "async_lock", "raw_cas"))]
CEILINGS = os.path.join(ROOT, "benches", "instructions.json")


def ceilings():
    """The recorded instruction counts of our cases (`--write-ceilings`)."""
    with open(CEILINGS) as f:
        return json.load(f)


def main():
    args = sys.argv[1:]
    write = "--write-ceilings" in args
    cases = [a for a in args if not a.startswith("--")] or CASES
    results = measure(cases)
    print(f"{'case':28s} {'instructions':>12s} {'locked':>7s}   (per admission + release)")
    for case, (instructions, locked) in results.items():
        print(f"{case:28s} {instructions:12.1f} {locked:7.2f}")
    if write:
        recorded = {case: results[case][0] for case in OURS if case in results}
        with open(CEILINGS, "w") as f:
            json.dump(recorded, f, indent=2, sort_keys=True)
            f.write("\n")
        print(f"recorded {len(recorded)} ceilings in {os.path.relpath(CEILINGS, ROOT)}")


if __name__ == "__main__":
    main()
