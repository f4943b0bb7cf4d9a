//! Statistics serialized with `serde`: the token books and listener panics.

use async_bulkhead_llm::events::EventKind;

use crate::common::usage_fixtures::{REV, budgeted, fixed, opts, plain, rejection, req, usage};

#[cfg(feature = "serde")]
#[test]
fn stats_serialize_with_the_token_books_and_listener_panics() {
    let bulkhead = budgeted(2, 5000);
    let _panics = bulkhead.on_events([EventKind::Usage], |_| {
        panic!("usage listener failure (expected by the test)")
    });
    let mut permit = bulkhead.try_acquire(&req(), fixed()).unwrap();
    permit.report_usage(usage(100, 1400)).unwrap();
    permit.release(None);
    rejection(bulkhead.try_acquire(&req(), opts(0, 9999)));

    let value = serde_json::to_value(bulkhead.stats()).unwrap();
    assert_eq!(value["listener_panics"], 1);
    assert_eq!(value["admitted"], 1);
    assert_eq!(value["released"], 1);
    assert_eq!(value["rejected"], 1);
    assert_eq!(value["rejected_by_reason"]["budget_limit"], 1);
    assert_eq!(value["limits"]["revision"], REV);
    assert_eq!(value["limits"]["token_budget"]["budget"], 5000);
    let t = &value["token_budget"];
    assert_eq!(t["total_reserved"], 1100);
    assert_eq!(t["total_consumed"], 1500);
    assert_eq!(t["total_refunded"], 0);
    assert_eq!(t["total_overrun"], 400);
    assert_eq!(t["in_flight_tokens"], 0);
    assert_eq!(t["available"], 5000);
    assert_eq!(t["budget"], 5000);
    assert_eq!(t["high_priority_reserve"], 0);

    // Without a budget the token block is null.
    let unbudgeted = plain(1);
    let value = serde_json::to_value(unbudgeted.stats()).unwrap();
    assert!(value["token_budget"].is_null());
    assert_eq!(value["listener_panics"], 0);
}
