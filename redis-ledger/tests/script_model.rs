//! The ledger's Lua scripts, run on a real `redis-server`, against a model of their arithmetic:
//! a property test of RESERVE / USAGE / RELEASE (exact replies, duplicated and reordered usage
//! updates, the total against the holds Redis keeps), and deterministic tests of the lease
//! expiry purge (with RENEW's `lost`) and of the leased mode's PLAN / SHRINK.

mod common;

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_bulkhead_llm_redis::scripts;
use common::{Observed, RedisServer, observe};
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};

const REPLICAS: [&str; 3] = ["r0", "r1", "r2"];
/// Long enough that no lease lapses during a case.
const LONG_LEASE_MS: u64 = 60_000;

/// Every script, loaded from its full source.
struct Scripts {
    reserve: redis::Script,
    usage: redis::Script,
    release: redis::Script,
    renew: redis::Script,
    plan: redis::Script,
    shrink: redis::Script,
    snapshot: redis::Script,
}

impl Scripts {
    fn new() -> Scripts {
        let script = |body: &str| redis::Script::new(&scripts::source(body));
        Scripts {
            reserve: script(scripts::RESERVE),
            usage: script(scripts::USAGE),
            release: script(scripts::RELEASE),
            renew: script(scripts::RENEW),
            plan: script(scripts::PLAN),
            shrink: script(scripts::SHRINK),
            snapshot: script(scripts::SNAPSHOT),
        }
    }
}

/// Runs `script` as `replica` in namespace `ns` with the seven keys, `ns`, `replica`, then `args`.
fn call(
    conn: &mut redis::Connection,
    script: &redis::Script,
    ns: &str,
    replica: &str,
    args: &[String],
) -> Vec<i64> {
    let mut invocation = script.prepare_invoke();
    invocation
        .key(format!("{ns}:total"))
        .key(format!("{ns}:leases"))
        .key(format!("{ns}:holds:{replica}"))
        .key(format!("{ns}:slices"))
        .key(format!("{ns}:wants"))
        .key(format!("{ns}:rate"))
        .key(format!("{ns}:rate:limits"))
        .arg(ns)
        .arg(replica);
    for a in args {
        invocation.arg(a);
    }
    invocation
        .invoke::<Vec<i64>>(conn)
        .unwrap_or_else(|e| panic!("script call by {replica} in {ns} with {args:?}: {e}"))
}

fn args(values: &[&dyn ToString]) -> Vec<String> {
    values.iter().map(|v| v.to_string()).collect()
}

// ---------------------------------------------------------------------------------------------
// The model of the exact mode.

#[derive(Debug, Clone)]
enum Op {
    /// A reservation carrying `riders`: releases of the same replica sent with it.
    Reserve {
        replica: usize,
        id: u8,
        tokens: u64,
        riders: Vec<u8>,
    },
    Usage {
        replica: usize,
        id: u8,
        seq: u64,
        held: u64,
    },
    /// One script releasing one or more ids (a batch; an id may repeat).
    Release { replica: usize, ids: Vec<u8> },
    /// The same usage update sent twice: the second is a duplicate.
    UsageTwice {
        replica: usize,
        id: u8,
        seq: u64,
        held: u64,
    },
    /// Sequence `seq + 1` then `seq`: the second arrives late and must change nothing.
    UsageReordered {
        replica: usize,
        id: u8,
        seq: u64,
        newer: u64,
        older: u64,
    },
}

/// Per replica: admission id -> (held tokens, last sequence); and whether it ever joined (a
/// successful RESERVE gives it a lease, which lasts the whole case).
struct Model {
    budget: u64,
    holds: [BTreeMap<String, (u64, u64)>; 3],
    joined: [bool; 3],
}

impl Model {
    fn new(budget: u64) -> Model {
        Model {
            budget,
            holds: Default::default(),
            joined: [false; 3],
        }
    }

    fn total(&self) -> u64 {
        self.holds
            .iter()
            .flat_map(|h| h.values())
            .map(|&(t, _)| t)
            .sum()
    }

    fn count(&self) -> u64 {
        self.holds.iter().map(|h| h.len() as u64).sum()
    }

    /// `{outcome, total, budget, purged, riders released}`: the riders are released first.
    fn reserve(&mut self, replica: usize, id: &str, tokens: u64, riders: &[String]) -> Vec<i64> {
        let released = riders
            .iter()
            .filter(|r| self.holds[replica].remove(r.as_str()).is_some())
            .count() as i64;
        let total = self.total();
        let budget = self.budget as i64;
        if total + tokens > self.budget {
            return vec![0, total as i64, budget, 0, released];
        }
        if self.holds[replica].contains_key(id) {
            return vec![-1, total as i64, budget, 0, released];
        }
        self.holds[replica].insert(id.to_owned(), (tokens, 0));
        self.joined[replica] = true;
        vec![1, self.total() as i64, budget, 0, released]
    }

    /// `{outcome, total, previous hold}`.
    fn usage(&mut self, replica: usize, id: &str, seq: u64, held: u64) -> Vec<i64> {
        let total = self.total() as i64;
        let Some(hold) = self.holds[replica].get_mut(id) else {
            return vec![-1, total, 0];
        };
        let (old, last) = *hold;
        if seq <= last {
            return vec![0, total, old as i64];
        }
        *hold = (held, seq);
        vec![1, self.total() as i64, old as i64]
    }

    /// `{released, total, tokens freed}`.
    fn release(&mut self, replica: usize, ids: &[String]) -> Vec<i64> {
        let (mut released, mut freed) = (0, 0);
        for id in ids {
            if let Some((tokens, _)) = self.holds[replica].remove(id.as_str()) {
                released += 1;
                freed += tokens as i64;
            }
        }
        vec![released, self.total() as i64, freed]
    }

    fn observed(&self) -> Observed {
        Observed {
            total: self.total(),
            holds: self.total(),
            hold_count: self.count(),
            slices: 0,
            replicas: self.joined.iter().filter(|&&j| j).count() as u64,
        }
    }
}

fn op_strategy() -> impl Strategy<Value = Op> {
    let replica = 0..REPLICAS.len();
    // Skewed toward a few ids, so that updates and releases often find a hold.
    let id = prop_oneof![3 => 0u8..3, 1 => 0u8..8];
    prop_oneof![
        3 => (replica.clone(), id.clone(), prop_oneof![0u64..500, 0u64..5000])
            .prop_flat_map(|(replica, id, tokens)| {
                proptest::collection::vec(0u8..3, 0..3)
                    .prop_map(move |riders| Op::Reserve { replica, id, tokens, riders })
            }),
        3 => (replica.clone(), id.clone(), 0u64..10, 0u64..6000)
            .prop_map(|(replica, id, seq, held)| Op::Usage { replica, id, seq, held }),
        2 => (replica.clone(), id.clone())
            .prop_flat_map(|(replica, id)| {
                proptest::collection::vec(0u8..4, 0..3).prop_map(move |more| {
                    let mut ids = vec![id];
                    ids.extend(more);
                    Op::Release { replica, ids }
                })
            }),
        1 => (replica.clone(), id.clone(), 0u64..10, 0u64..6000)
            .prop_map(|(replica, id, seq, held)| Op::UsageTwice { replica, id, seq, held }),
        1 => (replica, id, 0u64..10, 0u64..6000, 0u64..6000).prop_map(
            |(replica, id, seq, newer, older)| Op::UsageReordered { replica, id, seq, newer, older }
        ),
    ]
}

/// One case: a fresh namespace, then every op on Redis and on the model, compared after each.
fn run_case(
    conn: &mut redis::Connection,
    s: &Scripts,
    ns: &str,
    budget: u64,
    ops: &[Op],
    seen: &mut BTreeMap<(&'static str, i64), u64>,
) -> Result<(), TestCaseError> {
    let mut model = Model::new(budget);
    prop_assert_eq!(
        observe(conn, ns),
        model.observed(),
        "fresh namespace {}",
        ns
    );
    // Every replica joins first (its lease): a reservation of a replica Redis does not know
    // is refused until it registers (`-3`, see `an_unknown_replica_reserves_nothing`).
    for (replica, name) in REPLICAS.iter().enumerate() {
        let got = call_rated(
            conn,
            scripts::REGISTER,
            ns,
            name,
            &args(&[&LONG_LEASE_MS, &0, &0]),
        );
        prop_assert_eq!(got[0], 0, "{} joins {}", name, ns);
        model.joined[replica] = true;
    }
    for (step, op) in ops.iter().enumerate() {
        let ctx = format!("{ns} step {step}: {op:?}");
        match op.clone() {
            Op::Reserve {
                replica,
                id,
                tokens,
                riders,
            } => {
                let id = id.to_string();
                let riders: Vec<String> = riders.iter().map(u8::to_string).collect();
                let mut a = args(&[&id, &tokens, &budget, &LONG_LEASE_MS]);
                a.extend(riders.iter().cloned());
                let got = call(conn, &s.reserve, ns, REPLICAS[replica], &a);
                *seen.entry(("reserve", got[0])).or_default() += 1;
                if got.get(4).is_some_and(|&r| r > 0) {
                    *seen.entry(("riders", 1)).or_default() += 1;
                }
                // Its last two (a window, a wait) are for rate windows and recovery: 0 here.
                prop_assert_eq!(&got[5..], &[0, 0], "RESERVE {}", ctx);
                prop_assert_eq!(
                    got[..5].to_vec(),
                    model.reserve(replica, &id, tokens, &riders),
                    "RESERVE {}",
                    ctx
                );
            }
            Op::Usage {
                replica,
                id,
                seq,
                held,
            } => {
                let id = id.to_string();
                let got = call(
                    conn,
                    &s.usage,
                    ns,
                    REPLICAS[replica],
                    &args(&[&id, &seq, &held]),
                );
                *seen.entry(("usage", got[0])).or_default() += 1;
                prop_assert_eq!(got, model.usage(replica, &id, seq, held), "USAGE {}", ctx);
            }
            Op::Release { replica, ids } => {
                let ids: Vec<String> = ids.iter().map(u8::to_string).collect();
                let got = call(conn, &s.release, ns, REPLICAS[replica], &ids);
                *seen.entry(("release", got[0].min(2))).or_default() += 1;
                prop_assert_eq!(got, model.release(replica, &ids), "RELEASE {}", ctx);
            }
            Op::UsageTwice {
                replica,
                id,
                seq,
                held,
            } => {
                let id = id.to_string();
                let a = args(&[&id, &seq, &held]);
                let first = call(conn, &s.usage, ns, REPLICAS[replica], &a);
                prop_assert_eq!(
                    first,
                    model.usage(replica, &id, seq, held),
                    "USAGE 1st {}",
                    ctx
                );
                let between = observe(conn, ns);
                let second = call(conn, &s.usage, ns, REPLICAS[replica], &a);
                *seen.entry(("duplicate", second[0])).or_default() += 1;
                prop_assert!(
                    second[0] != 1,
                    "a duplicate was applied: {:?} {}",
                    second,
                    ctx
                );
                prop_assert_eq!(
                    second,
                    model.usage(replica, &id, seq, held),
                    "USAGE 2nd {}",
                    ctx
                );
                prop_assert_eq!(observe(conn, ns), between, "the duplicate changed {}", ctx);
            }
            Op::UsageReordered {
                replica,
                id,
                seq,
                newer,
                older,
            } => {
                let id = id.to_string();
                let a = args(&[&id, &(seq + 1), &newer]);
                let first = call(conn, &s.usage, ns, REPLICAS[replica], &a);
                let expected = model.usage(replica, &id, seq + 1, newer);
                prop_assert_eq!(first, expected, "USAGE newer {}", ctx);
                let between = observe(conn, ns);
                let a = args(&[&id, &seq, &older]);
                let second = call(conn, &s.usage, ns, REPLICAS[replica], &a);
                *seen.entry(("late", second[0])).or_default() += 1;
                prop_assert!(
                    second[0] != 1,
                    "a late update was applied: {:?} {}",
                    second,
                    ctx
                );
                let expected = model.usage(replica, &id, seq, older);
                prop_assert_eq!(second, expected, "USAGE older {}", ctx);
                prop_assert_eq!(
                    observe(conn, ns),
                    between,
                    "the late update changed {}",
                    ctx
                );
            }
        }
        prop_assert_eq!(observe(conn, ns), model.observed(), "ledger after {}", ctx);
    }
    // Keeps the database small (`observe` scans the keys).
    let mut del = redis::cmd("DEL");
    for key in ["total", "leases", "slices", "wants"] {
        del.arg(format!("{ns}:{key}"));
    }
    for replica in REPLICAS {
        del.arg(format!("{ns}:holds:{replica}"));
    }
    del.exec(conn).expect("DEL");
    Ok(())
}

#[test]
fn exact_scripts_match_the_model() {
    let server = RedisServer::start();
    let conn = RefCell::new(server.connection().unwrap());
    let s = Scripts::new();
    let case = Cell::new(0u64);
    let seen = RefCell::new(BTreeMap::new());
    let mut runner = TestRunner::new(Config {
        cases: 64,
        failure_persistence: None,
        ..Config::default()
    });
    let strategy = (
        1_000u64..20_000,
        prop::collection::vec(op_strategy(), 10..=60),
    );
    let started = Instant::now();
    let result = runner.run(&strategy, |(budget, ops)| {
        case.set(case.get() + 1);
        let ns = format!("{{case-{}}}", case.get());
        run_case(
            &mut conn.borrow_mut(),
            &s,
            &ns,
            budget,
            &ops,
            &mut seen.borrow_mut(),
        )
    });
    if let Err(e) = result {
        panic!("{e}");
    }
    let seen = seen.into_inner();
    eprintln!("{} cases in {:?}: {seen:?}", case.get(), started.elapsed());
    // The cases reached every outcome (the test is not vacuous); `late` -1 and 0 both happen.
    for outcome in [
        ("reserve", 1),
        ("reserve", 0),
        ("reserve", -1),
        ("usage", 1),
        ("usage", 0),
        ("usage", -1),
        ("release", 1),
        ("release", 0),
        ("release", 2),
        ("riders", 1),
        ("duplicate", 0),
        ("late", 0),
    ] {
        assert!(
            seen.contains_key(&outcome),
            "never saw {outcome:?}: {seen:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Lease expiry.

#[test]
fn a_lapsed_lease_is_purged_by_any_call_and_renew_reports_it_lost() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let s = Scripts::new();
    let ns = "{expiry}";
    let budget = 10_000u64;
    // "a" joins with a lease of 200 ms, "b" with a minute; a renewal then loses nothing.
    assert_eq!(
        call_rated(&mut c, scripts::REGISTER, ns, "a", &args(&[&200, &0, &0]))[..2],
        [0, 0]
    );
    assert_eq!(
        call_rated(
            &mut c,
            scripts::REGISTER,
            ns,
            "b",
            &args(&[&60_000, &0, &0])
        )[..2],
        [0, 0]
    );
    assert_eq!(call(&mut c, &s.renew, ns, "a", &args(&[&200]))[0], 0);

    let r = call(
        &mut c,
        &s.reserve,
        ns,
        "a",
        &args(&[&"1", &300, &budget, &200]),
    );
    assert_eq!(r, vec![1, 300, 10_000, 0, 0, 0, 0]);
    let r = call(
        &mut c,
        &s.reserve,
        ns,
        "a",
        &args(&[&"2", &200, &budget, &200]),
    );
    assert_eq!(r, vec![1, 500, 10_000, 0, 0, 0, 0]);
    let r = call(
        &mut c,
        &s.reserve,
        ns,
        "b",
        &args(&[&"1", &100, &budget, &60_000]),
    );
    assert_eq!(r, vec![1, 600, 10_000, 0, 0, 0, 0]);
    let o = observe(&mut c, ns);
    assert_eq!(
        (o.total, o.holds, o.hold_count, o.replicas),
        (600, 600, 3, 2)
    );

    std::thread::sleep(Duration::from_millis(400));

    // `{total, live replicas, leased replicas}` after the purge of "a".
    let r = call(&mut c, &s.snapshot, ns, "b", &[]);
    assert_eq!(r, vec![100, 1, 0]);
    let o = observe(&mut c, ns);
    assert_eq!(
        o,
        Observed {
            total: 100,
            holds: 100,
            hold_count: 1,
            slices: 0,
            replicas: 1,
        }
    );

    // `{lost, total, live replicas}`: "a" is told, and not renewed, so a later renewal (the
    // first reply may have arrived after "a" stopped waiting) says so again.
    let r = call(&mut c, &s.renew, ns, "a", &args(&[&60_000]));
    assert_eq!(r, vec![1, 100, 1, 0, 0]);
    let r = call(&mut c, &s.renew, ns, "a", &args(&[&60_000]));
    assert_eq!(r, vec![1, 100, 1, 0, 0]);
    // It re-registers (here with nothing left to hold) and renews as before.
    assert_eq!(
        call_rated(
            &mut c,
            scripts::REGISTER,
            ns,
            "a",
            &args(&[&60_000, &0, &0])
        )[..2],
        [0, 100]
    );
    let r = call(&mut c, &s.renew, ns, "a", &args(&[&60_000]));
    assert_eq!(r, vec![0, 100, 2, 0, 0]);
    // Renewing a live lease (with its live hold) loses nothing.
    let r = call(
        &mut c,
        &s.renew,
        ns,
        "b",
        &args(&[&60_000, &20_000, &"1", &"100|0"]),
    );
    assert_eq!(r, vec![0, 100, 2, 0, 0]);
    let o = observe(&mut c, ns);
    assert_eq!(
        (o.total, o.holds, o.hold_count, o.replicas),
        (100, 100, 1, 2)
    );
}

// ---------------------------------------------------------------------------------------------
// Leased mode.

#[test]
fn plan_grows_toward_the_fair_target_and_shrink_makes_room() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let s = Scripts::new();
    let ns = "{leased}";
    let budget = 10_000u64;
    let lease = 60_000u64;
    let check = |c: &mut redis::Connection, total: u64, slices: u64, replicas: u64| {
        let o = observe(c, ns);
        assert!(o.total <= budget, "total {} above the budget", o.total);
        assert_eq!(
            o,
            Observed {
                total,
                holds: 0,
                hold_count: 0,
                slices,
                replicas,
            }
        );
    };
    let plan = |c: &mut redis::Connection, replica: &str, want: u64, floor: u64| {
        call(
            c,
            &s.plan,
            ns,
            replica,
            &args(&[&want, &floor, &budget, &lease, &(lease / 3), &0, &0, &0]),
        )
    };

    // `{slice, target, total, live leased replicas, lost}`. Alone: the whole budget.
    assert_eq!(
        plan(&mut c, "a", 10_000, 0)[..5],
        [10_000, 10_000, 10_000, 1, 1]
    );
    check(&mut c, 10_000, 10_000, 1);

    // "b" is owed half, but nothing is free until "a" shrinks.
    assert_eq!(plan(&mut c, "b", 10_000, 0)[..5], [0, 5_000, 10_000, 2, 1]);
    check(&mut c, 10_000, 10_000, 2);

    // "a" now wants 1: its target drops, its slice does not (PLAN never shrinks).
    assert_eq!(plan(&mut c, "a", 1, 0)[..5], [10_000, 1, 10_000, 2, 0]);
    check(&mut c, 10_000, 10_000, 2);

    // `{slice, total}`.
    let r = call(&mut c, &s.shrink, ns, "a", &args(&[&1]));
    assert_eq!(r, vec![1, 1]);
    check(&mut c, 1, 1, 2);
    // SHRINK never raises.
    let r = call(&mut c, &s.shrink, ns, "a", &args(&[&5]));
    assert_eq!(r, vec![1, 1]);
    check(&mut c, 1, 1, 2);

    // "b" gets its fair share plus all that "a" does not ask for.
    assert_eq!(
        plan(&mut c, "b", 10_000, 0)[..5],
        [9_999, 9_999, 10_000, 2, 0]
    );
    check(&mut c, 10_000, 10_000, 2);
}

// ---------------------------------------------------------------------------------------------
// Rate windows: RESERVE_RATED, USAGE's and RELEASE's corrections, RATE_STATUS, CONFIGURE.

/// [`call`] of the script with `body` (loaded from its full source).
fn call_rated(
    conn: &mut redis::Connection,
    body: &str,
    ns: &str,
    replica: &str,
    args: &[String],
) -> Vec<i64> {
    call(
        conn,
        &redis::Script::new(&scripts::source(body)),
        ns,
        replica,
        args,
    )
}

/// Redis's clock, in microseconds.
fn redis_now_us(c: &mut redis::Connection) -> u64 {
    let t: Vec<u64> = redis::cmd("TIME").query(c).unwrap();
    t[0] * 1_000_000 + t[1]
}

#[test]
fn rated_reserve_charges_the_windows_atomically_on_redis_clock() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let ns = "{rated}";
    // 4 requests and 1,000 tokens per second: a requests tick is 250 ms, a tokens tick 1 ms.
    let limits = ["1000000", "4", "1000"];
    let reserve = |c: &mut redis::Connection, id: &str, tokens: u64, riders: &[&str]| {
        let mut a = args(&[&id, &tokens, &10_000, &LONG_LEASE_MS]);
        a.extend(limits.iter().map(|s| s.to_string()));
        a.extend(riders.iter().map(|s| s.to_string()));
        call_rated(c, scripts::RESERVE_RATED, ns, "a", &a)
    };
    let hash = |c: &mut redis::Connection| -> BTreeMap<String, u64> {
        redis::cmd("HGETALL")
            .arg(format!("{ns}:rate"))
            .query(c)
            .unwrap()
    };

    let join = |c: &mut redis::Connection, ns: &str| {
        call_rated(
            c,
            scripts::REGISTER,
            ns,
            "a",
            &args(&[&LONG_LEASE_MS, &0, &0]),
        )
    };
    assert_eq!(join(&mut c, ns)[..2], [0, 0]);
    let before = redis_now_us(&mut c);
    assert_eq!(
        reserve(&mut c, "1", 100, &[]),
        vec![1, 100, 10_000, 0, 0, 0, 0]
    );
    let after = redis_now_us(&mut c);
    let state = hash(&mut c);
    // Anchored at the call's own instant, charged 1 request and 100 tokens.
    let anchor = state["ro"];
    assert!((before..=after).contains(&anchor), "{state:?}");
    assert_eq!(
        (state["rtat"], state["to"], state["ttat"]),
        (1, anchor, 100)
    );
    // The hold carries the tokens window's charge.
    let hold: String = redis::cmd("HGET")
        .arg(format!("{ns}:holds:a"))
        .arg("1")
        .query(&mut c)
        .unwrap();
    assert_eq!(hold, "100|0|100");
    // The key lives until the windows are whole again plus a window: the requests window is
    // whole 250 ms after the anchor (one tick), so 1.25 s (less the ms since).
    let ttl: i64 = redis::cmd("PTTL")
        .arg(format!("{ns}:rate"))
        .query(&mut c)
        .unwrap();
    assert!((1_200..=1_250).contains(&ttl), "{ttl}");

    // The tokens window refuses 950 more (100 + 950 > 1,000 within the first tick): it would
    // fit once 50 ticks (50 ms) past the anchor have drained; nothing is taken.
    let sent = redis_now_us(&mut c);
    let refused = reserve(&mut c, "2", 950, &[]);
    let (e_min, e_max) = (sent - anchor, redis_now_us(&mut c) - anchor);
    assert_eq!(&refused[..6], &[2, 100, 10_000, 0, 0, 2]);
    let wait = refused[6] as u64;
    assert!(
        (50_000 - e_max.min(50_000)).div_ceil(1_000) <= wait
            && wait <= (50_000 - e_min.min(50_000)).div_ceil(1_000),
        "{refused:?} between {e_min} and {e_max} us after the anchor"
    );
    assert_eq!(hash(&mut c), state);
    // More tokens than the window's limit: never (-1).
    assert_eq!(
        reserve(&mut c, "2", 1_001, &[]),
        vec![2, 100, 10_000, 0, 0, 2, -1]
    );

    // Three more requests fit, the fifth is refused by the requests window (judged first).
    for id in ["3", "4", "5"] {
        assert_eq!(reserve(&mut c, id, 10, &[])[0], 1);
    }
    // It fits at the start of tick 1: 250 ms after the anchor, exactly, on Redis's clock.
    let sent = redis_now_us(&mut c);
    let refused = reserve(&mut c, "6", 10, &[]);
    let (e_min, e_max) = (sent - anchor, redis_now_us(&mut c) - anchor);
    assert_eq!(&refused[..6], &[2, 130, 10_000, 0, 0, 1]);
    let wait = refused[6] as u64;
    assert!(
        (250_000 - e_max).div_ceil(1_000) <= wait && wait <= (250_000 - e_min).div_ceil(1_000),
        "{refused:?} between {e_min} and {e_max} us after the anchor"
    );
    let state = hash(&mut c);
    assert_eq!((state["rtat"], state["ttat"]), (4, 130));

    // Usage beyond the charge is charged (no refusal), a stale update changes nothing.
    let usage = |c: &mut redis::Connection, seq: u64, held: u64, used: u64| {
        call_rated(
            c,
            scripts::USAGE,
            ns,
            "a",
            &args(&[&"3", &seq, &held, &used]),
        )
    };
    assert_eq!(usage(&mut c, 1, 25, 25), vec![1, 145, 10]);
    assert_eq!(hash(&mut c)["ttat"], 145);
    assert_eq!(usage(&mut c, 1, 40, 40), vec![0, 145, 25]);
    assert_eq!(hash(&mut c)["ttat"], 145);
    // A report below the charge gives nothing back (the release does).
    assert_eq!(usage(&mut c, 2, 25, 5), vec![1, 145, 25]);
    assert_eq!(hash(&mut c)["ttat"], 145);
    // Releases: `id=used` corrects from the charge (25 for "3": 20 back; 100 for "1": 60
    // back), a plain id keeps it, riding on a reservation too.
    let released = call_rated(&mut c, scripts::RELEASE, ns, "a", &args(&[&"3=5", &"4"]));
    assert_eq!(released, vec![2, 110, 35]);
    assert_eq!(hash(&mut c)["ttat"], 125);
    // The requests window refuses this one, so only the rider acts.
    let refused = reserve(&mut c, "7", 10, &["1=40"]);
    assert_eq!(&refused[..6], &[2, 10, 10_000, 0, 1, 1]);
    assert_eq!(hash(&mut c)["ttat"], 65);
    let released = call_rated(&mut c, scripts::RELEASE, ns, "a", &args(&[&"5=0"]));
    assert_eq!(released, vec![1, 0, 10]);
    let status = call_rated(&mut c, scripts::RATE_STATUS, ns, "a", &[]);
    let now_ticks = (redis_now_us(&mut c) - anchor) / 1_000;
    assert_eq!(&status[..3], &[1_000_000, 4, 0]);
    assert_eq!(status[4], 1_000);
    // 55 ticks ahead of the anchor, less what drained (a tick a millisecond).
    let remaining = status[5] as u64;
    assert!(
        remaining >= 945 && remaining <= 945 + now_ticks + 1,
        "{status:?} at tick {now_ticks}"
    );

    // CONFIGURE: the same limits agree; others are refused with what is stored.
    let configure = |c: &mut redis::Connection, l: [&str; 3]| {
        call_rated(
            c,
            scripts::CONFIGURE,
            ns,
            "b",
            &args(&[&l[0], &l[1], &l[2]]),
        )
    };
    assert_eq!(configure(&mut c, limits), vec![1]);
    assert_eq!(
        configure(&mut c, ["1000000", "5", "1000"]),
        vec![0, 1_000_000, 4, 1_000]
    );
    assert_eq!(
        configure(&mut c, ["0", "0", "0"]),
        vec![0, 1_000_000, 4, 1_000]
    );
    // RESERVE_RATED with other limits changes nothing (-2).
    let mut a = args(&[&"8", &10, &10_000, &LONG_LEASE_MS]);
    a.extend(["1000000", "4", "999"].map(String::from));
    let before = (observe(&mut c, ns), hash(&mut c));
    assert_eq!(
        call_rated(&mut c, scripts::RESERVE_RATED, ns, "a", &a),
        vec![-2, 0, 10_000, 0, 0, 0, 0]
    );
    assert_eq!((observe(&mut c, ns), hash(&mut c)), before);

    // Never below Redis's now: with the window idle (a tokens window of a day, its tick 86.4
    // ms), a give-back larger than the window's lead stops at now and does not go negative.
    let ns = "{rated-floor}";
    assert_eq!(join(&mut c, ns)[..2], [0, 0]);
    let day = ["86400000000", "0", "1000"];
    let mut a = args(&[&"1", &300, &10_000, &LONG_LEASE_MS]);
    a.extend(day.iter().map(|s| s.to_string()));
    assert_eq!(
        call_rated(&mut c, scripts::RESERVE_RATED, ns, "a", &a)[0],
        1
    );
    let mut a = args(&[&"2", &200, &10_000, &LONG_LEASE_MS]);
    a.extend(day.iter().map(|s| s.to_string()));
    assert_eq!(
        call_rated(&mut c, scripts::RESERVE_RATED, ns, "a", &a)[0],
        1
    );
    let ttat = |c: &mut redis::Connection| -> u64 {
        redis::cmd("HGET")
            .arg(format!("{ns}:rate"))
            .arg("ttat")
            .query(c)
            .unwrap()
    };
    assert_eq!(ttat(&mut c), 500);
    // "1" used nothing: 300 back; "2" reported 200 (its charge): nothing.
    let released = call_rated(
        &mut c,
        scripts::RELEASE,
        ns,
        "a",
        &args(&[&"1=0", &"2=200"]),
    );
    assert_eq!(released, vec![2, 0, 500]);
    assert_eq!(ttat(&mut c), 200);
    // A give-back beyond the lead (the hold of "3" claims a charge of 900, more than the
    // window's 200 ahead) stops at now: tick 0 (the anchor's) here.
    let _: () = redis::cmd("HSET")
        .arg(format!("{ns}:holds:a"))
        .arg("3")
        .arg("0|0|900")
        .query(&mut c)
        .unwrap();
    let released = call_rated(&mut c, scripts::RELEASE, ns, "a", &args(&[&"3=0"]));
    assert_eq!(released, vec![1, 0, 0]);
    assert_eq!(ttat(&mut c), 0);
}

/// A replica Redis does not know (it restarted without its data, or purged the lease) reserves
/// nothing, though its riders are released; `REGISTER` puts its lease and its live holds back
/// (a hold Redis still has is left as it is), and then it reserves as before.
#[test]
fn an_unknown_replica_reserves_nothing_until_it_registers_its_holds() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let s = Scripts::new();
    let ns = "{unknown}";
    let budget = 1_000u64;
    let register = |c: &mut redis::Connection, holds: &[(&str, &str)]| {
        let mut a = args(&[&LONG_LEASE_MS, &0, &0]);
        for (id, value) in holds {
            a.push(id.to_string());
            a.push(value.to_string());
        }
        call_rated(c, scripts::REGISTER, ns, "a", &a)
    };
    let r = call(
        &mut c,
        &s.reserve,
        ns,
        "a",
        &args(&[&"1", &300, &budget, &LONG_LEASE_MS]),
    );
    assert_eq!(r, vec![-3, 0, 1_000, 0, 0, 0, 0]);
    assert_eq!(observe(&mut c, ns).replicas, 0);
    // Two live holds back (one at its third usage update), the lease with them.
    assert_eq!(
        register(&mut c, &[("7", "400|3"), ("8", "200|0")])[..2],
        [600, 600]
    );
    let o = observe(&mut c, ns);
    assert_eq!((o.total, o.hold_count, o.replicas), (600, 2, 1));
    // Registering again adds nothing (the holds are there).
    assert_eq!(register(&mut c, &[("7", "400|3")])[..2], [0, 600]);
    // Judged against them now: 600 + 500 > 1,000.
    let r = call(
        &mut c,
        &s.reserve,
        ns,
        "a",
        &args(&[&"1", &500, &budget, &LONG_LEASE_MS]),
    );
    assert_eq!(r, vec![0, 600, 1_000, 0, 0, 0, 0]);
    // The usage sequence carried over: an older update is stale.
    let r = call(&mut c, &s.usage, ns, "a", &args(&[&"7", &2, &100]));
    assert_eq!(r[0], 0);
    let r = call(
        &mut c,
        &s.reserve,
        ns,
        "a",
        &args(&[&"1", &400, &budget, &LONG_LEASE_MS]),
    );
    assert_eq!(r, vec![1, 1_000, 1_000, 0, 0, 0, 0]);
}

/// The recovery gate (`ns:epoch`). A replica that never knew an epoch (a new process) opens a
/// new ledger at once; a replica that knew one and finds Redis without it (Redis lost its
/// data) opens the new epoch recovering: reservations answer `-4` with the wait, a leased
/// replica's slice comes back and none grows, until the recovery period has passed. A replica
/// of an earlier epoch that comes back after a new process opened the new one moves the end of
/// the recovery to its own period from then.
#[test]
fn a_ledger_that_lost_its_data_admits_nothing_new_for_the_recovery_period() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let s = Scripts::new();
    let ns = "{epoch}";
    let register = |c: &mut redis::Connection, replica: &str, known: u64, quiet: u64| {
        call_rated(
            c,
            scripts::REGISTER,
            ns,
            replica,
            &args(&[&LONG_LEASE_MS, &known, &quiet]),
        )
    };
    let reserve = |c: &mut redis::Connection, replica: &str, id: &str| {
        call(
            c,
            &s.reserve,
            ns,
            replica,
            &args(&[&id, &100, &1_000, &LONG_LEASE_MS]),
        )
    };
    // A new ledger, joined by new processes: open at once, one epoch for both.
    let a = register(&mut c, "a", 0, 400);
    assert_eq!((a[0], a[1], a[3]), (0, 0, 0));
    let epoch = a[2] as u64;
    assert!(
        epoch > 1_600_000_000_000_000,
        "microseconds of Redis's clock: {epoch}"
    );
    assert_eq!(register(&mut c, "b", 0, 400)[2..], [epoch as i64, 0]);
    assert_eq!(reserve(&mut c, "a", "1"), vec![1, 100, 1_000, 0, 0, 0, 0]);

    // Redis loses everything. "a" (which knew the epoch) comes back first, with its hold:
    // a new epoch, recovering for a's 400 ms.
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    assert_eq!(reserve(&mut c, "a", "2")[0], -3);
    let back = call_rated(
        &mut c,
        scripts::REGISTER,
        ns,
        "a",
        &args(&[&LONG_LEASE_MS, &epoch, &400, &"1", &"100|0"]),
    );
    assert_eq!(back[..2], [100, 100]);
    assert_ne!(back[2] as u64, epoch);
    assert!(back[3] > 300 && back[3] <= 400, "{back:?}");
    // "a" reserves nothing new, and neither does "b" once it is back.
    let r = reserve(&mut c, "a", "2");
    assert_eq!(r[..6], [-4, 100, 1_000, 0, 0, 0]);
    assert!(r[6] > 0 && r[6] <= 400, "{r:?}");
    assert_eq!(register(&mut c, "b", epoch, 400)[..2], [0, 100]);
    assert_eq!(reserve(&mut c, "b", "1")[0], -4);
    assert_eq!(observe(&mut c, ns).total, 100);
    std::thread::sleep(Duration::from_millis(450));
    assert_eq!(reserve(&mut c, "b", "1"), vec![1, 200, 1_000, 0, 0, 0, 0]);
    let open: String = redis::cmd("HGET")
        .arg(format!("{ns}:epoch"))
        .arg("open")
        .query(&mut c)
        .unwrap();
    assert_eq!(open, "0", "the first call past the recovery clears it");

    // Lost again; this time a new process "c" is first (it cannot know): open at once. Then
    // "a" of the earlier epoch comes back: recovering from now, for its period.
    let before = back[2] as u64;
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    let fresh = register(&mut c, "c", 0, 400);
    assert_eq!(fresh[3], 0);
    assert_eq!(reserve(&mut c, "c", "1")[0], 1);
    let late = register(&mut c, "a", before, 400);
    assert!(late[3] > 300 && late[3] <= 400, "{late:?}");
    assert_eq!(reserve(&mut c, "c", "2")[0], -4);
    // A replica whose lease lapsed in the same epoch re-registers without a recovery.
    std::thread::sleep(Duration::from_millis(450));
    assert_eq!(register(&mut c, "a", fresh[2] as u64, 400)[3], 0);

    // Leased: recovering, a replica Redis forgot puts its installed slice back, and nothing
    // grows; afterwards, slices grow again.
    let ns = "{epoch-leased}";
    let plan = |c: &mut redis::Connection, replica: &str, known: u64, installed: u64| {
        call(
            c,
            &s.plan,
            ns,
            replica,
            &args(&[
                &5_000,
                &0,
                &10_000,
                &LONG_LEASE_MS,
                &1_000,
                &known,
                &400,
                &installed,
            ]),
        )
    };
    let first = plan(&mut c, "a", 0, 0);
    assert_eq!(first[..5], [5_000, 5_000, 5_000, 1, 1]);
    assert_eq!(first[6], 0);
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    let back = plan(&mut c, "a", first[5] as u64, 5_000);
    assert_eq!(back[..5], [5_000, 5_000, 5_000, 1, 1]);
    assert!(back[6] > 300 && back[6] <= 400, "{back:?}");
    // "b" (new) gets nothing while recovering, though 5,000 are free.
    let b = plan(&mut c, "b", 0, 0);
    assert_eq!((b[0], b[2], b[4]), (0, 5_000, 1));
    assert!(b[6] > 0);
    std::thread::sleep(Duration::from_millis(450));
    let b = plan(&mut c, "b", b[5] as u64, 0);
    assert_eq!((b[0], b[2], b[6]), (5_000, 10_000, 0));

    // A replica whose slice ended locally (its lease ran out unrenewed: installed 0) still has
    // 3,000 in flight: Redis lost everything; they are counted, and nothing grows.
    let _: () = redis::cmd("FLUSHALL").query(&mut c).unwrap();
    let back = call(
        &mut c,
        &s.plan,
        ns,
        "a",
        &args(&[
            &5_000,
            &3_000,
            &10_000,
            &LONG_LEASE_MS,
            &1_000,
            &first[5],
            &400,
            &0,
        ]),
    );
    assert_eq!(back[..5], [3_000, 3_000, 3_000, 1, 1]);
    assert!(back[6] > 0);
}

/// RENEW reconciles a replica's holds with its live set: a live hold Redis lost is put back, a
/// newer usage replaces Redis's, and a hold Redis kept that the replica does not list (a lost
/// release) is released if still unlisted at the next renewal; one listed again in between (a
/// reservation whose answer was on its way) stays.
#[test]
fn a_renewal_mends_what_redis_lost_or_kept() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let s = Scripts::new();
    let ns = "{reconcile}";
    let renew = |c: &mut redis::Connection, live: &[(&str, &str)]| {
        let mut a = args(&[&LONG_LEASE_MS, &20_000]);
        for (id, value) in live {
            a.push(id.to_string());
            a.push(value.to_string());
        }
        call(c, &s.renew, ns, "a", &a)
    };
    let reserve = |c: &mut redis::Connection, id: &str, tokens: u64| {
        call(
            c,
            &s.reserve,
            ns,
            "a",
            &args(&[&id, &tokens, &10_000, &LONG_LEASE_MS]),
        )[0]
    };
    call_rated(
        &mut c,
        scripts::REGISTER,
        ns,
        "a",
        &args(&[&LONG_LEASE_MS, &0, &0]),
    );
    assert_eq!(reserve(&mut c, "1", 100), 1);
    assert_eq!(reserve(&mut c, "2", 200), 1);
    // "1" released, but Redis lost the release: a suspect, still counted.
    assert_eq!(renew(&mut c, &[("2", "200|0")]), vec![0, 300, 1, 0, 0]);
    // "4" reserved, its answer not read yet: a suspect too.
    assert_eq!(reserve(&mut c, "4", 40), 1);
    // Redis lost "2" (a failover), and "3", reserved since: both put back; "1", still
    // unlisted, released; "4" is listed now and stays.
    let _: () = redis::cmd("HDEL")
        .arg(format!("{ns}:holds:a"))
        .arg("2")
        .query(&mut c)
        .unwrap();
    let _: () = redis::cmd("DECRBY")
        .arg(format!("{ns}:total"))
        .arg(200)
        .query(&mut c)
        .unwrap();
    let live = [("2", "200|0"), ("3", "50|0"), ("4", "40|0")];
    assert_eq!(renew(&mut c, &live), vec![0, 290, 1, 100, 250]);
    let o = observe(&mut c, ns);
    assert_eq!((o.total, o.holds, o.hold_count), (290, 290, 3));
    // A usage update Redis lost: the replica's newer one wins (down from 200 to 150); an older
    // one would not.
    let live = [("2", "150|2"), ("3", "50|0"), ("4", "40|0")];
    assert_eq!(renew(&mut c, &live), vec![0, 240, 1, 50, 0]);
    let live = [("2", "180|1"), ("3", "50|0"), ("4", "40|0")];
    assert_eq!(renew(&mut c, &live), vec![0, 240, 1, 0, 0]);
    let o = observe(&mut c, ns);
    assert_eq!((o.total, o.holds, o.hold_count), (240, 240, 3));
    // Nothing lost, nothing kept: nothing moves, and no suspect is left.
    let live = [("2", "150|2"), ("3", "50|0"), ("4", "40|0")];
    assert_eq!(renew(&mut c, &live), vec![0, 240, 1, 0, 0]);
    let suspects: Vec<String> = redis::cmd("SMEMBERS")
        .arg(format!("{ns}:suspect:a"))
        .query(&mut c)
        .unwrap();
    assert!(suspects.is_empty(), "{suspects:?}");
}

/// Reconciling thousands of strays (a replica restarted under the same id while its
/// predecessor held many calls): they are suspected and then released in runs, past the bound
/// on how many values one Lua call can pass.
#[test]
fn a_renewal_reconciles_thousands_of_strays() {
    let server = RedisServer::start();
    let mut c = server.connection().unwrap();
    let s = Scripts::new();
    let ns = "{many-strays}";
    call_rated(
        &mut c,
        scripts::REGISTER,
        ns,
        "a",
        &args(&[&LONG_LEASE_MS, &0, &0]),
    );
    let mut hset = redis::cmd("HSET");
    hset.arg(format!("{ns}:holds:a"));
    for id in 0..25_000 {
        hset.arg(id).arg("2|0");
    }
    let _: () = hset.query(&mut c).unwrap();
    let _: () = redis::cmd("SET")
        .arg(format!("{ns}:total"))
        .arg(50_000)
        .query(&mut c)
        .unwrap();
    let renew =
        |c: &mut redis::Connection| call(c, &s.renew, ns, "a", &args(&[&LONG_LEASE_MS, &20_000]));
    assert_eq!(renew(&mut c), vec![0, 50_000, 1, 0, 0]);
    let suspects: u64 = redis::cmd("SCARD")
        .arg(format!("{ns}:suspect:a"))
        .query(&mut c)
        .unwrap();
    assert_eq!(suspects, 25_000);
    assert_eq!(renew(&mut c), vec![0, 0, 1, 50_000, 0]);
    assert_eq!(observe(&mut c, ns).hold_count, 0);
}
