//! A simulated LLM gateway: hundreds of concurrent calls with random prompt sizes, output
//! ceilings and latencies go through one `LlmBulkhead` on a multi-threaded tokio runtime.
//! Interactive calls fail fast (`try_acquire`); batch calls wait in the bounded FIFO queue of
//! the batch profile (`acquire`), some with a short timeout. Admitted calls *stream*: each
//! chunk carries the provider's cumulative usage, which the gateway reports at once, so an
//! over-estimated prompt is refunded to the budget at the first chunk, a call with an output
//! cap stops holding what it already generated (progressive reconciliation), and a call
//! without a cap that writes past its reservation holds more as it goes (overrun). Halfway
//! through, a "control plane" pushes new limits; at the end the gateway closes the bulkhead
//! and drains it. A listener follows the lifecycle events to measure the hold, the early
//! refunds and the admission timing. Prints what was admitted, what waited and for how long,
//! what was refused and why, how the token budget was used, and the peaks against the limits.
//!
//! Two admission classes share the quota: `premium` (the interactive traffic) has a protected
//! floor of slots and tokens that batch traffic may never borrow, `batch` has none and borrows
//! from the shared pool. A third of the way through, a burst of batch calls arrives at once:
//! the shared pool fills and the rest of the burst is refused at once with
//! `admission_class_protection`, while premium calls keep getting in on their floor (the demo
//! asserts that no premium call is refused while its class is below its floor).
//!
//! Then two more gateways show the features a rollout uses. A *retry storm*: 400 requests, only
//! 8 of them different, arrive at once on a bulkhead with in-flight deduplication
//! (`run_shared`): one provider call per distinct request runs, every other caller shares its
//! answer and takes no capacity. A *shadow rollout*: a bulkhead whose limits are still being
//! tuned runs every call in observe mode, so the calls it would refuse run anyway, and the
//! bypasses are counted by reason for the operator.
//!
//! Run: `cargo run --release --example gateway_demo`

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, Profile, RejectReason,
    TokenBudget, TokenUsage, classes::AdmissionClasses, classes::ClassLimits,
    classes::ClassLimitsTable, dedup::Deduplication, dedup::Sharing, events::Event,
    observe::ShadowReasons, rejection::Constraint, usage::Progressive,
};
use tokio::task::JoinSet;

const CALLS: usize = 600;
/// Batch calls arriving at once, a third of the way through.
const BURST: usize = 120;
/// Premium's protected floor: slots, and tokens.
const PREMIUM_SLOTS: u32 = 6;
const PREMIUM_TOKENS: u64 = 25_000;
const MODEL: &str = "claude-sonnet-4";
/// Tokens a progressive report keeps on top of the output the provider may still write.
const SAFETY_MARGIN: u64 = 32;

/// Figures the gateway tracks on its side of the calls.
#[derive(Default)]
struct Gauges {
    slots: AtomicU64,
    max_slots: AtomicU64,
    max_pending: AtomicU64,
    high_admitted: AtomicU64,
    batch_admitted: AtomicU64,
    uncapped: AtomicU64,
    streamed_chunks: AtomicU64,
    premium_admitted: AtomicU64,
    premium_borrowed: AtomicU64,
    premium_refused: AtomicU64,
    batch_protected_out: AtomicU64,
}

impl Gauges {
    fn enter(&self, pending: u64) {
        let slots = self.slots.fetch_add(1, Ordering::AcqRel) + 1;
        self.max_slots.fetch_max(slots, Ordering::AcqRel);
        self.max_pending.fetch_max(pending, Ordering::AcqRel);
    }

    fn leave(&self) {
        self.slots.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the event listener sees: the running hold, refunds made by reports before release,
/// reports that grew a hold, and the admission timing.
#[derive(Default)]
struct Tally {
    held: AtomicI64,
    peak_held: AtomicI64,
    refunded_early: AtomicU64,
    grown_by_reports: AtomicU64,
    decision_nanos: Mutex<Vec<u64>>,
    waited: AtomicU64,
    wait_micros: AtomicU64,
    max_wait_micros: AtomicU64,
}

impl Tally {
    fn hold(&self, delta: i64) {
        let held = self.held.fetch_add(delta, Ordering::AcqRel) + delta;
        self.peak_held.fetch_max(held, Ordering::AcqRel);
    }

    fn on_event(&self, event: &Event<'_>) {
        match event {
            Event::Admit(admit) => {
                self.hold(admit.reserved_tokens as i64);
                let nanos = admit.decision_duration.as_nanos() as u64;
                self.decision_nanos.lock().unwrap().push(nanos);
                if admit.queue_wait > Duration::ZERO {
                    let micros = admit.queue_wait.as_micros() as u64;
                    self.waited.fetch_add(1, Ordering::Relaxed);
                    self.wait_micros.fetch_add(micros, Ordering::Relaxed);
                    self.max_wait_micros.fetch_max(micros, Ordering::Relaxed);
                }
            }
            Event::Usage(usage) => {
                let delta = usage.delta_tokens as i64;
                self.hold(delta);
                if delta < 0 {
                    self.refunded_early
                        .fetch_add(delta.unsigned_abs(), Ordering::Relaxed);
                } else {
                    self.grown_by_reports
                        .fetch_add(delta as u64, Ordering::Relaxed);
                }
            }
            Event::Release(release) => self.hold(-(release.held_tokens as i64)),
            _ => {}
        }
    }
}

/// One simulated call: build a request, ask the bulkhead, "call the provider" and report its
/// streamed usage, settle. `burst` calls are batch calls.
async fn simulated_call(bulkhead: LlmBulkhead, gauges: Arc<Gauges>, seed: u64, burst: bool) {
    let mut rng = fastrand::Rng::with_seed(seed);
    let prompt = "x".repeat(rng.usize(200..24_000));
    // One call in five sets no output cap: the bulkhead reserves the budget's output cap for
    // it (100 tokens here, set in `main`; the default is 2,048), and the provider may write more.
    let cap = (rng.u8(0..5) != 0).then(|| rng.u64(256..=4096));
    let mut request = LlmRequest::new()
        .system("You are a careful assistant.")
        .user(prompt);
    if let Some(cap) = cap {
        request = request.max_tokens(cap);
    }
    let interactive = !burst && rng.bool();
    let priority = if interactive && rng.u8(0..4) == 0 {
        Priority::High
    } else {
        Priority::Normal
    };
    // Interactive traffic is premium; the rest is batch (resolved once in a real gateway).
    let class = bulkhead
        .class(if interactive { "premium" } else { "batch" })
        .expect("configured");
    let mut options = AcquireOptions::new().priority(priority).class(class);

    let admitted = if interactive {
        // Interactive traffic never waits: answer 429 at once if there is no room.
        bulkhead.try_acquire(&request, options)
    } else {
        // Batch traffic waits in the queue (the profile's 30 s timeout, or 150 ms for some).
        if rng.bool() {
            options = options.timeout(Duration::from_millis(150));
        }
        bulkhead.acquire(&request, options).await
    };
    let mut permit = match admitted {
        Ok(permit) => permit,
        // A gateway answers 429 (or 503 for shutdown) with `rejection.detail()` as the body.
        Err(AcquireError::Rejected(rejection)) => {
            let detail = rejection.detail();
            let own = detail.admission_class().expect("classes configured");
            if interactive {
                gauges.premium_refused.fetch_add(1, Ordering::Relaxed);
                // Premium keeps its floor: a premium call is refused for want of a slot only
                // when it would borrow (its class already fills its floor).
                if rejection.reason() == RejectReason::ConcurrencyLimit {
                    assert!(
                        own.in_flight >= own.protected_concurrent,
                        "a premium call below its floor was refused: {rejection}"
                    );
                }
            } else if detail.constraint == Some(Constraint::AdmissionClassProtection) {
                gauges.batch_protected_out.fetch_add(1, Ordering::Relaxed);
            }
            return;
        }
        Err(err) => panic!("{err}"), // an invalid request: not in this demo
    };
    if interactive {
        gauges.premium_admitted.fetch_add(1, Ordering::Relaxed);
        if permit.resources().borrowed_concurrency {
            gauges.premium_borrowed.fetch_add(1, Ordering::Relaxed);
        }
    }
    if !interactive {
        gauges.batch_admitted.fetch_add(1, Ordering::Relaxed);
    }
    if priority == Priority::High {
        gauges.high_admitted.fetch_add(1, Ordering::Relaxed);
    }
    if cap.is_none() {
        gauges.uncapped.fetch_add(1, Ordering::Relaxed);
    }
    gauges.enter(bulkhead.stats().pending);

    // The provider takes 30-120 ms to the first chunk, then streams 3-8 chunks 10-40 ms apart.
    // The prompt was 60-105% of its estimate; a capped call writes 5-70% of its cap, an
    // uncapped one 40-400 tokens.
    tokio::time::sleep(Duration::from_millis(rng.u64(30..120))).await;
    let estimated_input = permit.reservation().map_or(0, |r| r.input());
    let input = estimated_input * rng.u64(60..=105) / 100;
    let output = match cap {
        Some(cap) => cap * rng.u64(5..70) / 100,
        None => rng.u64(40..400),
    };
    let chunks = rng.u64(3..=8);
    for chunk in 1..=chunks {
        if chunk > 1 {
            tokio::time::sleep(Duration::from_millis(rng.u64(10..40))).await;
        }
        let written = output * chunk / chunks;
        let usage = TokenUsage::new(input, written).expect("small numbers");
        let report = match cap {
            // The cap is authoritative: hold only what may still come, plus a margin.
            Some(cap) => permit.report_usage_progressive(
                usage,
                Progressive::new(cap - written).safety_margin(SAFETY_MARGIN),
            ),
            // No cap: hold the actual input and the whole output so far.
            None => permit.report_usage(usage),
        };
        report.expect("usage within range");
        gauges.streamed_chunks.fetch_add(1, Ordering::Relaxed);
    }

    gauges.leave();
    // Settles with the last reported usage.
    permit.release(None);
}

#[tokio::main(flavor = "multi_thread", worker_threads = 4)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let bulkhead = LlmBulkhead::builder(MODEL, 16)
        .profile(Profile::Batch)
        .token_budget(
            TokenBudget::new(100_000)
                .high_priority_reserve(15_000)
                .output_cap(100),
        )
        .admission_classes(
            AdmissionClasses::new("batch")
                .class(
                    "premium",
                    ClassLimits::new()
                        .protected_concurrent(PREMIUM_SLOTS)
                        .protected_in_flight_tokens(PREMIUM_TOKENS),
                )
                .class("batch", ClassLimits::new()),
        )
        .build()?;
    let first = bulkhead.limits();
    let budget = first.token_budget.expect("configured");
    println!("async-bulkhead-llm demo: {CALLS} simulated calls to {MODEL}, 4 worker threads");
    println!(
        "limits at revision {}: max_concurrent {}, max_queue {} (batch profile, 30 s timeout), \
         token budget {} (high-priority reserve {})",
        first.revision,
        first.max_concurrent,
        first.max_queue,
        budget.budget,
        budget.high_priority_reserve,
    );
    println!(
        "classes: premium (interactive) keeps {PREMIUM_SLOTS} slots and {PREMIUM_TOKENS} tokens \
         batch may not borrow; batch borrows from the shared pool; a burst of {BURST} batch \
         calls arrives at call {}",
        CALLS / 3
    );

    let gauges = Arc::new(Gauges::default());
    let tally = Arc::new(Tally::default());
    let listener = tally.clone();
    let subscription = bulkhead.on(move |event| listener.on_event(event));
    let started = Instant::now();
    let mut calls = JoinSet::new();
    let mut arrivals = fastrand::Rng::with_seed(7);
    let mut raised = None;
    for i in 0..CALLS {
        calls.spawn(simulated_call(
            bulkhead.clone(),
            gauges.clone(),
            1000 + i as u64,
            false,
        ));
        if i == CALLS / 3 {
            // A batch job floods the gateway: the shared pool fills, the rest is refused at
            // once, and premium keeps its floor.
            for j in 0..BURST {
                calls.spawn(simulated_call(
                    bulkhead.clone(),
                    gauges.clone(),
                    50_000 + j as u64,
                    true,
                ));
            }
        }
        // Bursty arrivals: mostly back to back, sometimes a pause.
        if arrivals.u8(0..3) == 0 {
            tokio::time::sleep(Duration::from_millis(arrivals.u64(2..20))).await;
        }
        if i == CALLS / 2 {
            // The control plane raises concurrency and budget halfway through; waiters are
            // admitted at once.
            let next = Limits::new(1, 32)
                .with_max_queue(20)
                .with_token_budget(160_000, 15_000)
                .with_admission_classes(
                    ClassLimitsTable::new()
                        .with(
                            "premium",
                            ClassLimits::new()
                                .protected_concurrent(PREMIUM_SLOTS + 2)
                                .protected_in_flight_tokens(PREMIUM_TOKENS + 10_000),
                        )
                        .with("batch", ClassLimits::new()),
                );
            raised = Some(bulkhead.apply_limits(next)?.current().clone());
        }
    }
    // Shutdown: refuse new work and whoever still waits, then wait for the calls in flight.
    bulkhead.close();
    let report = bulkhead.drain_timeout(Duration::from_secs(10)).await;
    while calls.join_next().await.is_some() {}
    let elapsed = started.elapsed();
    drop(subscription);

    let stats = bulkhead.stats();
    let tokens = stats.token_budget.expect("budget configured");
    let raised = raised.expect("applied halfway");
    let by = stats.rejected_by_reason;
    let waited = tally.waited.load(Ordering::Relaxed);
    println!(
        "limits at revision {}: max_concurrent {}, token budget {} (applied mid-run)",
        raised.revision,
        raised.max_concurrent,
        raised.token_budget.expect("configured").budget
    );
    println!();
    println!(
        "  calls                {:>9}  in {:.2} s ({} + a burst of {})",
        CALLS + BURST,
        elapsed.as_secs_f64(),
        CALLS,
        BURST
    );
    println!(
        "  admitted             {:>9}  ({} high priority, {} batch)",
        stats.admitted,
        gauges.high_admitted.load(Ordering::Relaxed),
        gauges.batch_admitted.load(Ordering::Relaxed)
    );
    println!(
        "    after queueing     {:>9}  (mean wait {:.1} ms, longest {:.1} ms, peak queue {})",
        waited,
        tally.wait_micros.load(Ordering::Relaxed) as f64 / waited.max(1) as f64 / 1000.0,
        tally.max_wait_micros.load(Ordering::Relaxed) as f64 / 1000.0,
        gauges.max_pending.load(Ordering::Relaxed),
    );
    if waited == 0 {
        println!(
            "                                (with a protected floor, a borrower meets the full \
             shared pool before the bulkhead is full, and class refusals never queue)"
        );
    }
    println!("  rejected             {:>9}", stats.rejected);
    for &reason in RejectReason::ALL {
        if by.get(reason) > 0 {
            println!("    {:<18} {:>9}", reason.as_str(), by.get(reason));
        }
    }
    let classes = stats.admission_classes.clone().expect("classes configured");
    for class in &classes.classes {
        let refused = class.rejected_by_reason;
        println!(
            "  class {:<14} {:>9}  admitted ({} borrowed a slot), {} refused ({} for slots, {} \
             for tokens)",
            class.class.id(),
            class.admitted,
            class.total_borrowed_admissions,
            class.rejected,
            refused.concurrency_limit,
            refused.budget_limit,
        );
    }
    println!(
        "    batch refused by admission_class_protection {:>5}  (the shared pool was full; \
         premium's floor was never lent)",
        gauges.batch_protected_out.load(Ordering::Relaxed)
    );
    println!(
        "    premium admitted   {:>9}  ({} beyond its floor, {} refused, none below its floor)",
        gauges.premium_admitted.load(Ordering::Relaxed),
        gauges.premium_borrowed.load(Ordering::Relaxed),
        gauges.premium_refused.load(Ordering::Relaxed),
    );
    let mut decisions = std::mem::take(&mut *tally.decision_nanos.lock().unwrap());
    decisions.sort_unstable();
    let percentile = |p: usize| {
        decisions
            .get(decisions.len() * p / 100)
            .copied()
            .unwrap_or(0)
    };
    // Measured in situ: between network waits the caches are cold and the admission word was
    // last written by another core, so a decision costs a few cache misses (a hot loop of
    // decisions is ~40 ns each, see benches/README.md).
    println!(
        "  decision time        {:>9}  ns median, {} ns p90 (admit events, waits excluded; \
         cold caches)",
        percentile(50),
        percentile(90)
    );
    println!(
        "  usage reports        {:>9}  (streamed chunks; {} calls had no output cap)",
        gauges.streamed_chunks.load(Ordering::Relaxed),
        gauges.uncapped.load(Ordering::Relaxed)
    );
    println!("  tokens reserved      {:>9}", tokens.total_reserved);
    println!("  tokens consumed      {:>9}", tokens.total_consumed);
    println!(
        "  tokens refunded      {:>9}  (gross: taken off holds; {} held again)",
        tokens.total_refunded, tokens.total_reheld,
    );
    let refunded_early = tally.refunded_early.load(Ordering::Relaxed);
    println!(
        "  freed while streaming{:>9}  (holds lowered by usage reports before release)",
        refunded_early
    );
    println!(
        "  tokens overrun       {:>9}  (held beyond the reservations by uncapped calls)",
        tokens.total_overrun
    );
    println!(
        "  peak in flight       {:>9}  of {} slots (after the raise)",
        gauges.max_slots.load(Ordering::Relaxed),
        raised.max_concurrent
    );
    println!(
        "  peak tokens held     {:>9}  of a {} token budget (after the raise)",
        tally.peak_held.load(Ordering::Relaxed),
        raised.token_budget.expect("configured").budget
    );
    println!(
        "  drain after close    {:>9}  ({} in flight, {} queued when it completed)",
        if report.drained {
            "drained"
        } else {
            "timed out"
        },
        report.in_flight,
        report.pending
    );

    assert!(
        report.drained,
        "every call finished within the drain deadline"
    );
    assert_eq!(
        stats.admitted + stats.rejected,
        (CALLS + BURST) as u64,
        "every call decided once"
    );
    assert!(
        gauges.batch_protected_out.load(Ordering::Relaxed) > 0,
        "the batch burst met premium's protected floor"
    );
    assert!(
        classes
            .classes
            .iter()
            .all(|c| c.in_flight == 0 && c.admitted == c.released),
        "every class settled"
    );
    assert_eq!(
        (stats.in_flight, stats.pending, tokens.in_flight_tokens),
        (0, 0, 0),
        "everything returned"
    );
    assert_eq!(
        tokens.total_reserved + tokens.total_overrun + tokens.total_reheld,
        tokens.total_consumed + tokens.total_refunded + tokens.total_returned_unreported,
        "every reserved, overrun or re-held token was consumed, refunded or returned"
    );
    assert!(
        refunded_early > 0 && tokens.total_overrun > 0,
        "streaming refunds early and uncapped calls overrun"
    );
    assert_eq!(
        tally.held.load(Ordering::Relaxed),
        0,
        "every hold was returned"
    );

    retry_storm().await?;
    shadow_rollout().await?;
    Ok(())
}

/// Requests in the retry storm, and how many of them are different.
const STORM: usize = 400;
const DISTINCT: usize = 8;

/// A burst of identical requests shares one provider call per distinct request.
async fn retry_storm() -> Result<(), Box<dyn std::error::Error>> {
    let bulkhead = LlmBulkhead::builder(MODEL, 16)
        .token_budget(TokenBudget::new(200_000))
        .deduplication(Deduplication::new())
        .build()?;
    let provider_calls = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for i in 0..STORM {
        // Clients retrying the same few prompts (the JSON key order of their bodies differs,
        // which does not matter).
        let n = i % DISTINCT;
        let body = if i % 2 == 0 {
            format!(
                r#"{{"model":"{MODEL}","max_tokens":300,"messages":[{{"role":"user","content":"question {n}"}}]}}"#
            )
        } else {
            format!(
                r#"{{"messages":[{{"content":"question {n}","role":"user"}}],"max_tokens":300,"model":"{MODEL}"}}"#
            )
        };
        let request: LlmRequest = serde_json::from_str(&body)?;
        let provider_calls = Arc::clone(&provider_calls);
        let call = bulkhead.run_shared_with(
            &request,
            AcquireOptions::new(),
            Sharing::<Arc<str>>::cloned()
                .usage(|answer| TokenUsage::new(40, answer.len() as u64).ok()),
            move |_ctx| async move {
                provider_calls.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(80)).await; // the provider thinks
                Ok::<_, Arc<str>>(Arc::from(format!("answer to question {n}")))
            },
        );
        tasks.spawn(async move { (n, call.await) });
    }
    let mut answered = 0;
    while let Some(joined) = tasks.join_next().await {
        let (n, answer) = joined?;
        assert_eq!(
            answer.as_deref().ok(),
            Some(&*format!("answer to question {n}"))
        );
        answered += 1;
    }
    let stats = bulkhead.stats();
    let dedup = stats.deduplication.expect("configured");
    let provider_calls = provider_calls.load(Ordering::Relaxed);
    println!();
    println!(
        "retry storm: {STORM} requests, {DISTINCT} distinct, on a bulkhead with deduplication"
    );
    println!("  answered             {answered:>9}");
    println!("  provider calls       {provider_calls:>9}  (one per distinct request in flight)");
    println!(
        "  shared answers       {:>9}  (followers: no slot, no tokens, no estimate)",
        dedup.hits
    );
    println!(
        "  admitted             {:>9}  (the other {} calls took no slot and no tokens)",
        stats.admitted, dedup.hits
    );
    assert_eq!(answered, STORM);
    assert_eq!(provider_calls, stats.admitted);
    assert_eq!(stats.admitted + dedup.hits, STORM as u64);
    assert!(
        provider_calls < STORM as u64 / 10,
        "most requests shared a call"
    );
    assert_eq!((dedup.active, stats.in_flight), (0, 0));
    Ok(())
}

/// A shadow rollout: limits under test refuse nothing, and report what they would refuse.
async fn shadow_rollout() -> Result<(), Box<dyn std::error::Error>> {
    const SHADOW_CALLS: u64 = 200;
    // The limits being tuned: 4 slots, a queue of 4 with a 20 ms timeout, 6,000 tokens.
    let bulkhead = LlmBulkhead::builder(MODEL, 4)
        .max_queue(4)
        .queue_timeout(Duration::from_millis(20))
        .token_budget(TokenBudget::new(6_000))
        .build()?;
    let shadow = AcquireOptions::new().observe(ShadowReasons::ALL);
    let mut tasks = JoinSet::new();
    for i in 0..SHADOW_CALLS {
        let request = LlmRequest::new()
            .model(MODEL)
            .user("x".repeat(200 + (i as usize * 37) % 4_000))
            .max_tokens(200 + (i * 53) % 1_500);
        let bulkhead = bulkhead.clone();
        tasks.spawn(async move {
            // Arrivals spread over about 100 ms.
            tokio::time::sleep(Duration::from_micros(i * 500)).await;
            bulkhead
                .run(&request, shadow, async move |mut ctx| {
                    tokio::time::sleep(Duration::from_millis(10 + i % 30)).await;
                    let usage = TokenUsage::new(100 + i, 50 + i % 200).expect("small");
                    ctx.report_usage(usage).expect("a valid report");
                    Ok::<_, std::io::Error>(ctx.bypass().is_some())
                })
                .await
        });
    }
    let (mut ran, mut bypassed) = (0u64, 0u64);
    while let Some(joined) = tasks.join_next().await {
        let was_bypassed = joined?.map_err(|e| e.to_string())?;
        ran += 1;
        bypassed += u64::from(was_bypassed);
    }
    let stats = bulkhead.stats();
    let observe = stats.observe.expect("some calls were bypassed");
    let by = observe.bypassed_by_reason;
    println!();
    println!(
        "shadow rollout: {SHADOW_CALLS} calls in observe mode against limits under test \
         (4 slots, queue 4 / 20 ms, 6,000 tokens)"
    );
    println!("  calls that ran       {ran:>9}  (observe mode refuses nothing)");
    println!("  admitted             {:>9}", stats.admitted);
    println!(
        "  would have refused   {:>9}  (budget {}, concurrency {}, queue full {}, queue timeout {}; \
         {} raced past the advisory check)",
        observe.bypassed,
        by.budget_limit,
        by.concurrency_limit,
        by.queue_limit,
        by.timeout,
        observe.race_bypassed
    );
    println!(
        "  shadow usage         {:>9}  calls reported {} input + {} output tokens",
        observe.usage_reported, observe.total_input_tokens, observe.total_output_tokens
    );
    assert_eq!(ran, SHADOW_CALLS);
    assert_eq!(observe.bypassed, bypassed);
    assert_eq!(stats.admitted + observe.bypassed, SHADOW_CALLS);
    assert!(
        observe.bypassed > 0,
        "the limits under test would refuse some calls"
    );
    assert_eq!((stats.in_flight, stats.pending), (0, 0));
    Ok(())
}
