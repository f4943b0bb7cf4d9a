//! Builder configurations, `apply_limits` snapshots, `set_budget` values, admissions and
//! releases, checked against a plain model of the documented rules.
//!
//! - `build()` succeeds exactly when the configuration is valid, else fails with the first error
//!   in the documented order, and starts with the configured limits.
//! - `apply_limits`: a revision above 2^53 - 1 is refused first; a revision not above the
//!   current one is `Stale`; otherwise the snapshot is validated (max_concurrent, token budget
//!   shape, budget size) and, if valid, is exactly what `limits()` returns afterwards.
//! - `set_budget`: typed errors in the documented order, else the next revision with only the
//!   budget changed.
//! - Every error (and every stale snapshot) leaves `limits()` and `stats()` unchanged; applied
//!   revisions strictly increase; every applied change emits one reconfigure event.
//! - `try_acquire` / `would_admit` follow the limits in force: shutdown, then the
//!   priority-adjusted budget, then a free slot; filling up to `max_concurrent` succeeds while
//!   tokens fit and the next call is refused with the right reason and capacity snapshot.
//! - `stats()` agrees with the model after every step.

#![no_main]

use std::sync::{Arc, Mutex};
use std::time::Duration;

use arbitrary::Arbitrary;
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, Limits, LlmBulkhead, LlmRequest, OwnedPermit, Priority, Profile,
    RejectReason, Reservation, Stats, TokenBudget, TokenUsage, admission::Verdict,
    builder::ConfigError, events::Event, events::EventKind, limits::ApplyOutcome,
    limits::LimitsError, limits::MAX_BUDGET, limits::MAX_CONCURRENT, limits::MAX_REVISION,
    request::RequestError,
};
use libfuzzer_sys::fuzz_target;

/// Most permits held at once (a `max_concurrent` near 2^22 is probed, not filled).
const MAX_HELD: usize = 96;
/// Most admissions one `Fill` step makes before giving up on reaching the limit.
const FILL_LIMIT: usize = 48;

/// A `u64` biased toward the values the limits care about.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum U64 {
    Small(u8),
    Near(Anchor, i8),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Anchor {
    Zero,
    Thousand,
    MaxConcurrent,
    U32Max,
    MaxBudget,
    MaxRevision,
    U64Max,
}

impl U64 {
    fn get(self) -> u64 {
        match self {
            U64::Small(n) => u64::from(n),
            U64::Near(anchor, delta) => {
                let base = match anchor {
                    Anchor::Zero => 0,
                    Anchor::Thousand => 1_000,
                    Anchor::MaxConcurrent => u64::from(MAX_CONCURRENT),
                    Anchor::U32Max => u64::from(u32::MAX),
                    Anchor::MaxBudget => MAX_BUDGET,
                    Anchor::MaxRevision => MAX_REVISION,
                    Anchor::U64Max => u64::MAX,
                };
                base.saturating_add_signed(i64::from(delta))
            }
            U64::Raw(n) => n,
        }
    }
}

/// A `u32` count (max_concurrent, max_queue), mostly small.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Count {
    Small(u8),
    Big(U64),
}

impl Count {
    fn get(self) -> u32 {
        match self {
            Count::Small(n) => u32::from(n % 10),
            Count::Big(n) => u32::try_from(n.get()).unwrap_or(u32::MAX),
        }
    }
}

/// A revision relative to the current one.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Revision {
    Next(u8),
    Same,
    Back(u8),
    Absolute(U64),
}

impl Revision {
    fn resolve(self, current: u64) -> u64 {
        match self {
            Revision::Next(d) => current.saturating_add(1 + u64::from(d)),
            Revision::Same => current,
            Revision::Back(d) => current.saturating_sub(u64::from(d)),
            Revision::Absolute(n) => n.get(),
        }
    }
}

#[derive(Arbitrary, Debug, Clone)]
enum Model {
    Named(u8),
    Raw(String),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum ProfileChoice {
    Interactive,
    Batch,
    Custom {
        max_queue: Count,
        timeout_ms: Option<u16>,
    },
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct BudgetConfig {
    budget: U64,
    reserve: Option<U64>,
    output_cap: Option<U64>,
}

/// The token budget of a snapshot.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum BudgetShape {
    /// Present iff the bulkhead has one (the common, valid case).
    Matching(U64, U64),
    Absent,
    Present(U64, U64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Step {
    Apply {
        revision: Revision,
        max_concurrent: Count,
        max_queue: Count,
        budget: BudgetShape,
    },
    SetBudget(U64),
    /// One admission with a reservation override.
    Acquire {
        high: bool,
        input: U64,
        output: U64,
    },
    /// One admission sized by the default estimator (`max_tokens`, no text).
    AcquireEstimated {
        high: bool,
        max_tokens: U64,
    },
    Release {
        index: u8,
        usage: Option<(u16, u16)>,
    },
    ReleaseAll,
    /// Admit calls of `per_call` tokens until one is refused, then release them.
    Fill {
        high: bool,
        per_call: U64,
    },
    Close,
}

#[derive(Arbitrary, Debug)]
struct Input {
    model: Model,
    max_concurrent: Count,
    profile: Option<ProfileChoice>,
    max_queue: Option<Count>,
    queue_timeout_ms: Option<u16>,
    initial_revision: Option<U64>,
    budget: Option<BudgetConfig>,
    steps: Vec<Step>,
}

const MODELS: [&str; 4] = ["gpt-4o", "claude-sonnet-4", "my-model", " padded "];

fuzz_target!(|input: Input| run(input));

fn run(input: Input) {
    let model = match &input.model {
        Model::Named(i) => MODELS[usize::from(*i) % MODELS.len()].to_owned(),
        Model::Raw(s) => s.clone(),
    };
    let max_concurrent = input.max_concurrent.get();
    let mut builder = LlmBulkhead::builder(model.clone(), max_concurrent as usize);
    let profile = input.profile.map(|p| match p {
        ProfileChoice::Interactive => Profile::Interactive,
        ProfileChoice::Batch => Profile::Batch,
        ProfileChoice::Custom {
            max_queue,
            timeout_ms,
        } => Profile::Custom {
            max_queue: max_queue.get(),
            timeout: timeout_ms.map(|ms| Duration::from_millis(u64::from(ms))),
        },
    });
    if let Some(profile) = profile {
        builder = builder.profile(profile);
    }
    let max_queue = input.max_queue.map(Count::get);
    if let Some(q) = max_queue {
        builder = builder.max_queue(q as usize);
    }
    let queue_timeout = input
        .queue_timeout_ms
        .map(|ms| Duration::from_millis(u64::from(ms)));
    if let Some(t) = queue_timeout {
        builder = builder.queue_timeout(t);
    }
    let initial_revision = input.initial_revision.map_or(0, U64::get);
    if input.initial_revision.is_some() {
        builder = builder.initial_revision(initial_revision);
    }
    let budget = input.budget.map(|b| {
        let mut tb = TokenBudget::new(b.budget.get());
        if let Some(r) = b.reserve {
            tb = tb.high_priority_reserve(r.get());
        }
        if let Some(c) = b.output_cap {
            tb = tb.output_cap(c.get());
        }
        tb
    });
    if let Some(tb) = budget {
        builder = builder.token_budget(tb);
    }

    // The documented validation order.
    let expected_error = if model.trim().is_empty() {
        Some(ConfigError::EmptyModel {
            model: model.clone(),
        })
    } else if max_concurrent > MAX_CONCURRENT {
        Some(ConfigError::MaxConcurrentTooLarge {
            value: max_concurrent as usize,
            max: MAX_CONCURRENT as usize,
        })
    } else if initial_revision > MAX_REVISION {
        Some(ConfigError::InitialRevisionTooLarge {
            value: initial_revision,
            max: MAX_REVISION,
        })
    } else if let Some(tb) = budget.filter(|tb| tb.budget > MAX_BUDGET) {
        Some(ConfigError::BudgetTooLarge {
            value: tb.budget,
            max: MAX_BUDGET,
        })
    } else {
        budget
            .filter(|tb| tb.high_priority_reserve > tb.budget)
            .map(|tb| ConfigError::ReserveExceedsBudget {
                reserve: tb.high_priority_reserve,
                budget: tb.budget,
            })
    };
    let profile = profile.unwrap_or_default();
    let bulkhead = match (builder.build(), expected_error) {
        (Ok(b), None) => b,
        (Err(err), Some(expected)) => {
            assert_eq!(err, expected);
            let _ = err.to_string();
            return;
        }
        (got, expected) => panic!("build: got {got:?}, expected error {expected:?}"),
    };
    let mut limits = Limits::new(initial_revision, max_concurrent)
        .with_max_queue(max_queue.unwrap_or(profile.max_queue()));
    if let Some(tb) = budget {
        limits = limits.with_token_budget(tb.budget, tb.high_priority_reserve);
    }
    assert_eq!(bulkhead.limits(), limits, "initial limits");
    assert_eq!(
        bulkhead.queue_timeout(),
        queue_timeout.or(profile.timeout())
    );
    assert_eq!(bulkhead.model(), model);

    let mut harness = Harness::new(bulkhead, limits, budget.map(|b| b.output_cap));
    for step in input.steps.iter().take(64) {
        harness.step(*step);
        harness.check();
    }
    harness.release_all();
    harness.check();
}

struct Harness {
    bulkhead: LlmBulkhead,
    limits: Limits,
    output_cap: Option<u64>,
    closed: bool,
    held: Vec<(OwnedPermit, u64)>,
    admitted: u64,
    released: u64,
    rejected: [u64; 6],
    events: Arc<Mutex<Vec<(Limits, Limits)>>>,
    expected_events: Vec<(Limits, Limits)>,
    _subscription: async_bulkhead_llm::events::Subscription,
}

fn reason_index(reason: RejectReason) -> usize {
    RejectReason::ALL
        .iter()
        .position(|r| *r == reason)
        .expect("every reason is in ALL")
}

impl Harness {
    fn new(bulkhead: LlmBulkhead, limits: Limits, output_cap: Option<u64>) -> Harness {
        let events = Arc::new(Mutex::new(Vec::new()));
        let seen = events.clone();
        let subscription = bulkhead.on_events([EventKind::Reconfigure], move |event| {
            if let Event::Reconfigure(e) = event {
                seen.lock()
                    .unwrap()
                    .push((e.previous.clone(), e.current.clone()));
            } else {
                panic!("subscribed to reconfigure only, got {event:?}");
            }
        });
        Harness {
            bulkhead,
            limits,
            output_cap,
            closed: false,
            held: Vec::new(),
            admitted: 0,
            released: 0,
            rejected: [0; 6],
            events,
            expected_events: Vec::new(),
            _subscription: subscription,
        }
    }

    fn has_budget(&self) -> bool {
        self.limits.token_budget.is_some()
    }

    fn tokens(&self) -> u64 {
        self.held.iter().map(|(_, t)| t).sum()
    }

    fn step(&mut self, step: Step) {
        match step {
            Step::Apply {
                revision,
                max_concurrent,
                max_queue,
                budget,
            } => {
                let mut next =
                    Limits::new(revision.resolve(self.limits.revision), max_concurrent.get())
                        .with_max_queue(max_queue.get());
                match budget {
                    BudgetShape::Matching(b, r) if self.has_budget() => {
                        next = next.with_token_budget(b.get(), r.get());
                    }
                    BudgetShape::Matching(..) | BudgetShape::Absent => {}
                    BudgetShape::Present(b, r) => next = next.with_token_budget(b.get(), r.get()),
                }
                self.apply(next);
            }
            Step::SetBudget(tokens) => self.set_budget(tokens.get()),
            Step::Acquire {
                high,
                input,
                output,
            } => {
                let (input, output) = (input.get(), output.get());
                match Reservation::new(input, output) {
                    Ok(r) => {
                        let options = AcquireOptions::new()
                            .priority(priority(high))
                            .reservation(r);
                        let tokens = if self.has_budget() { r.reserved() } else { 0 };
                        self.acquire(&LlmRequest::new(), options, tokens, Some(r));
                    }
                    Err(err) => {
                        assert_eq!(
                            err,
                            RequestError::ReservationOverflow {
                                input,
                                max_output: output
                            }
                        );
                        assert!(input.checked_add(output).is_none());
                    }
                }
            }
            Step::AcquireEstimated { high, max_tokens } => {
                let request = LlmRequest::new().max_tokens(max_tokens.get());
                let options = AcquireOptions::new().priority(priority(high));
                let reservation = self
                    .output_cap
                    .map(|_| Reservation::new(0, max_tokens.get()).unwrap());
                assert_eq!(self.bulkhead.estimate(&request), Ok(reservation));
                // Without a ceiling the output cap is reserved.
                let uncapped = self.bulkhead.estimate(&LlmRequest::new());
                assert_eq!(
                    uncapped,
                    Ok(self.output_cap.map(|c| Reservation::new(0, c).unwrap()))
                );
                let tokens = reservation.map_or(0, |r| r.reserved());
                self.acquire(&request, options, tokens, reservation);
            }
            Step::Release { index, usage } => {
                if !self.held.is_empty() {
                    let i = usize::from(index) % self.held.len();
                    let (permit, tokens) = self.held.swap_remove(i);
                    let usage = usage.map(|(i, o)| TokenUsage::new(i.into(), o.into()).unwrap());
                    let report = permit.release(usage);
                    assert_eq!(report.held_tokens, tokens);
                    assert_eq!(report.usage, usage);
                    self.released += 1;
                }
            }
            Step::ReleaseAll => self.release_all(),
            Step::Fill { high, per_call } => self.fill(high, per_call.get()),
            Step::Close => {
                let before = self.bulkhead.limits();
                assert_eq!(self.bulkhead.close(), !self.closed, "close() result");
                self.closed = true;
                assert!(self.bulkhead.is_closed());
                assert_eq!(self.bulkhead.limits(), before);
            }
        }
    }

    /// Checks that an error or a stale snapshot changed nothing.
    fn unchanged(&self, before: &Stats, what: &str) {
        assert_eq!(
            self.bulkhead.limits(),
            self.limits,
            "{what}: limits changed"
        );
        assert_eq!(&self.bulkhead.stats(), before, "{what}: stats changed");
        assert_eq!(
            *self.events.lock().unwrap(),
            self.expected_events,
            "{what}: reconfigured"
        );
    }

    fn apply(&mut self, next: Limits) {
        let before = self.bulkhead.stats();
        let current = self.limits.clone();
        let result = self.bulkhead.apply_limits(next.clone());
        let expected: Result<ApplyOutcome, LimitsError> = if next.revision > MAX_REVISION {
            Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            })
        } else if next.revision <= current.revision {
            Ok(ApplyOutcome::Stale {
                current: current.clone(),
            })
        } else if next.max_concurrent > MAX_CONCURRENT {
            Err(LimitsError::MaxConcurrentTooLarge {
                value: next.max_concurrent,
                max: MAX_CONCURRENT,
            })
        } else {
            match (self.has_budget(), next.token_budget) {
                (true, None) => Err(LimitsError::TokenBudgetRequired),
                (false, Some(_)) => Err(LimitsError::TokenBudgetNotConfigured),
                (true, Some(b)) if b.budget > MAX_BUDGET => Err(LimitsError::BudgetTooLarge {
                    value: b.budget,
                    max: MAX_BUDGET,
                }),
                _ => Ok(ApplyOutcome::Applied {
                    previous: current.clone(),
                    current: next.clone(),
                }),
            }
        };
        assert_eq!(result, expected, "apply_limits({next:?}) on {current:?}");
        match result {
            Ok(ApplyOutcome::Applied { .. }) => {
                assert!(
                    next.revision > current.revision,
                    "revision did not increase"
                );
                self.limits = next.clone();
                self.expected_events.push((current, next.clone()));
                assert_eq!(self.bulkhead.limits(), next, "applied snapshot");
            }
            Ok(ApplyOutcome::Stale { .. }) => self.unchanged(&before, "stale apply"),
            Ok(other) => panic!("an outcome the fuzz model does not know: {other:?}"),
            Err(err) => {
                let _ = err.to_string();
                self.unchanged(&before, "refused apply");
            }
        }
    }

    fn set_budget(&mut self, tokens: u64) {
        let before = self.bulkhead.stats();
        let current = self.limits.clone();
        let result = self.bulkhead.set_budget(tokens);
        let expected = match current.token_budget {
            None => Err(LimitsError::TokenBudgetNotConfigured),
            Some(_) if current.revision >= MAX_REVISION => Err(LimitsError::RevisionExhausted {
                current: current.revision,
            }),
            Some(_) if tokens > MAX_BUDGET => Err(LimitsError::BudgetTooLarge {
                value: tokens,
                max: MAX_BUDGET,
            }),
            Some(b) => Ok(Limits::new(current.revision + 1, current.max_concurrent)
                .with_max_queue(current.max_queue)
                .with_token_budget(tokens, b.high_priority_reserve)),
        };
        assert_eq!(result, expected, "set_budget({tokens}) on {current:?}");
        match result {
            Ok(next) => {
                assert!(next.revision > current.revision);
                self.limits = next.clone();
                self.expected_events.push((current, next.clone()));
                assert_eq!(self.bulkhead.limits(), next);
            }
            Err(err) => {
                let _ = err.to_string();
                self.unchanged(&before, "refused set_budget");
            }
        }
    }

    /// What a newcomer asking for `tokens` must hear now (`None`: admitted).
    fn predict(&self, tokens: u64, priority: Priority) -> Option<RejectReason> {
        if self.closed {
            return Some(RejectReason::Shutdown);
        }
        if let Some(b) = self.limits.token_budget {
            let effective = match priority {
                Priority::High => b.budget,
                Priority::Normal => b.budget.saturating_sub(b.high_priority_reserve),
            };
            let total = u128::from(self.tokens()) + u128::from(tokens);
            if total > u128::from(effective) || total > u128::from(MAX_BUDGET) {
                return Some(RejectReason::BudgetLimit);
            }
        }
        if self.held.len() as u64 >= u64::from(self.limits.max_concurrent) {
            return Some(RejectReason::ConcurrencyLimit);
        }
        None
    }

    /// One `try_acquire`, checked against the prediction. Returns whether it was admitted.
    fn acquire(
        &mut self,
        request: &LlmRequest,
        options: AcquireOptions,
        tokens: u64,
        reservation: Option<Reservation>,
    ) -> bool {
        if self.held.len() >= MAX_HELD {
            return false;
        }
        let priority = options.priority;
        let predicted = self.predict(tokens, priority);
        // The advisory check agrees and counts nothing.
        let verdict = self
            .bulkhead
            .would_admit(request, options)
            .expect("valid request");
        let expected_verdict = match predicted {
            None => Verdict::Admit,
            Some(RejectReason::ConcurrencyLimit)
                if self.limits.max_concurrent > 0 && self.limits.max_queue > 0 =>
            {
                Verdict::Queue
            }
            Some(reason) => Verdict::Reject(reason),
        };
        assert_eq!(
            verdict, expected_verdict,
            "would_admit({tokens}, {priority:?})"
        );
        match (self.bulkhead.try_acquire_owned(request, options), predicted) {
            (Ok(permit), None) => {
                assert_eq!(permit.limit_revision(), self.limits.revision);
                assert_eq!(permit.held_tokens(), tokens);
                assert_eq!(permit.priority(), priority);
                let reservation = if self.has_budget() { reservation } else { None };
                assert_eq!(permit.reservation(), reservation);
                self.held.push((permit, tokens));
                self.admitted += 1;
                true
            }
            (Err(AcquireError::Rejected(rejection)), Some(reason)) => {
                assert_eq!(rejection.reason(), reason, "refusal reason");
                let d = rejection.detail();
                assert_eq!(d.limit_revision, self.limits.revision);
                assert_eq!(d.in_flight, self.held.len() as u64);
                assert_eq!(d.max_concurrent, self.limits.max_concurrent);
                assert_eq!(d.max_queue, self.limits.max_queue);
                assert_eq!(d.pending, 0);
                match (d.token_budget, self.limits.token_budget) {
                    (None, None) => {}
                    (Some(t), Some(b)) => {
                        assert_eq!(t.budget, b.budget);
                        assert_eq!(t.in_flight_tokens, self.tokens());
                        assert_eq!(t.requested, tokens);
                    }
                    (got, want) => panic!("detail budget {got:?} vs limits {want:?}"),
                }
                let _ = rejection.to_string();
                self.rejected[reason_index(reason)] += 1;
                false
            }
            (got, predicted) => panic!(
                "try_acquire({tokens}, {priority:?}) under {:?} with {} held ({} tokens, \
                 closed {}): got {got:?}, predicted refusal {predicted:?}",
                self.limits,
                self.held.len(),
                self.tokens(),
                self.closed
            ),
        }
    }

    /// Admits calls of `per_call` tokens until one is refused (or `FILL_LIMIT`), then releases
    /// the ones it admitted.
    fn fill(&mut self, high: bool, per_call: u64) {
        let mark = self.held.len();
        let options = AcquireOptions::new().priority(priority(high));
        let (options, tokens, reservation) = match Reservation::new(0, per_call) {
            Ok(r) if self.has_budget() => (options.reservation(r), per_call, Some(r)),
            _ => (options, 0, None),
        };
        for _ in 0..FILL_LIMIT {
            if !self.acquire(&LlmRequest::new(), options, tokens, reservation) {
                break;
            }
        }
        // Slots fill up to max_concurrent when tokens allow.
        if self.held.len() < MAX_HELD && self.held.len() - mark < FILL_LIMIT && !self.closed {
            let fits_tokens =
                self.predict(tokens, priority(high)) != Some(RejectReason::BudgetLimit);
            if fits_tokens {
                assert_eq!(
                    self.held.len() as u64,
                    u64::from(self.limits.max_concurrent).max(mark as u64),
                    "fill stopped before the concurrency limit"
                );
            }
        }
        while self.held.len() > mark {
            let (permit, _) = self.held.pop().unwrap();
            drop(permit);
            self.released += 1;
        }
    }

    fn release_all(&mut self) {
        for (permit, tokens) in self.held.drain(..) {
            assert_eq!(permit.release(None).held_tokens, tokens);
            self.released += 1;
        }
    }

    /// `limits()` and `stats()` agree with the model.
    fn check(&self) {
        assert_eq!(self.bulkhead.limits(), self.limits);
        let stats = self.bulkhead.stats();
        assert_eq!(stats.limits, self.limits);
        assert_eq!(stats.closed, self.closed);
        assert_eq!(stats.in_flight, self.held.len() as u64);
        assert_eq!(stats.pending, 0);
        assert_eq!(stats.admitted, self.admitted);
        assert_eq!(stats.released, self.released);
        for &reason in RejectReason::ALL {
            assert_eq!(
                stats.rejected_by_reason.get(reason),
                self.rejected[reason_index(reason)],
                "{reason} count"
            );
        }
        assert_eq!(stats.rejected, self.rejected.iter().sum::<u64>());
        match (stats.token_budget, self.limits.token_budget) {
            (None, None) => {}
            (Some(t), Some(b)) => {
                assert_eq!(
                    (t.budget, t.high_priority_reserve),
                    (b.budget, b.high_priority_reserve)
                );
                assert_eq!(t.in_flight_tokens, self.tokens());
                assert_eq!(t.available, b.budget.saturating_sub(self.tokens()));
            }
            (got, want) => panic!("stats budget {got:?} vs limits {want:?}"),
        }
        assert_eq!(*self.events.lock().unwrap(), self.expected_events);
    }
}

fn priority(high: bool) -> Priority {
    if high {
        Priority::High
    } else {
        Priority::Normal
    }
}
