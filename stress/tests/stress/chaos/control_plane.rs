//! What the chaos control plane changes (random limits, budgets, stale and invalid snapshots),
//! its quiet points after the close, and one scenario run on the kit.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use async_bulkhead_llm::{
    Limits, LlmBulkhead, Stats, TokenBudget, limits::LimitsError, limits::MAX_BUDGET,
    limits::MAX_CONCURRENT,
};

use super::books::Shared;
use super::callers::op;
use super::{BUDGET, PEAK_QUEUE, PEAK_SLOTS, POST_CLOSE_OPS, Plane, QUEUE, RESERVE, SLOTS};
use crate::kit::books::{Book, Heard, Ledger, bump, token_balance};
use crate::kit::control_plane::{
    Close, Pace, Schedule, apply, random_budget, set_budget, stale, with_budget,
};
use crate::kit::runtimes::{Rt, Task};
use crate::kit::scene::{Family, Scene, Setup, play};

/// The close between half and 95% of the operations, drains along the way.
const SCHEDULE: Schedule = Schedule {
    close: Close::Between(500, 950),
    drains: true,
    drain_at_close: false,
    pace: Pace::Think,
    post_close_ops: POST_CLOSE_OPS,
};

/// One random change (or non-change) of the limits, checked.
fn reconfigure(shared: &Shared, rng: &mut fastrand::Rng) {
    let bulkhead = &shared.bulkhead;
    let before = bulkhead.limits();
    let changes = shared.setup.plane != Plane::Fixed;
    match rng.u8(0..10) {
        0..=4 if changes => {
            let max_concurrent = match shared.setup.plane {
                Plane::Varying if rng.u8(0..8) == 0 => 0, // the kill switch, waiters kept
                Plane::Varying => rng.u32(1..=PEAK_SLOTS),
                _ => SLOTS,
            };
            let max_queue = if rng.u8(0..8) == 0 {
                0
            } else {
                rng.u32(1..=PEAK_QUEUE)
            };
            let budget = random_budget(bulkhead, rng, BUDGET);
            let reserve = match rng.u8(0..12) {
                // Above the budget: normal-priority calls get no tokens at all.
                0 => budget + rng.u64(0..100),
                _ => rng.u64(0..=budget / 4),
            };
            let next = Limits::new(before.revision + 1, max_concurrent)
                .with_max_queue(max_queue)
                .with_token_budget(budget, reserve);
            apply(shared, &before, next.clone(), &next);
        }
        5 | 6 if changes => {
            let budget = random_budget(bulkhead, rng, BUDGET);
            set_budget(shared, &with_budget(&before, budget));
        }
        7 => stale(shared, rng, &before, PEAK_SLOTS),
        8 => {
            // Invalid: refused whole, nothing changes.
            let next = Limits::new(before.revision + 1, SLOTS);
            let (invalid, expected) = match rng.u8(0..3) {
                0 => (next, LimitsError::TokenBudgetRequired),
                1 => (
                    Limits::new(before.revision + 1, MAX_CONCURRENT + 1).with_token_budget(1, 0),
                    LimitsError::MaxConcurrentTooLarge {
                        value: MAX_CONCURRENT + 1,
                        max: MAX_CONCURRENT,
                    },
                ),
                _ => (
                    next.with_token_budget(MAX_BUDGET + 1, 0),
                    LimitsError::BudgetTooLarge {
                        value: MAX_BUDGET + 1,
                        max: MAX_BUDGET,
                    },
                ),
            };
            assert_eq!(bulkhead.apply_limits(invalid).unwrap_err(), expected);
            assert_eq!(bulkhead.limits(), before);
        }
        _ => {
            let stats = bulkhead.stats();
            assert!(stats.in_flight <= shared.setup.ceiling(), "{stats:?}");
            shared.check_pending(&stats);
            assert_eq!(stats.limits, before);
        }
    }
}

/// After the close, once nothing is in flight (no admission unsettled, none can come: every
/// call is refused), the token books are quiet whatever the callers still do: the token
/// identity must hold exactly, at 0. The counters are read again after the word showed it
/// idle (a settlement books before it returns its hold), so none of them lags.
fn check_quiet_books(shared: &Shared) {
    let idle = shared.bulkhead.stats();
    let tokens = idle.token_budget.unwrap();
    if idle.in_flight > 0 || idle.abandoned_in_flight > 0 || tokens.in_flight_tokens > 0 {
        return;
    }
    let stats = shared.bulkhead.stats();
    let tokens = stats.token_budget.unwrap();
    assert_eq!(tokens.in_flight_tokens, 0, "closed and idle: {stats:?}");
    if let Some(balance) = token_balance(&tokens) {
        assert_eq!(
            balance, 0,
            "closed and idle: reserved + overrun + reheld - refunded - consumed - returned \
             == in_flight_tokens: {tokens:?}"
        );
        bump(&shared.quiet_checks);
    }
}

impl Family for Shared {
    fn op<'a>(
        shared: &'a Arc<Self>,
        rng: &'a mut fastrand::Rng,
        _worker: u64,
        handoffs: &'a mut Vec<Task>,
    ) -> impl Future<Output = ()> + Send + 'a {
        op(shared, rng, handoffs)
    }

    fn reconfigure(&self, rng: &mut fastrand::Rng) {
        reconfigure(self, rng);
    }

    fn closed_round(&self, _stats: &Stats, _previous: Option<&Stats>) {
        check_quiet_books(self);
    }

    fn drained(&self) {
        check_quiet_books(self);
    }

    fn verify(&self) {
        self.check_end();
    }
}

pub(crate) async fn scenario(runtime: &'static str, setup: Setup<Plane>, rt: Rt) {
    let bulkhead = LlmBulkhead::builder("gpt-4o", SLOTS as usize)
        .max_queue(QUEUE as usize)
        .token_budget(TokenBudget::new(BUDGET).high_priority_reserve(RESERVE))
        .build()
        .unwrap();
    let heard = Arc::new(Heard::new(false));
    let _subscription = setup.listen.then(|| {
        let heard = Arc::clone(&heard);
        bulkhead.on(move |event| heard.hear(event))
    });
    let shared = Arc::new(Shared {
        setup,
        scene: Scene::new("chaos", runtime, &setup, SCHEDULE, bulkhead, rt),
        book: if setup.listen {
            Book::tracing()
        } else {
            Book::default()
        },
        ledger: Ledger::default(),
        heard,
        quiet_checks: AtomicU64::new(0),
    });
    play(shared).await;
}
