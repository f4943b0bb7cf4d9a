//! loom models of the admission word: every interleaving of two or three threads, checking that
//! no ceiling is ever exceeded, that decisions agree with the limits they report, and that
//! slots and tokens return exactly.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, OwnedPermit, RejectReason,
    Reservation, TokenBudget, TokenUsage,
};
use loom::sync::Arc;
use loom::sync::atomic::AtomicBool;
use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering::{AcqRel, Acquire, Release};
use loom::thread;

fn with_tokens(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

/// Tracks what the threads of a model hold, to check ceilings at every step.
struct Ledger {
    slots: AtomicU64,
    tokens: AtomicU64,
    max_slots: u64,
    max_tokens: u64,
}

impl Ledger {
    fn new(max_slots: u64, max_tokens: u64) -> Arc<Ledger> {
        Arc::new(Ledger {
            slots: AtomicU64::new(0),
            tokens: AtomicU64::new(0),
            max_slots,
            max_tokens,
        })
    }

    fn enter(&self, tokens: u64) {
        let slots = self.slots.fetch_add(1, AcqRel) + 1;
        let held = self.tokens.fetch_add(tokens, AcqRel) + tokens;
        assert!(
            slots <= self.max_slots,
            "{slots} slots held, ceiling {}",
            self.max_slots
        );
        assert!(
            held <= self.max_tokens,
            "{held} tokens held, ceiling {}",
            self.max_tokens
        );
    }

    fn leave(&self, tokens: u64) {
        self.slots.fetch_sub(1, AcqRel);
        self.tokens.fetch_sub(tokens, AcqRel);
    }
}

fn assert_idle(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    assert_eq!(stats.in_flight, 0, "slots returned exactly");
    if let Some(tokens) = stats.token_budget {
        assert_eq!(tokens.in_flight_tokens, 0, "tokens returned exactly");
    }
    assert_eq!(stats.admitted, stats.released);
}

fn rejection(result: Result<OwnedPermit, AcquireError>) -> Result<OwnedPermit, RejectReason> {
    result.map_err(|e| {
        e.rejection()
            .expect("capacity refusal, not invalid input")
            .reason()
    })
}

#[test]
fn two_admissions_race_for_the_last_slot() {
    loom::model(|| {
        // 2 slots, 2000 tokens; 400 tokens and one slot already held: one slot is left, and
        // the tokens of both newcomers fit even together, so only the slot decides.
        let bulkhead = LlmBulkhead::builder("m", 2)
            .token_budget(TokenBudget::new(2000))
            .build()
            .unwrap();
        let ledger = Ledger::new(2, 2000);
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(0, 400))
            .unwrap();
        ledger.enter(400);

        let racers: Vec<_> = [600u64, 500]
            .into_iter()
            .map(|tokens| {
                let (bulkhead, ledger) = (bulkhead.clone(), ledger.clone());
                thread::spawn(move || {
                    match rejection(
                        bulkhead.try_acquire_owned(&LlmRequest::new(), with_tokens(0, tokens)),
                    ) {
                        Ok(permit) => {
                            ledger.enter(tokens);
                            ledger.leave(tokens);
                            drop(permit);
                            true
                        }
                        Err(reason) => {
                            assert_eq!(reason, RejectReason::ConcurrencyLimit);
                            false
                        }
                    }
                })
            })
            .collect();
        let admitted: Vec<bool> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        // At least one gets in; both only if the first released before the second decided.
        assert!(admitted.iter().any(|&a| a));
        ledger.leave(400);
        drop(held);
        assert_idle(&bulkhead);
    });
}

#[test]
fn two_admissions_race_for_the_last_tokens() {
    loom::model(|| {
        // Plenty of slots, 1000 tokens, 400 held: 600 left, each newcomer wants 600.
        let bulkhead = LlmBulkhead::builder("m", 4)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let ledger = Ledger::new(4, 1000);
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(100, 300))
            .unwrap();
        ledger.enter(400);

        let racers: Vec<_> = (0..2)
            .map(|_| {
                let (bulkhead, ledger) = (bulkhead.clone(), ledger.clone());
                thread::spawn(move || {
                    match rejection(
                        bulkhead.try_acquire_owned(&LlmRequest::new(), with_tokens(100, 500)),
                    ) {
                        Ok(permit) => {
                            ledger.enter(600);
                            // Hold the tokens until the thread ends, so the two cannot both
                            // get in by taking turns.
                            (Some(permit), None)
                        }
                        Err(reason) => (None, Some(reason)),
                    }
                })
            })
            .collect();
        let outcomes: Vec<_> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let admitted = outcomes.iter().filter(|(p, _)| p.is_some()).count();
        assert_eq!(
            admitted, 1,
            "exactly one of two 600-token calls fits in 600 tokens"
        );
        for (_, reason) in &outcomes {
            if let Some(reason) = reason {
                assert_eq!(*reason, RejectReason::BudgetLimit);
            }
        }
        let t = bulkhead.stats().token_budget.unwrap();
        assert_eq!(t.in_flight_tokens, 1000);
        for (permit, _) in outcomes {
            if let Some(p) = permit {
                ledger.leave(600);
                drop(p);
            }
        }
        ledger.leave(400);
        drop(held);
        assert_idle(&bulkhead);
    });
}

#[test]
fn admit_races_release() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let ledger = Ledger::new(1, 100);
        let first = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(60, 40))
            .unwrap();
        ledger.enter(100);

        let releaser = {
            let ledger = ledger.clone();
            thread::spawn(move || {
                ledger.leave(100);
                drop(first);
            })
        };
        let admitter = {
            let (bulkhead, ledger) = (bulkhead.clone(), ledger.clone());
            thread::spawn(move || {
                match rejection(bulkhead.try_acquire_owned(&LlmRequest::new(), with_tokens(10, 10)))
                {
                    Ok(permit) => {
                        ledger.enter(20);
                        ledger.leave(20);
                        drop(permit);
                    }
                    // Decided before the release: the slot (checked after the budget) or
                    // the tokens were still held.
                    Err(reason) => assert!(
                        reason == RejectReason::BudgetLimit
                            || reason == RejectReason::ConcurrencyLimit
                    ),
                }
            })
        };
        releaser.join().unwrap();
        admitter.join().unwrap();
        assert_idle(&bulkhead);
    });
}

#[test]
fn admit_races_refunding_release() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let ledger = Ledger::new(2, 1000);
        let big = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(200, 600))
            .unwrap();
        ledger.enter(800);

        let releaser = {
            let ledger = ledger.clone();
            thread::spawn(move || {
                ledger.leave(800);
                let report = big.release(Some(TokenUsage::new(150, 250).unwrap()));
                assert_eq!((report.held_tokens, report.refunded_tokens), (800, 400));
            })
        };
        let admitter = {
            let (bulkhead, ledger) = (bulkhead.clone(), ledger.clone());
            thread::spawn(move || {
                // Needs 500: fits only once the 800 are back.
                match rejection(
                    bulkhead.try_acquire_owned(&LlmRequest::new(), with_tokens(100, 400)),
                ) {
                    Ok(permit) => {
                        ledger.enter(500);
                        ledger.leave(500);
                        permit.release(Some(TokenUsage::new(100, 400).unwrap()));
                        true
                    }
                    Err(reason) => {
                        assert_eq!(reason, RejectReason::BudgetLimit);
                        false
                    }
                }
            })
        };
        releaser.join().unwrap();
        let second = admitter.join().unwrap();
        assert_idle(&bulkhead);
        let t = bulkhead.stats().token_budget.unwrap();
        let (reserved, consumed) = if second { (1300, 900) } else { (800, 400) };
        assert_eq!(
            (t.total_reserved, t.total_consumed, t.total_refunded),
            (reserved, consumed, 400)
        );
    });
}

/// An admission decided concurrently with a shrink: it is either decided under the old limits
/// (and may exceed the new ceiling, which shrinks by attrition) or under the new ones; once the
/// shrink has returned, only the new limits decide.
#[test]
fn admit_races_apply_limits_shrink() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let applied = Arc::new(AtomicBool::new(false));

        let shrinker = {
            let (bulkhead, applied) = (bulkhead.clone(), applied.clone());
            thread::spawn(move || {
                assert!(
                    bulkhead
                        .apply_limits(Limits::new(1, 1))
                        .unwrap()
                        .is_applied()
                );
                applied.store(true, Release);
            })
        };
        let admitter = {
            let (bulkhead, applied) = (bulkhead.clone(), applied.clone());
            thread::spawn(move || {
                let after_apply = applied.load(Acquire);
                match bulkhead.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new()) {
                    Ok(permit) => {
                        // Only the old limits (2 slots) admit a second call.
                        assert_eq!(permit.limit_revision(), 0);
                        assert!(
                            !after_apply,
                            "admitted under old limits after the shrink returned"
                        );
                    }
                    Err(err) => {
                        let rejection = err.rejection().unwrap();
                        assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
                        // Only the new limits (1 slot) refuse it, and the detail says so.
                        assert_eq!(rejection.limit_revision(), 1);
                        assert_eq!(rejection.detail().max_concurrent, 1);
                        assert_eq!(rejection.detail().in_flight, 1);
                    }
                }
            })
        };
        shrinker.join().unwrap();
        admitter.join().unwrap();
        drop(held);
        assert_eq!(bulkhead.limits(), Limits::new(1, 1));
        assert_idle(&bulkhead);
    });
}

#[test]
fn admit_races_apply_limits_grow() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(50, 0))
            .unwrap();
        let applied = Arc::new(AtomicBool::new(false));

        let grower = {
            let (bulkhead, applied) = (bulkhead.clone(), applied.clone());
            thread::spawn(move || {
                let next = Limits::new(1, 2).with_token_budget(100, 0);
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
                applied.store(true, Release);
            })
        };
        let admitter = {
            let (bulkhead, applied) = (bulkhead.clone(), applied.clone());
            thread::spawn(move || {
                let after_apply = applied.load(Acquire);
                match bulkhead.try_acquire_owned(&LlmRequest::new(), with_tokens(25, 25)) {
                    Ok(permit) => assert_eq!(permit.limit_revision(), 1),
                    Err(err) => {
                        let rejection = err.rejection().unwrap();
                        assert!(
                            !after_apply,
                            "refused under old limits after the growth returned"
                        );
                        assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
                        assert_eq!(rejection.limit_revision(), 0);
                        assert_eq!(rejection.detail().max_concurrent, 1);
                    }
                }
            })
        };
        grower.join().unwrap();
        admitter.join().unwrap();
        drop(held);
        assert_idle(&bulkhead);
    });
}

#[test]
fn admit_races_close() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2).build().unwrap();
        let closed = Arc::new(AtomicBool::new(false));

        let closer = {
            let (bulkhead, closed) = (bulkhead.clone(), closed.clone());
            thread::spawn(move || {
                assert!(bulkhead.close());
                closed.store(true, Release);
            })
        };
        let admitter = {
            let (bulkhead, closed) = (bulkhead.clone(), closed.clone());
            thread::spawn(move || {
                let after_close = closed.load(Acquire);
                match bulkhead.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new()) {
                    Ok(permit) => {
                        assert!(!after_close, "admitted after close returned");
                        drop(permit);
                    }
                    Err(err) => {
                        assert_eq!(err.rejection().unwrap().reason(), RejectReason::Shutdown)
                    }
                }
            })
        };
        closer.join().unwrap();
        admitter.join().unwrap();
        assert!(bulkhead.is_closed());
        assert!(
            bulkhead
                .try_acquire(&LlmRequest::new(), AcquireOptions::new())
                .is_err()
        );
        assert_idle(&bulkhead);
    });
}

/// A reconfiguration racing an admission and a release, with a budget: three spawned threads
/// (about 1 s at bound 2, 8 s at bound 3).
#[test]
fn admissions_release_and_set_budget() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let ledger = Ledger::new(2, 1000);
        let first = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(300, 300))
            .unwrap();
        ledger.enter(600);

        let releaser = {
            let ledger = ledger.clone();
            thread::spawn(move || {
                ledger.leave(600);
                drop(first);
            })
        };
        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                // Shrinking the budget below 1000: ledger ceilings stay valid (any admission
                // under the new budget also fits the old).
                assert_eq!(bulkhead.set_budget(700).unwrap().revision, 1);
            })
        };
        let admitter = {
            let (bulkhead, ledger) = (bulkhead.clone(), ledger.clone());
            thread::spawn(move || {
                match bulkhead.try_acquire_owned(&LlmRequest::new(), with_tokens(200, 200)) {
                    Ok(permit) => {
                        ledger.enter(400);
                        ledger.leave(400);
                        drop(permit);
                    }
                    Err(err) => {
                        let r = err.rejection().unwrap();
                        let t = r.detail().token_budget.unwrap();
                        // The refusal is consistent with the figures it reports.
                        assert!(
                            t.in_flight_tokens + 400 > t.effective_budget
                                || r.detail().in_flight >= 2
                        );
                        assert_eq!(t.budget, if r.limit_revision() == 0 { 1000 } else { 700 });
                    }
                }
            })
        };
        releaser.join().unwrap();
        reconfigurer.join().unwrap();
        admitter.join().unwrap();
        assert_idle(&bulkhead);
    });
}

#[test]
fn releases_race_each_other() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let a = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(100, 200))
            .unwrap();
        let b = bulkhead
            .try_acquire_owned(&LlmRequest::new(), with_tokens(300, 400))
            .unwrap();
        let first = thread::spawn(move || drop(a));
        let second = thread::spawn(move || b.release(Some(TokenUsage::new(300, 50).unwrap())));
        first.join().unwrap();
        let report = second.join().unwrap();
        assert_eq!(report.refunded_tokens, 350);
        assert_idle(&bulkhead);
        let t = bulkhead.stats().token_budget.unwrap();
        assert_eq!(
            (t.total_reserved, t.total_consumed, t.total_refunded),
            (1000, 350, 350)
        );
    });
}

/// A refusal has no CAS to discard a torn read of the limits, so it re-validates the epoch.
/// Two back-to-back reconfigurations rewrite the buffer a slow reader may be reading; every
/// refusal must still report the limits of exactly one revision.
#[test]
fn refusals_never_mix_two_revisions() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 0).build().unwrap();
        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                for revision in 1..=2u64 {
                    let next = Limits::new(revision, 0).with_max_queue(revision as u32);
                    assert!(bulkhead.apply_limits(next).unwrap().is_applied());
                }
            })
        };
        let refused = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let err = bulkhead
                    .try_acquire(&LlmRequest::new(), AcquireOptions::new())
                    .unwrap_err();
                let detail = *err.rejection().unwrap().detail();
                assert_eq!(
                    u64::from(detail.max_queue),
                    detail.limit_revision,
                    "torn limits: {detail:?}"
                );
                let limits = bulkhead.limits();
                assert_eq!(
                    u64::from(limits.max_queue),
                    limits.revision,
                    "torn limits: {limits:?}"
                );
            })
        };
        reconfigurer.join().unwrap();
        refused.join().unwrap();
        assert_eq!(bulkhead.stats().rejected, 1);
    });
}

/// The case the word's epoch bits cannot settle alone: two limit changes (a full wrap of the
/// one bit loom builds with) and an admission plus release by a third thread all land between
/// an admission's read of the word and its CAS, so the word holds exactly the value it read.
/// Its CAS succeeds; the epoch check after it must catch the stale limits and undo the commit,
/// or the admission would keep revision 0 although a call admitted after the first change ran
/// while it "held" the only slot.
#[test]
fn a_full_wrap_of_the_epoch_bits_cannot_admit_under_stale_limits() {
    full_wrap(true, Door::General);
}

/// The same through `try_acquire`'s fast lane (its own commit and epoch check).
#[test]
fn a_full_wrap_of_the_epoch_bits_cannot_admit_on_the_fast_lane() {
    full_wrap(true, Door::FastLane);
}

/// The same on a bulkhead without a token budget, on both doors: its fast lane decides on the
/// slot count alone.
#[test]
fn a_full_wrap_of_the_epoch_bits_cannot_admit_without_a_budget() {
    full_wrap(false, Door::General);
    full_wrap(false, Door::FastLane);
}

/// How the full wrap's two admissions are made: timed (a listener subscribed: the general
/// path's decision, `decide`) or not (`try_acquire`'s fast lane, nobody listening).
#[derive(Clone, Copy, PartialEq)]
enum Door {
    General,
    FastLane,
}

/// The limit revision an admission of `ask` through `door` was decided under, if admitted
/// (released at once).
fn admitted_revision(bulkhead: &LlmBulkhead, door: Door, ask: AcquireOptions) -> Option<u64> {
    match door {
        Door::General => bulkhead
            .try_acquire_owned(&LlmRequest::new(), ask)
            .ok()
            .map(|permit| permit.limit_revision()),
        Door::FastLane => bulkhead
            .try_acquire(&LlmRequest::new(), ask)
            .ok()
            .map(|permit| permit.limit_revision()),
    }
}

fn full_wrap(budget: bool, door: Door) {
    loom::model(move || {
        let mut builder = LlmBulkhead::builder("m", 1);
        if budget {
            builder = builder.token_budget(TokenBudget::new(100));
        }
        let bulkhead = builder.build().unwrap();
        // A listener makes every call timed: no fast lane.
        let _listening = (door == Door::General).then(|| bulkhead.on(|_| {}));
        let ask = if budget {
            with_tokens(10, 0)
        } else {
            AcquireOptions::new()
        };
        let first_applied = Arc::new(AtomicBool::new(false));

        let writer = {
            let (bulkhead, first_applied) = (bulkhead.clone(), first_applied.clone());
            thread::spawn(move || {
                for revision in 1..=2 {
                    let next = limits(revision, budget);
                    assert!(bulkhead.apply_limits(next).unwrap().is_applied());
                    first_applied.store(true, Release);
                }
            })
        };
        let late = {
            let (bulkhead, first_applied) = (bulkhead.clone(), first_applied.clone());
            thread::spawn(move || {
                if !first_applied.load(Acquire) {
                    return None;
                }
                // Admitted (and released) only after the first change returned.
                admitted_revision(&bulkhead, door, ask)
            })
        };
        // Held until the end, through the same door.
        let request = LlmRequest::new();
        let early_owned = match door {
            Door::General => bulkhead.try_acquire_owned(&request, ask).ok(),
            Door::FastLane => None,
        };
        let early_borrowed = match door {
            Door::General => None,
            Door::FastLane => bulkhead.try_acquire(&request, ask).ok(),
        };
        let early_revision = early_owned
            .as_ref()
            .map(|p| p.limit_revision())
            .or(early_borrowed.as_ref().map(|p| p.limit_revision()));
        writer.join().unwrap();
        let late_revision = late.join().unwrap();
        if let (Some(0), Some(late)) = (early_revision, late_revision) {
            // Admitted under revision 0, the early call held the only slot from before the
            // first change; a call admitted after that change could not have got one.
            panic!("stale admission: early call at revision 0, late call at revision {late}");
        }
        drop((early_owned, early_borrowed));
        assert_eq!(bulkhead.limits(), limits(2, budget));
        assert_idle(&bulkhead);
    });
}

/// Revision `revision` of the full wrap's limits: one slot, and 100 tokens with a budget.
fn limits(revision: u64, budget: bool) -> Limits {
    let limits = Limits::new(revision, 1);
    if budget {
        limits.with_token_budget(100, 0)
    } else {
        limits
    }
}
