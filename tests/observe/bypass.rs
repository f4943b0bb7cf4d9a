//! Bypasses of `run` / `run_with_usage`.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, RunError, TokenBudget,
    TokenUsage, events::Event, events::EventKind, observe::Bypass, observe::ShadowReasons,
    usage::Progressive, usage::UsageError,
};
use futures::executor::block_on;

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

fn budgeted(max_concurrent: usize, budget: u64) -> LlmBulkhead {
    LlmBulkhead::builder("m", max_concurrent)
        .max_queue(1)
        .token_budget(TokenBudget::new(budget))
        .build()
        .unwrap()
}

fn reserve(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

/// Every event, as `(kind, the bypass's reason and raced flag if it is a bypass event)`.
type Seen = Arc<Mutex<Vec<(EventKind, Option<(RejectReason, bool)>)>>>;

fn listen(bulkhead: &LlmBulkhead) -> (Seen, async_bulkhead_llm::events::Subscription) {
    let seen: Seen = Arc::default();
    let log = Arc::clone(&seen);
    let subscription = bulkhead.on(move |event| {
        let bypass = match event {
            Event::Bypass(e) => Some((e.reason, e.raced)),
            _ => None,
        };
        log.lock().unwrap().push((event.kind(), bypass));
    });
    (seen, subscription)
}

fn kinds(seen: &Seen) -> Vec<EventKind> {
    seen.lock().unwrap().iter().map(|(k, _)| *k).collect()
}

/// Runs a call in observe mode that returns what its context says about the bypass.
fn observed(
    bulkhead: &LlmBulkhead,
    options: AcquireOptions,
) -> Result<Option<Bypass>, RunError<()>> {
    block_on(bulkhead.run(
        &LlmRequest::new(),
        options.observe(ShadowReasons::ALL),
        async |ctx| {
            assert_eq!(
                ctx.held_tokens(),
                if ctx.bypass().is_some() {
                    0
                } else {
                    ctx.held_tokens()
                }
            );
            Ok::<_, ()>(ctx.bypass())
        },
    ))
}

#[test]
fn a_predicted_budget_refusal_runs_anyway_uncounted_and_unannounced() {
    let bulkhead = budgeted(4, 1_000);
    let (seen, _subscription) = listen(&bulkhead);
    let bypass = observed(&bulkhead, reserve(900, 600))
        .unwrap()
        .expect("bypassed");
    assert_eq!(bypass.reason, RejectReason::BudgetLimit);
    assert!(!bypass.raced);
    assert_eq!(
        bypass.reservation,
        Some(Reservation::new(900, 600).unwrap())
    );
    let detail = bypass.detail.expect("the advisory check's snapshot");
    let budget = detail.token_budget.unwrap();
    assert_eq!((budget.requested, budget.available), (1_500, 1_000));
    assert_eq!(bypass.limit_revision, detail.limit_revision);
    assert!(bypass.shadow_id.to_string().starts_with("shadow-"));
    let stats = bulkhead.stats();
    assert_eq!((stats.rejected, stats.admitted, stats.in_flight), (0, 0, 0));
    let observe = stats.observe.unwrap();
    assert_eq!((observe.bypassed, observe.race_bypassed), (1, 0));
    assert_eq!(observe.bypassed_by_reason.budget_limit, 1);
    assert_eq!(observe.usage_reported, 0);
    assert_eq!(kinds(&seen), [EventKind::Bypass, EventKind::BypassRelease]);
    assert_eq!(
        seen.lock().unwrap()[0].1,
        Some((RejectReason::BudgetLimit, false))
    );
}

#[test]
fn predicted_concurrency_and_queue_refusals_are_bypassed_too() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(0).build().unwrap();
    let holder = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let bypass = observed(&bulkhead, AcquireOptions::new()).unwrap().unwrap();
    assert_eq!(bypass.reason, RejectReason::ConcurrencyLimit);
    assert_eq!(bypass.detail.unwrap().in_flight, 1);

    let queueing = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
    let _held = queueing
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let mut queued = Box::pin(queueing.acquire(&EMPTY_REQUEST, AcquireOptions::new()));
    assert!(pending(&mut queued));
    let bypass = observed(&queueing, AcquireOptions::new()).unwrap().unwrap();
    assert_eq!(bypass.reason, RejectReason::QueueLimit);
    assert_eq!(queueing.stats().rejected, 0);
    drop(holder);
}

/// Polls `future` once (no-op waker); whether it is still pending.
fn pending<F: std::future::Future + Unpin>(future: &mut F) -> bool {
    futures::FutureExt::poll_unpin(
        future,
        &mut std::task::Context::from_waker(std::task::Waker::noop()),
    )
    .is_pending()
}

#[test]
fn a_queue_timeout_after_an_admitting_advisory_is_counted_then_bypassed_as_a_race() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(4).build().unwrap();
    let (seen, _subscription) = listen(&bulkhead);
    let holder = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    seen.lock().unwrap().clear();
    let options = AcquireOptions::new().timeout(Duration::from_millis(20));
    let bypass = observed(&bulkhead, options)
        .unwrap()
        .expect("bypassed after its timeout");
    assert_eq!(bypass.reason, RejectReason::Timeout);
    assert!(bypass.raced); // the advisory check said "queue"
    assert!(bypass.detail.is_some());
    let stats = bulkhead.stats();
    assert_eq!((stats.rejected, stats.rejected_by_reason.timeout), (1, 1));
    let observe = stats.observe.unwrap();
    assert_eq!((observe.bypassed, observe.race_bypassed), (1, 1));
    assert_eq!(observe.bypassed_by_reason.timeout, 1);
    assert_eq!(
        kinds(&seen),
        [
            EventKind::Reject,
            EventKind::Bypass,
            EventKind::BypassRelease
        ]
    );
    drop(holder);
}

#[test]
fn only_the_configured_reasons_are_bypassed() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(0).build().unwrap();
    let _holder = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let only_budget = ShadowReasons::new([RejectReason::BudgetLimit]).unwrap();
    let err = block_on(bulkhead.run(
        &LlmRequest::new(),
        AcquireOptions::new().observe(only_budget),
        async |_| Ok::<_, ()>(()),
    ))
    .unwrap_err();
    assert!(matches!(err, RunError::Rejected(r) if r.reason() == RejectReason::ConcurrencyLimit));
    let err = block_on(bulkhead.run(
        &LlmRequest::new(),
        AcquireOptions::new().observe(ShadowReasons::NONE),
        async |_| Ok::<_, ()>(()),
    ))
    .unwrap_err();
    assert!(matches!(err, RunError::Rejected(r) if r.reason() == RejectReason::ConcurrencyLimit));
    let stats = bulkhead.stats();
    assert_eq!(stats.rejected, 2);
    assert!(stats.observe.is_none());
}

#[test]
fn an_admitted_observe_call_runs_as_any_other() {
    let bulkhead = budgeted(2, 1_000);
    let (seen, _subscription) = listen(&bulkhead);
    assert_eq!(observed(&bulkhead, reserve(100, 100)), Ok(None));
    assert_eq!(kinds(&seen), [EventKind::Admit, EventKind::Release]);
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (1, 1));
    assert!(stats.observe.is_none());
}

#[test]
fn shutdown_is_never_bypassed() {
    let bulkhead = budgeted(2, 1_000);
    bulkhead.close();
    let ran = Arc::new(Mutex::new(false));
    let flag = Arc::clone(&ran);
    let err = block_on(bulkhead.run(
        &LlmRequest::new(),
        reserve(900, 600).observe(ShadowReasons::ALL),
        async move |_| {
            *flag.lock().unwrap() = true;
            Ok::<_, ()>(())
        },
    ))
    .unwrap_err();
    assert!(matches!(err, RunError::Rejected(r) if r.reason() == RejectReason::Shutdown));
    assert!(!*ran.lock().unwrap());
    let stats = bulkhead.stats();
    assert_eq!(stats.rejected_by_reason.shutdown, 1);
    assert!(stats.observe.is_none());
}

#[test]
fn a_bypassed_call_holds_nothing_while_it_runs() {
    let bulkhead = budgeted(1, 1_000);
    let during = block_on(bulkhead.run(
        &LlmRequest::new(),
        reserve(900, 600).observe(ShadowReasons::ALL),
        async |ctx| {
            assert!(!ctx.holds_slot());
            assert_eq!(ctx.admission_id(), None);
            // The bulkhead's one slot and its whole budget are still there for others.
            let other = bulkhead
                .try_acquire(&LlmRequest::new(), reserve(500, 500))
                .expect("nothing is held by the bypass");
            let stats = bulkhead.stats();
            drop(other);
            Ok::<_, ()>((
                stats.in_flight,
                stats.token_budget.unwrap().in_flight_tokens,
            ))
        },
    ));
    assert_eq!(during, Ok((1, 1_000)));
}

#[test]
fn a_bypassed_calls_usage_is_validated_clamped_announced_and_counted() {
    let bulkhead = budgeted(4, 1_000);
    let usage_events = Arc::new(Mutex::new(Vec::new()));
    let release = Arc::new(Mutex::new(None));
    let (log, last) = (Arc::clone(&usage_events), Arc::clone(&release));
    let _subscription = bulkhead.on(move |event| match event {
        Event::BypassUsage(e) => {
            log.lock()
                .unwrap()
                .push((e.sequence, e.usage, e.output_remaining))
        }
        Event::BypassRelease(e) => *last.lock().unwrap() = Some((e.usage_sequence, e.usage)),
        _ => {}
    });
    let result = block_on(bulkhead.run_with_usage(
        &LlmRequest::new(),
        reserve(900, 600).observe(ShadowReasons::ALL),
        |&(input, output): &(u64, u64)| TokenUsage::new(input, output).ok(),
        async |mut ctx| {
            let first = ctx.report_usage(TokenUsage::new(850, 100)?)?;
            assert_eq!((first.sequence, first.held, first.consumed), (1, 0, 950));
            assert_eq!((first.reserved, first.output_remaining), (1_500, Some(500)));
            assert!(first.shadow_id.is_some());
            // Cumulative: a smaller input does not go back; the same usage is not effective.
            let second = ctx.report_usage(TokenUsage::new(800, 300)?)?;
            assert_eq!((second.sequence, second.consumed), (2, 1_150));
            assert_eq!(ctx.report_usage(TokenUsage::new(850, 300)?)?.sequence, 2);
            // A progressive report is checked against the would-be reservation.
            let too_much =
                ctx.report_usage_progressive(TokenUsage::new(850, 300)?, Progressive::new(601));
            assert_eq!(
                too_much,
                Err(UsageError::RemainingExceedsCap {
                    remaining: 601,
                    cap: 600
                })
            );
            assert_eq!(ctx.usage(), Some(TokenUsage::new(850, 300)?));
            Ok::<_, UsageError>((860, 320))
        },
    ));
    assert_eq!(result, Ok((860, 320)));
    assert_eq!(
        *usage_events.lock().unwrap(),
        [
            (1, TokenUsage::new(850, 100).unwrap(), Some(500)),
            (2, TokenUsage::new(850, 300).unwrap(), Some(300)),
        ]
    );
    assert_eq!(
        *release.lock().unwrap(),
        Some((2, Some(TokenUsage::new(860, 320).unwrap())))
    );
    let observe = bulkhead.stats().observe.unwrap();
    assert_eq!(observe.usage_reported, 1);
    assert_eq!(
        (observe.total_input_tokens, observe.total_output_tokens),
        (860, 320)
    );
    // Nothing of it reached the budget's books.
    let tokens = bulkhead.stats().token_budget.unwrap();
    assert_eq!((tokens.total_reserved, tokens.total_consumed), (0, 0));
}

#[test]
fn a_dropped_bypass_ends_with_its_last_reported_usage() {
    let bulkhead = budgeted(4, 1_000);
    let (seen, _subscription) = listen(&bulkhead);
    let mut call = Box::pin(bulkhead.run(
        &LlmRequest::new(),
        reserve(900, 600).observe(ShadowReasons::ALL),
        async |mut ctx| {
            ctx.report_usage(TokenUsage::new(10, 5).unwrap()).unwrap();
            futures::future::pending::<Result<(), ()>>().await
        },
    ));
    assert!(pending(&mut call));
    drop(call);
    assert_eq!(
        kinds(&seen),
        [
            EventKind::Bypass,
            EventKind::BypassUsage,
            EventKind::BypassRelease
        ]
    );
    let observe = bulkhead.stats().observe.unwrap();
    assert_eq!(
        (observe.usage_reported, observe.total_input_tokens),
        (1, 10)
    );
}

#[test]
fn every_bypass_has_its_own_shadow_id() {
    let bulkhead = LlmBulkhead::builder("m", 0).build().unwrap();
    let ids: Vec<String> = (0..3)
        .map(|_| {
            observed(&bulkhead, AcquireOptions::new())
                .unwrap()
                .unwrap()
                .shadow_id
                .to_string()
        })
        .collect();
    assert!(
        ids.iter()
            .all(|id| id.starts_with("shadow-") && id.len() == 43)
    );
    assert!(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2]);
}

#[test]
fn shadow_reasons_refuse_reasons_that_can_never_be_bypassed() {
    for reason in [RejectReason::Shutdown, RejectReason::Aborted] {
        assert_eq!(ShadowReasons::new([reason]).unwrap_err().reason, reason);
    }
    let all = ShadowReasons::new([
        RejectReason::BudgetLimit,
        RejectReason::ConcurrencyLimit,
        RejectReason::QueueLimit,
        RejectReason::Timeout,
    ])
    .unwrap();
    assert_eq!(all, ShadowReasons::ALL);
    assert_eq!(ShadowReasons::default(), ShadowReasons::ALL);
}

/// Every reject event's `(reason, decision_duration, queue_wait)`.
type RejectTimings = Arc<Mutex<Vec<(RejectReason, Duration, Duration)>>>;

/// Subscribes a listener recording every reject event's timings.
fn reject_timings(
    bulkhead: &LlmBulkhead,
) -> (RejectTimings, async_bulkhead_llm::events::Subscription) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = Arc::clone(&seen);
    let subscription = bulkhead.on_events([EventKind::Reject], move |event| {
        if let Event::Reject(e) = event {
            log.lock()
                .unwrap()
                .push((e.reason, e.decision_duration, e.queue_wait));
        }
    });
    (seen, subscription)
}

/// In observe mode, a refusal by the admission itself for a reason the call would bypass (the
/// race bypass) is counted and announced untimed, as a follower's wait and a bypass's hard
/// refusal are: both durations zero. A refusal for a reason outside the call's shadow set is
/// timed as any other.
#[test]
fn a_race_bypassed_refusal_is_announced_untimed_and_others_stay_timed() {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
    let (seen, _subscription) = reject_timings(&bulkhead);
    let holder = bulkhead
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    let options = AcquireOptions::new().timeout(Duration::from_millis(20));
    let bypass = observed(&bulkhead, options).unwrap().expect("bypassed");
    assert!(bypass.raced);
    assert_eq!(
        *seen.lock().unwrap(),
        [(RejectReason::Timeout, Duration::ZERO, Duration::ZERO)]
    );
    seen.lock().unwrap().clear();

    // The same wait with only the budget shadowed: refused `timeout`, timed, not bypassed.
    let only_budget = ShadowReasons::new([RejectReason::BudgetLimit]).unwrap();
    let err = block_on(
        bulkhead.run(
            &LlmRequest::new(),
            AcquireOptions::new()
                .timeout(Duration::from_millis(20))
                .observe(only_budget),
            async |_| Ok::<_, ()>(()),
        ),
    )
    .unwrap_err();
    assert!(matches!(err, RunError::Rejected(r) if r.reason() == RejectReason::Timeout));
    let timed = seen.lock().unwrap().clone();
    assert_eq!(timed.len(), 1);
    let (reason, decision, wait) = timed[0];
    assert_eq!(reason, RejectReason::Timeout);
    assert!(wait >= Duration::from_millis(20), "queue wait {wait:?}");
    assert!(decision > Duration::ZERO);
    drop(holder);
}
