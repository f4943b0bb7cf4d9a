//! The driver: the real crate and the model side by side, on the harness's worker thread.

use std::collections::HashSet;
use std::fmt::Debug;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use async_bulkhead_llm::futures::{Acquire, AcquireOwned, Drain};
use async_bulkhead_llm::rate::{ManualClock, RateStatus, WindowStatus};
use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, OwnedPermit, Permit, RejectReason,
    TokenUsage, admission::Admission, admission::AdmissionId, admission::Verdict,
    classes::AdmissionClass, classes::AdmissionClasses, classes::ClassLimits, events::Subscription,
    futures::DrainReport, limits::ApplyOutcome, request::RequestError, usage::Progressive,
    usage::ReleaseReport, usage::UsageError, usage::UsageReport,
};

use super::convert::{
    View, detail_of, limits_from, limits_of, observe, prepare, reason_of, refused_of, stats_of,
    usage_of, view_of,
};
use super::flights::SharedScript;
use super::harness::{Call, Config, Op};
use super::rate::{CLOCK_START_NS, Status};
use super::runs::LiveRun;
use super::shared::SharedCalls;
use super::state::Model;
use super::values::{
    Ask, CLASS_IDS, Cause, LimitsOutcome, ModelLimits, ModelPermit, ModelVerdict, Observed,
    REASONS, Refused, Settled, Snapshot, Started, UsageSnapshot, WaiterState,
};

/// A live permit of either kind.
enum Live<'b> {
    Borrowed(Permit<'b>),
    Owned(OwnedPermit),
}

impl Live<'_> {
    fn report(
        &mut self,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        match (self, progressive) {
            (Live::Borrowed(p), None) => p.report_usage(usage),
            (Live::Borrowed(p), Some(g)) => p.report_usage_progressive(usage, g),
            (Live::Owned(p), None) => p.report_usage(usage),
            (Live::Owned(p), Some(g)) => p.report_usage_progressive(usage, g),
        }
    }

    fn release(self, usage: Option<TokenUsage>) -> ReleaseReport {
        match self {
            Live::Borrowed(p) => p.release(usage),
            Live::Owned(p) => p.release(usage),
        }
    }

    fn abandon(&mut self) -> bool {
        match self {
            Live::Borrowed(p) => p.abandon_borrowed_concurrency(),
            Live::Owned(p) => p.abandon_borrowed_concurrency(),
        }
    }

    fn admission(&self) -> &Admission {
        match self {
            Live::Borrowed(p) => p,
            Live::Owned(p) => p,
        }
    }
}

/// What the model expects a permit or run context of `permit` to show.
pub(super) fn model_view(id: AdmissionId, permit: &ModelPermit) -> View {
    View {
        id,
        held: permit.held,
        reservation: permit.reservation,
        revision: permit.revision,
        high: permit.high,
        class: permit.class,
        borrowed: permit.borrowed,
        holds_slot: permit.holds_slot,
        usage: permit.reported,
        sequence: permit.sequence,
    }
}

/// A waiting future of either kind.
enum Waiting<'b> {
    Borrowed(Acquire<'b, 'static>),
    Owned(AcquireOwned),
}

impl<'b> Waiting<'b> {
    fn poll(&mut self) -> Poll<Result<Live<'b>, AcquireError>> {
        let mut cx = Context::from_waker(Waker::noop());
        match self {
            Waiting::Borrowed(f) => Pin::new(f).poll(&mut cx).map_ok(Live::Borrowed),
            Waiting::Owned(f) => Pin::new(f).poll(&mut cx).map_ok(Live::Owned),
        }
    }
}

struct LivePermit<'b> {
    real: Live<'b>,
    model: ModelPermit,
    id: AdmissionId,
}

pub(crate) struct Driver<'b> {
    pub(super) bulkhead: &'b LlmBulkhead,
    /// The bulkhead's class handles, in order (empty without classes).
    pub(super) handles: Vec<AdmissionClass>,
    /// Class handles of another bulkhead (design §U6.2: refused before anything is counted).
    pub(super) foreign: Vec<AdmissionClass>,
    pub(crate) model: Model,
    config: Config,
    permits: Vec<LivePermit<'b>>,
    /// Waiting futures with their model keys, in creation order.
    waiters: Vec<(Waiting<'b>, u64)>,
    /// Runs, waiting or running, in creation order.
    pub(super) runs: Vec<LiveRun<'b>>,
    /// Pending drains with the model's idle epoch when they started.
    drains: Vec<(Drain<'b>, u64)>,
    /// `run_shared` callers not finished, and their callbacks.
    pub(super) shared: SharedCalls,
    /// The shadow id of each bypass, in the order they began (the model numbers them so).
    pub(super) shadows: Vec<u128>,
    auto_poll: bool,
    recorded: Arc<Mutex<Vec<Observed>>>,
    subscription: Option<Subscription>,
    pub(super) ids: HashSet<AdmissionId>,
    step: usize,
    /// The operation being checked, for messages.
    op: String,
    /// The rate windows' clock (`RateClock::manual`), moved by `Op::Advance`.
    clock: ManualClock,
}

impl<'b> Driver<'b> {
    pub(crate) fn new(
        bulkhead: &'b LlmBulkhead,
        limits: ModelLimits,
        default_class: Option<usize>,
        config: Config,
        clock: ManualClock,
    ) -> Driver<'b> {
        // The model counts refusals by `reason as usize`, in the crate's order.
        assert_eq!(
            RejectReason::ALL
                .iter()
                .map(|&r| reason_of(r))
                .collect::<Vec<_>>(),
            REASONS
        );
        // The manual clock starts where the crate's docs say (a day past the origin).
        assert_eq!(clock.now(), Duration::from_nanos(CLOCK_START_NS));
        // Another bulkhead's classes: other ids (a handle names an id at a position, so the
        // same ids at the same positions would be the same classes, design §U6.2).
        let foreign = LlmBulkhead::builder("other", 1)
            .admission_classes(CLASS_IDS.iter().fold(
                AdmissionClasses::new(format!("other {}", CLASS_IDS[0])),
                |classes, id| classes.class(format!("other {id}"), ClassLimits::new()),
            ))
            .build()
            .expect("another bulkhead");
        let driver = Driver {
            bulkhead,
            handles: bulkhead.classes().to_vec(),
            foreign: foreign.classes().to_vec(),
            model: Model::new(limits, default_class, config.dedup),
            config,
            permits: Vec::new(),
            waiters: Vec::new(),
            runs: Vec::new(),
            drains: Vec::new(),
            shared: SharedCalls::default(),
            shadows: Vec::new(),
            auto_poll: true,
            recorded: Arc::new(Mutex::new(Vec::new())),
            subscription: None,
            ids: HashSet::new(),
            step: 0,
            op: "building the bulkhead".into(),
            clock,
        };
        driver.check_handles(default_class);
        driver
    }

    /// Panics unless the crate's `real` equals the model's `model`.
    #[track_caller]
    pub(super) fn agree<T: PartialEq + Debug>(&self, what: &str, real: T, model: T) {
        if real != model {
            panic!(
                "the crate and the model disagree on {what}\n  at step {} ({})\n  config: \
                 {:?}\n  crate: {real:?}\n  model: {model:?}",
                self.step, self.op, self.config
            );
        }
    }

    pub(crate) fn apply(&mut self, op: Op) {
        self.step += 1;
        self.op = format!("{op:?}");
        if self.model.windows.is_some()
            && matches!(
                op,
                Op::Run { .. }
                    | Op::RunReport { .. }
                    | Op::RunAbandon { .. }
                    | Op::RunFinish { .. }
                    | Op::DropRun { .. }
                    | Op::Shared { .. }
                    | Op::SharedStep { .. }
                    | Op::DropShared { .. }
                    | Op::PollShared { .. }
            )
        {
            panic!("the model does not cover `run` nor `run_shared` with rate windows: {op:?}");
        }
        match op {
            Op::Advance { by } => {
                // The model's clock moves with the crate's (crate rate.rs `ManualClock`).
                self.clock.advance(by);
                self.model.now_ns += u64::try_from(by.as_nanos()).expect("a short advance");
                if self.model.windows.is_some() {
                    self.model.note("clock advanced");
                }
            }
            Op::TryAcquire { owned, call } => self.try_acquire(owned, &call),
            Op::Acquire {
                owned,
                timeout,
                call,
            } => self.acquire(owned, timeout, &call),
            Op::WouldAdmit { with_detail, call } => self.would_admit(with_detail, &call),
            Op::Estimate { call } => self.estimate(&call),
            Op::ReportUsage {
                permit,
                input,
                output,
            } => self.report(permit, (input, output), None),
            Op::ReportProgressive {
                permit,
                input,
                output,
                remaining,
                margin,
            } => self.report(permit, (input, output), Some((remaining, margin))),
            Op::Release {
                permit,
                with_usage,
                input,
                output,
            } => self.release(permit, with_usage.then_some((input, output))),
            Op::DropPermit { permit } => {
                if !self.permits.is_empty() {
                    let at = permit as usize % self.permits.len();
                    let LivePermit { real, model, .. } = self.permits.remove(at);
                    drop(real);
                    // A drop settles with the last reported usage (design §D3, `Drop`).
                    self.model.settle(model, None);
                }
            }
            Op::Abandon { permit } => {
                if !self.permits.is_empty() {
                    let at = permit as usize % self.permits.len();
                    let real = self.permits[at].real.abandon();
                    let mut model = self.permits[at].model;
                    let expected = self.model.abandon(&mut model, Cause::Manual);
                    self.permits[at].model = model;
                    self.agree("abandon_borrowed_concurrency", real, expected);
                }
            }
            Op::CancelWaiter { waiter } => {
                if !self.waiters.is_empty() {
                    let at = waiter as usize % self.waiters.len();
                    let (future, key) = self.waiters.remove(at);
                    drop(future);
                    self.model.cancel_waiter(key);
                }
            }
            Op::PollWaiter { waiter } => {
                if !self.waiters.is_empty() {
                    self.poll_waiter(waiter as usize % self.waiters.len());
                }
            }
            Op::AutoPoll { on } => self.auto_poll = on,
            Op::ApplyLimits {
                revision_delta,
                max_concurrent,
                max_queue,
                flip_budget,
                budget,
                reserve,
                class_shape,
                class_order,
                classes,
            } => {
                let revision = (i128::from(self.model.limits.revision) + i128::from(revision_delta))
                    .clamp(0, i128::from(u64::MAX)) as u64;
                let next = Snapshot {
                    revision,
                    max_concurrent,
                    max_queue,
                    budget: (self.model.has_budget != flip_budget).then_some((budget, reserve)),
                    classes: self.class_part(class_shape, class_order, &classes),
                    // The rate windows in force are kept.
                    rate: self.model.limits.rate,
                };
                self.apply_snapshot(&next);
            }
            Op::ApplyRate {
                revision_delta,
                rate,
            } => {
                // The limits in force with other rate limits (or none).
                let limits = self.model.limits;
                let next = Snapshot {
                    revision: (i128::from(limits.revision) + i128::from(revision_delta))
                        .clamp(0, i128::from(u64::MAX)) as u64,
                    max_concurrent: limits.max_concurrent,
                    max_queue: limits.max_queue,
                    budget: limits.budget,
                    classes: self.class_part(0, 0, &Default::default()),
                    rate,
                };
                // Units charged and not yet drained, in either window.
                let charged = self.model.windows.is_some_and(|w| {
                    let (requests, tokens) = w.status(self.model.now_ns);
                    [requests, tokens]
                        .into_iter()
                        .flatten()
                        .any(|s| s.remaining < s.limit)
                });
                self.apply_snapshot(&next);
                if self.model.limits.rate != limits.rate {
                    self.model.note("rate limits changed");
                    if charged {
                        self.model.note("rate limits changed with units charged");
                    }
                }
            }
            Op::SetBudget { tokens } => {
                let real = self.bulkhead.set_budget(tokens).map(|l| limits_of(&l));
                let model = self.model.set_budget(tokens);
                self.agree("set_budget", real, model);
            }
            Op::Close => {
                let real = self.bulkhead.close();
                let model = self.model.close();
                self.agree("close", real, model);
                self.agree("is_closed", self.bulkhead.is_closed(), true);
            }
            Op::Drain { zero_timeout } => self.drain(zero_timeout),
            Op::Listen { on } => {
                if on && self.subscription.is_none() {
                    let sink = Arc::clone(&self.recorded);
                    let handles = self.handles.clone();
                    self.subscription = Some(self.bulkhead.on(move |event| {
                        sink.lock()
                            .expect("the recorder")
                            .push(observe(event, &handles));
                    }));
                } else if !on {
                    self.subscription = None;
                }
                self.model.listening = on;
            }
            Op::Run {
                call,
                timeout,
                deadline,
                report_first,
                abandon_first,
                finish_first,
                observe,
            } => self.run(
                &call,
                timeout,
                deadline,
                (report_first, abandon_first, finish_first),
                observe,
            ),
            Op::RunReport {
                run,
                input,
                output,
                progressive,
            } => self.run_report(run, (input, output), progressive),
            Op::RunAbandon { run } => self.run_abandon(run),
            Op::RunFinish { run, ok, usage } => self.run_finish(run, ok, usage),
            Op::DropRun { run } => self.drop_run(run),
            Op::Shared {
                call,
                scope,
                no_dedup,
                timeout,
                observe,
                report_first,
                finish_first,
                extract,
            } => self.shared(
                &call,
                scope,
                no_dedup,
                timeout,
                observe,
                SharedScript {
                    report_first,
                    finish_first,
                    extract,
                },
            ),
            Op::SharedStep { flight, via, step } => self.shared_step(flight, via, step),
            Op::DropShared { caller } => self.drop_shared(caller),
            Op::PollShared { caller } => self.poll_one_shared(caller),
        }
        self.check_all();
        if self.auto_poll {
            self.poll_all();
            self.check_all();
        }
    }

    /// `apply_limits(next)` on the crate and the model.
    fn apply_snapshot(&mut self, next: &Snapshot) {
        let real = self
            .bulkhead
            .apply_limits(limits_from(next))
            .map(|outcome| match outcome {
                ApplyOutcome::Applied { previous, current } => LimitsOutcome::Applied {
                    previous: limits_of(&previous),
                    current: limits_of(&current),
                },
                ApplyOutcome::Stale { current } => LimitsOutcome::Stale {
                    current: limits_of(&current),
                },
                other => panic!("an outcome the model does not know: {other:?}"),
            });
        let model = self.model.apply_limits(next);
        self.agree("apply_limits", real, model);
    }

    /// A permit the crate granted, checked against the model's, and kept.
    fn keep(&mut self, real: Live<'b>, model: ModelPermit) {
        let id = real.admission().admission_id();
        let new = self.ids.insert(id);
        self.agree("whether the admission id is new", new, true);
        self.permits.push(LivePermit { real, model, id });
    }

    /// The call's request and options, and the model's resolution of it; `None` when the
    /// explicit reservation cannot even be built (checked against the model).
    pub(super) fn resolve(
        &mut self,
        call: &Call,
    ) -> Option<(LlmRequest, AcquireOptions, Result<Ask, RequestError>)> {
        let (named, handle) = self.named(call);
        match prepare(call, handle) {
            Ok((request, options)) => Some((request, options, self.model.resolve(call, named))),
            Err(error) => {
                let expected = RequestError::ReservationOverflow {
                    input: call.input,
                    max_output: call.max_output,
                };
                self.agree("building the explicit reservation", error, expected);
                self.model.note("invalid explicit reservation");
                None
            }
        }
    }

    fn try_acquire(&mut self, owned: bool, call: &Call) {
        let Some((request, options, ask)) = self.resolve(call) else {
            return;
        };
        let real = if owned {
            self.bulkhead
                .try_acquire_owned(&request, options)
                .map(Live::Owned)
        } else {
            self.bulkhead
                .try_acquire(&request, options)
                .map(Live::Borrowed)
        };
        let model = ask.map(|ask| self.model.try_acquire(ask));
        self.outcome("try_acquire", real, model);
    }

    /// Checks a finished acquire against the model's outcome, keeping the permit.
    fn outcome(
        &mut self,
        what: &str,
        real: Result<Live<'b>, AcquireError>,
        model: Result<Result<ModelPermit, Refused>, RequestError>,
    ) {
        match (real, model) {
            (Ok(permit), Ok(Ok(expected))) => {
                let view = view_of(permit.admission(), &self.handles);
                self.agree(what, view, model_view(view.id, &expected));
                self.keep(permit, expected);
            }
            (Err(AcquireError::Rejected(rejection)), Ok(Err(expected))) => {
                self.agree(what, refused_of(&rejection, &self.handles), expected);
            }
            (Err(AcquireError::Invalid(error)), Err(expected)) => {
                self.note_invalid(&error);
                self.agree(what, error, expected);
            }
            (real, model) => {
                let real = real.map(|p| view_of(p.admission(), &self.handles));
                self.agree(what, format!("{real:?}"), format!("{model:?}"));
            }
        }
    }

    pub(super) fn note_invalid(&mut self, error: &RequestError) {
        self.model.note("invalid request");
        match error {
            RequestError::ForeignClass { .. } => self.model.note("invalid request: foreign class"),
            RequestError::ClassesNotConfigured { .. } => {
                self.model.note("invalid request: classes not configured")
            }
            _ => {}
        }
    }

    fn acquire(&mut self, owned: bool, timeout: u8, call: &Call) {
        let Some((request, mut options, ask)) = self.resolve(call) else {
            return;
        };
        let zero_timeout = timeout % 4 == 1;
        if zero_timeout {
            options = options.timeout(Duration::ZERO);
        } else if timeout % 4 == 2 {
            options = options.timeout(Duration::from_secs(3600));
        }
        let mut future = if owned {
            Waiting::Owned(self.bulkhead.acquire_owned(&request, options))
        } else {
            // The borrowed future holds its request until its first poll (below), and the
            // driver keeps it for later polls: the request must outlive the future. A few
            // hundred bytes per waiting acquire of a test run, leaked on purpose.
            let request: &'static LlmRequest = Box::leak(Box::new(request));
            Waiting::Borrowed(self.bulkhead.acquire(request, options))
        };
        let real = future.poll();
        let model = ask.map(|ask| self.model.acquire(ask, zero_timeout));
        match (real, model) {
            (Poll::Pending, Ok(Started::Queued(key))) => self.waiters.push((future, key)),
            (Poll::Ready(real), Ok(Started::Admitted(permit))) => {
                self.outcome("acquire", real, Ok(Ok(permit)));
            }
            (Poll::Ready(real), Ok(Started::Refused(refused))) => {
                self.outcome("acquire", real, Ok(Err(refused)));
            }
            (Poll::Ready(real), Err(error)) => self.outcome("acquire", real, Err(error)),
            (real, model) => {
                let real = real.map(|r| r.map(|p| view_of(p.admission(), &self.handles)));
                let model = model.map(|started| match started {
                    Started::Admitted(p) => format!("admitted {p:?}"),
                    Started::Refused(r) => format!("refused {r:?}"),
                    Started::Queued(key) => format!("queued as waiter {key}"),
                });
                self.agree("acquire", format!("{real:?}"), format!("{model:?}"));
            }
        }
    }

    fn poll_waiter(&mut self, at: usize) {
        let key = self.waiters[at].1;
        let real = self.waiters[at].0.poll();
        let model = self.model.poll_waiter(key);
        match (real, model) {
            (Poll::Pending, Poll::Pending) => {}
            (Poll::Ready(real), Poll::Ready(model)) => {
                self.waiters.remove(at);
                self.outcome("a waiter's poll", real, Ok(model));
            }
            (real, model) => {
                let real = real.map(|r| r.map(|p| view_of(p.admission(), &self.handles)));
                self.agree("a waiter's poll", format!("{real:?}"), format!("{model:?}"));
            }
        }
    }

    fn would_admit(&mut self, with_detail: bool, call: &Call) {
        let Some((request, options, ask)) = self.resolve(call) else {
            return;
        };
        let verdict_of = |verdict: Verdict| match verdict {
            Verdict::Admit => ModelVerdict::Admit,
            Verdict::Queue => ModelVerdict::Queue,
            Verdict::Reject(reason) => ModelVerdict::Reject(reason_of(reason)),
            other => panic!("a verdict the model does not know: {other:?}"),
        };
        let model = ask.map(|ask| self.model.would_admit(ask));
        if with_detail {
            let real = self
                .bulkhead
                .would_admit_with_detail(&request, options)
                .map(|(verdict, detail)| (verdict_of(verdict), detail_of(&detail, &self.handles)));
            self.agree("would_admit_with_detail", real, model);
        } else {
            let real = self.bulkhead.would_admit(&request, options).map(verdict_of);
            self.agree("would_admit", real, model.map(|(verdict, _)| verdict));
        }
    }

    fn estimate(&mut self, call: &Call) {
        let request = match prepare(
            &Call {
                explicit: false,
                ..call.clone()
            },
            None,
        ) {
            Ok((request, _)) => request,
            Err(_) => unreachable!("only an explicit reservation can fail to build"),
        };
        let real = self
            .bulkhead
            .estimate(&request)
            .map(|r| r.map(|r| (r.input(), r.max_output())));
        // Design §U3.7: `None` without a budget; never reflects an override.
        let model = if self.model.has_budget {
            Model::estimate(call).map(Some)
        } else {
            Ok(None)
        };
        self.agree("estimate", real, model);
    }

    fn report(&mut self, permit: u32, usage: (u64, u64), progressive: Option<(u64, u64)>) {
        if self.permits.is_empty() {
            return;
        }
        let at = permit as usize % self.permits.len();
        let token_usage = match TokenUsage::new(usage.0, usage.1) {
            Ok(u) => u,
            Err(error) => {
                let expected = UsageError::TotalOverflow {
                    input: usage.0,
                    output: usage.1,
                };
                self.agree("building the usage", error, expected);
                return;
            }
        };
        let progress = progressive
            .map(|(remaining, margin)| Progressive::new(remaining).safety_margin(margin));
        let live = &mut self.permits[at];
        let real = live.real.report(token_usage, progress);
        let id = live.id;
        let mut model_permit = live.model;
        let model = self.model.report(&mut model_permit, usage, progressive);
        self.permits[at].model = model_permit;
        self.agree_report(real, id, model);
    }

    /// Checks a usage report's answer.
    pub(super) fn agree_report(
        &self,
        real: Result<UsageReport, UsageError>,
        id: AdmissionId,
        model: Result<UsageSnapshot, UsageError>,
    ) {
        let real = real.map(|r| {
            self.agree(
                "a usage report's ids",
                (r.admission_id, r.shadow_id),
                (id, None),
            );
            UsageSnapshot {
                limit_revision: r.limit_revision,
                sequence: r.sequence,
                reserved: r.reserved,
                held: r.held,
                consumed: r.consumed,
                output_cap: r.output_cap,
                output_remaining: r.output_remaining,
                over_reservation: r.over_reservation,
            }
        });
        self.agree("a usage report", real, model);
    }

    fn release(&mut self, permit: u32, usage: Option<(u64, u64)>) {
        if self.permits.is_empty() {
            return;
        }
        let at = permit as usize % self.permits.len();
        let token_usage = match usage.map(|(input, output)| TokenUsage::new(input, output)) {
            None => None,
            Some(Ok(u)) => Some(u),
            Some(Err(error)) => {
                let (input, output) = usage.expect("usage");
                self.agree(
                    "building the usage",
                    error,
                    UsageError::TotalOverflow { input, output },
                );
                return;
            }
        };
        let LivePermit { real, model, .. } = self.permits.remove(at);
        let real = real.release(token_usage);
        let model = self.model.settle(model, usage);
        let real = Settled {
            held_tokens: real.held_tokens,
            refunded_tokens: real.refunded_tokens,
            overrun_tokens: real.overrun_tokens,
            returned_tokens: real.returned_tokens,
            returned_total_tokens: real.returned_total_tokens,
            usage: usage_of(real.usage),
        };
        self.agree("a release report", real, model);
    }

    fn drain(&mut self, zero_timeout: bool) {
        let mut cx = Context::from_waker(Waker::noop());
        if zero_timeout {
            let mut future = self.bulkhead.drain_timeout(Duration::ZERO);
            let real = match Pin::new(&mut future).poll(&mut cx) {
                Poll::Ready(DrainReport {
                    drained,
                    in_flight,
                    pending,
                    ..
                }) => Some((drained, in_flight, pending)),
                Poll::Pending => None,
            };
            self.agree("drain_timeout(0)", real, Some(self.model.drain_now()));
        } else {
            let mut future = self.bulkhead.drain();
            let epoch = self.model.idle_epoch;
            let ready = Pin::new(&mut future).poll(&mut cx).is_ready();
            self.agree("a new drain's readiness", ready, self.model.is_idle());
            if !ready {
                self.drains.push((future, epoch));
            }
        }
    }

    /// Polls every waiter and every pending drain, in creation order.
    fn poll_all(&mut self) {
        let keys: Vec<u64> = self.waiters.iter().map(|(_, key)| *key).collect();
        for key in keys {
            let at = self
                .waiters
                .iter()
                .position(|(_, k)| *k == key)
                .expect("still waiting");
            self.poll_waiter(at);
        }
        self.poll_runs();
        self.poll_all_shared();
        let mut cx = Context::from_waker(Waker::noop());
        let mut at = 0;
        while at < self.drains.len() {
            let (future, epoch) = &mut self.drains[at];
            let epoch = *epoch;
            let ready = Pin::new(future).poll(&mut cx).is_ready();
            self.agree(
                "a pending drain's readiness",
                ready,
                self.model.drain_done(epoch),
            );
            if ready {
                self.model.note("pending drain completed");
                drop(self.drains.remove(at));
            } else {
                at += 1;
            }
        }
    }

    /// The token identity of the real stats, globally and per class: the tokens in flight,
    /// less those of waiters handed a slot they have not picked up (their reservations are
    /// counted at pick-up), are `reserved + overrun + reheld - refunded - consumed -
    /// returned_unreported` (crate stats.rs `TokenBudgetStats`), after every operation.
    fn check_token_identity(&mut self, stats: &async_bulkhead_llm::Stats) {
        let mut handed = vec![0u128; self.model.classes.len()];
        let mut handed_total = 0u128;
        for waiter in &self.model.waiters {
            if let WaiterState::Handed { .. } = waiter.state {
                let r = u128::from(waiter.ask.reserved());
                handed_total += r;
                if let Some(class) = waiter.ask.class {
                    handed[class] += r;
                }
            }
        }
        let balance = |totals: [u64; 6]| {
            let [reserved, overrun, reheld, refunded, consumed, returned] = totals.map(i128::from);
            (!totals.contains(&u64::MAX))
                .then_some(reserved + overrun + reheld - refunded - consumed - returned)
        };
        let Some(t) = stats.token_budget else {
            return;
        };
        if let Some(balance) = balance([
            t.total_reserved,
            t.total_overrun,
            t.total_reheld,
            t.total_refunded,
            t.total_consumed,
            t.total_returned_unreported,
        ]) {
            self.agree(
                "in_flight_tokens == reserved + overrun + reheld - refunded - consumed - returned",
                i128::from(t.in_flight_tokens) - handed_total as i128,
                balance,
            );
            self.model.note("token identity checked at a step");
        }
        for (at, class) in stats
            .admission_classes
            .iter()
            .flat_map(|c| &c.classes)
            .enumerate()
        {
            if let Some(balance) = balance([
                class.total_reserved,
                class.total_overrun,
                class.total_reheld,
                class.total_refunded,
                class.total_consumed,
                class.total_returned_unreported,
            ]) {
                self.agree(
                    "a class's in_flight_tokens == its reserved + overrun + reheld - refunded - consumed - returned",
                    i128::from(class.in_flight_tokens) - handed[at] as i128,
                    balance,
                );
                self.model.note("class token identity checked at a step");
            }
        }
    }

    /// Stats (and the token identity), events and every live permit.
    pub(crate) fn check_all(&mut self) {
        let stats = self.bulkhead.stats();
        self.check_token_identity(&stats);
        self.agree(
            "stats()",
            stats_of(&stats, &self.handles),
            self.model.stats(),
        );
        self.agree(
            "limits()",
            limits_of(&self.bulkhead.limits()),
            self.model.limits,
        );
        self.check_rate_status();
        let mut events = std::mem::take(&mut *self.recorded.lock().expect("the recorder"));
        for event in &mut events {
            if let Observed::Bypass { shadow, .. }
            | Observed::BypassUsage { shadow, .. }
            | Observed::BypassRelease { shadow, .. } = event
            {
                // Numbered in the order the bypasses began, as the model numbers them.
                *shadow = self
                    .shadows
                    .iter()
                    .position(|known| known == shadow)
                    .map_or(u128::MAX, |n| n as u128);
            }
        }
        let expected = std::mem::take(&mut self.model.events);
        self.agree("the events", events, expected);
        for p in &self.permits {
            self.agree(
                "a live permit's accessors",
                view_of(p.real.admission(), &self.handles),
                model_view(p.id, &p.model),
            );
        }
        self.check_runs();
        self.check_shared();
    }

    /// `rate_status()` field by field against the model's windows (crate rate.rs
    /// `Words::status`: remaining = limit - min(limit, tat - now) in ticks, reset = when tick
    /// `tat` starts, from now); `None` without windows.
    fn check_rate_status(&mut self) {
        let figures = |status: Option<RateStatus>| {
            status.map(|status| {
                let window = |w: Option<WindowStatus>| {
                    w.map(|w| Status {
                        limit: w.limit,
                        remaining: w.remaining,
                        reset_ns: u64::try_from(w.reset.as_nanos()).expect("a short reset"),
                    })
                };
                (window(status.requests), window(status.tokens))
            })
        };
        let now_ns = self.model.now_ns;
        let model = self.model.windows.and_then(|w| w.report(now_ns));
        self.note_spent(model, "");
        self.agree("rate_status()", figures(self.bulkhead.rate_status()), model);
        // Each class's pair (crate `class_rate_status`: none without windows of its own).
        for (i, handle) in self.handles.clone().into_iter().enumerate() {
            let model = self
                .model
                .class_windows
                .get(i)
                .and_then(|w| w.report(now_ns));
            self.note_spent(model, "class ");
            self.agree(
                "class_rate_status()",
                figures(self.bulkhead.class_rate_status(handle)),
                model,
            );
        }
    }

    /// Notes a window partly or wholly spent.
    fn note_spent(&mut self, windows: Option<(Option<Status>, Option<Status>)>, class: &str) {
        let Some((requests, tokens)) = windows else {
            return;
        };
        let [requests, tokens] = [requests, tokens].map(|s| s.map(|s| (s.remaining, s.limit)));
        let any = |test: fn(u64, u64) -> bool| {
            requests.is_some_and(|(r, l)| test(r, l)) || tokens.is_some_and(|(r, l)| test(r, l))
        };
        if any(|remaining, limit| remaining < limit) {
            self.model.note(if class.is_empty() {
                "rate window partly spent"
            } else {
                "class rate window partly spent"
            });
        }
        if any(|remaining, _| remaining == 0) {
            self.model.note(if class.is_empty() {
                "rate window spent"
            } else {
                "class rate window spent"
            });
        }
    }

    /// Cancels every waiter, drops every permit (oldest first), and checks the end
    /// invariants (design §U4.5, §U15).
    pub(crate) fn finish(&mut self) {
        self.op = "finish".into();
        self.step += 1;
        while !self.waiters.is_empty() {
            let (future, key) = self.waiters.remove(0);
            drop(future);
            self.model.cancel_waiter(key);
            self.check_all();
        }
        while !self.runs.is_empty() {
            self.drop_run(0);
            self.check_all();
        }
        while !self.shared.is_empty() {
            self.drop_oldest_shared();
            self.check_all();
        }
        while !self.permits.is_empty() {
            let LivePermit { real, model, .. } = self.permits.remove(0);
            drop(real);
            self.model.settle(model, None);
            self.check_all();
        }
        // Q5: every pending drain completes once the bulkhead is idle.
        self.poll_all();
        self.agree("drains left pending when idle", self.drains.len(), 0);
        let mut cx = Context::from_waker(Waker::noop());
        let drained = Pin::new(&mut self.bulkhead.drain())
            .poll(&mut cx)
            .is_ready();
        self.agree("an idle bulkhead's drain", drained, true);
        self.check_all();

        let stats = self.bulkhead.stats();
        self.agree("the slots in flight at the end", stats.in_flight, 0);
        self.agree(
            "the abandoned admissions at the end",
            stats.abandoned_in_flight,
            0,
        );
        self.agree("the calls waiting at the end", stats.pending, 0);
        self.agree(
            "the shared calls in flight at the end",
            stats.deduplication.map(|d| d.active),
            self.model.flights.kind.map(|_| 0),
        );
        self.agree(
            "admitted == released at the end",
            stats.admitted,
            stats.released,
        );
        for class in stats.admission_classes.iter().flat_map(|c| &c.classes) {
            self.agree("a class's slots at the end", class.in_flight, 0);
            self.agree("a class's tokens at the end", class.in_flight_tokens, 0);
            self.agree(
                "a class's admitted == released at the end",
                class.admitted,
                class.released,
            );
            let saturated = [
                class.total_reserved,
                class.total_consumed,
                class.total_refunded,
                class.total_overrun,
                class.total_reheld,
            ]
            .contains(&u64::MAX);
            if self.model.all_settled_with_usage && stats.token_budget.is_some() && !saturated {
                self.agree(
                    "a class's reserved + overrun + reheld == consumed + refunded",
                    u128::from(class.total_reserved)
                        + u128::from(class.total_overrun)
                        + u128::from(class.total_reheld),
                    u128::from(class.total_consumed) + u128::from(class.total_refunded),
                );
                self.agree(
                    "a class's returned unreported when all settled with usage",
                    class.total_returned_unreported,
                    0,
                );
                self.model.note("class token identity checked");
            }
        }
        if let Some(t) = stats.token_budget {
            self.agree("the tokens in flight at the end", t.in_flight_tokens, 0);
            let saturated = [
                t.total_reserved,
                t.total_consumed,
                t.total_refunded,
                t.total_overrun,
                t.total_reheld,
            ]
            .contains(&u64::MAX);
            if self.model.all_settled_with_usage && !saturated {
                self.agree(
                    "reserved + overrun + reheld == consumed + refunded",
                    u128::from(t.total_reserved)
                        + u128::from(t.total_overrun)
                        + u128::from(t.total_reheld),
                    u128::from(t.total_consumed) + u128::from(t.total_refunded),
                );
                self.agree(
                    "returned unreported when all settled with usage",
                    t.total_returned_unreported,
                    0,
                );
                self.model.note("token identity checked");
            }
        }
    }
}
