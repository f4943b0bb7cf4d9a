//! loom models of limit changes (`apply_limits`, `set_budget`) racing the wait queue: the
//! post-commit epoch check and `undo_commit` inside the queue's own decisions (a newcomer
//! arriving under the queue lock, the hand-off loop), the hand-off that raised limits start
//! (`install` pumps while holding the writer lock), a budget change racing a hand-off, a
//! timeout racing a grant made by raised limits, and what still holds while a commit that the
//! epoch check undoes is visible to other decisions (the accepted trade-off described in
//! `loom-tests/README.md`).
//!
//! Under `--cfg loom` the admission word carries one epoch bit, so two limit changes wrap it:
//! a decision whose read of the word and whose CAS straddle two changes commits (the bits
//! match again) and must be caught by the full-epoch check after the CAS.
//!
//! Invariants checked: no ceiling exceeded by a decision made under the limits it reports, no
//! lost wake-up, no waiter left queued while capacity is free, FIFO hand-off, and slots,
//! tokens and places returned exactly.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use std::task::Poll;
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, RejectReason, TokenBudget,
};
use common::{Queued, assert_idle, first_poll, poll, queued, reason, settle, tokens};
use loom::sync::Arc;
use loom::sync::atomic::AtomicBool;
use loom::sync::atomic::Ordering::{Acquire, Release};
use loom::thread;

/// A newcomer finds no slot and arrives under the queue lock while two limit changes (a full
/// wrap of the word's epoch bit) land between its read of the word and its CAS: the CAS
/// succeeds on matching bits, so only the epoch check after it can tell that the decision to
/// queue was made under revision 0. It must be undone (the `WAITERS` flag it set taken back)
/// and re-decided under revision 2, which has a free slot; queued for good, the newcomer
/// would wait forever, because the change that freed the slot saw no waiter to pump.
#[test]
fn arrival_queued_across_two_limit_changes_is_re_decided() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();

        let newcomer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
                let (first, flag) = first_poll(&mut future);
                (future, first, flag)
            })
        };
        // Revision 1 changes nothing but the epoch; revision 2 adds a slot.
        for revision in 1..=2u64 {
            let next = Limits::new(revision, revision as u32).with_max_queue(1);
            assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        }
        let (future, first, flag) = newcomer.join().unwrap();

        // Only revision 2 has a slot for it, directly or through the queue.
        let permit = settle(future, first, &flag).expect("admitted");
        assert_eq!(permit.limit_revision(), 2);
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (2, 0));
        drop(permit);
        drop(held);
        assert_idle(&bulkhead);
    });
}

/// The hand-off loop grants the last waiter (clearing `WAITERS` in the same CAS), then two
/// limit changes complete before its epoch check, the second a kill switch. The check cannot
/// tell this from a stale commit, so the grant is undone and the head re-decided under
/// revision 2 (no slot): it must stay queued *with* the `WAITERS` flag restored, so that the
/// next change that frees a slot serves it. It is never admitted under revision 2.
#[test]
fn hand_off_undone_by_two_limit_changes_keeps_the_waiter_queued() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let Queued { future, flag } = queued(&bulkhead, AcquireOptions::new());

        let releaser = thread::spawn(move || drop(held));
        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                for (revision, max) in [(1, 1), (2, 0)] {
                    let next = Limits::new(revision, max).with_max_queue(1);
                    assert!(bulkhead.apply_limits(next).unwrap().is_applied());
                }
            })
        };
        releaser.join().unwrap();
        reconfigurer.join().unwrap();

        // A slot again: a waiter still queued must be served now.
        let next = Limits::new(3, 1).with_max_queue(1);
        assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        let permit = settle(future, Poll::Pending, &flag).expect("admitted");
        assert_ne!(
            permit.limit_revision(),
            2,
            "admitted under max_concurrent 0"
        );
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (1, 0));
        drop(permit);
        assert_idle(&bulkhead);
    });
}

/// Raised limits free one slot while two calls wait and a newcomer tries its luck: the slot
/// goes to the head (woken), the second waiter keeps its place (not woken), and the newcomer
/// never barges past them.
#[test]
fn raised_limits_hand_the_new_slot_to_the_head() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let first = queued(&bulkhead, AcquireOptions::new());
        let mut second = queued(&bulkhead, AcquireOptions::new());

        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let next = Limits::new(1, 2).with_max_queue(2);
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
            })
        };
        let refused = bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap_err();
        reconfigurer.join().unwrap();

        let rejection = refused.rejection().unwrap();
        assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
        let head = settle(first.future, Poll::Pending, &first.flag).expect("the head");
        assert_eq!(head.limit_revision(), 1);
        assert!(!second.flag.woken(), "the second waiter was woken");
        // Polled with its own recording waker, so the flag still sees the next wake-up.
        assert!(
            poll(&mut second.future, &common::waker(&second.flag)).is_pending(),
            "the second waiter was served past the head"
        );
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (2, 1));

        drop(held);
        let next = settle(second.future, Poll::Pending, &second.flag).expect("served next");
        assert_eq!(next.limit_revision(), 1);
        drop((head, next));
        assert_idle(&bulkhead);
    });
}

/// Raised limits and a release free two slots while two calls wait: both are served, in
/// order (the head never by a later revision than the call behind it), both are woken, and a
/// newcomer deciding meanwhile never takes a slot from them.
#[test]
fn raised_limits_and_a_release_serve_both_waiters_in_order() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(2).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let first = queued(&bulkhead, AcquireOptions::new());
        let second = queued(&bulkhead, AcquireOptions::new());

        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let next = Limits::new(1, 2).with_max_queue(2);
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
            })
        };
        let releaser = thread::spawn(move || drop(held));
        let refused = bulkhead
            .try_acquire(&LlmRequest::new(), AcquireOptions::new())
            .unwrap_err();
        reconfigurer.join().unwrap();
        releaser.join().unwrap();

        assert_eq!(
            refused.rejection().unwrap().reason(),
            RejectReason::ConcurrencyLimit,
            "a newcomer barged past the queue"
        );
        let head = settle(first.future, Poll::Pending, &first.flag).expect("the head");
        let next = settle(second.future, Poll::Pending, &second.flag).expect("the second");
        assert!(
            head.limit_revision() <= next.limit_revision(),
            "served out of order"
        );
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.pending), (2, 0));
        drop((head, next));
        assert_idle(&bulkhead);
    });
}

/// A budget cut races the release that hands the queue head its slot: the head is granted
/// only under the budget it fitted (revision 0, and only if the hand-off decided before the
/// cut returned), otherwise refused `budget_limit` under the new budget; either way the queue
/// empties and everything comes back.
#[test]
fn set_budget_races_a_hand_off() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .max_queue(1)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), tokens(40, 0))
            .unwrap();
        // 40 + 60 fit the budget of 100: only the slot is missing.
        let Queued { future, flag } = queued(&bulkhead, tokens(60, 0));
        let cut = Arc::new(AtomicBool::new(false));

        let reconfigurer = {
            let (bulkhead, cut) = (bulkhead.clone(), cut.clone());
            thread::spawn(move || {
                assert_eq!(bulkhead.set_budget(50).unwrap().revision, 1);
                cut.store(true, Release);
            })
        };
        let releaser = {
            let cut = cut.clone();
            thread::spawn(move || {
                let after_cut = cut.load(Acquire);
                drop(held);
                after_cut
            })
        };
        reconfigurer.join().unwrap();
        let released_after_cut = releaser.join().unwrap();

        let stats = bulkhead.stats();
        assert_eq!(stats.pending, 0, "the head was left in the queue");
        match future_outcome(future, &flag) {
            Ok(permit) => {
                assert_eq!(permit.limit_revision(), 0, "60 tokens granted under 50");
                assert!(
                    !released_after_cut,
                    "granted under the old budget after the cut returned"
                );
                assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 60);
                drop(permit);
            }
            Err(rejection) => {
                assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                assert_eq!(rejection.limit_revision(), 1);
                assert_eq!(rejection.detail().token_budget.unwrap().budget, 50);
                assert_eq!(stats.in_flight, 0);
            }
        }
        assert_idle(&bulkhead);
    });
}

/// The outcome of a queued acquire whose fate has been decided, with the full rejection.
fn future_outcome(
    mut future: async_bulkhead_llm::futures::AcquireOwned,
    flag: &common::Flag,
) -> Result<async_bulkhead_llm::OwnedPermit, async_bulkhead_llm::Rejection> {
    assert!(flag.woken(), "a decided waiter was never woken");
    match poll(&mut future, std::task::Waker::noop()) {
        Poll::Ready(result) => result.map_err(|e| *e.rejection().unwrap()),
        Poll::Pending => panic!("a waiter was left in the queue"),
    }
}

/// A zero timeout races the hand-off that raised limits start (under the writer lock): the
/// call is admitted under revision 1 or times out, never both, and nothing leaks.
#[test]
fn timeout_races_a_grant_by_raised_limits() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();

        let waiter = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let options = AcquireOptions::new().timeout(Duration::ZERO);
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), options);
                match poll(&mut future, std::task::Waker::noop()) {
                    Poll::Ready(result) => reason(result),
                    Poll::Pending => panic!("a zero timeout completes at its first poll"),
                }
            })
        };
        let next = Limits::new(1, 2).with_max_queue(1);
        assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        let outcome = waiter.join().unwrap();

        let stats = bulkhead.stats();
        assert_eq!(stats.pending, 0);
        match outcome {
            Ok(permit) => {
                assert_eq!(permit.limit_revision(), 1);
                assert_eq!((stats.in_flight, stats.rejected), (2, 0));
                drop(permit);
            }
            Err(reason) => {
                assert_eq!(reason, RejectReason::Timeout);
                assert_eq!(stats.in_flight, 1, "a timed-out call holds nothing");
                assert_eq!(stats.rejected_by_reason.timeout, 1);
            }
        }
        drop(held);
        assert_idle(&bulkhead);
    });
}

/// The accepted trade-off of the post-CAS epoch check ("Known, accepted" in
/// `loom-tests/README.md`), and everything that still holds in it.
///
/// A call of 60 tokens decides under a budget of 100 while the budget is cut to 50; a call of
/// 30 tokens decides meanwhile. With loom's one epoch bit, a single change published between
/// the big call's CAS and its epoch check already makes the check undo the commit and decide
/// again (in production it takes 15 changes inside that window, or 16 between its read of
/// the word and its CAS). Between that CAS and the undo, the small call may see the 60 tokens
/// and be refused on them although the big call ends up refused too: in no sequential order
/// is 30 refused while 60 are not held. What is guaranteed, and checked here:
///
/// - (a) a refusal of the small call reports exactly the big call's 60 tokens in flight (no
///   tokens from nowhere, no torn value) under the budget of 50 they overflow; if the big call
///   was not admitted, that refusal saw its undone commit, and the big call itself was decided
///   again under the budget of 50 and refused `budget_limit`;
/// - (b) the big call is admitted only under the budget of 100, and never once `set_budget(50)`
///   has returned: a call that starts after the cut returned is decided under it;
/// - (c) slots and tokens come back exactly.
///
/// The model also checks that the phantom refusal is reached in at least one interleaving, so
/// it keeps covering the undo window.
#[test]
fn an_undone_commit_is_re_decided_and_only_its_own_tokens_can_refuse_another_call() {
    use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering::Relaxed};
    static PHANTOM_REFUSAL_SEEN: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .token_budget(TokenBudget::new(100))
            .build()
            .unwrap();
        let cut = Arc::new(AtomicBool::new(false));

        let big = {
            let (bulkhead, cut) = (bulkhead.clone(), cut.clone());
            thread::spawn(move || {
                let after_cut = cut.load(Acquire);
                let result = bulkhead
                    .try_acquire_owned(&LlmRequest::new(), tokens(60, 0))
                    .map_err(|e| *e.rejection().expect("a capacity refusal"));
                (after_cut, result)
            })
        };
        let small = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                bulkhead
                    .try_acquire_owned(&LlmRequest::new(), tokens(30, 0))
                    .map_err(|e| *e.rejection().expect("a capacity refusal"))
            })
        };
        // The cut runs on the model's main thread: the phantom refusal then needs only two
        // preemptions (the big call after its CAS, the main thread back), so CI's bound
        // reaches it.
        assert_eq!(bulkhead.set_budget(50).unwrap().revision, 1);
        cut.store(true, Release);
        let (big_after_cut, big) = big.join().unwrap();
        let small = small.join().unwrap();

        // (b) The big call: admitted only under the budget it fits, decided before the cut.
        match &big {
            Ok(permit) => {
                assert_eq!(permit.limit_revision(), 0, "60 tokens admitted under 50");
                assert!(!big_after_cut, "admitted after set_budget(50) returned");
                assert_eq!(permit.held_tokens(), 60);
            }
            Err(rejection) => {
                assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                assert_eq!(
                    rejection.limit_revision(),
                    1,
                    "refused under the budget of 100"
                );
                assert_eq!(rejection.detail().token_budget.unwrap().budget, 50);
            }
        }

        // (a) The small call: refused only on the big call's 60 tokens, under 50.
        if let Err(rejection) = &small {
            assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
            let t = rejection.detail().token_budget.unwrap();
            assert_eq!(
                (t.budget, t.in_flight_tokens),
                (50, 60),
                "refused on tokens nobody asked for, or under a budget 30 + 60 fit"
            );
            if big.is_err() {
                // The phantom refusal: it saw the commit that the epoch check then undid (the
                // big call's refusal under 50 was checked above).
                PHANTOM_REFUSAL_SEEN.store(true, Relaxed);
            }
        }

        // (c) Everything comes back.
        let admitted = u64::from(big.is_ok()) + u64::from(small.is_ok());
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.admitted), (admitted, admitted));
        drop((big, small));
        assert_idle(&bulkhead);
    });
    assert!(
        PHANTOM_REFUSAL_SEEN.load(Relaxed),
        "no interleaving reached the undo window: the model no longer covers it"
    );
}

/// A newcomer's fast-path commit is undone by the epoch check (a limit change, here one that
/// changes nothing but the epoch, landed after its CAS) while a second call, which found the
/// slot taken by that commit, joined the queue. The undo returns the slot outside the queue
/// lock, so it must serve the queue itself: the waiter is handed the slot (and woken) or the
/// first call keeps it, and in no interleaving is the waiter left queued with the only slot
/// free.
#[test]
fn an_undone_commit_hands_its_slot_to_a_call_that_queued_behind_it() {
    use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering::Relaxed};
    static UNDO_HANDED_OFF: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();

        let first = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                reason(bulkhead.try_acquire_owned(&LlmRequest::new(), AcquireOptions::new()))
            })
        };
        let second = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut future = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
                let (poll, flag) = first_poll(&mut future);
                (future, poll, flag)
            })
        };
        let next = Limits::new(1, 1).with_max_queue(1);
        assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        let first = first.join().unwrap();
        let (future, poll, flag) = second.join().unwrap();

        match first {
            Ok(permit) => {
                // The first call kept the slot: the second waits for it, not woken yet.
                let Poll::Pending = poll else {
                    panic!("both calls hold the only slot");
                };
                assert!(!flag.woken(), "woken without a slot");
                assert_eq!(bulkhead.stats().pending, 1);
                drop(permit);
                drop(settle(future, Poll::Pending, &flag).expect("served after the release"));
            }
            Err(reason) => {
                assert_eq!(reason, RejectReason::ConcurrencyLimit);
                // Queued, then served: only the first call's undo can have freed the slot.
                if poll.is_pending() {
                    UNDO_HANDED_OFF.store(true, Relaxed);
                }
                let permit = settle(future, poll, &flag).expect("the slot was not lost");
                let stats = bulkhead.stats();
                assert_eq!((stats.in_flight, stats.pending), (1, 0));
                drop(permit);
            }
        }
        assert_idle(&bulkhead);
    });
    assert!(
        UNDO_HANDED_OFF.load(Relaxed),
        "no interleaving had the undo hand its slot to the queue"
    );
}

/// A waker that calls back into `apply_limits` when it is woken (as a waker that polls its task
/// inline does when the task's admit listener pushes new limits), then records the wake-up.
struct ReconfiguresOnWake {
    bulkhead: loom::sync::Mutex<Option<LlmBulkhead>>,
    woken: AtomicBool,
}

impl std::task::Wake for ReconfiguresOnWake {
    fn wake(self: std::sync::Arc<Self>) {
        // Taken out, so the bulkhead (which holds this waker) is not kept alive by a cycle.
        if let Some(bulkhead) = self.bulkhead.lock().unwrap().take() {
            let next = Limits::new(5, 2).with_max_queue(1);
            assert!(bulkhead.apply_limits(next).unwrap().is_applied());
        }
        self.woken.store(true, Release);
    }
}

/// Raised limits (or a release racing them) hand the slot to a waiter whose waker calls
/// `apply_limits` at once. `apply_limits` hands off under its writer lock but wakes only after
/// releasing it: woken under the lock, the waker would lock it again, which loom
/// reports as a deadlock. The waiter is served exactly once, and the waker's own change is
/// the one in force at the end.
#[test]
fn a_waker_may_apply_limits_when_raised_limits_hand_it_a_slot() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
        let held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
            .unwrap();
        let waker = std::sync::Arc::new(ReconfiguresOnWake {
            bulkhead: loom::sync::Mutex::new(Some(bulkhead.clone())),
            woken: AtomicBool::new(false),
        });
        let mut future = bulkhead.acquire_owned(&LlmRequest::new(), AcquireOptions::new());
        assert!(poll(&mut future, &std::task::Waker::from(waker.clone())).is_pending());

        let reconfigurer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                // Stale if the waker's own change (revision 5) came first.
                bulkhead
                    .apply_limits(Limits::new(1, 2).with_max_queue(1))
                    .unwrap();
            })
        };
        drop(held); // a release racing the raised limits for the same waiter
        reconfigurer.join().unwrap();

        assert!(
            waker.woken.load(Acquire),
            "the served waiter was never woken"
        );
        let permit = match poll(&mut future, std::task::Waker::noop()) {
            Poll::Ready(result) => result.expect("served"),
            Poll::Pending => panic!("a woken waiter was left in the queue"),
        };
        assert_eq!(bulkhead.limits().revision, 5);
        drop(permit);
        assert_idle(&bulkhead);
    });
}
