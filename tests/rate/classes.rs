//! Rate windows on admission classes: a class's windows beside the bulkhead's, one decision
//! (a refusal by either takes nothing from the other), usage corrections on both, give-backs,
//! versioned changes and typed errors, and threads that never get more through a class's
//! window than its limit.

use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, RejectReason, TokenBudget, TokenUsage,
    builder::ConfigError,
    classes::{AdmissionClasses, ClassLimits, ClassLimitsError},
    limits::LimitsError,
    rate::{ManualClock, RateClock, RateLimits, RateWindow},
};

use super::{SECOND, tokens};

/// `chat` (no window of its own) and `batch` (`batch_rate`), within the bulkhead's `rate`.
fn classed(
    rate: Option<RateLimits>,
    batch_rate: Option<RateLimits>,
    clock: &ManualClock,
) -> LlmBulkhead {
    let mut batch = ClassLimits::new();
    batch.rate = batch_rate;
    let mut builder = LlmBulkhead::builder("m", 64)
        .max_queue(4)
        .token_budget(TokenBudget::new(1_000_000))
        .admission_classes(
            AdmissionClasses::new("chat")
                .class("chat", ClassLimits::new())
                .class("batch", batch),
        )
        .rate_clock(RateClock::manual(clock));
    if let Some(rate) = rate {
        builder = builder.rate_limits(rate);
    }
    builder.build().unwrap()
}

fn in_class(bulkhead: &LlmBulkhead, class: &str, n: u64) -> AcquireOptions {
    tokens(n).class(bulkhead.class(class).unwrap())
}

fn class_stats(bulkhead: &LlmBulkhead, class: &str) -> async_bulkhead_llm::stats::ClassStats {
    let stats = bulkhead.stats();
    let classes = stats.admission_classes.unwrap().classes;
    classes.into_iter().find(|c| c.class.id() == class).unwrap()
}

#[test]
fn a_class_window_refuses_its_class_only_and_every_call_is_charged_to_both() {
    let clock = ManualClock::new();
    let bulkhead = classed(
        Some(RateLimits::new(SECOND).requests(10)),
        Some(RateLimits::new(SECOND).requests(2)),
        &clock,
    );
    let request = LlmRequest::new();
    let batch = || in_class(&bulkhead, "batch", 100);
    let chat = || in_class(&bulkhead, "chat", 100);
    drop((
        bulkhead.try_acquire(&request, batch()).unwrap(),
        bulkhead.try_acquire(&request, batch()).unwrap(),
    ));
    // The class's window is full: refused by it, half a second (one request's share).
    let refused = bulkhead.try_acquire(&request, batch()).unwrap_err();
    let rejection = refused.rejection().unwrap();
    assert_eq!(rejection.reason(), RejectReason::RateLimit);
    assert_eq!(rejection.rate_window(), Some(RateWindow::ClassRequests));
    assert_eq!(rejection.retry_after(), Some(Duration::from_millis(500)));
    assert_eq!(
        rejection.detail().admission_class().unwrap().class.id(),
        "batch"
    );
    assert!(
        refused
            .to_string()
            .contains("admission class's requests window"),
        "{refused}"
    );
    // It took nothing from the bulkhead's window: 2 charged of 10.
    let global = bulkhead.rate_status().unwrap().requests.unwrap();
    assert_eq!(global.remaining, 8);
    let class = bulkhead
        .class_rate_status(bulkhead.class("batch").unwrap())
        .unwrap();
    assert_eq!(class.requests.unwrap().remaining, 0);
    assert!(
        bulkhead
            .class_rate_status(bulkhead.class("chat").unwrap())
            .is_none()
    );
    // The other class fills the bulkhead's window, then its refusal is the bulkhead's.
    for _ in 0..8 {
        drop(bulkhead.try_acquire(&request, chat()).unwrap());
    }
    let refused = bulkhead.try_acquire(&request, chat()).unwrap_err();
    let rejection = refused.rejection().unwrap();
    assert_eq!(rejection.rate_window(), Some(RateWindow::Requests));
    assert_eq!(rejection.retry_after(), Some(Duration::from_millis(100)));
    // Half a second on: room for 5 in the bulkhead's window and 1 in the class's. With the
    // bulkhead's filled, a batch call is refused by it (checked first), its class's untouched.
    clock.advance(Duration::from_millis(500));
    for _ in 0..5 {
        drop(bulkhead.try_acquire(&request, chat()).unwrap());
    }
    let refused = bulkhead.try_acquire(&request, batch()).unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().rate_window(),
        Some(RateWindow::Requests)
    );
    // Counted on each class.
    let (batch_stats, chat_stats) = (
        class_stats(&bulkhead, "batch"),
        class_stats(&bulkhead, "chat"),
    );
    assert_eq!(
        (
            batch_stats.admitted,
            batch_stats.rejected_by_reason.rate_limit
        ),
        (2, 2)
    );
    assert_eq!(
        (
            chat_stats.admitted,
            chat_stats.rejected_by_reason.rate_limit
        ),
        (13, 1)
    );
    assert_eq!(bulkhead.stats().rejected_by_reason.rate_limit, 3);
    let class = bulkhead.class_rate_status(bulkhead.class("batch").unwrap());
    assert_eq!(class.unwrap().requests.unwrap().remaining, 1);
}

#[test]
fn a_class_tokens_window_follows_usage_beside_the_bulkhead_s_and_gives_back_refusals() {
    let clock = ManualClock::new();
    let bulkhead = classed(
        Some(RateLimits::new(SECOND).tokens(100_000)),
        Some(RateLimits::new(SECOND).requests(5).tokens(3_000)),
        &clock,
    );
    let batch = bulkhead.class("batch").unwrap();
    let request = LlmRequest::new();
    let status = || {
        let global = bulkhead.rate_status().unwrap().tokens.unwrap().remaining;
        let class = bulkhead.class_rate_status(batch).unwrap();
        (
            global,
            class.requests.unwrap().remaining,
            class.tokens.unwrap().remaining,
        )
    };
    let a = bulkhead
        .try_acquire(&request, in_class(&bulkhead, "batch", 2_000))
        .unwrap();
    assert_eq!(status(), (98_000, 4, 1_000));
    // 1,000 short on the class's tokens window: a third of a second, rounded up to the ms.
    let refused = bulkhead
        .try_acquire(&request, in_class(&bulkhead, "batch", 2_000))
        .unwrap_err();
    let rejection = refused.rejection().unwrap();
    assert_eq!(rejection.rate_window(), Some(RateWindow::ClassTokens));
    assert_eq!(rejection.retry_after(), Some(Duration::from_millis(334)));
    // Nothing kept by the refusal: neither the bulkhead's tokens nor the class's request.
    assert_eq!(status(), (98_000, 4, 1_000));
    // The call used 500: both tokens windows get 1,500 back at its release.
    a.release(Some(TokenUsage::new(200, 300).unwrap()));
    assert_eq!(status(), (99_500, 4, 2_500));
    // A report beyond the reservation is charged to both as it arrives.
    let mut b = bulkhead
        .try_acquire(&request, in_class(&bulkhead, "batch", 500))
        .unwrap();
    b.report_usage(TokenUsage::new(500, 1_000).unwrap())
        .unwrap();
    assert_eq!(status(), (98_000, 3, 1_000));
    b.release(None);
    assert_eq!(status(), (98_000, 3, 1_000));
    // More than the class's whole window: never (413).
    let never = bulkhead
        .try_acquire(&request, in_class(&bulkhead, "batch", 3_001))
        .unwrap_err();
    assert_eq!(never.rejection().unwrap().retry_after(), None);
    assert_eq!(never.rejection().unwrap().http_status(), 413);
    assert_eq!(status(), (98_000, 3, 1_000));
}

#[test]
fn a_queued_class_call_keeps_its_class_charge_until_its_wait_ends_refused() {
    let clock = ManualClock::new();
    let bulkhead = LlmBulkhead::builder("m", 1)
        .max_queue(4)
        .admission_classes(
            AdmissionClasses::new("chat")
                .class("chat", ClassLimits::new())
                .class(
                    "batch",
                    ClassLimits::new().rate(RateLimits::new(SECOND).requests(10)),
                ),
        )
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    let batch = bulkhead.class("batch").unwrap();
    let request = LlmRequest::new();
    let remaining = || {
        bulkhead
            .class_rate_status(batch)
            .unwrap()
            .requests
            .unwrap()
            .remaining
    };
    let held = bulkhead
        .try_acquire(&request, AcquireOptions::new().class(batch))
        .unwrap();
    assert_eq!(remaining(), 9);
    let short = AcquireOptions::new()
        .class(batch)
        .timeout(Duration::from_millis(20));
    let err = bulkhead.acquire_blocking(&request, short).unwrap_err();
    assert_eq!(err.rejection().unwrap().reason(), RejectReason::Timeout);
    assert_eq!(remaining(), 9);
    drop(held);
    assert_eq!(remaining(), 9);
}

#[test]
fn class_windows_change_through_apply_limits_and_bad_ones_change_nothing() {
    let clock = ManualClock::new();
    // Windows on one class only: the bulkhead keeps a pair for every class.
    let bulkhead = classed(None, Some(RateLimits::new(SECOND).requests(1)), &clock);
    let request = LlmRequest::new();
    assert!(bulkhead.rate_status().is_none());
    let chat = bulkhead.class("chat").unwrap();
    let current = bulkhead.limits();
    // Give `chat` a window, raise `batch`'s: both in force at the next revision.
    let mut next = current.clone();
    next.revision += 1;
    let table = next.admission_classes.as_mut().unwrap();
    let mut chat_limits = *table.get("chat").unwrap();
    chat_limits.rate = Some(RateLimits::new(SECOND).requests(2));
    table.insert("chat".to_owned(), chat_limits);
    let mut batch_limits = *table.get("batch").unwrap();
    batch_limits.rate = Some(RateLimits::new(SECOND).requests(3));
    table.insert("batch".to_owned(), batch_limits);
    bulkhead.apply_limits(next.clone()).unwrap();
    for _ in 0..2 {
        drop(
            bulkhead
                .try_acquire(&request, AcquireOptions::new().class(chat))
                .unwrap(),
        );
    }
    let refused = bulkhead
        .try_acquire(&request, AcquireOptions::new().class(chat))
        .unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().rate_window(),
        Some(RateWindow::ClassRequests)
    );
    for _ in 0..3 {
        drop(
            bulkhead
                .try_acquire(&request, in_class(&bulkhead, "batch", 1))
                .unwrap(),
        );
    }
    assert!(
        bulkhead
            .try_acquire(&request, in_class(&bulkhead, "batch", 1))
            .is_err()
    );
    // Bad class rate limits: typed, and nothing changes.
    let mut bad = next.clone();
    bad.revision += 1;
    let table = bad.admission_classes.as_mut().unwrap();
    let mut chat_limits = *table.get("chat").unwrap();
    chat_limits.rate = Some(RateLimits::new(Duration::ZERO).requests(2));
    table.insert("chat".to_owned(), chat_limits);
    let err = bulkhead.apply_limits(bad).unwrap_err();
    assert!(
        matches!(&err, LimitsError::Class(ClassLimitsError::Rate { class, error })
            if class == "chat" && matches!(**error, LimitsError::RateWindowOutOfRange { .. })),
        "{err:?}"
    );
    assert_eq!(bulkhead.limits().revision, next.revision);
    // The bulkhead's own window cannot appear later (its presence is fixed at build).
    let mut global = next.clone();
    global.revision += 1;
    global.rate = Some(RateLimits::new(SECOND).requests(5));
    assert_eq!(
        bulkhead.apply_limits(global).unwrap_err(),
        LimitsError::RateLimitsNotConfigured
    );
    // Windows removed from a class: it is governed by the in-flight limits alone.
    let mut open = next.clone();
    open.revision += 2;
    let table = open.admission_classes.as_mut().unwrap();
    let mut chat_limits = *table.get("chat").unwrap();
    chat_limits.rate = None;
    table.insert("chat".to_owned(), chat_limits);
    bulkhead.apply_limits(open).unwrap();
    for _ in 0..20 {
        drop(
            bulkhead
                .try_acquire(&request, AcquireOptions::new().class(chat))
                .unwrap(),
        );
    }
    assert!(bulkhead.class_rate_status(chat).is_none());
}

#[test]
fn class_rate_limits_are_checked_at_build_and_need_windows_to_be_applied() {
    let build = |class: ClassLimits, budget: bool| {
        let mut builder = LlmBulkhead::builder("m", 4)
            .admission_classes(AdmissionClasses::new("a").class("a", class));
        if budget {
            builder = builder.token_budget(TokenBudget::new(10_000));
        }
        builder.build()
    };
    let rate = |error: &ConfigError| match error {
        ConfigError::Class(ClassLimitsError::Rate { class, error }) => {
            assert_eq!(class, "a");
            (**error).clone()
        }
        other => panic!("not a class rate error: {other:?}"),
    };
    let no_limit = ClassLimits::new().rate(RateLimits::new(SECOND));
    assert_eq!(
        rate(&build(no_limit, true).unwrap_err()),
        LimitsError::RateLimitsEmpty
    );
    let tokens = ClassLimits::new().rate(RateLimits::new(SECOND).tokens(100));
    assert_eq!(
        rate(&build(tokens, false).unwrap_err()),
        LimitsError::RateTokensNeedBudget
    );
    assert!(build(tokens, true).is_ok());
    let err = build(
        ClassLimits::new().rate(RateLimits::new(SECOND).requests(0)),
        true,
    )
    .unwrap_err();
    assert_eq!(rate(&err), LimitsError::RateLimitsEmpty);
    assert!(err.to_string().contains("[\"a\"].rate"), "{err}");
    // Without windows anywhere at build, none can be given to a class later.
    let plain = build(ClassLimits::new(), true).unwrap();
    let mut next: Limits = plain.limits();
    next.revision += 1;
    let table = next.admission_classes.as_mut().unwrap();
    table.insert(
        "a".to_owned(),
        ClassLimits::new().rate(RateLimits::new(SECOND).requests(1)),
    );
    let err = plain.apply_limits(next).unwrap_err();
    assert!(
        matches!(&err, LimitsError::Class(ClassLimitsError::Rate { error, .. })
            if **error == LimitsError::RateLimitsNotConfigured),
        "{err:?}"
    );
    assert_eq!(plain.limits().revision, 0);
}

#[test]
fn under_threads_a_frozen_class_window_admits_exactly_its_limit() {
    let clock = ManualClock::new();
    let bulkhead = classed(
        Some(RateLimits::new(SECOND).requests(300)),
        Some(RateLimits::new(SECOND).requests(120).tokens(50_000)),
        &clock,
    );
    let request = LlmRequest::new();
    let (batch, chat) = (
        bulkhead.class("batch").unwrap(),
        bulkhead.class("chat").unwrap(),
    );
    let admitted: Vec<(u64, u64)> = std::thread::scope(|scope| {
        let threads: Vec<_> = (0..4)
            .map(|t| {
                let (bulkhead, request) = (&bulkhead, &request);
                scope.spawn(move || {
                    let (mut b, mut c) = (0, 0);
                    for i in 0..400 {
                        let class = if (i + t) % 2 == 0 { batch } else { chat };
                        let options = tokens(100).class(class);
                        if let Ok(permit) = bulkhead.try_acquire(request, options) {
                            if class == batch {
                                b += 1
                            } else {
                                c += 1
                            }
                            // Half report usage, half are dropped (charged their reservation).
                            if i % 4 == 0 {
                                permit.release(Some(TokenUsage::new(50, 0).unwrap()));
                            }
                        }
                    }
                    (b, c)
                })
            })
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    let batch_admitted: u64 = admitted.iter().map(|(b, _)| b).sum();
    let chat_admitted: u64 = admitted.iter().map(|(_, c)| c).sum();
    // The clock never moved: exactly each window's burst, the class's within the bulkhead's.
    assert_eq!(batch_admitted, 120);
    assert_eq!(batch_admitted + chat_admitted, 300);
    let stats = bulkhead.stats();
    assert_eq!(
        (
            stats.in_flight,
            stats.token_budget.unwrap().in_flight_tokens
        ),
        (0, 0)
    );
    assert_eq!(class_stats(&bulkhead, "batch").admitted, 120);
}

/// A call larger than its class's tokens window is answered 413, and the message names the
/// window (not the class's ceiling of tokens in flight, which it is within).
#[test]
fn a_call_larger_than_its_class_window_is_told_so() {
    let clock = ManualClock::new();
    let batch = ClassLimits::new()
        .max_in_flight_tokens(5_000)
        .rate(RateLimits::new(SECOND).tokens(1_000));
    let bulkhead = LlmBulkhead::builder("m", 8)
        .token_budget(TokenBudget::new(10_000))
        .admission_classes(
            AdmissionClasses::new("chat")
                .class("chat", ClassLimits::new())
                .class("batch", batch),
        )
        .rate_clock(RateClock::manual(&clock))
        .build()
        .unwrap();
    let refused = bulkhead
        .try_acquire(&LlmRequest::new(), in_class(&bulkhead, "batch", 2_000))
        .unwrap_err();
    assert_eq!(
        refused.rejection().unwrap().rate_window(),
        Some(RateWindow::ClassTokens)
    );
    let answer = async_bulkhead_llm::http::HttpRefusal::from(refused);
    assert_eq!(answer.status, 413);
    assert!(answer.message.contains("rate window"), "{}", answer.message);
    assert!(!answer.message.contains("ceiling"), "{}", answer.message);
}
