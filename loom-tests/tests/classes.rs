//! loom models of admission classes: the class lock, the wide (128-bit) admission word that
//! commits a class decision together with the shared pool's figures, limits installed under
//! every class lock, and abandoning a borrowed slot, in every interleaving of the threads
//! involved.
//!
//! Invariants checked: a protected floor is never lent and the shared pool never overdrawn (at
//! most one of two borrowers wins the last shared slot, a call within its floor always gets
//! in, and a borrower racing a borrowing release, one 128-bit `fetch_sub`, gets the slot only
//! after it); every refusal is explained by a sequential order (its detail shows the pool full
//! with someone else's committed admission, never a half-made one); an admission racing
//! `apply_limits` is decided wholly under the old limits or wholly under the new ones; an
//! abandoned slot reaches the queue's head exactly once; and at the end every slot, token,
//! class count and shared figure returns exactly (`assert_classes_idle`).
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod common;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, RejectReason, Rejection, TokenBudget,
    classes::AdmissionClasses, classes::ClassLimits, classes::ClassLimitsTable,
    rejection::Constraint,
};
use common::{assert_idle, drain_to_completion, first_poll, settle, tokens};
use loom::thread;

fn in_class(bulkhead: &LlmBulkhead, id: &str) -> AcquireOptions {
    AcquireOptions::new().class(bulkhead.class(id).unwrap())
}

fn try_admit(bulkhead: &LlmBulkhead, options: AcquireOptions) -> Result<OwnedPermit, Rejection> {
    bulkhead
        .try_acquire_owned(&LlmRequest::new(), options)
        .map_err(|e| *e.rejection().expect("a capacity refusal"))
}

/// Everything returned: the global figures, every class's counts and the shared pool.
fn assert_classes_idle(bulkhead: &LlmBulkhead) {
    assert_idle(bulkhead);
    let stats = bulkhead.stats();
    assert_eq!(stats.abandoned_in_flight, 0);
    let classes = stats.admission_classes.expect("classes");
    assert_eq!(classes.shared.in_flight, 0, "shared slots returned exactly");
    if let Some(tokens) = classes.shared.token_budget {
        assert_eq!(tokens.in_flight_tokens, 0, "shared tokens returned exactly");
    }
    for class in &classes.classes {
        assert_eq!(
            (class.in_flight, class.in_flight_tokens),
            (0, 0),
            "class {} returned exactly",
            class.class
        );
        assert_eq!(class.admitted, class.released);
    }
}

/// A borrower refused by protection on a shared pool of 1 slot that a committed admission
/// holds (never a half-made admission or release).
fn assert_refused_on_a_committed_borrow(loser: &Rejection) {
    assert_eq!(loser.reason(), RejectReason::ConcurrencyLimit);
    let detail = loser.detail();
    assert_eq!(
        detail.constraint,
        Some(Constraint::AdmissionClassProtection)
    );
    let shared = detail.shared_capacity().unwrap().concurrency;
    assert_eq!(
        (shared.capacity, shared.in_use, shared.requested_borrowed),
        (1, 1, 1),
        "refused only on a committed borrow"
    );
}

/// Two classes race for the last shared slot at a floor boundary: 3 slots, floors a = 1 and
/// b = 1, so 1 slot is shared. `a` already holds its floor; a second `a` call borrows, while
/// `b` makes a call within its floor and then one that borrows. Exactly one of the two
/// borrowers wins the shared slot, the call within its floor always gets in, and the loser's
/// refusal shows the pool held by a committed admission.
#[test]
fn two_classes_race_at_a_floor_boundary_for_the_last_shared_slot() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 3)
            .admission_classes(
                AdmissionClasses::new("a")
                    .class("a", ClassLimits::new().protected_concurrent(1))
                    .class("b", ClassLimits::new().protected_concurrent(1)),
            )
            .build()
            .unwrap();
        let floor_a = try_admit(&bulkhead, in_class(&bulkhead, "a")).unwrap();

        let borrower_a = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || try_admit(&bulkhead, in_class(&bulkhead, "a")))
        };
        let b_calls = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let first = try_admit(&bulkhead, in_class(&bulkhead, "b"));
                let second = try_admit(&bulkhead, in_class(&bulkhead, "b"));
                (first, second)
            })
        };
        let a = borrower_a.join().unwrap();
        let (b_floor, b_borrow) = b_calls.join().unwrap();

        // b's first call is within b's floor: the shared pool cannot take it away.
        let b_floor = b_floor.expect("a call within its floor is admitted");
        assert!(!b_floor.resources().borrowed_concurrency);
        // Exactly one borrower won the one shared slot.
        let (winner, loser) = match (a, b_borrow) {
            (Ok(w), Err(l)) | (Err(l), Ok(w)) => (w, l),
            (Ok(_), Ok(_)) => panic!("the shared pool of 1 slot was lent twice"),
            (Err(x), Err(y)) => panic!("both borrowers refused: {x} / {y}"),
        };
        assert!(winner.resources().borrowed_concurrency);
        assert_refused_on_a_committed_borrow(&loser);
        let stats = bulkhead.stats();
        assert_eq!(stats.in_flight, 3);
        assert_eq!(stats.admission_classes.unwrap().shared.in_flight, 1);
        drop((floor_a, b_floor, winner));
        assert_classes_idle(&bulkhead);
    });
}

/// Two class admissions race `apply_limits` that moves a floor from class a to class b and
/// gives b a ceiling of 1. Each decision is made wholly under one revision, and what it
/// records agrees with that revision: under revision 0 (a's floor 1, b none: one shared slot)
/// b's first call borrows and its second is refused by protection; under revision 1 (b's floor
/// 1, ceiling 1) b's first call is within its floor and a second is refused by the ceiling. The
/// shared figure recomputed at install agrees with the new floors whatever was admitted before.
#[test]
fn class_admissions_racing_apply_limits_each_see_one_set_of_limits() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .token_budget(TokenBudget::new(100))
            .admission_classes(
                AdmissionClasses::new("a")
                    .class("a", ClassLimits::new().protected_concurrent(1))
                    .class("b", ClassLimits::new()),
            )
            .build()
            .unwrap();

        let caller = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let options =
                    in_class(&bulkhead, "b").reservation(tokens(10, 10).reservation.unwrap());
                let first = try_admit(&bulkhead, options);
                let second = try_admit(&bulkhead, options);
                (first, second)
            })
        };
        let control = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut next = bulkhead.limits();
                next.revision = 1;
                next.admission_classes =
                    Some(ClassLimitsTable::new().with("a", ClassLimits::new()).with(
                        "b",
                        ClassLimits::new().protected_concurrent(1).max_concurrent(1),
                    ));
                assert!(bulkhead.apply_limits(next).unwrap().is_applied());
            })
        };
        let (first, second) = caller.join().unwrap();
        control.join().unwrap();

        let first = first.expect("b's first call fits under either revision");
        match first.limit_revision() {
            0 => assert!(
                first.resources().borrowed_concurrency,
                "b had no floor then"
            ),
            1 => assert!(
                !first.resources().borrowed_concurrency,
                "within b's new floor"
            ),
            other => panic!("revision {other}"),
        }
        let refused = second.expect_err("b's second call never fits");
        assert!(refused.limit_revision() >= first.limit_revision());
        assert_eq!(refused.reason(), RejectReason::ConcurrencyLimit);
        let expected = if refused.limit_revision() == 0 {
            Constraint::AdmissionClassProtection
        } else {
            Constraint::AdmissionClass
        };
        assert_eq!(refused.detail().constraint, Some(expected));
        // Under the new floors b's one call is within b's floor: nothing is shared now.
        let classes = bulkhead.stats().admission_classes.unwrap();
        assert_eq!(
            (classes.shared.max_concurrent, classes.shared.in_flight),
            (1, 0)
        );
        assert_eq!(classes.classes[1].in_flight, 1);
        drop(first);
        assert_classes_idle(&bulkhead);
    });
}

/// A borrowed slot is abandoned while its holder's twin releases and a call of another class
/// waits in the queue: the waiter gets a slot exactly once (by whichever frees one first), the
/// abandoned admission's tokens stay held until it settles, and everything returns exactly.
#[test]
fn abandonment_races_a_release_and_a_hand_off() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .max_queue(1)
            .token_budget(TokenBudget::new(100))
            .admission_classes(
                AdmissionClasses::new("a")
                    .class("a", ClassLimits::new())
                    .class("b", ClassLimits::new()),
            )
            .build()
            .unwrap();
        let a = in_class(&bulkhead, "a");
        let mut abandoning =
            try_admit(&bulkhead, a.reservation(tokens(10, 0).reservation.unwrap())).unwrap();
        let releasing =
            try_admit(&bulkhead, a.reservation(tokens(20, 0).reservation.unwrap())).unwrap();
        let b = in_class(&bulkhead, "b").reservation(tokens(30, 0).reservation.unwrap());
        let mut waiter = bulkhead.acquire_owned(&LlmRequest::new(), b);
        let (first, flag) = first_poll(&mut waiter);
        assert!(first.is_pending(), "joins the queue");

        let abandoner = thread::spawn(move || {
            assert!(abandoning.abandon_borrowed_concurrency());
            abandoning
        });
        let releaser = thread::spawn(move || drop(releasing));
        let abandoning = abandoner.join().unwrap();
        releaser.join().unwrap();

        let handed = settle(waiter, first, &flag).expect("a freed slot reaches the waiter");
        assert_eq!(handed.class().unwrap().id(), "b");
        let stats = bulkhead.stats();
        assert_eq!(
            (stats.in_flight, stats.abandoned_in_flight, stats.pending),
            (1, 1, 0)
        );
        // The abandoned admission still holds its 10 tokens; the releaser's 20 returned.
        assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 40);
        let classes = stats.admission_classes.unwrap();
        assert_eq!(
            (
                classes.classes[0].in_flight,
                classes.classes[0].in_flight_tokens
            ),
            (0, 10)
        );
        assert_eq!(classes.classes[0].borrowed_concurrency_abandoned, 1);
        assert_eq!(
            (
                classes.shared.in_flight,
                classes.shared.token_budget.unwrap().in_flight_tokens
            ),
            (1, 40)
        );
        drop(abandoning);
        drop(handed);
        assert_classes_idle(&bulkhead);
    });
}

/// An abandonment races the same class's new admission: the class lock serializes them, so the
/// class's count and the shared pool stay the sum of what is held at every step, and the slot
/// given back is there for the newcomer (which is admitted in every interleaving, since the
/// bulkhead had room for it anyway) with its borrow computed from a settled count.
#[test]
fn abandonment_races_an_admission_of_the_same_class() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .admission_classes(
                AdmissionClasses::new("a")
                    .class("a", ClassLimits::new().protected_concurrent(1))
                    .class("b", ClassLimits::new()),
            )
            .build()
            .unwrap();
        let a = in_class(&bulkhead, "a");
        let _floor = try_admit(&bulkhead, a).unwrap();
        let mut borrowed = try_admit(&bulkhead, a).unwrap();
        assert!(borrowed.resources().borrowed_concurrency);

        let abandoner = thread::spawn(move || {
            assert!(borrowed.abandon_borrowed_concurrency());
            borrowed
        });
        let newcomer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || try_admit(&bulkhead, in_class(&bulkhead, "a")))
        };
        let borrowed = abandoner.join().unwrap();
        let newcomer = newcomer.join();
        let stats = bulkhead.stats();
        let classes = stats.admission_classes.clone().unwrap();
        match newcomer.unwrap() {
            // Admitted after the abandonment: it borrows the shared slot given back.
            Ok(permit) => {
                assert!(permit.resources().borrowed_concurrency);
                assert_eq!(
                    (classes.classes[0].in_flight, classes.shared.in_flight),
                    (2, 1)
                );
                drop(permit);
            }
            // Before it: the one shared slot was still borrowed (and no global slot was free).
            Err(rejection) => {
                assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
                assert_eq!(
                    (classes.classes[0].in_flight, classes.shared.in_flight),
                    (1, 0)
                );
            }
        }
        drop(borrowed);
        drop(_floor);
        assert_classes_idle(&bulkhead);
    });
}

/// A borrowing admission's release (slot, hold and shared figures in one 128-bit `fetch_sub`,
/// no CAS loop) races another class's borrow of the last shared slot: 3 slots and 190 tokens,
/// floors a = 1 slot / 10 tokens and b = 1 slot / 10 tokens, so 1 slot and 170 tokens are
/// shared. `a` holds its floor and a borrower (1 slot, 80 shared
/// tokens); `b` makes a call within its floor, then one that borrows. The borrower is
/// admitted exactly when the release came first, and a refusal shows the pool held by the
/// committed admissions, never by a half-made release; the shared figures come back exact.
#[test]
fn a_borrowing_release_races_another_class_borrowing_the_last_shared_slot() {
    use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering::Relaxed};
    // Which orders the model reached: the borrow after the release, and before it.
    static AFTER: StdAtomicBool = StdAtomicBool::new(false);
    static BEFORE: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 3)
            .token_budget(TokenBudget::new(190))
            .admission_classes(
                AdmissionClasses::new("a")
                    .class(
                        "a",
                        ClassLimits::new()
                            .protected_concurrent(1)
                            .protected_in_flight_tokens(10),
                    )
                    .class(
                        "b",
                        ClassLimits::new()
                            .protected_concurrent(1)
                            .protected_in_flight_tokens(10),
                    ),
            )
            .build()
            .unwrap();
        let a = in_class(&bulkhead, "a");
        let floor_a =
            try_admit(&bulkhead, a.reservation(tokens(10, 0).reservation.unwrap())).unwrap();
        let borrower_a =
            try_admit(&bulkhead, a.reservation(tokens(80, 0).reservation.unwrap())).unwrap();
        let resources = borrower_a.resources();
        assert!(resources.borrowed_concurrency);
        assert_eq!(resources.borrowed_tokens, 80);

        let releaser = thread::spawn(move || drop(borrower_a));
        let b_calls = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let b = in_class(&bulkhead, "b");
                let floor = try_admit(&bulkhead, b.reservation(tokens(10, 0).reservation.unwrap()));
                let borrow =
                    try_admit(&bulkhead, b.reservation(tokens(80, 0).reservation.unwrap()));
                (floor, borrow)
            })
        };
        releaser.join().unwrap();
        let (b_floor, b_borrow) = b_calls.join().unwrap();

        let b_floor = b_floor.expect("a call within its floors is admitted");
        assert!(!b_floor.resources().borrowed_concurrency);
        assert_eq!(b_floor.resources().borrowed_tokens, 0);
        let stats = bulkhead.stats();
        let shared = stats.admission_classes.clone().unwrap().shared;
        match b_borrow {
            // After the release: b holds the shared slot and the 80 shared tokens.
            Ok(permit) => {
                AFTER.store(true, Relaxed);
                assert!(permit.resources().borrowed_concurrency);
                assert_eq!(permit.resources().borrowed_tokens, 80);
                assert_eq!(stats.in_flight, 3);
                assert_eq!(
                    (
                        shared.in_flight,
                        shared.token_budget.unwrap().in_flight_tokens
                    ),
                    (1, 80)
                );
                drop(permit);
            }
            // Before it: the shared slot was held by a's committed borrow, never by a half-made
            // release (the budget had room: 10 + 80 + 10 + 80 of 190).
            Err(loser) => {
                BEFORE.store(true, Relaxed);
                assert_refused_on_a_committed_borrow(&loser);
                // The release has happened by now: the pool is empty and lends again.
                assert_eq!(
                    (
                        shared.in_flight,
                        shared.token_budget.unwrap().in_flight_tokens
                    ),
                    (0, 0)
                );
                let again = try_admit(
                    &bulkhead,
                    in_class(&bulkhead, "b").reservation(tokens(80, 0).reservation.unwrap()),
                )
                .expect("the released shared slot and tokens lend again");
                drop(again);
            }
        }
        drop((floor_a, b_floor));
        assert_classes_idle(&bulkhead);
    });
    assert!(
        AFTER.load(Relaxed) && BEFORE.load(Relaxed),
        "the model reached the borrow both after the release and before it"
    );
}

/// Floors of 1 call and `tokens` tokens.
fn floors(tokens: u64) -> ClassLimits {
    ClassLimits::new()
        .protected_concurrent(1)
        .protected_in_flight_tokens(tokens)
}

/// 2 slots, a budget of 100, class a with floors of 1 call and 50 tokens, class b none.
fn a_with_floors_and_b() -> LlmBulkhead {
    LlmBulkhead::builder("m", 2)
        .token_budget(TokenBudget::new(100))
        .admission_classes(
            AdmissionClasses::new("a")
                .class("a", floors(50))
                .class("b", ClassLimits::new()),
        )
        .build()
        .unwrap()
}

/// A thread that installs `next` on `bulkhead` as revision 1.
fn installing(bulkhead: &LlmBulkhead, next: ClassLimitsTable) -> thread::JoinHandle<()> {
    let bulkhead = bulkhead.clone();
    thread::spawn(move || {
        let mut limits = bulkhead.limits();
        limits.revision = 1;
        limits.admission_classes = Some(next);
        assert!(bulkhead.apply_limits(limits).unwrap().is_applied());
    })
}

/// The two `apply_limits` models below: on [`a_with_floors_and_b`], a call of a for 20 tokens
/// (within a's floors, so admitted on a's class word while the floors are reserved) races
/// `apply_limits` installing `next` as revision 1. Returns the bulkhead and the call's permit
/// (it fits under either revision).
fn a_call_within_its_floor_racing(next: ClassLimitsTable) -> (LlmBulkhead, OwnedPermit) {
    let bulkhead = a_with_floors_and_b();
    let caller = {
        let bulkhead = bulkhead.clone();
        thread::spawn(move || {
            let options = in_class(&bulkhead, "a").reservation(tokens(10, 10).reservation.unwrap());
            try_admit(&bulkhead, options)
        })
    };
    let control = installing(&bulkhead, next);
    let permit = caller.join().unwrap().expect("fits under either revision");
    control.join().unwrap();
    (bulkhead, permit)
}

/// A call within its class's floor races `apply_limits` that moves the floor of calls to the
/// other class. Under revision 0 it is within a's floor; under revision 1 a has none and it
/// borrows the one shared slot. Either way the install's recount leaves the shared figures
/// equal to the sums they stand for under the new floors (a's call beyond floors of 0), and
/// everything returns exactly.
#[test]
fn a_call_within_its_floor_races_apply_limits_moving_the_floor() {
    loom::model(|| {
        let (bulkhead, permit) = a_call_within_its_floor_racing(
            ClassLimitsTable::new()
                .with("a", ClassLimits::new())
                .with("b", ClassLimits::new().protected_concurrent(1)),
        );
        let borrowed = permit.resources().borrowed_concurrency;
        match permit.limit_revision() {
            0 => assert!(!borrowed, "within a's floor then"),
            1 => assert!(borrowed, "a has no floor now"),
            other => panic!("revision {other}"),
        }
        let stats = bulkhead.stats();
        assert_eq!(
            (
                stats.in_flight,
                stats.token_budget.unwrap().in_flight_tokens
            ),
            (1, 20)
        );
        let classes = stats.admission_classes.unwrap();
        assert_eq!(classes.shared.in_flight, 1, "the shared figure is the sum");
        assert_eq!(classes.shared.token_budget.unwrap().in_flight_tokens, 20);
        drop(permit);
        assert_classes_idle(&bulkhead);
    });
}

/// A call within its class's floors races `apply_limits` that lowers the class's token floor
/// from 50 to 5 and leaves everything else as it was: the class word's counts and its
/// reserving bit are the same before and after, so only the limits epoch the install writes
/// into it makes the call's CAS fail when it read the old floor. Under revision 0 the call's
/// 20 tokens are within the floor; under revision 1 it borrows 15. Either way the shared tokens
/// are 15 afterwards (the install's recount), and everything returns exactly.
#[test]
fn a_call_within_its_floor_races_apply_limits_lowering_the_floor() {
    loom::model(|| {
        let (bulkhead, permit) = a_call_within_its_floor_racing(
            ClassLimitsTable::new()
                .with("a", floors(5))
                .with("b", ClassLimits::new()),
        );
        let borrowed = permit.resources().borrowed_tokens;
        match permit.limit_revision() {
            0 => assert_eq!(borrowed, 0, "within a's floor of 50 then"),
            1 => assert_eq!(borrowed, 15, "beyond a's floor of 5 now"),
            other => panic!("revision {other}"),
        }
        let classes = bulkhead.stats().admission_classes.unwrap();
        assert_eq!(
            classes.shared.token_budget.unwrap().in_flight_tokens,
            15,
            "the shared tokens are the sum under the new floor"
        );
        drop(permit);
        assert_classes_idle(&bulkhead);
    });
}

/// The release of a call within its class's floors races `apply_limits` that lowers the
/// class's token floor from 50 to 5 below the call's 20 tokens. The release reads no limits:
/// the class word says whether its counts are beyond the floors in force (the install sets
/// that bit when it unlocks the word). Released before the install, the call gives back
/// nothing shared; after it, the class is beyond its new floor and the release takes the
/// locked path and gives back the 15 tokens it now borrows. A release on the class word alone
/// after the install would leave those 15 shared tokens counted for good.
#[test]
fn a_release_within_its_floor_races_apply_limits_lowering_the_floor() {
    loom::model(|| {
        let bulkhead = a_with_floors_and_b();
        let options = in_class(&bulkhead, "a").reservation(tokens(10, 10).reservation.unwrap());
        let permit = try_admit(&bulkhead, options).expect("within a's floors");
        assert_eq!(permit.resources().borrowed_tokens, 0);
        let releaser = thread::spawn(move || drop(permit));
        let control = installing(
            &bulkhead,
            ClassLimitsTable::new()
                .with("a", floors(5))
                .with("b", ClassLimits::new()),
        );
        releaser.join().unwrap();
        control.join().unwrap();
        assert_classes_idle(&bulkhead);
    });
}

/// 2 slots, one class `a` with a floor of 1 call.
fn one_class_with_a_floor_of_one_call() -> LlmBulkhead {
    LlmBulkhead::builder("m", 2)
        .admission_classes(
            AdmissionClasses::new("a").class("a", ClassLimits::new().protected_concurrent(1)),
        )
        .build()
        .unwrap()
}

/// `close` races a call within its class's floor. Closing stops reserving the floors in the
/// same CAS that sets the flag, under every class lock, so the call is either admitted before
/// the close (and the close's caller, reading the stats right after, sees it in flight) or
/// refused `shutdown`; never admitted on its class's word once the bulkhead is closed.
#[test]
fn close_races_a_call_within_its_floor() {
    loom::model(|| {
        let bulkhead = one_class_with_a_floor_of_one_call();
        let caller = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || try_admit(&bulkhead, in_class(&bulkhead, "a")))
        };
        let closer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                assert!(bulkhead.close());
                bulkhead.stats().in_flight
            })
        };
        let admitted = caller.join().unwrap();
        let seen_after_close = closer.join().unwrap();
        match admitted {
            Ok(permit) => {
                assert_eq!(
                    seen_after_close, 1,
                    "admitted before the close, seen after it"
                );
                drop(permit);
            }
            Err(refused) => {
                assert_eq!(refused.reason(), RejectReason::Shutdown);
                assert_eq!(seen_after_close, 0);
            }
        }
        assert_classes_idle(&bulkhead);
    });
}

/// A drain races the release of a call admitted within its class's floor. The word counts
/// the reserved floor whatever is in flight, so it never reads idle while the floors are
/// reserved: the drain releases them (recounting under every class lock) before it arms, and
/// the release, on its class's word or then under its lock, makes the bulkhead idle. The drain
/// completes in every interleaving (a lost wake-up spins past loom's branch limit).
#[test]
fn a_drain_races_a_release_within_its_floor() {
    loom::model(|| {
        let bulkhead = one_class_with_a_floor_of_one_call();
        let permit = try_admit(&bulkhead, in_class(&bulkhead, "a")).unwrap();
        assert!(!permit.resources().borrowed_concurrency);
        let releaser = thread::spawn(move || drop(permit));
        drain_to_completion(&bulkhead);
        releaser.join().unwrap();
        assert_classes_idle(&bulkhead);
    });
}

/// A release within a class's floor (one CAS on the class word) races a second call of the
/// same class, which borrows if it is decided while the first is in flight (under the class
/// lock: the release's CAS fails while the lock is held, and takes the locked path) and is
/// within the floor if decided after. The shared figure is the sum it stands for once both are
/// done (a's one call is within its floor: nothing shared), and everything returns exactly.
#[test]
fn a_release_within_its_floor_races_a_call_of_its_class() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 2)
            .admission_classes(
                AdmissionClasses::new("a")
                    .class("a", ClassLimits::new().protected_concurrent(1))
                    .class("b", ClassLimits::new()),
            )
            .build()
            .unwrap();
        let first = try_admit(&bulkhead, in_class(&bulkhead, "a")).unwrap();
        assert!(!first.resources().borrowed_concurrency);
        let releaser = thread::spawn(move || drop(first));
        let second = try_admit(&bulkhead, in_class(&bulkhead, "a")).expect("a slot either way");
        releaser.join().unwrap();
        let classes = bulkhead.stats().admission_classes.unwrap();
        assert_eq!(classes.classes[0].in_flight, 1);
        assert_eq!(
            classes.shared.in_flight, 0,
            "one call of a, within its floor"
        );
        drop(second);
        assert_classes_idle(&bulkhead);
    });
}

/// Two calls within their class's floor race on the class word, then so do their releases:
/// the operation whose CAS fails (the other committed first) decides again on the class word
/// and retries there, never taking the class lock. Both calls are admitted within the floor
/// (nothing borrowed, nothing shared) in every interleaving, and everything returns exactly.
#[test]
fn two_calls_within_their_floor_race_on_the_class_word() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 3)
            .admission_classes(
                AdmissionClasses::new("a")
                    .class("a", ClassLimits::new().protected_concurrent(2))
                    .class("b", ClassLimits::new()),
            )
            .build()
            .unwrap();
        let other = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || try_admit(&bulkhead, in_class(&bulkhead, "a")).unwrap())
        };
        let mine = try_admit(&bulkhead, in_class(&bulkhead, "a")).unwrap();
        let other = other.join().unwrap();
        for permit in [&mine, &other] {
            assert!(!permit.resources().borrowed_concurrency, "within a's floor");
        }
        let classes = bulkhead.stats().admission_classes.unwrap();
        assert_eq!(classes.classes[0].in_flight, 2);
        assert_eq!(classes.shared.in_flight, 0, "nothing borrowed");
        let releaser = thread::spawn(move || drop(other));
        drop(mine);
        releaser.join().unwrap();
        assert_classes_idle(&bulkhead);
    });
}
