//! Resources and abandoning a borrowed slot: what an admission borrowed, giving the slot back
//! early (to the queue's head), the tokens settling later, counts, events and drain.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, TokenBudget, TokenUsage, classes::AbandonCause,
    classes::AdmissionClasses, classes::ClassLimits, classes::Resources,
    events::BorrowedConcurrencyAbandonEvent, events::Event, events::EventKind,
};

use crate::support::{admit, class_stats, in_class, tokens};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

/// 2 slots, 1000 tokens; premium keeps 1 slot and 400 tokens, batch has no floor.
fn tiers(max_queue: usize) -> LlmBulkhead {
    LlmBulkhead::builder("m", 2)
        .max_queue(max_queue)
        .token_budget(TokenBudget::new(1000))
        .admission_classes(
            AdmissionClasses::new("batch")
                .class(
                    "premium",
                    ClassLimits::new()
                        .protected_concurrent(1)
                        .protected_in_flight_tokens(400),
                )
                .class("batch", ClassLimits::new()),
        )
        .build()
        .unwrap()
}

fn record(
    b: &LlmBulkhead,
) -> (
    Arc<Mutex<Vec<BorrowedConcurrencyAbandonEvent>>>,
    async_bulkhead_llm::events::Subscription,
) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    let sub = b.on_events([EventKind::BorrowedConcurrencyAbandon], move |e| {
        if let Event::BorrowedConcurrencyAbandon(e) = e {
            sink.lock().unwrap().push(**e);
        }
    });
    (seen, sub)
}

#[test]
fn resources_are_recorded_at_commit_and_exposed_everywhere() {
    let b = tiers(0);
    let premium = tokens(in_class(&b, "premium"), 100, 200);
    let first = admit(&b, premium);
    let second = admit(&b, tokens(in_class(&b, "premium"), 50, 100));
    assert_eq!(first.resources(), Resources::NONE); // within both floors
    // 150 tokens, 100 of them within the floor (400 - 300).
    assert_eq!(
        (
            second.resources().borrowed_concurrency,
            second.resources().borrowed_tokens
        ),
        (true, 50)
    );
    let p = class_stats(&b, b.class("premium").unwrap());
    assert_eq!(
        (
            p.in_flight,
            p.protected_concurrent_in_use,
            p.borrowed_concurrent
        ),
        (2, 1, 1)
    );
    assert_eq!(
        (
            p.in_flight_tokens,
            p.protected_tokens_in_use,
            p.borrowed_in_flight_tokens
        ),
        (450, 400, 50)
    );
    assert_eq!(
        (
            p.total_borrowed_admissions,
            p.total_borrowed_tokens_reserved
        ),
        (1, 50)
    );
    assert_eq!(p.total_reserved, 450);
    drop((first, second));
    let p = class_stats(&b, b.class("premium").unwrap());
    assert_eq!((p.in_flight, p.in_flight_tokens, p.released), (0, 0, 2));
    // Cumulative borrow totals only grow.
    assert_eq!(
        (
            p.total_borrowed_admissions,
            p.total_borrowed_tokens_reserved
        ),
        (1, 50)
    );
}

#[test]
fn abandoning_returns_the_slot_keeps_the_tokens_and_settles_later() {
    let b = tiers(0);
    let (events, _sub) = record(&b);
    let batch = tokens(in_class(&b, "batch"), 100, 200);
    let mut long = admit(&b, batch);
    let _premium = admit(&b, tokens(in_class(&b, "premium"), 10, 10));
    // The bulkhead is full.
    assert!(b.try_acquire(&LlmRequest::new(), batch).is_err());

    assert!(long.abandon_borrowed_concurrency());
    assert!(!long.holds_slot());
    assert!(!long.abandon_borrowed_concurrency()); // once only
    let stats = b.stats();
    assert_eq!((stats.in_flight, stats.abandoned_in_flight), (1, 1));
    assert_eq!(stats.token_budget.as_ref().unwrap().in_flight_tokens, 320);
    assert_eq!(stats.borrowed_concurrency_abandoned, 1);
    assert_eq!(stats.borrowed_concurrency_abandoned_by_cause.manual, 1);
    let c = class_stats(&b, b.class("batch").unwrap());
    assert_eq!((c.in_flight, c.in_flight_tokens), (0, 300));
    assert_eq!((c.borrowed_concurrency_abandoned, c.released), (1, 0));
    // The event carries the class, what it borrowed and what it still holds.
    let e = events.lock().unwrap()[0];
    assert_eq!(e.admission_id, long.admission_id());
    assert_eq!((e.cause, e.held_tokens), (AbandonCause::Manual, 300));
    assert_eq!(e.class.map(|c| c.id()), Some("batch"));
    assert!(e.resources.borrowed_concurrency);

    // The slot is free for the next call; usage can still be reported.
    let next = admit(&b, tokens(in_class(&b, "batch"), 100, 100));
    long.report_usage(TokenUsage::new(100, 20).unwrap())
        .unwrap();
    assert_eq!(
        b.stats().token_budget.unwrap().in_flight_tokens,
        100 + 200 + 20 + 200
    );
    let report = long.release(None);
    assert_eq!(report.usage, Some(TokenUsage::new(100, 20).unwrap()));
    let stats = b.stats();
    assert_eq!(
        (stats.in_flight, stats.abandoned_in_flight, stats.released),
        (2, 0, 1)
    );
    assert_eq!(stats.token_budget.unwrap().in_flight_tokens, 220);
    let c = class_stats(&b, b.class("batch").unwrap());
    assert_eq!(
        (
            c.in_flight,
            c.in_flight_tokens,
            c.released,
            c.total_consumed
        ),
        (1, 200, 1, 120)
    );
    drop(next);
}

#[test]
fn only_a_borrowed_slot_can_be_abandoned() {
    let b = tiers(0);
    let mut within = admit(&b, tokens(in_class(&b, "premium"), 1, 1));
    assert!(!within.resources().borrowed_concurrency);
    assert!(!within.abandon_borrowed_concurrency());
    assert!(within.holds_slot());
    let plain = LlmBulkhead::builder("m", 1).build().unwrap();
    let mut p = plain
        .try_acquire(&LlmRequest::new(), AcquireOptions::new())
        .unwrap();
    assert!(!p.abandon_borrowed_concurrency());
    assert_eq!(plain.stats().borrowed_concurrency_abandoned, 0);
    assert_eq!(b.stats().borrowed_concurrency_abandoned, 0);
}

#[test]
fn an_abandoned_slot_goes_to_the_queue_head_at_once() {
    // No floors: protection never applies, so a full bulkhead queues (class checks never do).
    let b = LlmBulkhead::builder("m", 2)
        .max_queue(2)
        .token_budget(TokenBudget::new(1000))
        .admission_classes(
            AdmissionClasses::new("batch")
                .class("premium", ClassLimits::new())
                .class("batch", ClassLimits::new()),
        )
        .build()
        .unwrap();
    let batch = tokens(in_class(&b, "batch"), 10, 10);
    let mut first = admit(&b, batch);
    let _premium = admit(&b, tokens(in_class(&b, "premium"), 10, 10));
    futures::executor::block_on(async {
        let waiting = b.acquire(&EMPTY_REQUEST, batch.timeout(Duration::from_secs(5)));
        let mut waiting = std::pin::pin!(waiting);
        assert!(futures::poll!(waiting.as_mut()).is_pending());
        assert_eq!(b.stats().pending, 1);
        assert!(first.abandon_borrowed_concurrency());
        let handed = waiting.await.unwrap();
        assert!(handed.resources().borrowed_concurrency);
        let stats = b.stats();
        assert_eq!(
            (stats.in_flight, stats.abandoned_in_flight, stats.pending),
            (2, 1, 0)
        );
    });
    drop(first);
    assert_eq!(b.stats().abandoned_in_flight, 0);
}

#[test]
fn drain_waits_for_abandoned_admissions_to_settle() {
    let b = tiers(0);
    let mut long = admit(&b, tokens(in_class(&b, "batch"), 10, 10));
    assert!(long.abandon_borrowed_concurrency());
    b.close();
    futures::executor::block_on(async {
        let report = b.drain_timeout(Duration::from_millis(20)).await;
        assert!(!report.drained);
        assert_eq!(report.in_flight, 1); // no slot, but unsettled
        let mut drain = std::pin::pin!(b.drain());
        assert!(futures::poll!(drain.as_mut()).is_pending());
        drop(long);
        drain.await;
    });
    assert_eq!(b.stats().released, 1);
}

#[test]
fn abandonments_beyond_what_the_word_counts_keep_their_slot() {
    // The admission word counts at most 4,095 admissions that gave their slot back and have
    // not settled: the next one keeps its slot (and says so), nothing is lost.
    let b = LlmBulkhead::builder("m", 9_000)
        .admission_classes(AdmissionClasses::new("batch").class("batch", ClassLimits::new()))
        .build()
        .unwrap();
    let mut permits: Vec<_> = (0..4_096)
        .map(|_| admit(&b, AcquireOptions::new()))
        .collect();
    for permit in &mut permits[..4_095] {
        assert!(permit.abandon_borrowed_concurrency());
    }
    let last = permits.last_mut().unwrap();
    assert!(!last.abandon_borrowed_concurrency());
    assert!(last.holds_slot());
    let stats = b.stats();
    assert_eq!((stats.in_flight, stats.abandoned_in_flight), (1, 4_095));
    assert_eq!(stats.borrowed_concurrency_abandoned, 4_095);
    drop(permits);
    let stats = b.stats();
    assert_eq!(
        (stats.in_flight, stats.abandoned_in_flight, stats.released),
        (0, 0, 4_096)
    );
}
