//! `run` and `run_with_usage`: settlement, failures, cancellation, waiting.

use std::cell::Cell;
use std::io;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, Priority, RejectReason, Rejection, Reservation, RunError,
    TokenBudget, TokenUsage,
};
use futures::executor::block_on;

use crate::support::{
    SHORT, SetOnDrop, assert_pending, budgeted, figures, opts, plain, queued, ready, req, tokens,
    toks, usage, within,
};

#[test]
fn run_returns_the_value_and_settles() {
    let bulkhead = plain(1, 0);
    let value = block_on(bulkhead.run(&req(), opts(), async |_ctx| Ok::<_, io::Error>(42)))
        .expect("admitted and succeeded");
    assert_eq!(value, 42);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.pending,
            stats.admitted,
            stats.released
        ),
        (0, 0, 1, 1)
    );
    assert_eq!(stats.rejected, 0);
}

#[test]
fn run_with_usage_books_consumed_and_refunded_exactly() {
    let bulkhead = budgeted(2, 0, 10_000);
    let options = AcquireOptions::new().reservation(Reservation::new(100, 1000).expect("fits"));
    let reply = block_on(bulkhead.run_with_usage(
        &req(),
        options,
        |reply: &(&str, TokenUsage)| Some(reply.1),
        async |_ctx| Ok::<_, io::Error>(("hi", usage(90, 10))),
    ))
    .expect("admitted and succeeded");
    assert_eq!(reply.0, "hi");
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.in_flight_tokens,
            t.total_reserved,
            t.total_consumed,
            t.total_refunded
        ),
        (0, 1100, 100, 1000)
    );

    // Usage above the hold refunds nothing; an extractor answering None books nothing.
    block_on(bulkhead.run_with_usage(
        &req(),
        options,
        |u: &TokenUsage| Some(*u),
        async |_ctx| Ok::<_, io::Error>(usage(900, 300)),
    ))
    .expect("admitted and succeeded");
    block_on(bulkhead.run_with_usage(
        &req(),
        options,
        |_: &()| None,
        async |_ctx| Ok::<_, io::Error>(()),
    ))
    .expect("admitted and succeeded");
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.in_flight_tokens,
            t.total_reserved,
            t.total_consumed,
            t.total_refunded
        ),
        (0, 3300, 1300, 1000)
    );
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

#[test]
fn a_failed_callback_is_failed_and_settles_without_usage() {
    let bulkhead = budgeted(1, 0, 10_000);
    let extracted = Cell::new(false);
    let err = block_on(bulkhead.run_with_usage(
        &req(),
        toks(500),
        |_: &()| {
            extracted.set(true);
            Some(usage(1, 1))
        },
        async |_ctx| Err::<(), _>(io::Error::other("provider down")),
    ))
    .expect_err("the callback failed");
    assert!(
        matches!(&err, RunError::Failed(e) if e.to_string() == "provider down"),
        "got {err:?}"
    );
    assert!(err.rejection().is_none());
    assert!(!extracted.get(), "no usage is extracted from a failure");
    let t = tokens(&bulkhead);
    assert_eq!(
        (
            t.in_flight_tokens,
            t.total_reserved,
            t.total_consumed,
            t.total_refunded
        ),
        (0, 500, 0, 0)
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.admitted,
            stats.released,
            stats.rejected
        ),
        (0, 1, 1, 0)
    );
}

#[test]
fn a_rejected_run_never_calls_the_callback() {
    let called = Cell::new(false);
    let call = async |_ctx: async_bulkhead_llm::RunContext<'_>| {
        called.set(true);
        Ok::<_, io::Error>(())
    };

    let full = plain(1, 0);
    let held = full.try_acquire(&req(), opts()).expect("free slot");
    let err = block_on(full.run(&req(), opts(), call)).expect_err("no slot");
    match &err {
        RunError::Rejected(r) => assert_eq!(r.reason(), RejectReason::ConcurrencyLimit),
        other => panic!("expected a rejection, got {other:?}"),
    }
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::ConcurrencyLimit)
    );
    drop(held);

    let small = budgeted(1, 4, 100);
    let err = block_on(small.run(&req(), toks(500), call)).expect_err("too many tokens");
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::BudgetLimit)
    );
    assert_eq!(small.stats().pending, 0);

    let closed = plain(1, 4);
    closed.close();
    let err = block_on(closed.run(&req(), opts(), call)).expect_err("closed");
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::Shutdown)
    );

    assert!(!called.get(), "the callback never ran");
    assert_eq!(full.stats().admitted, 1);
    assert_eq!((small.stats().admitted, closed.stats().admitted), (0, 0));
}

#[test]
fn the_run_context_describes_the_admission() {
    let bulkhead = LlmBulkhead::builder("test-model", 2)
        .initial_revision(3)
        .token_budget(TokenBudget::new(10_000))
        .build()
        .expect("valid configuration");
    bulkhead
        .apply_limits(Limits::new(5, 2).with_token_budget(10_000, 0))
        .expect("valid limits");
    let reservation = Reservation::new(100, 1000).expect("fits");
    let options = AcquireOptions::new()
        .reservation(reservation)
        .priority(Priority::High);
    let run = async || {
        bulkhead
            .run(&req(), options, async |ctx| {
                Ok::<_, io::Error>((
                    ctx.admission_id(),
                    ctx.limit_revision(),
                    ctx.reservation(),
                    ctx.priority(),
                ))
            })
            .await
            .expect("admitted")
    };
    let (id1, revision, seen, priority) = block_on(run());
    assert_eq!(revision, 5);
    assert_eq!(seen, Some(reservation));
    assert_eq!(priority, Priority::High);
    let (id2, ..) = block_on(run());
    assert_ne!(id1, id2, "every admission has its own id");

    let unbudgeted = plain(1, 0);
    let (reservation, priority) = block_on(unbudgeted.run(&req(), opts(), async |ctx| {
        Ok::<_, io::Error>((ctx.reservation(), ctx.priority()))
    }))
    .expect("admitted");
    assert_eq!((reservation, priority), (None, Priority::Normal));
}

#[test]
fn dropping_a_run_future_while_the_callback_runs_settles_at_once() {
    let bulkhead = budgeted(1, 4, 1000);
    let callback_dropped = Cell::new(false);
    let mut running = Box::pin(bulkhead.run(&req(), toks(300), async |_ctx| {
        let _guard = SetOnDrop(&callback_dropped);
        std::future::pending::<Result<(), io::Error>>().await
    }));
    assert_pending(&mut running);
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 300);
    let mut next = queued(&bulkhead, toks(200));

    drop(running);
    assert!(callback_dropped.get(), "the callback's future was dropped");
    // Settled at once: the slot and the next waiter's tokens went to the waiter.
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 200);
    let permit = ready(&mut next).expect("the next waiter got the slot");
    drop(permit);
    let t = tokens(&bulkhead);
    assert_eq!(
        (t.in_flight_tokens, t.total_consumed, t.total_refunded),
        (0, 0, 0)
    );
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.admitted,
            stats.released,
            stats.rejected
        ),
        (0, 2, 2, 0)
    );
}

#[test]
fn run_waits_in_the_queue_like_acquire() {
    let bulkhead = plain(1, 4);
    let held = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let called = Cell::new(false);
    let mut waiting = Box::pin(bulkhead.run(&req(), opts(), async |ctx| {
        called.set(true);
        Ok::<_, io::Error>(ctx.limit_revision())
    }));
    assert_pending(&mut waiting);
    assert_eq!(figures(&bulkhead), (1, 1, 1));
    assert!(!called.get());
    bulkhead
        .apply_limits(Limits::new(6, 2).with_max_queue(4))
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (2, 0, 1));
    let revision = ready(&mut waiting).expect("handed a slot by the raise");
    assert_eq!(revision, 6);
    assert!(called.get());
    assert_eq!(figures(&bulkhead), (1, 0, 2));

    // A queued run times out, and a dropped queued run counts as aborted.
    let second = bulkhead.try_acquire(&req(), opts()).expect("free slot");
    let mut timed =
        Box::pin(bulkhead.run(&req(), within(SHORT), async |_ctx| Ok::<_, io::Error>(())));
    let err = block_on(&mut timed).expect_err("timed out in the queue");
    assert_eq!(
        err.rejection().map(Rejection::reason),
        Some(RejectReason::Timeout)
    );
    let mut dropped = Box::pin(bulkhead.run(&req(), opts(), async |_ctx| Ok::<_, io::Error>(())));
    assert_pending(&mut dropped);
    assert_eq!(bulkhead.stats().pending, 1);
    drop(dropped);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.pending,
            stats.rejected_by_reason.timeout,
            stats.rejected_by_reason.aborted
        ),
        (0, 1, 1)
    );
    drop((held, second));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
}

/// A refused `run`'s message names the reason code (what a log line of `{err}` shows), and
/// the rejection stays its source, with its own message (the capacity figures).
#[test]
fn a_refused_runs_message_names_its_reason_and_keeps_the_rejection_as_its_source() {
    use std::error::Error;
    let full = plain(1, 0);
    let _held = full.try_acquire(&req(), opts()).unwrap();
    let err = block_on(full.run(&req(), opts(), async |_| Ok::<(), io::Error>(()))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the bulkhead refused the call: concurrency_limit"
    );
    let source = err.source().expect("the rejection").to_string();
    assert!(
        source.starts_with("bulkhead rejected: concurrency_limit ("),
        "{source}"
    );

    let tight = budgeted(4, 0, 100);
    let err =
        block_on(tight.run(&req(), toks(120), async |_| Ok::<(), io::Error>(()))).unwrap_err();
    assert_eq!(
        err.to_string(),
        "the bulkhead refused the call: budget_limit"
    );
    assert!(
        matches!(err.source(), Some(s) if s.to_string().starts_with("bulkhead rejected: budget_limit"))
    );
}
