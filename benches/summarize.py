#!/usr/bin/env python3
"""Prints the medians criterion recorded under target/criterion and the ratios that
benches/README.md tracks. Usage: python3 benches/summarize.py [target/criterion]"""
import glob
import json
import os
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "target", "criterion")
medians = {}
for path in glob.glob(os.path.join(root, "**", "new", "estimates.json"), recursive=True):
    bench = os.path.relpath(os.path.dirname(os.path.dirname(path)), root)
    with open(path) as f:
        medians[bench] = json.load(f)["median"]["point_estimate"]

for bench in sorted(medians):
    print(f"{bench:58s} {medians[bench]:10.2f} ns")


def ratio(name, ours, theirs, goal, lower_is_better=True):
    if ours not in medians or theirs not in medians:
        return
    r = medians[ours] / medians[theirs]
    if not lower_is_better:
        r = 1 / r  # a time ratio turned into a throughput ratio
    ok = r <= goal if lower_is_better else r >= goal
    sign = "<=" if lower_is_better else ">="
    print(f"{name:58s} {r:6.2f}x  (goal {sign} {goal}x) {'PASS' if ok else 'MISS'}")


print()
ratio("no budget, 1 thread: ours / tokio", "uncontended_no_budget/llm_bulkhead", "uncontended_no_budget/tokio_semaphore", 1.0)
ratio("budget, 1 thread: ours / two tokio semaphores", "uncontended_budget/llm_bulkhead", "uncontended_budget/tokio_two_semaphores", 0.8)
ratio("budget, 1 thread: ours / raw CAS floor", "uncontended_budget/llm_bulkhead", "uncontended_budget/raw_cas", 2.0)
ratio("budget, 2 threads: throughput ours / tokio", "contended_2_threads/budget/llm_bulkhead", "contended_2_threads/no_budget/tokio_semaphore", 1.5, lower_is_better=False)
ratio("no budget, 2 threads: throughput ours / tokio", "contended_2_threads/no_budget/llm_bulkhead", "contended_2_threads/no_budget/tokio_semaphore", 1.5, lower_is_better=False)
ratio("budget, 2 threads: throughput ours / two tokio semaphores", "contended_2_threads/budget/llm_bulkhead", "contended_2_threads/budget/tokio_two_semaphores", 1.5, lower_is_better=False)
