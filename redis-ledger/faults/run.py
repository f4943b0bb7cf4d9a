#!/usr/bin/env python3
"""The ledger's multi-process fault suite: a driver and its analyzer (standard library only).

For each scenario it starts a redis-server on a free loopback port and N replica processes
(the `fault_replica` example), applies one fault (kill -9 of a replica, DEBUG SLEEP, Redis
killed and restarted without data, a partition of one replica through a TCP proxy, a replica's
clock at half speed), stops everything, then sweeps every replica's log to find the tokens
really in flight at each instant (calls between their `start` and `end` lines; a killed
replica's open calls end at its death) and compares them with the global budget.

    python3 redis-ledger/faults/run.py            # every scenario, a markdown table
    python3 redis-ledger/faults/run.py --quick    # the CI subset (~30 s), non-zero on a broken bound

Bounds: exact mode failing closed, 0 tokens over the budget; a local floor, at most
replicas x floor; leased mode the same, plus (for a replica cut off from Redis) the calls it
still had in flight when it last admitted (they outlive its slice); --lenient-leased reports
leased mode without judging it.
"""

import argparse
import asyncio
import bisect
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
NS = "{faults}"


def now_us():
    return time.time_ns() // 1000


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- a minimal RESP client -------------------------------------------------------------------


def encode(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def read_reply(f):
    line = f.readline()
    if not line.endswith(b"\r\n"):
        raise ConnectionError("connection closed")
    kind, rest = line[:1], line[1:-2]
    if kind == b"+":
        return rest.decode()
    if kind == b"-":
        return RuntimeError(rest.decode())
    if kind == b":":
        return int(rest)
    if kind == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2].decode()
    if kind == b"*":
        n = int(rest)
        return None if n < 0 else [read_reply(f) for _ in range(n)]
    raise ConnectionError("bad reply %r" % line)


class Conn:
    """One connection to Redis; `call` sends commands in one pipeline and reads every reply."""

    def __init__(self, port, timeout):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self.file = self.sock.makefile("rb")

    def call(self, *commands):
        self.sock.sendall(b"".join(encode(*c) for c in commands))
        return [read_reply(self.file) for _ in commands]

    def close(self):
        try:
            self.file.close()
            self.sock.close()
        except OSError:
            pass


# --- processes -------------------------------------------------------------------------------


class Redis:
    """A redis-server without persistence on a loopback port; killed and started again on it."""

    def __init__(self, workdir):
        self.port = free_port()
        self.workdir = workdir
        self.proc = None
        self.launch()

    def launch(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--enable-debug-command", "yes", "--dir", self.workdir],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while time.time() < deadline:
            try:
                c = Conn(self.port, 0.2)
                ok = c.call(["PING"])[0] == "PONG"
                c.close()
                if ok:
                    return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer on port %d" % self.port)

    def kill(self):
        if self.proc:
            self.proc.kill()
            self.proc.wait()
            self.proc = None

    def sleep(self, seconds):
        """DEBUG SLEEP from a thread; returns once Redis has begun sleeping."""
        def run():
            c = Conn(self.port, seconds + 30)
            c.call(["DEBUG", "SLEEP", "%.3f" % seconds])
            c.close()
        t = threading.Thread(target=run, daemon=True)
        t.start()
        time.sleep(0.03)
        return t


class Proxy:
    """A TCP proxy (asyncio, its own thread) in front of Redis for one replica. `cut(s)`
    stops forwarding either way for `s` seconds: bytes wait in the proxy (as in the network
    while TCP retransmits) and flow again after it, as when a partition heals."""

    def __init__(self, target_port):
        self.target = target_port
        self.port = free_port()
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self.main(),),
                                       daemon=True)
        self.thread.start()
        self.ready.wait(5)

    async def main(self):
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.stop = asyncio.Event()
        server = await asyncio.start_server(self.client, "127.0.0.1", self.port)
        self.ready.set()
        async with server:
            await self.stop.wait()

    async def pump(self, reader, writer):
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                await self.flowing.wait()
                writer.write(data)
                await writer.drain()
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    async def client(self, reader, writer):
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self.pump(reader, up_writer), self.pump(up_reader, writer))

    def cut(self, seconds):
        self.loop.call_soon_threadsafe(self.flowing.clear)
        self.loop.call_soon_threadsafe(self.loop.call_later, seconds, self.flowing.set)

    def close(self):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(5)


class Replica:
    def __init__(self, binary, name, port, logdir, cfg, seed, faketime=None):
        self.name = name
        self.log = os.path.join(logdir, name + ".log")
        self.death_us = None
        self.speed = None
        args = [binary, "--redis", "redis://127.0.0.1:%d/" % port, "--ns", NS, "--id", name,
                "--mode", cfg["mode"], "--policy", cfg["policy"], "--budget", str(cfg["budget"]),
                "--lease-ms", str(cfg["lease_ms"]), "--renew-ms", str(cfg["renew_ms"]),
                "--timeout-ms", str(cfg["timeout_ms"]), "--retry-ms", str(cfg["retry_ms"]),
                "--tasks", str(cfg["tasks"]), "--max-call-ms", str(cfg["max_call_ms"]),
                "--seed", str(seed), "--log", self.log]
        env = dict(os.environ)
        if faketime:
            # This process's clocks (wall and monotonic) run at `speed` from its start: its log
            # times are mapped back to the real clock (real = start + (fake - start) / speed).
            env.update(faketime[0])
            self.speed = faketime[1]
        self.err = open(os.path.join(logdir, name + ".stderr"), "wb")
        self.spawn_us = now_us()
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, env=env)
        self.marks = []

    def calibrate(self):
        """Asks the replica its clock a few times (`c` -> `clock <us>`); keeps the answer of the
        shortest round trip as one point (its clock, the real time mid-way)."""
        best = None
        for _ in range(7):
            sent = now_us()
            self.proc.stdin.write(b"c\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline().split()
            received = now_us()
            if len(answer) == 2 and (best is None or received - sent < best[0]):
                best = (received - sent, int(answer[1]), (sent + received) / 2)
            time.sleep(0.005)
        self.marks.append(best)

    def real(self, t):
        """A time of this replica's log on the real clock: the identity, or for a slowed clock
        the line through its two calibration points."""
        if self.speed is None or len(self.marks) < 2:
            return t
        (_, f1, r1), (_, f2, r2) = self.marks[0], self.marks[-1]
        return r1 + (t - f1) * (r2 - r1) / (f2 - f1)

    def is_ready(self):
        try:
            with open(self.log) as f:
                return f.readline().startswith("ready")
        except OSError:
            return False

    def kill9(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.death_us = now_us()

    def stop(self):
        try:
            self.proc.stdin.close()
        except OSError:
            pass

    def wait(self, timeout):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            self.death_us = now_us()
        self.err.close()


class Sampler(threading.Thread):
    """Reads the ledger's total, the replicas Redis has a lease for, and whether `watch` (a
    replica) still holds anything, every 20 ms on its own connection:
    `(sent_us, received_us, total, watched_present, leased_replicas)` per sample, `None`
    figures while Redis does not answer within 100 ms (it then reconnects). Every 5 ms instead
    with `period` 0.005 (a restart: the replicas come back within tens of ms)."""

    def __init__(self, port, watch=None, period=0.02):
        super().__init__(daemon=True)
        self.port, self.watch, self.period = port, watch, period
        self.samples = []
        self.halt = threading.Event()

    def run(self):
        conn = None
        while not self.halt.is_set():
            sent = now_us()
            try:
                if conn is None:
                    conn = Conn(self.port, 0.1)
                commands = [["GET", NS + ":total"], ["ZRANGE", NS + ":leases", 0, -1]]
                if self.watch:
                    commands += [["EXISTS", NS + ":holds:" + self.watch],
                                 ["HEXISTS", NS + ":slices", self.watch]]
                replies = conn.call(*commands)
                total, leased = int(replies[0] or 0), replies[1]
                present = None
                if self.watch:
                    present = self.watch in leased or replies[2] == 1 or replies[3] == 1
                self.samples.append((sent, now_us(), total, present, leased))
            except (OSError, ConnectionError, ValueError):
                if conn:
                    conn.close()
                conn = None
                self.samples.append((sent, now_us(), None, None, None))
            time.sleep(self.period)
        if conn:
            conn.close()


# --- analysis --------------------------------------------------------------------------------


def read_log(replica):
    """Calls `(start_us, end_us, tokens)`, every other event, and the log's stats line."""
    starts, calls, info = {}, [], {"ready": None, "exit": None, "stats": {}, "last": None}
    with open(replica.log) as f:
        for line in f:
            parts = line.split()
            if len(parts) < 2 or not line.endswith("\n"):
                continue  # a line cut by the kill
            kind, t = parts[0], replica.real(int(parts[1]))
            info["last"] = t
            if kind == "start":
                starts[parts[3]] = (t, int(parts[2]))
            elif kind == "end" and parts[3] in starts:
                s, tokens = starts.pop(parts[3])
                calls.append((s, t, tokens))
            elif kind == "ready":
                info["ready"] = t
            elif kind == "exit":
                info["exit"] = t
            elif kind == "stats":
                info["stats"] = dict(p.split("=") for p in parts[2:])
    # Calls without an `end`: in flight until the process died (or, stopped normally, until
    # its last line).
    until = replica.death_us or info["exit"] or info["last"] or now_us()
    for s, tokens in starts.values():
        calls.append((s, until, tokens))
    return calls, info


def sweep(calls):
    """The tokens in flight as a step function: `times` and the value from each on."""
    events = []
    for s, e, tokens in calls:
        events.append((s, 1, tokens))
        # At one instant, ends first: an `end` is logged before its release, which comes before
        # any admission the release makes room for.
        events.append((e, 0, -tokens))
    events.sort()
    times, values, level = [], [], 0
    for t, _, delta in events:
        level += delta
        if times and times[-1] == t:
            values[-1] = level
        else:
            times.append(t)
            values.append(level)
    return times, values


def longest_starved(calls, tasks, since, until):
    """The longest time (us) within `[since, until]` that one replica had a task free (fewer
    than `tasks` calls in flight) and admitted nothing: what its refusals cost it."""
    events = sorted([(s, 1) for s, _, _ in calls] + [(e, -1) for _, e, _ in calls])
    level, free_since, longest = 0, since, 0
    for t, delta in events:
        if delta > 0:
            if free_since is not None and t > since:
                longest = max(longest, min(t, until) - max(free_since, since))
            level += 1
            free_since = None if level >= tasks else t
        else:
            level -= 1
            if free_since is None and level < tasks:
                free_since = t
        if t >= until:
            break
    if free_since is not None and free_since < until:
        longest = max(longest, until - max(free_since, since))
    return max(longest, 0)


def over_budget(times, values, budget):
    """Max in flight, and the total time (us) above the budget."""
    peak, over = 0, 0
    for i, v in enumerate(values):
        peak = max(peak, v)
        if v > budget and i + 1 < len(times):
            over += times[i + 1] - times[i]
    return peak, over


def shortfalls(calls, samples):
    """Where Redis's total was below the tokens surely in flight while it was read (calls begun
    before the read was sent and ended after its reply: the ledger must count them):
    `(received_us, shortfall)` for every such sample."""
    by_end = sorted(calls, key=lambda c: c[1])
    ends = [c[1] for c in by_end]
    times, values = sweep(calls)
    out = []
    for sent, received, total, _, _ in samples:
        if total is None:
            continue
        i = bisect.bisect_right(times, sent) - 1
        level = values[i] if i >= 0 else 0
        # Calls ending between the send and the reply may have been released before the read.
        for s, e, tokens in by_end[bisect.bisect_right(ends, sent):
                                   bisect.bisect_right(ends, received)]:
            if s <= sent:
                level -= tokens
        if level > total:
            out.append((received, level - total))
    return out


# --- scenarios -------------------------------------------------------------------------------

BASE = {"mode": "exact", "policy": "closed", "budget": 20_000, "lease_ms": 3_000,
        "renew_ms": 1_000, "timeout_ms": 100, "retry_ms": 100, "tasks": 8, "max_call_ms": 200}


def scenario(name, fault, mode="exact", policy="closed", replicas=4, warmup=None, after=None,
             **overrides):
    cfg = dict(BASE, mode=mode, policy=policy, **overrides)
    if warmup is None:
        # Leased replicas join with what the first left and reach their shares over a few
        # rebalances: the fault waits for that.
        warmup = 4.0 if mode == "leased" else 2.0
    return {"name": name, "fault": fault, "cfg": cfg, "replicas": replicas, "warmup": warmup,
            "after": after}


# Calls long enough to outlive a Redis restart (LLM calls last seconds): what a restart
# without data makes Redis forget, and the replicas must put back.
LONG = {"max_call_ms": 4_000}


def full_scenarios(faketime_ok):
    out = []
    families = [("exact", "closed"), ("exact", "floor:1500"), ("leased", "closed"),
                ("leased", "floor:1500")]
    for mode, policy in families:
        main = policy == "closed"  # every scenario; the floors: where Redis is out of reach
        exact_closed = main and mode == "exact"
        if main:
            out.append(scenario("a plain", ("none",), mode, policy, after=5.0))
            out.append(scenario("b kill -9 one replica", ("kill9",), mode, policy, after=4.0))
        if exact_closed:
            out.append(scenario("c DEBUG SLEEP 1 s (< lease 3 s)", ("sleep", 1.0), mode, policy,
                                after=3.0))
        if mode == "exact" or main:
            out.append(scenario("d DEBUG SLEEP 4 s (> lease 3 s)", ("sleep", 4.0), mode, policy,
                                after=3.0))
        if exact_closed:
            out.append(scenario("d DEBUG SLEEP 10 s (10x lease 1 s)", ("sleep", 10.0), mode,
                                policy, after=3.0, lease_ms=1_000, renew_ms=300))
        if mode == "exact" or main:
            out.append(scenario("e Redis restarted empty after 1 s, calls <= 4 s",
                                ("restart", 1.0), mode, policy, after=5.0, **LONG))
        if main:
            out.append(scenario("e Redis restarted empty after 2 s, calls <= 4 s",
                                ("restart", 2.0), mode, policy, after=5.0, **LONG))
        out.append(scenario("f partition of one replica, 4 s", ("partition", 4.0), mode, policy,
                            after=4.0))
        if main:
            out.append(scenario("f partition of one replica, 4 s, calls <= 4 s",
                                ("partition", 4.0), mode, policy, after=5.0, **LONG))
        if faketime_ok and main:
            out.append(scenario("g one replica's clock at half speed", ("halfclock", 0.0), mode,
                                policy, after=6.0))
            out.append(scenario("g half-speed replica partitioned 4 s", ("halfclock", 4.0),
                                mode, policy, after=5.0))
    return out


def quick_scenarios():
    q = {"lease_ms": 2_000, "renew_ms": 500, "replicas": 3, "warmup": 1.5}
    return [
        scenario("a plain", ("none",), after=4.0, **q),
        scenario("b kill -9 one replica", ("kill9",), after=3.5, **q),
        scenario("d DEBUG SLEEP 3 s (> lease 2 s)", ("sleep", 3.0), after=3.0, **q),
        scenario("e Redis restarted empty after 1 s, calls <= 4 s", ("restart", 1.0), after=4.0,
                 **dict(q, **LONG)),
    ]


def bound_of(cfg, replicas, judge_leased):
    """(bound in tokens over the budget, whether it is judged): replicas x floor (0 failing
    closed); leased mode is judged too unless `--lenient-leased`."""
    floor = int(cfg["policy"].split(":")[1]) if cfg["policy"].startswith("floor:") else 0
    judged = cfg["mode"] == "exact" or judge_leased
    return replicas * floor, judged


def held_at_last_start(calls, since, until):
    """The tokens one replica held in flight right after its last admission in
    `[since, until]` (at `since` if it admitted nothing then)."""
    starts = [s for s, _, _ in calls if since <= s <= until]
    at = max(starts) if starts else since
    return sum(tokens for s, e, tokens in calls if s <= at < e)


def faketime_env():
    """libfaketime's preload for a clock at half speed, if installed."""
    for lib in ("/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
                "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1"):
        if os.path.exists(lib):
            return {"LD_PRELOAD": lib, "FAKETIME": "+0 x0.5", "FAKETIME_NO_CACHE": "1"}
    return None


def run_scenario(binary, sc, workdir, judge_leased, verbose):
    cfg, n = sc["cfg"], sc["replicas"]
    logdir = tempfile.mkdtemp(prefix="scenario-", dir=workdir)
    redis = Redis(logdir)
    kind = sc["fault"][0]
    cut = sc["fault"][1] if kind in ("partition", "halfclock") else 0
    proxy = Proxy(redis.port) if cut else None
    replicas = []
    for i in range(n):
        port = proxy.port if proxy and i == 0 else redis.port
        fake = (faketime_env(), 0.5) if kind == "halfclock" and i == 0 else None
        replicas.append(Replica(binary, "r%d" % i, port, logdir, cfg, seed=1000 + i,
                                faketime=fake))
    deadline = time.time() + 15
    while not all(r.is_ready() for r in replicas):
        if time.time() > deadline or any(r.proc.poll() is not None for r in replicas):
            raise RuntimeError("replicas did not start: see %s" % logdir)
        time.sleep(0.02)
    for r in replicas:
        if r.speed is not None:
            r.calibrate()
    watch = replicas[0].name if kind == "kill9" else None
    sampler = Sampler(redis.port, watch, 0.005 if kind == "restart" else 0.02)
    sampler.start()
    t_ready = now_us()
    time.sleep(sc["warmup"])
    fault_us = now_us()
    notes = []
    if kind == "kill9":
        replicas[0].kill9()
        fault_us = replicas[0].death_us
    elif kind == "sleep":
        redis.sleep(sc["fault"][1]).join()
    elif kind == "restart":
        redis.kill()
        time.sleep(sc["fault"][1])
        redis.launch()
        sampler.port = redis.port
    elif cut:
        proxy.cut(cut)
        time.sleep(cut)
    fault_end_us = now_us()
    time.sleep(sc["after"])
    for r in replicas:
        if r.speed is not None:
            r.calibrate()
    stop_us = now_us()
    for r in replicas:
        if r.death_us is None:
            r.stop()
    for r in replicas:
        r.wait(15)
    sampler.halt.set()
    sampler.join(5)
    if proxy:
        proxy.close()
    redis.kill()

    calls, admitted, stats, starved, cut_held = [], 0, {}, 0, 0
    for i, r in enumerate(replicas):
        c, info = read_log(r)
        calls += c
        if cut and i == 0:
            # The cut-off replica (r0) in leased mode: what it held in flight when it last
            # admitted during the cut (it admits nothing after its lease's local end).
            cut_held = held_at_last_start(c, fault_us, fault_end_us)
        if r.death_us is None:
            # After the fault ends (Redis back, the link restored): how long recovery
            # starves a replica.
            starved = max(starved, longest_starved(c, cfg["tasks"], fault_end_us, stop_us))
        admitted += sum(1 for s, _, _ in c if t_ready <= s < stop_us)
        for k, v in info["stats"].items():
            stats[k] = stats.get(k, 0) + int(v)
    times, values = sweep(calls)
    peak, over_us = over_budget(times, values, cfg["budget"])
    budget = cfg["budget"]
    bound, judged = bound_of(cfg, n, judge_leased)
    if cfg["mode"] == "leased" and cut:
        # Leased mode's stated bound for a cut-off replica: its calls still in flight once
        # Redis gives its slice away (at most what it held at its last admission).
        bound += cut_held
        notes.append("r0 held %d in flight at its last admission during the cut" % cut_held)
    over = max(0, peak - budget)
    passed = over <= bound
    if kind == "kill9":
        back = next((s[1] for s in sampler.samples if s[0] > fault_us and s[3] is False), None)
        notes.append("its tokens back in Redis %s after the kill (lease %d ms)" % (
            "never" if back is None else "%d ms" % ((back - fault_us) / 1000), cfg["lease_ms"]))
    if kind == "restart":
        # When each replica was back in Redis (a lease again: re-registered or renewed).
        back = []
        for r in replicas:
            t = next((s[1] for s in sampler.samples
                      if s[0] >= fault_end_us and s[4] and r.name in s[4]), None)
            back.append("never" if t is None else "%+d" % ((t - fault_end_us) / 1000))
        notes.append("replicas back in Redis at %s ms of its restart" % ", ".join(back))
    if cfg["policy"] == "closed":
        short = shortfalls(calls, sampler.samples)
        if short:
            notes.append("Redis's total below the tokens surely in flight in %d samples, by up "
                         "to %d, from %+d to %+d ms of the fault" % (
                             len(short), max(x for _, x in short),
                             (short[0][0] - fault_us) / 1000, (short[-1][0] - fault_us) / 1000))
    for r in replicas:
        if r.speed is not None:
            (rtt1, f1, r1), (rtt2, f2, r2) = r.marks[0], r.marks[-1]
            notes.append("%s's clock ran at %.3f of the real one (calibrated to %d us)" % (
                r.name, (f2 - f1) / (r2 - r1), max(rtt1, rtt2) / 2))
    for key in ("admitted_on_floor", "reregistrations", "reregistered_tokens", "leases_lost"):
        if stats.get(key):
            notes.append("%s %d" % (key, stats[key]))
    with open(os.path.join(logdir, "meta.json"), "w") as f:
        json.dump({"ready_us": t_ready, "fault_us": fault_us, "fault_end_us": fault_end_us,
                   "stop_us": stop_us, "samples": sampler.samples,
                   "clocks": {r.name: r.marks for r in replicas},
                   "deaths": {r.name: r.death_us for r in replicas}, "config": cfg}, f)
    result = {
        "scenario": sc["name"], "mode": cfg["mode"], "policy": cfg["policy"],
        "replicas": "%dx%d" % (n, cfg["tasks"]), "budget": budget, "max_in_flight": peak,
        "over_at_max": over, "ms_over": round(over_us / 1000, 1),
        "admissions_per_s": round(admitted / ((stop_us - t_ready) / 1e6), 1),
        "starved_ms": round(starved / 1000),
        "bound": bound, "judged": judged, "passed": passed, "notes": "; ".join(notes),
        "logs": logdir,
    }
    if verbose:
        print(json.dumps(result), file=sys.stderr, flush=True)
    return result


def table(results):
    head = ("| scenario | mode | policy | replicas x tasks | budget | max in flight | over at max "
            "| ms over | admissions/s | longest starved ms | bound | result | notes |")
    lines = [head, "|" + "---|" * 13]
    for r in results:
        verdict = ("pass" if r["passed"] else "FAIL") if r["judged"] else (
            "not judged (within)" if r["passed"] else "not judged (over)")
        lines.append("| %s | %s | %s | %s | %d | %d | %d | %.1f | %.1f | %d | <= %d | %s | %s |" % (
            r["scenario"], r["mode"], r["policy"], r["replicas"], r["budget"],
            r["max_in_flight"], r["over_at_max"], r["ms_over"], r["admissions_per_s"],
            r["starved_ms"], r["bound"], verdict, r["notes"]))
    return "\n".join(lines)


def target_dir():
    meta = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                          cwd=REPO, capture_output=True, check=True, text=True)
    return json.loads(meta.stdout)["target_directory"]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the CI subset (about a minute)")
    p.add_argument("--lenient-leased", action="store_true",
                   help="report leased mode without judging it")
    p.add_argument("--only", action="append", default=[],
                   help="run only the scenarios whose '<name> <mode> <policy>' contains this "
                        "(repeat: all must match)")
    p.add_argument("--skip", action="append", default=[],
                   help="leave out the scenarios whose '<name> <mode> <policy>' contains this")
    p.add_argument("--repeat", type=int, default=1, help="run each scenario this many times")
    p.add_argument("--json", help="also write the results to this file")
    p.add_argument("--keep", action="store_true", help="keep the logs (printed per scenario)")
    p.add_argument("--no-build", action="store_true", help="use the example already built")
    p.add_argument("--debug", action="store_true",
                   help="build and run the example in the dev profile (reuses a test build)")
    p.add_argument("-v", "--verbose", action="store_true")
    args = p.parse_args()
    if shutil.which("redis-server") is None:
        sys.exit("redis-server must be installed (apt-get install -y redis-server)")
    started = time.time()
    if not args.no_build:
        profile = [] if args.debug else ["--release"]
        subprocess.run(["cargo", "build", "-q", "-p", "async-bulkhead-llm-redis", "--example",
                        "fault_replica"] + profile, cwd=REPO, check=True)
    binary = os.path.join(target_dir(), "debug" if args.debug else "release", "examples",
                          "fault_replica")
    scenarios = quick_scenarios() if args.quick else full_scenarios(faketime_env() is not None)
    scenarios = [s for s in scenarios if all(
        term in "%s %s %s" % (s["name"], s["cfg"]["mode"], s["cfg"]["policy"])
        for term in args.only) and not any(
        term in "%s %s %s" % (s["name"], s["cfg"]["mode"], s["cfg"]["policy"])
        for term in args.skip) for _ in range(args.repeat)]
    workdir = tempfile.mkdtemp(prefix="ledger-faults-")
    results = []
    try:
        for sc in scenarios:
            r = run_scenario(binary, sc, workdir, not args.lenient_leased, args.verbose)
            results.append(r)
            print("%-45s %-7s %-11s max %6d  over %5d  %7.1f ms over  %6.1f adm/s  "
                  "starved %5d ms  %s" % (
                r["scenario"], r["mode"], r["policy"], r["max_in_flight"], r["over_at_max"],
                r["ms_over"], r["admissions_per_s"], r["starved_ms"],
                ("pass" if r["passed"] else "FAIL") if r["judged"] else "reported"),
                flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print()
    print(table(results))
    print()
    print("%d scenarios in %.0f s; host: %s, %d cores" % (
        len(results), time.time() - started, os.uname().nodename, os.cpu_count()))
    if args.keep:
        print("logs in", workdir)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    broken = [r for r in results if r["judged"] and not r["passed"]]
    if broken:
        print("broken bounds: " + ", ".join("%s (%s %s)" % (r["scenario"], r["mode"],
                                                          r["policy"]) for r in broken))
        sys.exit(1)


if __name__ == "__main__":
    main()
