//! Deterministic scenarios of the rate windows (crate src/engine/rate.rs module docs): exact
//! figures pinned, on top of the harness's own comparison of the crate and the model after
//! every step.

use std::time::Duration;

use crate::reference::{Config, Harness, Op, Rate, Reason};
use crate::scenarios::{acquire, ask, release, try_acquire};

const SECOND: u64 = 1_000_000_000;

fn config(max_concurrent: u32, max_queue: u32, budget: Option<(u64, u64)>, rate: Rate) -> Config {
    Config {
        max_concurrent,
        max_queue,
        budget,
        initial_revision: 0,
        classes: None,
        dedup: None,
        rate: Some(rate),
    }
}

fn advance(ms: u64) -> Op {
    Op::Advance {
        by: Duration::from_millis(ms),
    }
}

/// `(limit, remaining, reset in ns)` of a window.
type Figures = Option<(u64, u64, u64)>;

/// The model's windows now (the harness checked `rate_status()` equals them).
fn windows(harness: &mut Harness) -> (Figures, Figures) {
    harness.inspect(|m| {
        let (requests, tokens) = m.windows.expect("windows").status(m.now_ns);
        let figures =
            |s: Option<_>| s.map(|s: crate::reference::Status| (s.limit, s.remaining, s.reset_ns));
        (figures(requests), figures(tokens))
    })
}

/// The last refusal announced: its reason, and for a window's, `(which window, retry after
/// in ms)`.
fn last_refusal(harness: &mut Harness) -> (Reason, Option<(&'static str, Option<u64>)>) {
    harness.inspect(|m| {
        let (_, refused) = m.last_refused.expect("a refusal");
        let window = |class, tokens| match (class, tokens) {
            (false, false) => "requests",
            (false, true) => "tokens",
            (true, false) => "class requests",
            (true, true) => "class tokens",
        };
        (
            refused.reason,
            refused
                .rate
                .map(|r| (window(r.class, r.tokens), r.retry_after_ms)),
        )
    })
}

fn rejected(harness: &mut Harness) -> [u64; 7] {
    harness.inspect(|m| m.rejected)
}

#[test]
fn a_burst_then_a_refusal_with_its_exact_retry_after() {
    // Three requests a second: a tick is a third of a second, which no millisecond divides.
    let rate = Rate {
        window_ns: SECOND,
        requests: Some(3),
        tokens: None,
    };
    let mut h = Harness::new(config(8, 0, None, rate));
    for _ in 0..3 {
        h.apply(&try_acquire(ask(1, 1)));
    }
    assert_eq!(windows(&mut h), (Some((3, 0, SECOND)), None));
    h.apply(&try_acquire(ask(1, 1)));
    // It fits at the start of the window's next tick: 333,333,334 ns from now (rounded up),
    // 334 ms as `retry_after` reports it.
    assert_eq!(
        last_refusal(&mut h),
        (Reason::RateLimit, Some(("requests", Some(334))))
    );
    h.apply(&advance(333));
    h.apply(&try_acquire(ask(1, 1)));
    assert_eq!(
        last_refusal(&mut h),
        (Reason::RateLimit, Some(("requests", Some(1))))
    );
    h.apply(&advance(1));
    h.apply(&try_acquire(ask(1, 1)));
    assert_eq!(rejected(&mut h)[Reason::RateLimit as usize], 2);
    assert_eq!(h.tally().get("refused: requests window"), Some(&2));
    assert_eq!(windows(&mut h).0.map(|w| w.1), Some(0));
    h.finish();
}

#[test]
fn a_refusal_by_the_word_or_the_tokens_window_gives_the_charge_back() {
    // One slot; three requests and a thousand tokens a second (a token's tick: 1 ms).
    let rate = Rate {
        window_ns: SECOND,
        requests: Some(3),
        tokens: Some(1000),
    };
    let mut h = Harness::new(config(1, 0, Some((10_000, 0)), rate));
    h.apply(&try_acquire(ask(100, 400)));
    assert_eq!(
        windows(&mut h),
        (Some((3, 2, SECOND / 3 + 1)), Some((1000, 500, SECOND / 2)))
    );
    // No slot: both charges given back.
    h.apply(&try_acquire(ask(0, 100)));
    assert_eq!(last_refusal(&mut h), (Reason::ConcurrencyLimit, None));
    assert_eq!(
        windows(&mut h),
        (Some((3, 2, SECOND / 3 + 1)), Some((1000, 500, SECOND / 2)))
    );
    // The tokens window refuses 600 of its 500 left: fits in 100 ms; the request's charge
    // goes back.
    h.apply(&try_acquire(ask(0, 600)));
    assert_eq!(
        last_refusal(&mut h),
        (Reason::RateLimit, Some(("tokens", Some(100))))
    );
    assert_eq!(windows(&mut h).0, Some((3, 2, SECOND / 3 + 1)));
    // More than the whole limit never fits: no retry-after.
    h.apply(&try_acquire(ask(1, 1000)));
    assert_eq!(
        last_refusal(&mut h),
        (Reason::RateLimit, Some(("tokens", None)))
    );
    assert_eq!(windows(&mut h).1.map(|w| w.1), Some(500));
    assert_eq!(rejected(&mut h), [0, 1, 0, 0, 0, 0, 2]);
    h.finish();
}

#[test]
fn a_queued_call_keeps_its_charge_and_gets_it_back_when_its_wait_ends_refused() {
    let rate = Rate {
        window_ns: SECOND,
        requests: Some(4),
        tokens: None,
    };
    let remaining = |h: &mut Harness| windows(h).0.map(|w| w.1);
    let mut h = Harness::new(config(1, 2, Some((10_000, 0)), rate));
    h.apply(&try_acquire(ask(1, 1)));
    assert_eq!(remaining(&mut h), Some(3));
    // A zero queue timeout: refused `timeout`, the charge given back.
    h.apply(&Op::Acquire {
        owned: false,
        timeout: 1,
        call: ask(1, 1),
    });
    assert_eq!(last_refusal(&mut h), (Reason::Timeout, None));
    assert_eq!(remaining(&mut h), Some(3));
    // Queued: charged while it waits; cancelled: given back.
    h.apply(&acquire(ask(1, 1)));
    assert_eq!(remaining(&mut h), Some(2));
    h.apply(&Op::CancelWaiter { waiter: 0 });
    assert_eq!(remaining(&mut h), Some(3));
    // Queued again, then refused `shutdown` by close: given back when the refusal is picked
    // up; a closed bulkhead charges nothing.
    h.apply(&acquire(ask(1, 1)));
    assert_eq!(remaining(&mut h), Some(2));
    h.apply(&Op::Close);
    assert_eq!(last_refusal(&mut h), (Reason::Shutdown, None));
    assert_eq!(remaining(&mut h), Some(3));
    h.apply(&try_acquire(ask(1, 1)));
    assert_eq!(remaining(&mut h), Some(3));
    let tally = h.finish_with_tally();
    assert_eq!(tally.get("rate charge given back: refused now"), Some(&1));
    assert_eq!(
        tally.get("rate charge given back: wait cancelled"),
        Some(&1)
    );
    assert_eq!(
        tally.get("rate charge given back: wait ended refused"),
        Some(&1)
    );
}

#[test]
fn the_tokens_charge_follows_the_usage() {
    let rate = Rate {
        window_ns: SECOND,
        requests: None,
        tokens: Some(1000),
    };
    let tokens = |h: &mut Harness| windows(h).1.map(|w| w.1);
    let mut h = Harness::new(config(2, 0, Some((10_000, 0)), rate));
    // Charged its reservation (500), corrected at release to its usage (150).
    h.apply(&try_acquire(ask(100, 400)));
    assert_eq!(tokens(&mut h), Some(500));
    h.apply(&release(0, Some((50, 100))));
    assert_eq!(tokens(&mut h), Some(850));
    // A report beyond the reservation (100) is charged as it arrives (300); a release without
    // usage then settles with that report: nothing more moves.
    h.apply(&try_acquire(ask(0, 100)));
    assert_eq!(tokens(&mut h), Some(750));
    h.apply(&Op::ReportUsage {
        permit: 0,
        input: 0,
        output: 300,
    });
    assert_eq!(tokens(&mut h), Some(550));
    h.apply(&release(0, None));
    assert_eq!(tokens(&mut h), Some(550));
    // A permit dropped without any usage keeps its reservation charged.
    h.apply(&try_acquire(ask(0, 200)));
    h.apply(&Op::DropPermit { permit: 0 });
    assert_eq!(tokens(&mut h), Some(350));
    // A tenth of a second refills a hundred tokens.
    h.apply(&advance(100));
    assert_eq!(tokens(&mut h), Some(450));
    let tally = h.finish_with_tally();
    assert_eq!(tally.get("rate usage given back"), Some(&1));
    assert_eq!(tally.get("rate usage charged beyond"), Some(&1));
}

#[test]
fn new_rate_limits_keep_what_is_charged_and_refusals_change_nothing() {
    let requests = |n| Rate {
        window_ns: SECOND,
        requests: Some(n),
        tokens: None,
    };
    let apply = |rate| Op::ApplyRate {
        revision_delta: 1,
        rate,
    };
    let mut h = Harness::new(config(8, 0, None, requests(4)));
    for _ in 0..3 {
        h.apply(&try_acquire(ask(1, 1)));
    }
    assert_eq!(windows(&mut h).0, Some((4, 1, 3 * SECOND / 4)));
    // Lowered to 2: the 3 charged stay charged, at most the new limit (crate rate.rs
    // `Words::rescale`).
    h.apply(&apply(Some(requests(2))));
    assert_eq!(windows(&mut h).0, Some((2, 0, SECOND)));
    // Raised to 10, in a window of 2 s: the 2 still charged are there, the new room at once.
    h.apply(&apply(Some(Rate {
        window_ns: 2 * SECOND,
        ..requests(10)
    })));
    assert_eq!(windows(&mut h).0, Some((10, 8, 2 * SECOND / 5)));
    // Refused (no limit; none at all; a tokens window without a budget; a window too short):
    // nothing changes.
    h.apply(&apply(Some(requests(0))));
    h.apply(&apply(None));
    h.apply(&apply(Some(Rate {
        tokens: Some(100),
        ..requests(3)
    })));
    h.apply(&apply(Some(Rate {
        window_ns: 999_999,
        ..requests(3)
    })));
    assert_eq!(windows(&mut h).0, Some((10, 8, 2 * SECOND / 5)));
    assert_eq!(h.inspect(|m| m.limits.revision), 2);
    let tally = h.finish_with_tally();
    assert_eq!(tally.get("rate limits refused"), Some(&4));
    assert_eq!(tally.get("rate limits changed"), Some(&2));
}

#[test]
fn a_class_window_refuses_and_gives_the_bulkheads_charge_back() {
    use crate::reference::{ClassCaps, Classes};
    // `premium` has a window of one request a second of its own; `standard` none; the
    // bulkhead three a second.
    let premium = ClassCaps {
        rate: Some(Rate {
            window_ns: SECOND,
            requests: Some(1),
            tokens: None,
        }),
        ..ClassCaps::default()
    };
    let mut config = config(
        4,
        0,
        None,
        Rate {
            window_ns: SECOND,
            requests: Some(3),
            tokens: None,
        },
    );
    config.classes = Some(Classes {
        default: 1,
        caps: vec![premium, ClassCaps::default()],
    });
    let of = |class, call| crate::reference::Call { class, ..call };
    let remaining = |h: &mut Harness| {
        h.inspect(|m| {
            let left = |w: Option<(Option<crate::reference::Status>, _)>| {
                w.and_then(|(requests, _)| requests).map(|s| s.remaining)
            };
            (
                left(m.windows.and_then(|w| w.report(m.now_ns))),
                left(m.class_windows[0].report(m.now_ns)),
                m.class_windows[1].report(m.now_ns).is_none(),
            )
        })
    };
    let mut h = Harness::new(config);
    h.apply(&try_acquire(of(1, ask(1, 1))));
    assert_eq!(remaining(&mut h), (Some(2), Some(0), true));
    // The class's window refuses: the bulkhead's charge goes back; the call counts against
    // its class.
    h.apply(&try_acquire(of(1, ask(1, 1))));
    assert_eq!(
        last_refusal(&mut h),
        (Reason::RateLimit, Some(("class requests", Some(1000))))
    );
    assert_eq!(remaining(&mut h), (Some(2), Some(0), true));
    assert_eq!(
        h.inspect(|m| m.classes[0].rejected[Reason::RateLimit as usize]),
        1
    );
    // The default class (`standard`) has no window of its own.
    h.apply(&try_acquire(ask(1, 1)));
    assert_eq!(remaining(&mut h), (Some(1), Some(0), true));
    h.finish();
}
