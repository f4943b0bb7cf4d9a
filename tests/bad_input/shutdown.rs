//! close, drain, drain_timeout

use std::time::Duration;

use async_bulkhead_llm::{LlmBulkhead, futures::DrainReport};
use futures::executor::block_on;

use crate::support::{Twin, budgeted, with_res};

#[test]
fn closing_twice_changes_nothing_the_second_time() {
    let mut twin = Twin::new(|| budgeted(2, 1000, 0));
    twin.hold(with_res(1, 1));
    assert_eq!(twin.both(LlmBulkhead::close), (true, true));
    assert!(!twin.subject.close());
    assert!(!twin.subject.close());
    twin.assert_behaves_like_control("second close");
}

#[test]
fn drain_timeout_with_zero_and_huge_durations_never_panics() {
    for timeout in [
        Duration::ZERO,
        Duration::from_nanos(1),
        Duration::from_secs(1 << 40),
        Duration::new(u64::MAX, 999_999_999),
        Duration::MAX,
    ] {
        // Idle: drained at once.
        let b = budgeted(2, 1000, 0);
        assert_eq!(
            drain_parts(block_on(b.drain_timeout(timeout))),
            (true, 0, 0),
            "{timeout:?}"
        );
        // Busy: a zero or short timeout answers (at once or at its deadline) that it is
        // not drained; a huge one waits for the release.
        let mut twin = Twin::new(|| budgeted(2, 1000, 0));
        twin.hold(with_res(1, 1));
        let holder = twin.held.remove(0);
        if timeout < Duration::from_secs(1) {
            assert_eq!(
                drain_parts(block_on(twin.subject.drain_timeout(timeout))),
                (false, 1, 0)
            );
            drop(holder);
        } else {
            block_on(async {
                let mut drain = Box::pin(twin.subject.drain_timeout(timeout));
                assert!(futures::poll!(drain.as_mut()).is_pending());
                drop(holder);
                assert!(drain.await.drained);
            });
        }
        let control_holder = twin.held.remove(0);
        drop(control_holder);
        twin.assert_behaves_like_control(&format!("drain_timeout({timeout:?})"));
    }
}

/// A drain report's `(drained, in_flight, pending)` (`DrainReport` is `#[non_exhaustive]`).
fn drain_parts(report: DrainReport) -> (bool, u64, u64) {
    (report.drained, report.in_flight, report.pending)
}
