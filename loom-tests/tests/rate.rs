//! loom models of the rate windows: a window decision racing a refusal by the word, a release
//! with usage (the tokens charge corrected), and `apply_limits` (the window's ticks rescaled).
//! No call gets through a window that had no room, a refused call's charge comes back, and the
//! window's state adds up to the charges that stayed.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err)]

use std::time::Duration;

use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget, TokenUsage,
};
use loom::thread;

const SECOND: Duration = Duration::from_secs(1);

fn tokens(n: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(n, 0).unwrap())
}

/// What a racer's call came to: admitted and settled with `usage` tokens (or its reservation,
/// dropped), or refused for `reason`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Settled(u64),
    Refused(RejectReason),
}

#[test]
fn a_window_decision_races_a_word_refusal_and_a_release_with_usage() {
    loom::model(|| {
        // One slot; 2 requests and 1,000 tokens per (frozen) second.
        let clock = ManualClock::new();
        let bulkhead = LlmBulkhead::builder("m", 1)
            .token_budget(TokenBudget::new(10_000))
            .rate_limits(RateLimits::new(SECOND).requests(2).tokens(1_000))
            .rate_clock(RateClock::manual(&clock))
            .build()
            .unwrap();
        let racers: Vec<_> = [(600u64, Some(100u64)), (300, None)]
            .into_iter()
            .map(|(reserved, usage)| {
                let bulkhead = bulkhead.clone();
                thread::spawn(move || {
                    match bulkhead.try_acquire_owned(&LlmRequest::new(), tokens(reserved)) {
                        Ok(permit) => match usage {
                            Some(used) => {
                                permit.release(Some(TokenUsage::new(used, 0).unwrap()));
                                Outcome::Settled(used)
                            }
                            None => {
                                drop(permit);
                                Outcome::Settled(reserved)
                            }
                        },
                        Err(error) => Outcome::Refused(error.rejection().unwrap().reason()),
                    }
                })
            })
            .collect();
        let outcomes: Vec<Outcome> = racers.into_iter().map(|t| t.join().unwrap()).collect();
        let charged: u64 = outcomes
            .iter()
            .map(|o| match o {
                Outcome::Settled(tokens) => *tokens,
                Outcome::Refused(_) => 0,
            })
            .sum();
        let admitted = outcomes
            .iter()
            .filter(|o| matches!(o, Outcome::Settled(_)))
            .count() as u64;
        for outcome in &outcomes {
            if let Outcome::Refused(reason) = outcome {
                // The only refusal possible: the one slot taken (the windows had room).
                assert_eq!(*reason, RejectReason::ConcurrencyLimit, "{outcomes:?}");
            }
        }
        let status = bulkhead.rate_status().unwrap();
        assert_eq!(
            status.requests.unwrap().remaining,
            2 - admitted,
            "{outcomes:?}"
        );
        assert_eq!(
            status.tokens.unwrap().remaining,
            1_000 - charged,
            "{outcomes:?}"
        );
        let stats = bulkhead.stats();
        assert_eq!((stats.in_flight, stats.admitted), (0, admitted));
    });
}

#[test]
fn a_window_decision_races_apply_limits() {
    loom::model(|| {
        // 1 request per (frozen) second, used up; raised to 2 while a call races for it.
        let clock = ManualClock::new();
        let bulkhead = LlmBulkhead::builder("m", 4)
            .rate_limits(RateLimits::new(SECOND).requests(1))
            .rate_clock(RateClock::manual(&clock))
            .build()
            .unwrap();
        drop(
            bulkhead
                .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                .unwrap(),
        );
        let racer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                bulkhead
                    .try_acquire_owned(&LlmRequest::new(), AcquireOptions::new())
                    .map(drop)
                    .map_err(|e| e.rejection().unwrap().reason())
            })
        };
        let mut raised = bulkhead.limits();
        raised.revision = 1;
        raised.rate = Some(RateLimits::new(SECOND).requests(2));
        assert!(bulkhead.apply_limits(raised).unwrap().is_applied());
        let outcome = racer.join().unwrap();
        // Before the change it is refused (the one request is used); after it, admitted (the
        // used one stays used, the new one is free). Either way the window counts it.
        let requests = bulkhead.rate_status().unwrap().requests.unwrap();
        assert_eq!(requests.limit, 2);
        match outcome {
            Ok(()) => assert_eq!(requests.remaining, 0),
            Err(reason) => {
                assert_eq!(reason, RejectReason::RateLimit);
                assert_eq!(requests.remaining, 1);
            }
        }
    });
}

#[test]
fn a_window_decision_races_a_usage_report_beyond_the_reservation() {
    loom::model(|| {
        // 1,000 tokens per (frozen) second; one call holds 400 and reports 700 used (300 more
        // charged as it reports) while another asks for 400.
        let clock = ManualClock::new();
        let bulkhead = LlmBulkhead::builder("m", 4)
            .token_budget(TokenBudget::new(10_000))
            .rate_limits(RateLimits::new(SECOND).tokens(1_000))
            .rate_clock(RateClock::manual(&clock))
            .build()
            .unwrap();
        let mut held = bulkhead
            .try_acquire_owned(&LlmRequest::new(), tokens(400))
            .unwrap();
        let racer = {
            let bulkhead = bulkhead.clone();
            thread::spawn(move || {
                bulkhead
                    .try_acquire_owned(&LlmRequest::new(), tokens(400))
                    .map(drop)
                    .map_err(|e| e.rejection().unwrap().reason())
            })
        };
        held.report_usage(TokenUsage::new(700, 0).unwrap()).unwrap();
        let outcome = racer.join().unwrap();
        held.release(None);
        let remaining = bulkhead.rate_status().unwrap().tokens.unwrap().remaining;
        match outcome {
            // Admitted before the report's charge (400 + 400 fit; the overrun is charged
            // without refusing, 1,100 of 1,000: nothing left), or refused after it
            // (400 + 300 + 400 > 1,000).
            Ok(()) => assert_eq!(remaining, 0),
            Err(reason) => {
                assert_eq!(reason, RejectReason::RateLimit);
                assert_eq!(remaining, 1_000 - 700);
            }
        }
    });
}
