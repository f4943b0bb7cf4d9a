//! What followers get: a clone (or the share hook's copy) of the leader's value, the leader's
//! error (counted once), the leader's refusal, a panic of their own share hook, and the panic
//! of a call that panicked; and the usage a shared call settles with, once.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    AcquireOptions, LlmRequest, RejectReason, Reservation, RunError, TokenBudget, TokenUsage,
    dedup::Sharing, request::RequestError,
};
use futures::FutureExt;
use futures::executor::block_on;

use super::support::{Gate, Runs, builder, dedup, poll_once, prompt};

fn plain() -> AcquireOptions {
    AcquireOptions::new()
}

#[test]
fn followers_get_what_the_share_hook_makes_and_the_leader_the_original() {
    let bulkhead = dedup(2);
    let request = prompt("shared");
    let shares = Arc::new(AtomicU64::new(0));
    let sharing = || {
        let shares = Arc::clone(&shares);
        Sharing::with(move |v: &(u64, &'static str)| {
            shares.fetch_add(1, Ordering::SeqCst);
            (v.0, "copy")
        })
    };
    let gate = Gate::new();
    let runs = Runs::default();
    let calls: Vec<_> = (0..4)
        .map(|i| {
            bulkhead.run_shared_with(
                &request,
                plain(),
                sharing(),
                runs.call(&gate, (i, "original")),
            )
        })
        .collect();
    gate.open();
    let got = block_on(futures::future::join_all(calls));
    assert_eq!(
        got,
        [
            Ok((0, "original")),
            Ok((0, "copy")),
            Ok((0, "copy")),
            Ok((0, "copy"))
        ]
    );
    assert_eq!(shares.load(Ordering::SeqCst), 3); // once per follower, never for the leader
}

#[test]
fn a_share_hook_that_panics_fails_that_follower_only() {
    let bulkhead = dedup(2);
    let request = prompt("fragile");
    let served = Arc::new(AtomicU64::new(0));
    let sharing = || {
        let served = Arc::clone(&served);
        Sharing::with(move |v: &u64| {
            // The second copy panics.
            if served.fetch_add(1, Ordering::SeqCst) == 1 {
                panic!("share hook fails");
            }
            *v
        })
    };
    let gate = Gate::new();
    let runs = Runs::default();
    let mut leader =
        Box::pin(bulkhead.run_shared_with(&request, plain(), sharing(), runs.call(&gate, 9)));
    assert!(poll_once(&mut leader).is_pending());
    let first = bulkhead.run_shared_with(&request, plain(), sharing(), runs.call(&gate, 0));
    let second = bulkhead.run_shared_with(&request, plain(), sharing(), runs.call(&gate, 0));
    gate.open();
    assert_eq!(block_on(leader), Ok(9));
    assert_eq!(block_on(first), Ok(9));
    let panicked = block_on(AssertUnwindSafe(second).catch_unwind()).unwrap_err();
    assert_eq!(panicked.downcast_ref::<&str>(), Some(&"share hook fails"));
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.rejected), (0, 0));
    assert_eq!(stats.deduplication.unwrap().active, 0);
}

#[test]
fn a_leader_failure_reaches_every_follower_and_is_counted_once() {
    let bulkhead = dedup(2);
    let request = prompt("failing");
    let gate = Gate::new();
    let failing = || {
        let passed = gate.passed();
        move |_ctx| async move {
            passed.await;
            Err::<u64, _>(Arc::new(String::from("provider down")))
        }
    };
    let calls: Vec<_> = (0..3)
        .map(|_| bulkhead.run_shared(&request, plain(), failing()))
        .collect();
    gate.open();
    for result in block_on(futures::future::join_all(calls)) {
        match result {
            Err(RunError::Failed(error)) => assert_eq!(*error, "provider down"),
            other => panic!("expected the leader's failure, got {other:?}"),
        }
    }
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.rejected), (1, 1, 0));
}

#[test]
fn a_leader_refusal_reaches_followers_with_its_detail_and_is_counted_once() {
    let bulkhead = builder(1).max_queue(0).build().unwrap();
    let holder = bulkhead.try_acquire(&LlmRequest::new(), plain()).unwrap();
    let request = prompt("refused");
    let runs = Runs::default();
    let gate = Gate::open_now();
    let leader = bulkhead.run_shared(&request, plain(), runs.call(&gate, 1));
    let follower = bulkhead.run_shared(&request, plain(), runs.call(&gate, 2));
    let (a, b) = block_on(futures::future::join(leader, follower));
    let (Err(RunError::Rejected(a)), Err(RunError::Rejected(b))) = (a, b) else {
        panic!("both refused");
    };
    assert_eq!(a.reason(), RejectReason::ConcurrencyLimit);
    assert_eq!(a, b);
    assert_eq!(b.detail().in_flight, 1);
    assert_eq!(bulkhead.stats().rejected, 1);
    assert_eq!(runs.started(), 0);
    drop(holder);
}

#[test]
fn a_leader_whose_request_is_invalid_fails_its_followers_the_same_way() {
    let bulkhead = builder(2)
        .token_budget(TokenBudget::new(1_000))
        .build()
        .unwrap();
    // The estimate does not fit the budget's representable range: the leader's estimation
    // fails after it registered, and the follower (never estimated) gets the same error.
    let request = prompt("x").extra_input_tokens(u64::MAX);
    let runs = Runs::default();
    let gate = Gate::open_now();
    let leader = bulkhead.run_shared(&request, plain(), runs.call(&gate, 1));
    let follower = bulkhead.run_shared(&request, plain(), runs.call(&gate, 2));
    let (a, b) = block_on(futures::future::join(leader, follower));
    let (Err(RunError::Invalid(a)), Err(RunError::Invalid(b))) = (a, b) else {
        panic!("both invalid");
    };
    assert_eq!(a, b);
    assert!(!matches!(a, RequestError::ZeroBorrowedConcurrencyDeadline));
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.rejected), (0, 0));
    assert_eq!(stats.deduplication.unwrap().hits, 1);
}

#[test]
fn a_shared_call_settles_once_with_the_usage_of_its_value() {
    let bulkhead = builder(4)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .unwrap();
    let request = prompt("metered");
    let options = plain().reservation(Reservation::new(100, 900).unwrap());
    let sharing = || Sharing::<(u64, u64)>::cloned().usage(|(i, o)| TokenUsage::new(*i, *o).ok());
    let gate = Gate::new();
    let runs = Runs::default();
    let calls: Vec<_> = (0..3)
        .map(|_| bulkhead.run_shared_with(&request, options, sharing(), runs.call(&gate, (80, 20))))
        .collect();
    gate.open();
    assert!(
        block_on(futures::future::join_all(calls))
            .iter()
            .all(|r| *r == Ok((80, 20)))
    );
    let tokens = bulkhead.stats().token_budget.unwrap();
    assert_eq!((tokens.total_reserved, tokens.total_consumed), (1_000, 100));
    assert_eq!(tokens.in_flight_tokens, 0);
}

#[test]
fn a_call_that_panics_panics_every_waiter_and_leaves_nothing_behind() {
    let bulkhead = dedup(2);
    let request = prompt("boom");
    let gate = Gate::new();
    let passed = gate.passed();
    let leader = bulkhead.run_shared(&request, plain(), move |_ctx| async move {
        passed.await;
        if true {
            panic!("the call panics");
        }
        Ok::<u64, String>(0)
    });
    let mut follower =
        Box::pin(bulkhead.run_shared(&request, plain(), |_ctx| async { Ok::<u64, String>(1) }));
    assert!(poll_once(&mut follower).is_pending());
    gate.open();
    let driver = block_on(AssertUnwindSafe(leader).catch_unwind()).unwrap_err();
    assert_eq!(driver.downcast_ref::<&str>(), Some(&"the call panics"));
    let other = block_on(AssertUnwindSafe(follower).catch_unwind()).unwrap_err();
    assert!(other.downcast_ref::<&str>().unwrap().contains("panicked"));
    let stats = bulkhead.stats();
    assert_eq!((stats.in_flight, stats.admitted, stats.released), (0, 1, 1));
    assert_eq!(stats.deduplication.unwrap().active, 0);
}

/// The leader registers its flight, then resolves its call (the estimator, user code) before
/// installing it. A panic there must not strand the followers that joined meanwhile: each gets
/// a panic of its own, the flight leaves the registry, and the next identical call leads anew.
#[test]
fn a_leader_that_panics_before_its_call_is_installed_strands_no_follower() {
    let estimates = Arc::new(AtomicU64::new(0));
    let counted = Arc::clone(&estimates);
    let bulkhead = builder(2)
        .token_budget(TokenBudget::new(10_000))
        .estimator(move |_: &LlmRequest| {
            if counted.fetch_add(1, Ordering::SeqCst) == 0 {
                std::thread::sleep(std::time::Duration::from_millis(30));
                panic!("the estimator fails");
            }
            async_bulkhead_llm::estimate::TokenEstimate::new(10, 10)
        })
        .build()
        .unwrap();
    let request = prompt("estimated");
    let leader = {
        let (bulkhead, request) = (bulkhead.clone(), request.clone());
        std::thread::spawn(move || {
            std::panic::catch_unwind(AssertUnwindSafe(|| {
                drop(bulkhead.run_shared(&request, plain(), |_ctx| async { Ok::<u64, String>(0) }))
            }))
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(10));
    // Joins the leader's flight while the leader is still in its estimator.
    let (done, outcome) = std::sync::mpsc::channel();
    {
        let (bulkhead, request) = (bulkhead.clone(), request.clone());
        std::thread::spawn(move || {
            let call =
                bulkhead.run_shared(&request, plain(), |_ctx| async { Ok::<u64, String>(1) });
            let _ = done.send(block_on(AssertUnwindSafe(call).catch_unwind()));
        });
    }
    let panicked = leader.join().unwrap().unwrap_err();
    assert_eq!(
        panicked.downcast_ref::<&str>(),
        Some(&"the estimator fails")
    );
    let follower = outcome
        .recv_timeout(std::time::Duration::from_secs(10))
        .expect("the follower got no outcome: stranded by its leader's panic");
    let payload = follower.unwrap_err();
    assert!(
        payload
            .downcast_ref::<&str>()
            .unwrap()
            .contains("leader panicked"),
        "the follower's panic says why"
    );
    let stats = bulkhead.stats();
    assert_eq!(stats.deduplication.unwrap().active, 0);
    assert_eq!((stats.in_flight, stats.admitted), (0, 0));
    // The next identical call leads a flight of its own.
    let again =
        block_on(bulkhead.run_shared(&request, plain(), |_ctx| async { Ok::<u64, String>(2) }));
    assert_eq!(again, Ok(2));
    assert_eq!(bulkhead.stats().deduplication.unwrap().active, 0);
}

/// Each follower's copy is made by its own share hook (its `Sharing`), not the leader's; the
/// call settles once, with the usage the leader's `Sharing` extracts (it is the leader's call).
#[test]
fn each_follower_gets_its_copy_from_its_own_share_hook() {
    let bulkhead = builder(2)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .unwrap();
    let request = prompt("hooks");
    let options = plain().reservation(Reservation::new(100, 900).unwrap());
    let tagged = |tag: &'static str, output: u64| {
        Sharing::with(move |v: &(u64, &'static str)| (v.0, tag))
            .usage(move |v: &(u64, &'static str)| TokenUsage::new(v.0, output).ok())
    };
    let gate = Gate::new();
    let runs = Runs::default();
    let leader = bulkhead.run_shared_with(
        &request,
        options,
        tagged("leader's", 1),
        runs.call(&gate, (7, "original")),
    );
    let first = bulkhead.run_shared_with(
        &request,
        options,
        tagged("first's", 2),
        runs.call(&gate, (8, "x")),
    );
    let second = bulkhead.run_shared_with(
        &request,
        options,
        tagged("second's", 3),
        runs.call(&gate, (9, "y")),
    );
    gate.open();
    let got = block_on(futures::future::join3(leader, first, second));
    assert_eq!(
        got,
        (Ok((7, "original")), Ok((7, "first's")), Ok((7, "second's")))
    );
    let tokens = bulkhead.stats().token_budget.unwrap();
    // Settled once, with the leader's usage hook: 7 input + 1 output.
    assert_eq!((tokens.total_reserved, tokens.total_consumed), (1_000, 8));
}
