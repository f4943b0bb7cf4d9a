//! The public types are `Send`, `Sync` and `'static`.

use async_bulkhead_llm::{
    AcquireError, Limits, LlmBulkhead, LlmBulkheadBuilder, LlmRequest, OwnedPermit, Permit,
    Rejection, Reservation, Stats, TokenUsage, admission::AdmissionId, admission::Verdict,
    builder::ConfigError, limits::ApplyOutcome, limits::LimitsError, rejection::CapacityDetail,
    request::RequestError, usage::ReleaseReport, usage::UsageError,
};

use crate::support::{budgeted, opts, req, totals, usage};

#[test]
fn public_types_are_send_sync_and_static() {
    fn check<T: Send + Sync + 'static>() {}
    fn error<T: std::error::Error + Send + Sync + 'static>() {}
    check::<LlmBulkhead>();
    check::<OwnedPermit>();
    check::<Permit<'static>>();
    check::<Rejection>();
    check::<AcquireError>();
    check::<Stats>();
    check::<Limits>();
    check::<ApplyOutcome>();
    check::<CapacityDetail>();
    check::<AdmissionId>();
    check::<Reservation>();
    check::<TokenUsage>();
    check::<ReleaseReport>();
    check::<Verdict>();
    check::<LlmRequest>();
    check::<LlmBulkheadBuilder>();
    error::<ConfigError>();
    error::<LimitsError>();
    error::<RequestError>();
    error::<UsageError>();
    error::<AcquireError>();
    error::<Rejection>();
}

#[test]
fn bulkhead_and_owned_permits_move_freely_between_threads() {
    let bulkhead = budgeted(4, 1000, 0);
    let permits: Vec<OwnedPermit> = (0..4)
        .map(|_| bulkhead.try_acquire_owned(&req(), opts(100, 100)).unwrap())
        .collect();
    let handles: Vec<_> = permits
        .into_iter()
        .map(|p| std::thread::spawn(move || p.release(Some(usage(50, 50))).refunded_tokens))
        .collect();
    let refunded: u64 = handles.into_iter().map(|h| h.join().unwrap()).sum();
    assert_eq!(refunded, 400);

    let moved = bulkhead.clone();
    let from_thread = std::thread::spawn(move || {
        let p = moved.try_acquire_owned(&req(), opts(1, 1)).unwrap();
        (moved.stats().in_flight, p)
    })
    .join()
    .unwrap();
    assert_eq!(from_thread.0, 1);
    assert_eq!(bulkhead.stats().in_flight, 1);
    drop(from_thread);
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released, stats.in_flight), (5, 5, 0));
    assert_eq!(totals(&stats.token_budget.unwrap()), (802, 400, 400, 0));
}
