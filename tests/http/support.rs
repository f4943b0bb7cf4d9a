//! Bulkheads and refusals the tests share.

use std::pin::pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Rejection, Reservation,
    TokenBudget, classes::AdmissionClasses, classes::ClassLimits, events::Event, events::EventKind,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

pub fn req() -> LlmRequest {
    LlmRequest::new()
}

/// Options reserving `input + output` tokens.
pub fn tokens(input: u64, output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, output).expect("valid"))
}

pub fn rejection(result: Result<impl Sized, AcquireError>) -> Rejection {
    match result {
        Err(AcquireError::Rejected(rejection)) => rejection,
        Err(other) => panic!("expected a rejection, got {other}"),
        Ok(_) => panic!("expected a rejection, got an admission"),
    }
}

/// `concurrency_limit`: one slot, held. Returns the bulkhead too (the refusal's figures).
pub fn concurrency_limit() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
    let _held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    rejection(bulkhead.try_acquire(&req(), AcquireOptions::new()))
}

/// `budget_limit` that fits later: budget 1000, 600 in flight, 600 more asked.
pub fn budget_limit_later() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(1000))
        .build()
        .unwrap();
    let _held = bulkhead.try_acquire(&req(), tokens(100, 500)).unwrap();
    rejection(bulkhead.try_acquire(&req(), tokens(100, 500)))
}

/// `budget_limit` that can never fit: budget 1000, nothing in flight, 1500 asked.
pub fn budget_limit_never() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(1000))
        .build()
        .unwrap();
    rejection(bulkhead.try_acquire(&req(), tokens(500, 1000)))
}

/// `queue_limit`: one slot held, the one queue place taken.
pub fn queue_limit() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
    let _held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let mut waiting = pin!(bulkhead.acquire(&EMPTY_REQUEST, AcquireOptions::new()));
    let mut cx = Context::from_waker(std::task::Waker::noop());
    assert!(waiting.as_mut().poll(&mut cx).is_pending());
    let mut refused = pin!(bulkhead.acquire(&EMPTY_REQUEST, AcquireOptions::new()));
    match refused.as_mut().poll(&mut cx) {
        Poll::Ready(result) => rejection(result),
        Poll::Pending => panic!("a full queue refuses at once"),
    }
}

/// `timeout`: one slot held, a 10 ms queue timeout.
pub fn timeout() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
    let _held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    let options = AcquireOptions::new().timeout(Duration::from_millis(10));
    rejection(futures::executor::block_on(
        bulkhead.acquire(&req(), options),
    ))
}

/// `shutdown`: a closed bulkhead.
pub fn shutdown() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 1).build().unwrap();
    bulkhead.close();
    rejection(bulkhead.try_acquire(&req(), AcquireOptions::new()))
}

/// `aborted`, as its reject event tells it (nobody receives an aborted rejection: its caller
/// dropped the future): one slot held, a queued call dropped.
pub fn aborted() -> (RejectReason, async_bulkhead_llm::rejection::CapacityDetail) {
    let bulkhead = LlmBulkhead::builder("m", 1).max_queue(1).build().unwrap();
    let seen = Arc::new(Mutex::new(None));
    let sink = seen.clone();
    let _subscription = bulkhead.on_events([EventKind::Reject], move |event| {
        if let Event::Reject(reject) = event {
            *sink.lock().unwrap() = Some((reject.reason, reject.detail));
        }
    });
    let _held = bulkhead.try_acquire(&req(), AcquireOptions::new()).unwrap();
    {
        let mut waiting = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, AcquireOptions::new()));
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(waiting.as_mut().poll(&mut cx).is_pending());
    }
    let seen = seen.lock().unwrap().take();
    seen.expect("the dropped waiter's refusal was announced")
}

/// Slots: 4, floors premium 2 / standard 1 (shared capacity 1); three premium calls in
/// flight (one borrowed): the fourth is refused `concurrency_limit` /
/// `admission_class_protection`.
pub fn class_slots() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .admission_classes(
            AdmissionClasses::new("standard")
                .class("premium", ClassLimits::new().protected_concurrent(2))
                .class("standard", ClassLimits::new().protected_concurrent(1)),
        )
        .build()
        .unwrap();
    let premium = AcquireOptions::new().class(bulkhead.class("premium").unwrap());
    let _held: Vec<_> = (0..3)
        .map(|_| bulkhead.try_acquire(&req(), premium).unwrap())
        .collect();
    rejection(bulkhead.try_acquire(&req(), premium))
}

/// Tokens: budget 2000, token floors premium 400 / standard 800 (shared 800); three 400-token
/// premium calls in flight (two borrowed): the fourth is refused `budget_limit` /
/// `admission_class_protection`.
pub fn class_tokens() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 10)
        .token_budget(TokenBudget::new(2000))
        .admission_classes(
            AdmissionClasses::new("standard")
                .class(
                    "premium",
                    ClassLimits::new().protected_in_flight_tokens(400),
                )
                .class(
                    "standard",
                    ClassLimits::new().protected_in_flight_tokens(800),
                ),
        )
        .build()
        .unwrap();
    let premium = tokens(100, 300).class(bulkhead.class("premium").unwrap());
    let _held: Vec<_> = (0..3)
        .map(|_| bulkhead.try_acquire(&req(), premium).unwrap())
        .collect();
    rejection(bulkhead.try_acquire(&req(), premium))
}

/// A class token ceiling of 1000 (budget 10,000): a 1500-token call can never fit.
pub fn class_ceiling_never() -> Rejection {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(10_000))
        .admission_classes(
            AdmissionClasses::new("batch").class(
                "batch",
                ClassLimits::new()
                    .max_in_flight_tokens(1000)
                    .max_concurrent(2),
            ),
        )
        .build()
        .unwrap();
    rejection(bulkhead.try_acquire(&req(), tokens(500, 1000)))
}
