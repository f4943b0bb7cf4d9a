//! An overrun hold blocks admissions until it is released.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, LlmBulkhead, LlmRequest, Permit, Priority, RejectReason, Reservation,
    TokenBudget, admission::Verdict, usage::Progressive, usage::UsageError,
};

use super::{usage, with};

/// A barrier that gives up (panics) after a while, so that a participant that failed fails the
/// test instead of leaving the others waiting forever.
struct Rendezvous {
    parties: usize,
    /// (arrived, generation)
    state: Mutex<(usize, u64)>,
    turn: Condvar,
}

impl Rendezvous {
    fn new(parties: usize) -> Rendezvous {
        Rendezvous {
            parties,
            state: Mutex::new((0, 0)),
            turn: Condvar::new(),
        }
    }

    fn wait(&self) {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let generation = state.1;
        state.0 += 1;
        if state.0 == self.parties {
            *state = (0, generation + 1);
            self.turn.notify_all();
            return;
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while state.1 == generation {
            let left = deadline.saturating_duration_since(Instant::now());
            assert!(
                !left.is_zero(),
                "a participant never arrived (did it fail?)"
            );
            state = self
                .turn
                .wait_timeout(state, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

/// Checks that a call needing `reservation` is refused for its tokens right now, in every way
/// of asking; returns how many refusals the bulkhead counted.
fn assert_refused_for_tokens(
    bulkhead: &LlmBulkhead,
    reservation: Reservation,
    priority: Priority,
    in_flight_tokens: u64,
) -> u64 {
    let options = with(reservation).priority(priority);
    let request = LlmRequest::new();
    let check = |result: Result<(), AcquireError>| {
        let error = result.expect_err("refused while the holds exceed the budget");
        let rejection = error.rejection().expect("a capacity refusal");
        assert_eq!(rejection.reason(), RejectReason::BudgetLimit, "{rejection}");
        let detail = rejection.detail().token_budget.unwrap();
        assert_eq!(
            (detail.in_flight_tokens, detail.requested),
            (in_flight_tokens, reservation.reserved())
        );
    };
    check(bulkhead.try_acquire(&request, options).map(drop));
    check(bulkhead.try_acquire_owned(&request, options).map(drop));
    // A token shortage never makes a call wait, even one that may queue.
    let queued = options.timeout(Duration::from_secs(30));
    check(bulkhead.acquire_blocking(&request, queued).map(drop));
    assert_eq!(
        bulkhead.would_admit(&request, options).unwrap(),
        Verdict::Reject(RejectReason::BudgetLimit)
    );
    3
}

/// Admits `reservation`-sized calls of `priority` until the first refusal (which must be for
/// tokens); returns the permits.
fn fill<'a>(
    bulkhead: &'a LlmBulkhead,
    reservation: Reservation,
    priority: Priority,
    refusals: &AtomicU64,
) -> Vec<Permit<'a>> {
    let mut permits = Vec::new();
    loop {
        match bulkhead.try_acquire(&LlmRequest::new(), with(reservation).priority(priority)) {
            Ok(permit) => permits.push(permit),
            Err(error) => {
                let reason = error.rejection().unwrap().reason();
                assert_eq!(reason, RejectReason::BudgetLimit);
                refusals.fetch_add(1, Ordering::Relaxed);
                return permits;
            }
        }
    }
}

/// Threads hold permits whose usage runs past their reservations, pushing the tokens in flight
/// above the budget; meanwhile other threads hammer the bulkhead and every call needing budget
/// is refused `budget_limit` (even a zero-token one, even a high-priority one, even one that
/// may queue). A progressive report then refunds most of the holds and exactly what fits is
/// admitted; after the holders release, the whole budget is admitted again.
#[test]
fn overrun_holds_block_admissions_until_released() {
    const HOLDERS: usize = 3;
    const HAMMERS: usize = 4;
    let bulkhead = LlmBulkhead::builder("m", 64)
        .max_queue(16)
        .token_budget(TokenBudget::new(1_000).high_priority_reserve(100))
        .build()
        .unwrap();
    // 3 x 300 = 900: the normal-priority budget, exactly.
    let held = Reservation::new(100, 200).unwrap();
    let hundred = Reservation::new(20, 80).unwrap();
    let holders: Vec<Permit<'_>> = (0..HOLDERS)
        .map(|_| {
            bulkhead
                .try_acquire(&LlmRequest::new(), with(held))
                .unwrap()
        })
        .collect();
    let refusals = AtomicU64::new(0);
    let admitted_in_phase = [AtomicU64::new(0), AtomicU64::new(0)];
    let barrier = Rendezvous::new(HOLDERS + HAMMERS);
    let tokens_in_flight = || bulkhead.stats().token_budget.unwrap().in_flight_tokens;
    // At a quiet point (holders parked, hammers only refused): the tokens in flight are the
    // books' balance, `reserved + overrun + reheld - refunded - consumed - returned`.
    let balanced = || {
        let t = bulkhead.stats().token_budget.unwrap();
        assert_eq!(
            t.total_reserved + t.total_overrun + t.total_reheld,
            t.in_flight_tokens + t.total_refunded + t.total_consumed + t.total_returned_unreported,
            "{t:?}"
        );
        t.in_flight_tokens
    };

    std::thread::scope(|s| {
        for mut permit in holders {
            let barrier = &barrier;
            s.spawn(move || {
                // Phase 1: the output runs 150 past the reservation: hold 100 + 350 = 450.
                let report = permit.report_usage(usage(100, 350)).unwrap();
                assert_eq!((report.held, report.sequence), (450, 1));
                assert!(report.over_reservation);
                barrier.wait(); // (1) every hold is above the budget: 1350 in flight
                barrier.wait(); // (2) the hammers were refused
                // Phase 2: nothing more to come: only the 150 above the cap stays held.
                let progress = Progressive::new(0);
                let report = permit
                    .report_usage_progressive(usage(100, 350), progress)
                    .unwrap();
                assert_eq!((report.held, report.sequence), (150, 2));
                barrier.wait(); // (3) refunded: 450 in flight
                barrier.wait(); // (4) the hammers filled what the refunds freed
                // Phase 3: settle with the final usage (450, above the hold of 150).
                let report = permit.release(Some(usage(100, 350)));
                assert_eq!(
                    (
                        report.held_tokens,
                        report.refunded_tokens,
                        report.overrun_tokens
                    ),
                    (150, 0, 150)
                );
                barrier.wait(); // (5) every holder released
                barrier.wait(); // (6) the hammers filled the whole budget
                barrier.wait(); // (7) ...and that was checked
            });
        }
        for h in 0..HAMMERS {
            let (bulkhead, barrier, refusals) = (&bulkhead, &barrier, &refusals);
            let (admitted_in_phase, tokens_in_flight) = (&admitted_in_phase, &tokens_in_flight);
            let balanced = &balanced;
            s.spawn(move || {
                let mut rng = fastrand::Rng::with_seed(h as u64);
                barrier.wait(); // (1)
                assert_eq!(tokens_in_flight(), 1_350);
                // 900 reserved + 450 overrun; the other hammers' refusals book no tokens.
                assert_eq!(balanced(), 1_350);
                for _ in 0..50 {
                    let reservation = match rng.u8(0..4) {
                        0 => Reservation::new(0, 0).unwrap(),
                        _ => Reservation::new(rng.u64(0..50), rng.u64(1..50)).unwrap(),
                    };
                    let priority = if rng.bool() {
                        Priority::High
                    } else {
                        Priority::Normal
                    };
                    let counted = assert_refused_for_tokens(bulkhead, reservation, priority, 1_350);
                    refusals.fetch_add(counted, Ordering::Relaxed);
                }
                assert_eq!(bulkhead.stats().pending, 0, "nothing queued for tokens");
                barrier.wait(); // (2)
                barrier.wait(); // (3)
                // The refunds are available at once: 450 in flight leaves 450 of the normal
                // budget and 550 of the whole one. Whatever the interleaving of normal and high
                // calls, 100-token admissions stop at 950 in flight: 5 of them.
                let mut permits = fill(bulkhead, hundred, Priority::Normal, refusals);
                permits.extend(fill(bulkhead, hundred, Priority::High, refusals));
                admitted_in_phase[0].fetch_add(permits.len() as u64, Ordering::Relaxed);
                barrier.wait(); // (4)
                for permit in permits {
                    assert_eq!(permit.release(Some(usage(20, 80))).refunded_tokens, 0);
                }
                barrier.wait(); // (5)
                // Everything released: the whole budget is admitted again, 10 x 100 tokens.
                let mut permits = fill(bulkhead, hundred, Priority::Normal, refusals);
                permits.extend(fill(bulkhead, hundred, Priority::High, refusals));
                admitted_in_phase[1].fetch_add(permits.len() as u64, Ordering::Relaxed);
                barrier.wait(); // (6)
                if h == 0 {
                    assert_eq!(tokens_in_flight(), 1_000);
                    // 2400 reserved + 900 overrun + 450 re-held - 900 refunded - 1850 consumed.
                    assert_eq!(balanced(), 1_000);
                }
                barrier.wait(); // (7)
                for permit in permits {
                    permit.release(Some(usage(20, 80)));
                }
            });
        }
    });

    assert_eq!(admitted_in_phase[0].load(Ordering::Relaxed), 5);
    assert_eq!(admitted_in_phase[1].load(Ordering::Relaxed), 10);
    let stats = bulkhead.stats();
    let tokens = stats.token_budget.unwrap();
    assert_eq!((stats.in_flight, tokens.in_flight_tokens), (0, 0));
    assert_eq!(stats.admitted, HOLDERS as u64 + 15);
    assert_eq!(stats.released, stats.admitted);
    assert_eq!(
        stats.rejected_by_reason.budget_limit,
        refusals.load(Ordering::Relaxed)
    );
    assert_eq!(stats.rejected, stats.rejected_by_reason.budget_limit);
    // Each holder: +150 above the reservation, -300 refunded, then +150 re-held and +150 above
    // the reservation again at settlement (refunds are gross: the re-hold is booked apart).
    assert_eq!(tokens.total_overrun, HOLDERS as u64 * 300);
    assert_eq!(tokens.total_refunded, HOLDERS as u64 * 300);
    assert_eq!(tokens.total_reheld, HOLDERS as u64 * 150);
    assert_eq!(tokens.total_returned_unreported, 0);
    assert_eq!(tokens.total_consumed, HOLDERS as u64 * 450 + 15 * 100);
    assert_eq!(
        tokens.total_reserved + tokens.total_overrun + tokens.total_reheld,
        tokens.total_consumed + tokens.total_refunded
    );
}

/// The same inside `run`: while a callback's reported usage holds more than the budget, calls
/// from other tasks are refused for tokens; once the run settles, all of them get in.
#[test]
fn an_overrun_inside_run_blocks_admissions_until_the_run_settles() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(4)
        .build()
        .unwrap();
    runtime.block_on(async {
        let bulkhead = LlmBulkhead::builder("m", 8)
            .max_queue(64)
            .token_budget(TokenBudget::new(1_000))
            .build()
            .unwrap();
        let (overran, overran_rx) = tokio::sync::oneshot::channel();
        let (finish, finish_rx) = tokio::sync::oneshot::channel::<()>();
        let runner = tokio::spawn({
            let bulkhead = bulkhead.clone();
            async move {
                let options = with(Reservation::new(100, 400).unwrap());
                bulkhead
                    .run(&LlmRequest::new(), options, async |mut ctx| {
                        // 100 + 950: 550 past the reservation, 50 past the whole budget.
                        let report = ctx.report_usage(usage(100, 950))?;
                        assert_eq!(report.held, 1_050);
                        overran.send(()).unwrap();
                        finish_rx.await.unwrap();
                        Ok::<_, UsageError>(())
                    })
                    .await
                    .unwrap();
            }
        });
        overran_rx.await.unwrap();
        let probes: Vec<_> = (0..16u64)
            .map(|i| {
                let bulkhead = bulkhead.clone();
                tokio::spawn(async move {
                    let mut rng = fastrand::Rng::with_seed(i);
                    for _ in 0..20 {
                        let reservation = Reservation::new(rng.u64(0..20), rng.u64(0..20)).unwrap();
                        let options = with(reservation).timeout(Duration::from_secs(30));
                        let result = bulkhead.acquire(&LlmRequest::new(), options).await;
                        let reason = result.unwrap_err().rejection().unwrap().reason();
                        assert_eq!(reason, RejectReason::BudgetLimit);
                        tokio::task::yield_now().await;
                    }
                })
            })
            .collect();
        for probe in probes {
            probe.await.unwrap();
        }
        assert_eq!(bulkhead.stats().rejected_by_reason.budget_limit, 16 * 20);
        finish.send(()).unwrap();
        runner.await.unwrap();
        // Settled with the reported usage: the overrun is gone, everyone gets in (8 at a time,
        // the rest waiting in the queue for a slot).
        let callers: Vec<_> = (0..40u64)
            .map(|i| {
                let bulkhead = bulkhead.clone();
                tokio::spawn(async move {
                    let options =
                        with(Reservation::new(10, 90).unwrap()).timeout(Duration::from_secs(30));
                    let mut permit = bulkhead.acquire(&LlmRequest::new(), options).await.unwrap();
                    permit.report_usage(usage(10, i)).unwrap();
                    tokio::task::yield_now().await;
                    permit.release(None);
                })
            })
            .collect();
        for caller in callers {
            caller.await.unwrap();
        }
        let stats = bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        assert_eq!((stats.in_flight, tokens.in_flight_tokens), (0, 0));
        assert_eq!((stats.admitted, stats.released), (41, 41));
        assert_eq!(tokens.total_overrun, 550);
        assert_eq!(
            tokens.total_consumed,
            1_050 + 40 * 10 + (0..40).sum::<u64>()
        );
        assert_eq!(
            tokens.total_reserved + tokens.total_overrun,
            tokens.total_consumed + tokens.total_refunded
        );
    });
}
