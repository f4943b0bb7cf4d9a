//! The sizing guide: every row (critical fast API 50–100 / 200, non-critical slow API 5–10 /
//! 20, background jobs 2–5 / 10, high-throughput microservice 100–200 / 500) builds at both
//! ends of its range and behaves: exactly `max_concurrent` run, `max_queue` wait, the next is
//! refused `QueueFull`, and the queue drains in order.

use async_bulkhead_llm::BulkheadError;

use crate::support::{assert_pending, bulkhead, on_three_runtimes, st};

/// `(service type, max_concurrent range, max_queue)`.
const ROWS: [(&str, [u32; 2], u32); 4] = [
    ("critical, fast API", [50, 100], 200),
    ("non-critical, slow API", [5, 10], 20),
    ("background jobs", [2, 5], 10),
    ("high-throughput microservice", [100, 200], 500),
];

async fn every_row_builds_and_behaves() {
    for (service, range, max_queue) in ROWS {
        for max_concurrent in range {
            let bulkhead = bulkhead(max_concurrent as usize, max_queue as usize);
            let limits = bulkhead.limits();
            assert_eq!(
                (limits.max_concurrent, limits.max_queue),
                (max_concurrent, max_queue)
            );
            let (slots, places) = (u64::from(max_concurrent), u64::from(max_queue));
            let held: Vec<_> = (0..max_concurrent)
                .map(|_| bulkhead.try_acquire().expect("free"))
                .collect();
            let mut waiters = Vec::new();
            for _ in 0..max_queue {
                let mut waiter = bulkhead.acquire();
                assert_pending(&mut waiter).await;
                waiters.push(waiter);
            }
            assert_eq!(bulkhead.state(), st(slots, places), "{service}");
            assert_eq!(
                bulkhead.acquire().await.unwrap_err(),
                BulkheadError::QueueFull {
                    state: st(slots, places)
                },
                "{service}"
            );
            drop(held);
            assert_eq!(
                bulkhead.state(),
                st(slots.min(places), places.saturating_sub(slots)),
                "{service}: the freed slots went to the oldest waiters"
            );
            for waiter in waiters {
                drop(waiter.await.expect("served"));
            }
            let stats = bulkhead.stats();
            assert_eq!(
                (stats.admitted, stats.released, stats.rejected_queue_full),
                (slots + places, slots + places, 1),
                "{service}"
            );
            assert_eq!(bulkhead.state(), st(0, 0));
        }
    }
}

on_three_runtimes!(
    every_row_of_the_sizing_guide_builds_and_behaves,
    super::every_row_builds_and_behaves
);
