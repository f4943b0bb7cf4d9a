#!/usr/bin/env python3
"""Runs the side-by-side benches and checks every performance target of docs/design.md §D5.

It also checks the deduplication and observe-mode targets that benches/README.md adds. One
command (about 10 minutes on a 2-vCPU machine):

    python3 benches/targets.py

It runs the criterion benches (single-thread groups in a quick mode, the multi-thread groups
with their own longer sampling), the JavaScript original in several fresh Node processes, and
the counting-allocator test, then prints the raw medians and one line per target:

    TARGET <name> ratio=<measured> goal=<goal> PASS|FAIL

Every ratio compares figures measured in the same run; a target with an absolute bound
(dedup_unique_key_overhead, tower_layer_overhead) shows the measured difference in ns as its value. Criterion's
results are read where criterion writes them ($CRITERION_HOME, else $CARGO_TARGET_DIR/criterion,
else target/criterion). Options:

    --no-run    only summarise the criterion results already under target/criterion
    --no-js     skip the JavaScript original (no Node.js or npm registry at hand)
    --ci        CI's quick mode (`.ci/run`, a few minutes): no criterion and no JS; the
                instruction counts (`instructions.py`), the plain loops (`cycles.rs`, short)
                and the counting-allocator test. It exits 1 for an allocation on a fast path,
                an instruction count above its recorded ceiling (`instructions.json`), or an
                instruction goal met before and missed now; nanosecond ratios are printed
                (with the host's raw CAS figure) but judged by the full run only

The multi-thread groups (scaling, events_2_threads, classes_2_threads, the LLM bulkhead's
waiting bench and the general Bulkhead's hand-off) run in 5 separate processes and are judged
on the median, with the min and max printed beside it; so are the single-thread ratios of one bench to another measured
apart (the async path, the class path: PAIRED_GROUPS).

Exits with status 1 if a target fails.
"""
import argparse
import glob
import re
import json
import os
import shutil
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where criterion writes, looked up as criterion does: $CRITERION_HOME, else
# $CARGO_TARGET_DIR/criterion, else target/criterion (relative paths from the crate's root,
# where the benches run).
CRITERION = os.path.join(ROOT, os.environ.get("CRITERION_HOME") or os.path.join(
    os.environ.get("CARGO_TARGET_DIR") or "target", "criterion"))
JS_DIR = os.path.join(ROOT, "benches", "js")
QUICK = ["--warm-up-time", "0.3", "--measurement-time", "1", "--sample-size", "20", "--noplot"]
JS_PROCESSES = 5


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import instructions  # noqa: E402  (benches/instructions.py, beside this file)


def plain_loops(quick):
    """ns per iteration of every case of `benches/cycles.rs` (fixed iterations, median of
    several runs, no criterion); fewer and shorter runs in CI's quick mode."""
    env = dict(os.environ)
    if quick:
        env.update(CYCLES_RUNS="3", CYCLES_ITERATIONS="300000")
    out = subprocess.run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "cycles", "--", "ns"], cwd=ROOT,
                         check=True, capture_output=True, text=True, env=env).stdout
    found = {}
    for line in out.splitlines():
        match = re.match(r"(\w+) ([0-9.]+)$", line.strip())
        if match:
            found[match.group(1)] = float(match.group(2))
    return found


# Goals in instructions per admission + release (docs/design.md §D5), each a ratio of two
# cases of `benches/cycles.rs`: (name, ours, theirs, goal).
INSTRUCTION_GOALS = [
    ("instructions_no_budget_vs_tokio_try_acquire", "no_budget", "tokio_try_acquire", 1.2),
    ("instructions_budget_vs_two_tokio_semaphores", "budget", "tokio_two_semaphores", 1.0),
    ("instructions_classes_vs_no_classes", "classes", "budget", 1.5),
    ("instructions_acquire_await_vs_try_acquire", "await_budget", "budget", 1.3),
    ("instructions_tenant_within_global_vs_one_bulkhead", "within", "budget_owned", 2.0),
    ("instructions_rate_window_vs_none", "rate_window", "budget", 1.3),
    ("instructions_rate_window_owned_vs_none", "rate_window_owned", "budget_owned", 1.3),
    ("instructions_rate_window_await_vs_none", "rate_window_await", "await_budget", 1.3),
    ("instructions_bulkhead_try_acquire_vs_tokio_try_acquire", "bulkhead_try_acquire",
     "tokio_try_acquire", 1.0),
    ("instructions_bulkhead_await_vs_tokio_acquire_await", "bulkhead_await",
     "tokio_acquire_await", 1.0),
]
# The same ratios in ns on the plain loops, and the other single-thread goals: judged by the
# full run (ns move with the host: its raw CAS figure is printed beside them).
PLAIN_GOALS = [
    ("plain_no_budget_vs_tokio_try_acquire", "no_budget", "tokio_try_acquire", 1.0),
    ("plain_budget_vs_two_tokio_semaphores", "budget", "tokio_two_semaphores", 0.8),
    ("plain_classes_vs_no_classes", "classes", "budget", 1.5),
    ("plain_tenant_within_global_vs_one_bulkhead", "within", "budget_owned", 2.0),
    ("plain_rate_window_vs_none", "rate_window", "budget", 1.3),
    ("plain_acquire_await_vs_try_acquire", "await_budget", "budget", 1.3),
    ("plain_acquire_await_vs_tokio_acquire_await", "await_budget", "tokio_acquire_await", 1.0),
    ("plain_bulkhead_try_acquire_vs_tokio_try_acquire", "bulkhead_try_acquire",
     "tokio_try_acquire", 1.0),
    ("plain_bulkhead_await_vs_tokio_acquire_await", "bulkhead_await", "tokio_acquire_await", 1.0),
]
# Criterion's figure and the plain loop's of the same case must agree within 15%.
AGREEMENT = [
    ("no_budget", "uncontended_no_budget/llm_bulkhead"),
    ("tokio_try_acquire", "uncontended_no_budget/tokio_semaphore"),
    ("budget", "uncontended_budget/llm_bulkhead"),
    ("tokio_two_semaphores", "uncontended_budget/tokio_two_semaphores"),
    ("classes", "classes_1_thread/four_classes"),
    ("raw_cas", "uncontended_no_budget/raw_cas"),
]


def run(cmd, **kwargs):
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=ROOT, check=True, **kwargs)


def run_benches():
    shutil.rmtree(CRITERION, ignore_errors=True)
    # The multi-thread groups (scaling, events_2_threads) set their own sampling in code.
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "admission", "--bench", "estimate", "--"] + QUICK,
        stdout=subprocess.DEVNULL)
    # classes_2_threads sets its own (longer) sampling in code, like the groups below.
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "classes", "--"] + QUICK, stdout=subprocess.DEVNULL)
    paired_runs()
    multi_thread_runs()
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "dedup", "--"] + QUICK, stdout=subprocess.DEVNULL)
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--features", "tower", "--bench", "tower", "--"] + QUICK,
        stdout=subprocess.DEVNULL)
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--features", "metrics,tracing", "--bench", "observability", "--"]
        + QUICK, stdout=subprocess.DEVNULL)
    waiting_runs()
    # The general Bulkhead: its single-thread group quick, its hand-off group with the
    # sampling set in code (like `waiting`).
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "bulkhead", "--", "bulkhead_uncontended"] + QUICK,
        stdout=subprocess.DEVNULL)
    run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "bulkhead", "--no-run"], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    handoff_runs()
    ledger_runs()


def ledger_runs():
    """The Redis ledger (workspace member `redis-ledger`): its bench starts its own
    redis-server on a free loopback port. Criterion runs it from the member's directory, so
    its output is sent to the same place as the others'."""
    if shutil.which("redis-server") is None:
        print("+ ledger bench skipped: redis-server is not installed", flush=True)
        return
    run(["cargo", "bench", "-p", "async-bulkhead-llm-redis", "--bench", "ledger", "--",
         "--warm-up-time", "1", "--measurement-time", "3", "--noplot"],
        stdout=subprocess.DEVNULL, env={**os.environ, "CRITERION_HOME": CRITERION})


# The single-thread targets that divide one bench by another (the async path by
# `try_acquire` and by tokio, `try_acquire` without a budget by tokio's, the class path by the
# same bulkhead without classes and by three tokio semaphores) are judged on the median of PAIRED_PROCESSES processes, each running the
# benches of its ratio back to back (the first is the full run's), with the min and max
# beside it: the machine's speed drifts between two benches measured minutes apart, and one
# process's ratio moved by up to 0.3 (benches/README.md, "The async fast path").
PAIRED_PROCESSES = 5
PAIRED_GROUPS = [
    # The whole `uncontended/budget` group, not only `llm_bulkhead`: the budget targets
    # divide it by its neighbours, which must come from the same (the last) process.
    ("admission", "^(uncontended/budget/|uncontended/no_budget/(llm_bulkhead|tokio_semaphore)$|"
                  "vs_js/(acquire_await_budget|tokio_semaphore_acquire_await)$)"),
    ("classes", "^classes_1_thread/"),
]
PAIRED_RATIOS = []


def paired_ratios():
    m = medians()
    tried, v, c = m["uncontended_budget/llm_bulkhead"], "vs_js/", "classes_1_thread/"
    awaited = m[v + "acquire_await_budget"]
    classes, plain = m[c + "four_classes"], m[c + "no_classes"]
    # The least a class cycle could cost: the class protocol's locked instructions alone,
    # plus everything the path without classes does besides its own (no class decision).
    floor = m[c + "atomics_floor"] + plain - m[c + "atomics_floor_no_classes"]
    plain_try = m["uncontended_no_budget/llm_bulkhead"]
    return {
        "no_budget_vs_tokio": plain_try / m["uncontended_no_budget/tokio_semaphore"],
        "awaited_ns": awaited,
        "await_vs_try": awaited / tried,
        "await_vs_tokio": awaited / m[v + "tokio_semaphore_acquire_await"],
        "classes_vs_plain": classes / m[c + "no_classes"],
        "classes_vs_tokio": classes / m[c + "tokio_three_semaphores"],
        "floor_vs_plain": floor / plain,
    }


def paired_runs():
    PAIRED_RATIOS.clear()
    PAIRED_RATIOS.append(paired_ratios())
    for _ in range(PAIRED_PROCESSES - 1):
        for bench, groups in PAIRED_GROUPS:
            run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", bench, "--", groups] + QUICK,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        PAIRED_RATIOS.append(paired_ratios())


# The multi-thread groups (one limiter hammered from several threads) are judged like the
# hand-off below: MULTI_PROCESSES separate processes (the first is the full run's), the
# target on the median, with the min and max beside it; the two-thread budget target also
# fails if any process falls below 1.0x tokio (see benches/README.md, "Multi-thread figures").
MULTI_PROCESSES = 5
MULTI_GROUPS = [
    ("admission", "^(scaling|events_2_threads)/"),
    ("classes", "^classes_2_threads/"),
]
MULTI_RATIOS = []


def multi_thread_ratios():
    m = medians()
    s, c2 = "scaling/", "classes_2_threads/"
    return {
        "budget_2": m[s + "tokio_semaphore/2"] / m[s + "llm_bulkhead_budget/2"],
        "no_budget_2": m[s + "tokio_semaphore/2"] / m[s + "llm_bulkhead_no_budget/2"],
        "classes_2": m[c2 + "tokio_three_semaphores"] / m[c2 + "four_classes"],
    }


def multi_thread_runs():
    MULTI_RATIOS.clear()
    MULTI_RATIOS.append(multi_thread_ratios())
    for _ in range(MULTI_PROCESSES - 1):
        for bench, groups in MULTI_GROUPS:
            run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", bench, "--", groups, "--noplot"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        MULTI_RATIOS.append(multi_thread_ratios())


# The LLM bulkhead's waiting bench (64 tasks on a multi-thread tokio runtime) is judged the
# same way, over WAITING_PROCESSES processes.
WAITING_PROCESSES = 5
WAITING = "waiting_64_tasks_4_slots/"
WAITING_RATIOS = []


def waiting_runs():
    WAITING_RATIOS.clear()
    for _ in range(WAITING_PROCESSES):
        run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "waiting", "--", "--noplot"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        m = medians()
        WAITING_RATIOS.append({
            case: m[WAITING + "tokio_semaphore/acquire"] / m[WAITING + "llm_bulkhead/" + case]
            for case in ("no_budget", "budget")
        })


# The hand-off benches on two workers are bimodal on a shared 2-core machine (see
# benches/README.md): each process is judged on its own, and the target on the median of
# HANDOFF_PROCESSES processes, with the min and max beside it.
HANDOFF_PROCESSES = 5
HANDOFF = "bulkhead_waiting_64_tasks_4_slots/"
HANDOFF_RATIOS = []


def handoff_runs():
    HANDOFF_RATIOS.clear()
    for _ in range(HANDOFF_PROCESSES):
        run(["cargo", "bench", "-p", "async-bulkhead-llm-benches", "--bench", "bulkhead", "--", "bulkhead_waiting", "--noplot"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        m = medians()
        HANDOFF_RATIOS.append({
            workers: (m[HANDOFF + f"tokio_semaphore/{workers}"]
                      / m[HANDOFF + f"bulkhead_wait_indefinitely/{workers}"],
                      m[HANDOFF + f"tokio_semaphore/{workers}"]
                      / m[HANDOFF + f"bulkhead_defaults/{workers}"])
            for workers in (1, 2)
        })


def medians():
    found = {}
    for path in glob.glob(os.path.join(CRITERION, "**", "new", "estimates.json"), recursive=True):
        bench = os.path.relpath(os.path.dirname(os.path.dirname(path)), CRITERION)
        with open(path) as f:
            found[bench] = json.load(f)["median"]["point_estimate"]
    return found


def run_js():
    """Median ns per acquire + release of the JavaScript original, per case, over fresh
    processes (Node's figures vary up to 2x between processes)."""
    run(["sh", os.path.join(JS_DIR, "fetch.sh")])
    results = {}
    for case in ["budget", "no_budget"]:
        samples = []
        for _ in range(JS_PROCESSES):
            out = subprocess.run(["node", "bench.mjs", case], cwd=JS_DIR, check=True,
                                 capture_output=True, text=True).stdout
            samples.append(json.loads(out.strip().splitlines()[-1])["ns_per_cycle"])
        results[case] = (statistics.median(samples), samples)
    return results


def allocations_test():
    result = subprocess.run(["cargo", "test", "-p", "async-bulkhead-llm-benches", "--profile", "bench", "--quiet", "--test", "alloc"],
                            cwd=ROOT, capture_output=True, text=True)
    return result.returncode == 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-run", action="store_true")
    parser.add_argument("--no-js", action="store_true")
    parser.add_argument("--ci", action="store_true",
                        help="CI's quick mode: shorter sampling, one process per multi-thread "
                             "group, no JS; fails only on an allocation on a fast path or a "
                             "ratio worse than 3x its goal (what noise cannot explain)")
    args = parser.parse_args()
    global MULTI_PROCESSES, HANDOFF_PROCESSES, WAITING_PROCESSES, PAIRED_PROCESSES
    if args.ci:
        args.no_js = True
        MULTI_PROCESSES = HANDOFF_PROCESSES = 1
        # Three: the async ratio's single quick processes ranged 1.16-1.49x.
        PAIRED_PROCESSES = 3
        # The waiting bench's budget case swings most between the machine's regimes: the
        # median of three keeps one slow process from deciding.
        WAITING_PROCESSES = 3
        QUICK[:] = ["--warm-up-time", "0.1", "--measurement-time", "0.5", "--sample-size",
                    "10", "--noplot"]

    if not args.no_run and not args.ci:
        run_benches()
    m = {} if args.ci else medians()
    js = None if args.no_js else run_js()
    allocation_free = None if args.no_run else allocations_test()
    counted = instructions.measure()
    plain = plain_loops(quick=args.ci)

    print("\nMedians (ns per iteration; multi-thread cases: per operation on every thread)")
    for bench in sorted(m):
        print(f"  {bench:62s} {m[bench]:10.2f}")
    if js:
        for case, (median, samples) in js.items():
            listed = ", ".join(f"{s:.0f}" for s in samples)
            print(f"  {'js/acquire_release_' + case:62s} {median:10.2f}  ({listed})")
    print("\nInstructions and locked instructions per admission + release (callgrind)")
    for case, (count, locked) in counted.items():
        print(f"  {case:62s} {count:10.1f} {locked:6.2f}")
    print(f"\nPlain loops (ns per iteration; raw CAS acquire + release on this host: "
          f"{plain.get('raw_cas', float('nan')):.2f} ns)")
    for case, ns in plain.items():
        print(f"  {case:62s} {ns:10.2f}")
    print()

    failed = []

    def target(name, ratio, goal, at_most, note=""):
        ok = ratio <= goal if at_most else ratio >= goal
        sign = "<=" if at_most else ">="
        hard = name == "zero_allocations_fast_path"
        verdict = "PASS" if ok else "FAIL"
        if args.ci and not ok and not hard:
            verdict += " (ci: reported; the full run judges ns)"
        print(f"TARGET {name} ratio={ratio:.2f} goal={sign}{goal} {verdict}"
              + (f"  ({note})" if note else ""))
        if not ok and (not args.ci or hard):
            failed.append(name)

    def have(*names):
        if args.ci:
            return False  # no criterion in CI's quick mode
        missing = [n for n in names if n not in m]
        if missing:
            print(f"TARGET ? missing results: {', '.join(missing)}")
        return not missing

    def spread(values):
        return (f"median {statistics.median(values):.2f}, min {min(values):.2f}, "
                f"max {max(values):.2f} over {len(values)} processes")

    # Instruction counts: the same on every host (callgrind), so CI judges them exactly.
    try:
        recorded = instructions.ceilings()
    except FileNotFoundError:
        recorded = {}
    for case, ceiling in sorted(recorded.items()):
        count = counted[case][0]
        ok = count <= ceiling
        print(f"TARGET instructions_ceiling_{case} ratio={count / ceiling:.3f} goal=<=1.0 "
              f"{'PASS' if ok else 'FAIL'}  ({count:.0f} instructions, recorded {ceiling:.0f}: "
              f"a change may lower it, not raise it)")
        if not ok:
            failed.append(f"instructions_ceiling_{case}")
    for name, ours, theirs, goal in INSTRUCTION_GOALS:
        ratio = counted[ours][0] / counted[theirs][0]
        ok = ratio <= goal
        recorded_ratio = (recorded[ours] / counted[theirs][0]
                          if ours in recorded else float("inf"))
        verdict = "PASS" if ok else "FAIL"
        note = (f"{counted[ours][0]:.0f} vs {counted[theirs][0]:.0f} instructions, "
                f"{counted[ours][1]:.0f} vs {counted[theirs][1]:.0f} locked")
        if not ok and args.ci and recorded_ratio > goal:
            # Not met when recorded either: an open goal, held by its ceiling above.
            verdict += " (ci: an open goal; its count is held by its ceiling)"
        elif not ok:
            failed.append(name)
        print(f"TARGET {name} ratio={ratio:.2f} goal=<={goal} {verdict}  ({note})")
    cas = plain.get("raw_cas")
    for name, ours, theirs, goal in PLAIN_GOALS:
        if ours in plain and theirs in plain:
            target(name, plain[ours] / plain[theirs], goal, True,
                   f"{plain[ours]:.1f} vs {plain[theirs]:.1f} ns; raw CAS {cas:.2f} ns")
    if cas and "rejection_full" in plain:
        worst = max(plain["rejection_full"], plain["rejection_closed"])
        target("plain_rejection_vs_raw_cas_cycle", worst / cas, 1.0, True,
               f"{worst:.1f} ns vs the raw CAS acquire + release {cas:.2f} ns")
    for case, bench in AGREEMENT if m else []:
        if case in plain and bench in m:
            ratio = max(plain[case] / m[bench], m[bench] / plain[case])
            target(f"plain_vs_criterion_{case}", ratio, 1.15, True,
                   f"plain loop {plain[case]:.1f} ns, criterion {m[bench]:.1f} ns")

    a = "uncontended_no_budget/"
    b = "uncontended_budget/"
    if PAIRED_RATIOS:
        ratios = [r["no_budget_vs_tokio"] for r in PAIRED_RATIOS]
        target("no_budget_1_thread_vs_tokio_semaphore", statistics.median(ratios), 1.0, True,
               "try_acquire + release without a budget vs tokio's try_acquire + drop: "
               + spread(ratios))
    elif have(a + "llm_bulkhead", a + "tokio_semaphore"):
        ours, theirs = m[a + "llm_bulkhead"], m[a + "tokio_semaphore"]
        target("no_budget_1_thread_vs_tokio_semaphore", ours / theirs, 1.0, True,
               f"{ours:.1f} vs {theirs:.1f} ns")
    if have(b + "llm_bulkhead", b + "tokio_two_semaphores", b + "raw_cas"):
        ours = m[b + "llm_bulkhead"]
        target("budget_1_thread_vs_two_tokio_semaphores", ours / m[b + "tokio_two_semaphores"],
               0.8, True, f"{ours:.1f} vs {m[b + 'tokio_two_semaphores']:.1f} ns")
        target("budget_1_thread_vs_raw_cas_floor", ours / m[b + "raw_cas"], 2.0, True,
               f"{ours:.1f} vs {m[b + 'raw_cas']:.1f} ns")
    s = "scaling/"
    if MULTI_RATIOS:
        two = [r["budget_2"] for r in MULTI_RATIOS]
        target("budget_2_threads_throughput_vs_tokio_semaphore", statistics.median(two), 1.5,
               False, "throughput at 2 threads, ours with a budget vs tokio's semaphore: "
               + spread(two))
        target("budget_2_threads_never_below_tokio", min(two), 1.0, False,
               "the worst of the processes above")
        plain = [r["no_budget_2"] for r in MULTI_RATIOS]
        print(f"INFO no_budget_2_threads_throughput_vs_tokio_semaphore "
              f"ratio={statistics.median(plain):.2f}  ({spread(plain)})")
    elif have(s + "llm_bulkhead_budget/2", s + "tokio_semaphore/2"):
        ours, theirs = m[s + "llm_bulkhead_budget/2"], m[s + "tokio_semaphore/2"]
        target("budget_2_threads_throughput_vs_tokio_semaphore", theirs / ours, 1.5, False,
               f"{ours:.1f} vs {theirs:.1f} ns per iteration (one process: --no-run)")
    if have("rejection/llm_bulkhead_full", "rejection/llm_bulkhead_closed",
            a + "raw_cas"):
        worst = max(m["rejection/llm_bulkhead_full"], m["rejection/llm_bulkhead_closed"])
        target("rejection_vs_raw_cas_cycle", worst / m[a + "raw_cas"], 1.0, True,
               f"{worst:.1f} ns; the 20 ns class is one CAS acquire + release: "
               f"{m[a + 'raw_cas']:.1f} ns")
    e = "estimate_ascii_2000/model_aware/default_model"
    if have(e):
        target("estimate_2000_chars_vs_100ns_class", m[e] / 100.0, 1.0, True,
               f"{m[e]:.1f} ns for a 2,000-character prompt, default estimator")
    w = "waiting_64_tasks_4_slots/"
    for case in ["no_budget", "budget"] if WAITING_RATIOS else []:
        ratios = [r[case] for r in WAITING_RATIOS]
        target(f"waiting_{case}_throughput_vs_tokio_acquire", statistics.median(ratios), 0.75,
               False, spread(ratios))
    for case in ["no_budget", "budget"] if not WAITING_RATIOS else []:
        if have(w + "llm_bulkhead/" + case, w + "tokio_semaphore/acquire"):
            ours, theirs = m[w + "llm_bulkhead/" + case], m[w + "tokio_semaphore/acquire"]
            target(f"waiting_{case}_throughput_vs_tokio_acquire", theirs / ours, 0.75, False,
                   f"{ours:.0f} vs {theirs:.0f} ns per operation")
    if js is not None and have(b + "llm_bulkhead", "vs_js/acquire_await_budget"):
        # The admission call of each API: JS `await acquire()` (a Promise is its only form),
        # Rust `try_acquire` (the same decision, synchronously). The async Rust path is shown
        # too: it adds the future's state machine, not more admission work.
        theirs = js["budget"][0]
        ours = m[b + "llm_bulkhead"]
        target("vs_js", theirs / ours, 50, False,
               f"admission + release with a budget: try_acquire {ours:.1f} ns vs {theirs:.0f} ns")
        awaited = m["vs_js/acquire_await_budget"]
        if PAIRED_RATIOS:
            awaited = statistics.median(r["awaited_ns"] for r in PAIRED_RATIOS)
        target("vs_js_acquire_await", theirs / awaited, 50, False,
               f"acquire().await + release {awaited:.1f} ns vs {theirs:.0f} ns")
    v = "vs_js/"
    if PAIRED_RATIOS:
        ratios = [r["await_vs_try"] for r in PAIRED_RATIOS]
        target("acquire_await_vs_try_acquire", statistics.median(ratios), 1.3, True,
               "acquire().await + release vs try_acquire + release, a slot free, with a "
               "budget: " + spread(ratios))
        ratios = [r["await_vs_tokio"] for r in PAIRED_RATIOS]
        target("acquire_await_vs_tokio_acquire_await", statistics.median(ratios), 1.0, True,
               "vs tokio's Semaphore::acquire().await + drop: " + spread(ratios))
    elif have(b + "llm_bulkhead", v + "acquire_await_budget",
              v + "tokio_semaphore_acquire_await"):
        awaited, tried = m[v + "acquire_await_budget"], m[b + "llm_bulkhead"]
        target("acquire_await_vs_try_acquire", awaited / tried, 1.3, True,
               f"acquire().await + release {awaited:.1f} ns vs try_acquire + release "
               f"{tried:.1f} ns, a slot free, with a budget")
        theirs = m[v + "tokio_semaphore_acquire_await"]
        target("acquire_await_vs_tokio_acquire_await", awaited / theirs, 1.0, True,
               f"{awaited:.1f} vs tokio's Semaphore::acquire().await + drop {theirs:.1f} ns")
    c = "classes_1_thread/"
    if PAIRED_RATIOS:
        ratios = [r["classes_vs_plain"] for r in PAIRED_RATIOS]
        target("classes_1_thread_vs_no_classes", statistics.median(ratios), 1.5, True,
               "4 classes, floors, budget vs the same without classes: " + spread(ratios))
        ratios = [r["classes_vs_tokio"] for r in PAIRED_RATIOS]
        target("classes_1_thread_vs_three_tokio_semaphores", statistics.median(ratios), 0.6,
               True, "vs three tokio semaphores: " + spread(ratios))
        ratios = [r["floor_vs_plain"] for r in PAIRED_RATIOS]
        print(f"INFO classes_1_thread_atomics_floor_vs_no_classes "
              f"ratio={statistics.median(ratios):.2f}  (the class protocol's locked "
              f"instructions alone + the rest of the path without classes, no class "
              f"decision: the least a class cycle can cost; " + spread(ratios) + ")")
    elif have(c + "four_classes", c + "no_classes", c + "tokio_three_semaphores"):
        ours = m[c + "four_classes"]
        target("classes_1_thread_vs_no_classes", ours / m[c + "no_classes"], 1.5, True,
               f"4 classes, floors, budget {ours:.1f} ns vs the same without classes "
               f"{m[c + 'no_classes']:.1f} ns")
        target("classes_1_thread_vs_three_tokio_semaphores",
               ours / m[c + "tokio_three_semaphores"], 0.6, True,
               f"{ours:.1f} vs {m[c + 'tokio_three_semaphores']:.1f} ns")
    c2 = "classes_2_threads/"
    if MULTI_RATIOS:
        ratios = [r["classes_2"] for r in MULTI_RATIOS]
        target("classes_2_threads_throughput_vs_three_tokio_semaphores",
               statistics.median(ratios), 1.5, False, spread(ratios))
    elif have(c2 + "four_classes", c2 + "tokio_three_semaphores"):
        ours, theirs = m[c2 + "four_classes"], m[c2 + "tokio_three_semaphores"]
        target("classes_2_threads_throughput_vs_three_tokio_semaphores", theirs / ours, 1.5,
               False, f"{ours:.1f} vs {theirs:.1f} ns per iteration (one op on each thread)")
    d = "dedup_unique_key/"
    if have(d + "run", d + "run_shared_unique_key", d + "run_shared_no_dedup"):
        # An absolute bound (design §D5: "<= 2 µs more than without"): the value is the
        # difference in ns, the goal a number of ns.
        plain, shared = m[d + "run"], m[d + "run_shared_unique_key"]
        target("dedup_unique_key_overhead", shared - plain, 2000, True,
               f"absolute, in ns: run_shared with a new key {shared:.0f} ns - run "
               f"{plain:.0f} ns, 2,000-character request")
        solo = m[d + "run_shared_no_dedup"]
        print(f"INFO dedup_no_dedup_vs_run ratio={solo / plain:.2f}  "
              f"(run_shared with no_dedup() {solo:.1f} ns vs run {plain:.1f} ns)")
    t = "tower_layer/"
    if have(t + "bare", t + "llm_layer", t + "json_parse", t + "concurrency_limit"):
        # An absolute bound (design §D5: "tower layer overhead per request < 1 us plus the
        # JSON parse"): the layer's time minus the bare service's minus the request's parse.
        bare, ours, parse = m[t + "bare"], m[t + "llm_layer"], m[t + "json_parse"]
        target("tower_layer_overhead", ours - bare - parse, 1000, True,
               f"absolute, in ns: LlmLayer {ours:.0f} ns - bare service {bare:.0f} ns - "
               f"parsing the 2,000-character request {parse:.0f} ns")
        limit = m[t + "concurrency_limit"]
        print(f"INFO tower_concurrency_limit_overhead ratio={limit - bare:.0f}  "
              f"(tower's ConcurrencyLimit {limit:.0f} ns - bare {bare:.0f} ns, in ns)")
    j = "dedup_follower_join/"
    if have(j + "10_keys", j + "10000_keys"):
        few, many = m[j + "10_keys"], m[j + "10000_keys"]
        target("dedup_follower_join_10000_vs_10_keys", many / few, 1.5, True,
               f"join + leave with 10,000 leaders in flight {many:.1f} ns vs 10: {few:.1f} ns")
    o = "observe_admitted/"
    if have(o + "run", o + "run_observe_all"):
        plain, observed = m[o + "run"], m[o + "run_observe_all"]
        target("observe_admitted_vs_run", observed / plain, 1.2, True,
               f"run with observe(ShadowReasons::ALL) {observed:.1f} ns vs without "
               f"{plain:.1f} ns")
    g = "bulkhead_uncontended/"
    if have(g + "bulkhead_try_acquire", g + "tokio_semaphore_try_acquire",
            g + "bulkhead_acquire_await", g + "tokio_semaphore_acquire_await"):
        ours, theirs = m[g + "bulkhead_try_acquire"], m[g + "tokio_semaphore_try_acquire"]
        target("bulkhead_try_acquire_vs_tokio_semaphore", ours / theirs, 1.0, True,
               f"Bulkhead::try_acquire + release {ours:.1f} ns vs tokio's {theirs:.1f} ns")
        awaited, theirs = m[g + "bulkhead_acquire_await"], m[g + "tokio_semaphore_acquire_await"]
        print(f"INFO bulkhead_acquire_await_vs_tokio ratio={awaited / theirs:.2f}  "
              f"(acquire().await + release, a slot free: {awaited:.1f} vs {theirs:.1f} ns)")
    o = "metrics/"
    if have(o + "off", o + "default_sampling", o + "every_call_sampled"):
        on, off = m[o + "default_sampling"], m[o + "off"]
        target("metrics_on_vs_off_1_thread", on / off, 1.5, True,
               f"admission + release with BulkheadMetrics (default sampling, Prometheus "
               f"recorder) {on:.1f} ns vs without {off:.1f} ns; every call sampled "
               f"{m[o + 'every_call_sampled']:.1f} ns")
    if HANDOFF_RATIOS:
        # Like for like: tokio's `acquire().await` has no timeout, so neither does the
        # judged case (`wait_indefinitely`); the defaults (a 10 s queue timeout, a timer
        # armed per queued wait) are shown beside it. Judged on two workers, as a gateway
        # runs; one worker (the machinery's own cost, no contention) is shown.
        two = [r[2][0] for r in HANDOFF_RATIOS]
        target("bulkhead_handoff_2_workers_throughput_vs_tokio_acquire",
               statistics.median(two), 1.0, False, "queued hand-off, no timeout: " + spread(two))
        for workers, case, index in [(1, "no timeout", 0), (2, "defaults, 10 s queue timeout", 1),
                                     (1, "defaults, 10 s queue timeout", 1)]:
            values = [r[workers][index] for r in HANDOFF_RATIOS]
            print(f"INFO bulkhead_handoff_{workers}_worker{'s' if workers > 1 else ''}_"
                  f"{'defaults' if index else 'no_timeout'}_vs_tokio_acquire "
                  f"ratio={statistics.median(values):.2f}  ({case}: {spread(values)})")
    l = "ledger/"
    if shutil.which("redis-server") and have(l + "ping", l + "exact_reserve_release",
                                             l + "exact_64_tasks", l + "local_acquire_release",
                                             l + "leased_acquire_release"):
        ping, exact = m[l + "ping"], m[l + "exact_reserve_release"]
        target("ledger_exact_reserve_release_vs_ping", exact / ping, 2.5, True,
               f"exact mode try_acquire + release {exact / 1000:.1f} us vs PING "
               f"{ping / 1000:.1f} us, one Redis on loopback")
        rate = 1e9 / m[l + "exact_64_tasks"]
        target("ledger_exact_admissions_per_second_vs_20000", rate / 20000, 1.0, False,
               f"{rate:.0f} exact admissions + releases per second, 64 tasks, one Redis")
        leased, local = m[l + "leased_acquire_release"], m[l + "local_acquire_release"]
        target("ledger_leased_vs_local", leased / local, 1.2, True,
               f"admission + release on the leased slice {leased:.1f} ns vs the plain "
               f"bulkhead {local:.1f} ns")
    if allocation_free is not None:
        target("zero_allocations_fast_path", 0 if allocation_free else 1, 0, True,
               "benches/tests/alloc.rs: admission, report, release, drop and refusal, classes included; "
               "the waiting path once warm: queueing, hand-off, cancellation, time-out")

    if failed:
        print(f"\n{len(failed)} target(s) failed: {', '.join(failed)}")
        sys.exit(1)
    if args.ci:
        print("\nci: no allocation on a fast path, no instruction count above its ceiling, "
              "no met instruction goal lost (the full run, without --ci, judges the ns goals)")


if __name__ == "__main__":
    main()
