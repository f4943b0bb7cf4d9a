//! loom models of in-flight deduplication (`src/llm/dedup.rs`, `src/llm/run_shared.rs`): the
//! registry's sharded map of flights, joining a flight against its finish, a waiter leaving
//! against another, and the hand-off of the shared call from a leader that leaves to a
//! follower that then drives it, in every interleaving of the callers involved.
//!
//! The registry's shard mutexes and each flight's mutex are loom's, and so are the `Arc`s of
//! the flights (a flight never freed shows as a loom `Arc` leak); every model goes through the
//! public `run_shared` with real callbacks, so the leader's admission (the word, the release)
//! runs too. The counters `active` and `hits` are statistics (`sync::unmodeled`): the models
//! read them only after joining the threads that wrote them.
//!
//! Invariants checked: a call made while an identical one settles either follows it and gets
//! its value, or (once it finished) leads and runs its own callback, never anything in
//! between; no value crosses a `DedupScope`; the last waiter to leave an unfinished call
//! drops it exactly once and its admission settles; a leader leaving hands the call to a
//! waiting follower, which drives it to the end (a lost wake-up is a loom deadlock); no waiter
//! whose outcome arrived is left unwoken; and at the end no flight stays registered
//! (`active == 0`) and every slot comes back (`assert_idle`).
//!
//! No model sets a timeout: the timer thread is not compiled under loom.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err)]

mod common;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc as StdArc;
use std::sync::atomic::{AtomicBool as StdAtomicBool, Ordering::Relaxed};
use std::task::{Context, Poll, Waker};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RunError, dedup::DedupScope, dedup::Deduplication,
};
use common::{Flag, assert_idle, flag, poll};
use loom::future::{AtomicWaker, block_on};
use loom::sync::atomic::Ordering::{AcqRel, Acquire, Release};
use loom::sync::atomic::{AtomicBool, AtomicU64};
use loom::thread;

type Reply<T> = Result<T, RunError<String>>;

/// A bulkhead of `max_concurrent` slots that deduplicates by the whole request.
fn dedup(max_concurrent: usize) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent)
        .deduplication(Deduplication::new())
        .build()
        .unwrap()
}

/// The request every call of a model makes.
fn request() -> LlmRequest {
    LlmRequest::new().user("q")
}

/// A `run_shared` call, pinned so that it can be polled by hand.
type Call<T> = Pin<Box<dyn Future<Output = Reply<T>> + Send>>;

/// The outcome of a `run_shared` call polled once (`first`) with the recording waker `flag`,
/// after every thread that could finish it has been joined: if it was pending, someone must
/// have woken it (a lost wake-up fails here) and one more poll must finish it.
fn settle<T>(mut call: Call<T>, first: Poll<Reply<T>>, flag: &Flag) -> Reply<T> {
    match first {
        Poll::Ready(reply) => reply,
        Poll::Pending => {
            assert!(
                flag.woken(),
                "a waiter whose outcome arrived was never woken"
            );
            match poll(&mut call, Waker::noop()) {
                Poll::Ready(reply) => reply,
                Poll::Pending => panic!("a waiter was left without its outcome"),
            }
        }
    }
}

/// Polls `call` once with a fresh recording waker.
fn first_poll<T>(call: &mut Call<T>) -> (Poll<Reply<T>>, StdArc<Flag>) {
    let (flag, waker) = flag();
    (poll(call, &waker), flag)
}

/// No flight left in the registry, nothing in flight, every admission settled.
fn assert_settled(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    assert_eq!(
        stats.deduplication.unwrap().active,
        0,
        "no flight left registered"
    );
    assert_idle(bulkhead);
}

/// A call is made while an identical one (`max_concurrent` 1) is polled to completion on
/// another thread. Whatever the interleaving, the second call either joined the flight
/// before it left the registry (a follower: `hits` 1, it gets the leader's value, one
/// admission) or came after it (a leader: `hits` 0, it ran its own callback under a second
/// admission, the first slot already back); never a follower of a finished flight left
/// without a value, nor a leader refused a slot the first still held.
#[test]
fn a_call_made_while_the_leader_settles_follows_it_or_leads_anew() {
    // Which roles the second call took.
    static FOLLOWED: StdAtomicBool = StdAtomicBool::new(false);
    static LED: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = dedup(1);
        // Registered as the leader by the call itself, before any poll.
        let leader = bulkhead.run_shared(&request(), AcquireOptions::new(), |_ctx| async {
            Ok::<_, String>("leader")
        });
        let leading = thread::spawn(move || block_on(leader));
        let second = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut call: Call<&str> = Box::pin(bulkhead.run_shared(
                    &request(),
                    AcquireOptions::new(),
                    |_ctx| async { Ok::<_, String>("second") },
                ));
                let (first, flag) = first_poll(&mut call);
                (call, first, flag)
            })
        };
        assert_eq!(leading.join().unwrap(), Ok("leader"));
        let (call, first, flag) = second.join().unwrap();
        let reply = settle(call, first, &flag);

        let stats = bulkhead.stats();
        match stats.deduplication.unwrap().hits {
            1 => {
                assert_eq!(reply, Ok("leader"), "a follower gets the leader's value");
                assert_eq!(stats.admitted, 1, "a follower takes no capacity");
                FOLLOWED.store(true, Relaxed);
            }
            0 => {
                assert_eq!(reply, Ok("second"), "a new leader runs its own callback");
                assert_eq!(stats.admitted, 2);
                LED.store(true, Relaxed);
            }
            hits => panic!("{hits} hits for one second call"),
        }
        assert_eq!(stats.rejected, 0);
        assert_settled(&bulkhead);
    });
    assert!(
        FOLLOWED.load(Relaxed) && LED.load(Relaxed),
        "the second call did not both follow and lead"
    );
}

/// A leader in scope "a" (`max_concurrent` 2) settles on the main thread while one thread
/// makes the same request in scope "a" and another in scope "b". Each callback returns its
/// (scope, caller): every caller gets a value of its own scope; the "b" call always leads
/// (its scope has no flight), the second "a" call follows the leader or leads once it left.
#[test]
fn outcomes_never_cross_a_dedup_scope() {
    static FOLLOWED: StdAtomicBool = StdAtomicBool::new(false);
    static LED: StdAtomicBool = StdAtomicBool::new(false);

    type Pair = (&'static str, &'static str);
    fn make(bulkhead: &LlmBulkhead, scope: &'static str, caller: &'static str) -> Call<Pair> {
        let options = AcquireOptions::new().dedup_scope(DedupScope::new(scope));
        Box::pin(
            bulkhead.run_shared(&request(), options, move |_ctx| async move {
                Ok::<_, String>((scope, caller))
            }),
        )
    }

    loom::model(|| {
        let bulkhead = dedup(2);
        let mut leader = make(&bulkhead, "a", "leader");
        let callers = ["a", "b"].map(|scope| {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                let mut call = make(&bulkhead, scope, scope);
                let (first, flag) = first_poll(&mut call);
                (call, first, flag)
            })
        });
        let (first, flag) = first_poll(&mut leader);
        let [a, b] = callers.map(|caller| {
            let (call, first, flag) = caller.join().unwrap();
            settle(call, first, &flag)
        });
        assert_eq!(settle(leader, first, &flag), Ok(("a", "leader")));
        assert_eq!(b, Ok(("b", "b")), "a call in scope b never joins scope a");

        let stats = bulkhead.stats();
        match stats.deduplication.unwrap().hits {
            1 => {
                assert_eq!(a, Ok(("a", "leader")));
                assert_eq!(stats.admitted, 2);
                FOLLOWED.store(true, Relaxed);
            }
            0 => {
                assert_eq!(a, Ok(("a", "a")));
                assert_eq!(stats.admitted, 3);
                LED.store(true, Relaxed);
            }
            hits => panic!("{hits} hits for one joinable call"),
        }
        assert_eq!(stats.rejected, 0);
        assert_settled(&bulkhead);
    });
    assert!(
        FOLLOWED.load(Relaxed) && LED.load(Relaxed),
        "the second call in scope a did not both follow and lead"
    );
}

/// Counts its drops: held by a callback's future, it shows when (and how often) the shared
/// call is dropped.
struct Probe(StdArc<AtomicU64>);

impl Drop for Probe {
    fn drop(&mut self) {
        self.0.fetch_add(1, AcqRel);
    }
}

/// The leader was admitted and its callback never finishes (it holds a [`Probe`]); a follower
/// joined. One thread drops the leader while another drops the follower, after polling it
/// once if `poll_follower` (it then drives the call: it takes the call out and puts it back,
/// racing the leader's leave). Whichever leaves last drops the call: the probe is dropped
/// exactly once, the admission settles (`admitted == released == 1`), the flight leaves the
/// registry. The follower, dropped without an outcome (polled or not: it joined when it was
/// made), counts as `aborted`.
fn the_last_waiter_to_leave_drops_the_call(poll_follower: bool) {
    loom::model(move || {
        let bulkhead = dedup(1);
        let drops = StdArc::new(AtomicU64::new(0));
        let probe = Probe(drops.clone());
        let mut leader: Call<&str> = Box::pin(bulkhead.run_shared(
            &request(),
            AcquireOptions::new(),
            move |_ctx| async move {
                let _probe = probe;
                std::future::pending::<()>().await;
                Ok::<_, String>("never")
            },
        ));
        assert!(
            poll(&mut leader, Waker::noop()).is_pending(),
            "admitted, running"
        );
        let mut follower: Call<&str> = Box::pin(bulkhead.run_shared(
            &request(),
            AcquireOptions::new(),
            |_ctx| async { Ok::<_, String>("follower") },
        ));
        let stats = bulkhead.stats();
        assert_eq!((stats.admitted, stats.in_flight), (1, 1));
        assert_eq!(stats.deduplication.unwrap().hits, 1);

        let leaving = thread::spawn(move || drop(leader));
        let following = thread::spawn(move || {
            if poll_follower {
                let (first, _flag) = first_poll(&mut follower);
                assert!(first.is_pending(), "the call never finishes");
            }
            drop(follower);
        });
        leaving.join().unwrap();
        following.join().unwrap();

        assert_eq!(drops.load(Acquire), 1, "the call is dropped exactly once");
        let stats = bulkhead.stats();
        assert_eq!((stats.admitted, stats.released), (1, 1));
        assert_eq!((stats.rejected, stats.rejected_by_reason.aborted), (1, 1));
        assert_settled(&bulkhead);
    });
}

#[test]
fn the_last_waiter_to_leave_drops_the_call_once_with_a_follower_that_drove_it() {
    the_last_waiter_to_leave_drops_the_call(true);
}

#[test]
fn the_last_waiter_to_leave_drops_the_call_once_with_a_follower_never_polled() {
    the_last_waiter_to_leave_drops_the_call(false);
}

/// A gate a callback waits on: a loom flag and waker slot, so a wake-up loom sees.
#[derive(Default)]
struct Gate {
    open: AtomicBool,
    waker: AtomicWaker,
}

impl Gate {
    fn open(&self) {
        self.open.store(true, Release);
        self.waker.wake();
    }

    async fn passed(&self) {
        std::future::poll_fn(|cx: &mut Context<'_>| {
            self.waker.register_by_ref(cx.waker());
            if self.open.load(Acquire) {
                Poll::Ready(())
            } else {
                Poll::Pending
            }
        })
        .await;
    }
}

/// The leader's callback waits on a gate. One thread polls the leader once and drops it; a
/// follower is driven to completion on another (`block_on`); the main thread opens the gate.
/// Whoever polls the call when the gate opens (the leader, the follower, or nobody yet), the
/// wake-up reaches a waiter that drives the call: the leader leaving hands it to the waiting
/// follower, a wake-up during a poll makes the driver poll again. A lost wake-up leaves the
/// follower blocked for good, which loom reports as a deadlock. The follower gets the
/// leader's value; one admission, settled; nothing left registered.
#[test]
fn a_leader_leaving_hands_the_call_to_a_follower_that_drives_it_to_the_end() {
    // Whether the leader's only poll saw the call finish (the gate opened first), or not.
    static LEADER_FINISHED: StdAtomicBool = StdAtomicBool::new(false);
    static LEADER_LEFT: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = dedup(1);
        let gate = StdArc::new(Gate::default());
        let mut leader: Call<&str> = {
            let gate = gate.clone();
            Box::pin(bulkhead.run_shared(
                &request(),
                AcquireOptions::new(),
                move |_ctx| async move {
                    gate.passed().await;
                    Ok::<_, String>("leader")
                },
            ))
        };
        let follower = bulkhead.run_shared(&request(), AcquireOptions::new(), |_ctx| async {
            Ok::<_, String>("follower")
        });

        let leaving = thread::spawn(move || {
            let first = poll(&mut leader, Waker::noop());
            drop(leader);
            first
        });
        let following = thread::spawn(move || block_on(follower));
        gate.open();
        match leaving.join().unwrap() {
            Poll::Ready(reply) => {
                assert_eq!(reply, Ok("leader"));
                LEADER_FINISHED.store(true, Relaxed);
            }
            Poll::Pending => LEADER_LEFT.store(true, Relaxed),
        }
        assert_eq!(following.join().unwrap(), Ok("leader"));

        let stats = bulkhead.stats();
        assert_eq!(stats.deduplication.unwrap().hits, 1);
        assert_eq!((stats.admitted, stats.released), (1, 1));
        assert_eq!(stats.rejected, 0, "a leader leaving is not a refusal");
        assert_settled(&bulkhead);
    });
    assert!(
        LEADER_FINISHED.load(Relaxed) && LEADER_LEFT.load(Relaxed),
        "the leader's poll did not both finish the call and leave it to the follower"
    );
}

/// The window between a leader's registration and its install: the leader's `run_shared`
/// registers the flight, resolves its call (the estimator, unlocked) and only then installs
/// it, while an identical call on another thread may join and be polled in between (it finds
/// no call to drive and waits). The leader's future is never polled. Whatever the
/// interleaving, the install wakes the waiting follower, which drives the call to the end (a
/// lost wake-up is a loom deadlock); if the second call registered first, it leads and runs
/// its own. Both orders are asserted reached.
#[test]
fn a_follower_polled_before_the_leader_installs_its_call_drives_it_when_it_comes() {
    static FIRST_LED: StdAtomicBool = StdAtomicBool::new(false);
    static SECOND_LED: StdAtomicBool = StdAtomicBool::new(false);

    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .deduplication(Deduplication::new())
            .token_budget(async_bulkhead_llm::TokenBudget::new(1_000))
            .estimator(|_: &LlmRequest| async_bulkhead_llm::estimate::TokenEstimate::new(10, 10))
            .build()
            .unwrap();
        let registering = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                // Registered, estimated and installed here; never polled.
                let call: Call<&str> = Box::pin(bulkhead.run_shared(
                    &request(),
                    AcquireOptions::new(),
                    |_ctx| async { Ok::<_, String>("first") },
                ));
                call
            })
        };
        let second = bulkhead.run_shared(&request(), AcquireOptions::new(), |_ctx| async {
            Ok::<_, String>("second")
        });
        let reply = block_on(second);
        let first = registering.join().unwrap();
        match reply {
            Ok("first") => FIRST_LED.store(true, Relaxed),
            Ok("second") => SECOND_LED.store(true, Relaxed),
            ref other => panic!("unexpected outcome {other:?}"),
        }
        // The first call's own outcome: already there when the calls shared one flight; when
        // the second finished before the first registered, the first leads its own and this
        // poll drives it.
        let mut first = first;
        let value = match poll(&mut first, Waker::noop()) {
            Poll::Ready(value) => value,
            Poll::Pending => panic!("the first call was left without its outcome"),
        };
        let stats = bulkhead.stats();
        if value == reply {
            assert_eq!(stats.deduplication.unwrap().hits, 1);
            assert_eq!((stats.admitted, stats.released), (1, 1));
        } else {
            assert_eq!((value, reply), (Ok("first"), Ok("second")));
            assert_eq!(stats.deduplication.unwrap().hits, 0);
            assert_eq!((stats.admitted, stats.released), (2, 2));
        }
        assert_settled(&bulkhead);
    });
    assert!(
        FIRST_LED.load(Relaxed) && SECOND_LED.load(Relaxed),
        "the model did not reach both registration orders"
    );
}

/// A leader whose estimator panics between its registration and its install, while an
/// identical call joins on another thread: the follower gets a panic of its own (never a wait
/// for a call that will never come: a stranded follower is a loom deadlock), the flight leaves
/// the registry, and nothing was admitted. Whichever call registers first leads, so each
/// thread's call may be the one that panics in its estimator.
#[test]
fn a_leader_that_panics_before_installing_its_call_fails_its_followers() {
    loom::model(|| {
        let bulkhead = LlmBulkhead::builder("m", 1)
            .deduplication(Deduplication::new())
            .token_budget(async_bulkhead_llm::TokenBudget::new(1_000))
            .estimator(
                |_: &LlmRequest| -> async_bulkhead_llm::estimate::TokenEstimate {
                    panic!("the estimator fails")
                },
            )
            .build()
            .unwrap();
        let call = |bulkhead: LlmBulkhead| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(move || {
                let call = bulkhead.run_shared(&request(), AcquireOptions::new(), |_ctx| async {
                    Ok::<_, String>("never")
                });
                block_on(call)
            }))
        };
        let other = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || call(bulkhead).is_err())
        };
        assert!(call(bulkhead.clone()).is_err(), "a panic, never a value");
        assert!(other.join().unwrap(), "a panic, never a value");
        let stats = bulkhead.stats();
        assert_eq!(stats.admitted, 0);
        assert_settled(&bulkhead);
    });
}
