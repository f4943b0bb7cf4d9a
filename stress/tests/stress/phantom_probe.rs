//! The "phantom commit" probe: a control plane that changes the token
//! budget about 1,000 times a second while more threads than cores hammer one bulkhead.
//!
//! A refusal's capacity detail is read from one consistent snapshot of the admission word. Every
//! slot in that word belongs to a call that is inside `try_acquire` or holds a permit; if the
//! call ends admitted, its slot is legitimate. A slot whose call ends *refused* can only be a
//! commit that the crate made and then undid (the phantom): it was visible to other decisions
//! although no sequential order of the calls ever held it. The probe stamps every call with a
//! logical clock (one `SeqCst` counter) before it starts and after it ends, and checks each
//! refusal: the slots its detail counts must not exceed the admitted calls whose interval
//! overlaps the refusal's. Overlap over-approximates what could be in the word, so the check is
//! sound (it never blames a correct crate) but may miss a phantom hidden by a busy moment.
//!
//! `PHANTOM_PROBE_SECS` sets the duration (default 10 s; the figures in `loom-tests/README.md`
//! were measured with 60 s in release mode: `PHANTOM_PROBE_SECS=60 cargo test --release --test
//! stress phantom_probe -- --nocapture`).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget,
};

/// Workers: with the control plane, far more runnable threads than this machine's cores, so
/// that a preempted thread stays off its core for many milliseconds.
const WORKERS: usize = 48;
/// How long an admitted call holds its permit (busy, so the thread stays runnable).
const HOLD: Duration = Duration::from_micros(2);
/// One refusal in this many is checked (a phantom lasts milliseconds: thousands of refusals see it).
const SAMPLE: u32 = 1024;
/// Slots and budget fit 8 calls at `HIGH` and 4 at `LOW`.
const FIT: u64 = 8;
/// Every call reserves the same tokens, so a snapshot's slots and tokens tell the same story.
const TOKENS: u64 = 100;
/// The budget alternates between these: at `LOW` only half the workers fit, so refusals are
/// frequent and a re-decided (undone) commit is often refused.
const HIGH: u64 = TOKENS * FIT;
const LOW: u64 = HIGH / 2;

struct Refused {
    start: u64,
    end: u64,
    slots: u64,
}

/// One worker's record. Admitted calls are kept as two sorted lists (their intervals are not
/// needed as pairs: counting starts before a point and ends before another is enough).
#[derive(Default)]
struct Log {
    /// When each admitted call started its acquire (in clock order).
    admitted_starts: Vec<u64>,
    /// When each admitted call finished its release (in clock order).
    admitted_ends: Vec<u64>,
    /// One sampled refusal in [`SAMPLE`].
    refused: Vec<Refused>,
    refusals: u64,
}

/// Stays on the core (runnable) for `span`.
fn busy(span: Duration) {
    let start = Instant::now();
    while start.elapsed() < span {
        std::hint::spin_loop();
    }
}

#[test]
fn no_refusal_counts_a_commit_that_was_never_admitted() {
    let secs = std::env::var("PHANTOM_PROBE_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(10u64);
    let bulkhead = LlmBulkhead::builder("probe", WORKERS)
        .token_budget(TokenBudget::new(HIGH))
        .build()
        .unwrap();
    let clock = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let options = AcquireOptions::new().reservation(Reservation::new(TOKENS, 0).unwrap());

    let workers: Vec<_> = (0..WORKERS)
        .map(|_| {
            let (bulkhead, clock, stop) = (bulkhead.clone(), clock.clone(), stop.clone());
            std::thread::spawn(move || {
                let request = LlmRequest::new();
                let mut log = Log::default();
                while !stop.load(Ordering::Relaxed) {
                    let start = clock.fetch_add(1, Ordering::SeqCst);
                    match bulkhead.try_acquire(&request, options) {
                        Ok(permit) => {
                            busy(HOLD);
                            drop(permit);
                            let end = clock.fetch_add(1, Ordering::SeqCst);
                            log.admitted_starts.push(start);
                            log.admitted_ends.push(end);
                        }
                        Err(err) => {
                            let end = clock.fetch_add(1, Ordering::SeqCst);
                            let rejection = err.rejection().expect("a capacity refusal");
                            assert_eq!(rejection.reason(), RejectReason::BudgetLimit);
                            let detail = rejection.detail();
                            let tokens = detail.token_budget.unwrap().in_flight_tokens;
                            assert_eq!(tokens, detail.in_flight * TOKENS, "all reserve {TOKENS}");
                            log.refusals += 1;
                            if log.refusals.is_multiple_of(u64::from(SAMPLE)) {
                                log.refused.push(Refused {
                                    start,
                                    end,
                                    slots: detail.in_flight,
                                });
                            }
                        }
                    }
                }
                log
            })
        })
        .collect();

    // The control plane: 1,000 budget changes a second on average. It sleeps a millisecond
    // between rounds and, when it got no core for a while, catches up in a burst (as a control
    // plane that follows every response's rate-limit headers would).
    let started = Instant::now();
    let deadline = started + Duration::from_secs(secs);
    let mut changes = 0u64;
    while Instant::now() < deadline {
        let due = started.elapsed().as_millis() as u64;
        while changes < due {
            let budget = if changes.is_multiple_of(2) { LOW } else { HIGH };
            bulkhead.set_budget(budget).unwrap();
            changes += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    stop.store(true, Ordering::Relaxed);
    let logs: Vec<Log> = workers.into_iter().map(|w| w.join().unwrap()).collect();

    let mut starts: Vec<u64> = logs
        .iter()
        .flat_map(|l| l.admitted_starts.iter().copied())
        .collect();
    let mut ends: Vec<u64> = logs
        .iter()
        .flat_map(|l| l.admitted_ends.iter().copied())
        .collect();
    starts.sort_unstable();
    ends.sort_unstable();
    let refusals: u64 = logs.iter().map(|l| l.refusals).sum();
    let mut phantoms = Vec::new();
    for r in logs.iter().flat_map(|l| &l.refused) {
        // Admitted calls that may have held a slot at some instant of the refusal: started
        // before it ended, and not released before it started.
        let began = starts.partition_point(|&s| s < r.end) as u64;
        let gone = ends.partition_point(|&e| e <= r.start) as u64;
        let overlapping = began - gone;
        if r.slots > overlapping {
            phantoms.push((r.slots, overlapping));
        }
    }
    let admitted = starts.len();
    println!(
        "{secs} s: {changes} budget changes, {admitted} admissions, {refusals} refusals, \
         {} of {} sampled refusals counted a commit that was never admitted",
        phantoms.len(),
        refusals / u64::from(SAMPLE)
    );
    assert!(
        admitted > 1000 && refusals > 100 * u64::from(SAMPLE),
        "the probe must exercise both outcomes"
    );
    assert!(
        phantoms.is_empty(),
        "{} sampled refusals counted slots no admitted call held (slots seen, admitted calls that \
         overlapped): {:?}",
        phantoms.len(),
        &phantoms[..phantoms.len().min(10)]
    );
}
