//! Statistics shards and admission ids across thread lifetimes: threads take a counter slot on
//! first use and give it back when they exit; counts survive their threads, ids never repeat,
//! and a permit dropped while its thread tears down its thread-locals is still counted.

use std::cell::RefCell;
use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, Reservation, TokenBudget, TokenUsage,
    admission::AdmissionId,
};

fn bulkhead() -> LlmBulkhead {
    LlmBulkhead::builder("m", 64)
        .token_budget(TokenBudget::new(1_000_000))
        .build()
        .unwrap()
}

fn opts() -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(10, 90).unwrap())
}

#[test]
fn counts_and_ids_survive_hundreds_of_short_lived_threads() {
    const THREADS: usize = 300;
    const EACH: u64 = 20;
    let bulkhead = bulkhead();
    let ids = Arc::new(Mutex::new(HashSet::<AdmissionId>::new()));
    // Sequential waves of 3 threads: slots are given back and reused many times over.
    for _ in 0..THREADS / 3 {
        let handles: Vec<_> = (0..3)
            .map(|_| {
                let (bulkhead, ids) = (bulkhead.clone(), ids.clone());
                std::thread::spawn(move || {
                    for _ in 0..EACH {
                        let permit = bulkhead.try_acquire(&LlmRequest::new(), opts()).unwrap();
                        assert!(ids.lock().unwrap().insert(permit.admission_id()));
                        permit.release(Some(TokenUsage::new(5, 5).unwrap()));
                    }
                })
            })
            .collect();
        handles.into_iter().for_each(|h| h.join().unwrap());
    }
    let expected = THREADS as u64 * EACH;
    assert_eq!(ids.lock().unwrap().len() as u64, expected, "no id repeated");
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.in_flight),
        (expected, expected, 0)
    );
    let tokens = stats.token_budget.unwrap();
    assert_eq!(
        (
            tokens.total_reserved,
            tokens.total_consumed,
            tokens.total_refunded
        ),
        (100 * expected, 10 * expected, 90 * expected)
    );
}

thread_local! {
    static HELD: RefCell<Option<OwnedPermit>> = const { RefCell::new(None) };
}

#[test]
fn a_permit_dropped_during_thread_teardown_is_counted() {
    let bulkhead = bulkhead();
    for _ in 0..8 {
        let bulkhead = bulkhead.clone();
        std::thread::spawn(move || {
            // Counted once in the thread's own shard...
            drop(bulkhead.try_acquire(&LlmRequest::new(), opts()).unwrap());
            // ...and one admission left in a thread-local, released by its destructor after
            // the thread may already have given its slot back.
            let mut permit = bulkhead
                .try_acquire_owned(&LlmRequest::new(), opts())
                .unwrap();
            permit.report_usage(TokenUsage::new(4, 6).unwrap()).unwrap();
            HELD.with(|held| *held.borrow_mut() = Some(permit));
        })
        .join()
        .unwrap();
    }
    let stats = bulkhead.stats();
    assert_eq!(
        (stats.admitted, stats.released, stats.in_flight),
        (16, 16, 0)
    );
    let tokens = stats.token_budget.unwrap();
    assert_eq!(tokens.in_flight_tokens, 0);
    // Eight settled with usage (10 consumed, 90 refunded by the report), eight without.
    assert_eq!((tokens.total_consumed, tokens.total_refunded), (80, 720));
}

#[test]
fn many_threads_at_once_each_count_exactly() {
    let bulkhead = bulkhead();
    std::thread::scope(|s| {
        for _ in 0..32 {
            s.spawn(|| {
                for _ in 0..500 {
                    drop(bulkhead.try_acquire(&LlmRequest::new(), opts()).unwrap());
                }
            });
        }
    });
    let stats = bulkhead.stats();
    assert_eq!((stats.admitted, stats.released), (16_000, 16_000));
}
