//! [`LlmCore`]: the engine paired with what makes it an LLM bulkhead: the model it guards, the
//! estimator that sizes reservations, and the event listeners. Every admission of the LLM
//! bulkhead goes through [`LlmCore::admit`], which resolves nothing itself (see
//! [`LlmCore::resolve`]), asks the engine, builds the [`Admission`](crate::admission::Admission) and announces the outcome.

use core::ops::Deref;
use std::time::{Duration, Instant};

use crate::engine::timer::Bound;
use crate::engine::{Ask, Decision, Engine, Grant, Wait, WaiterHandle};
use crate::events::{
    AdmitEvent, BorrowedConcurrencyAbandonEvent, DECISION_KINDS, Event, EventKind, Listeners,
    ReconfigureEvent, RejectEvent, SAMPLED_CALL_KINDS, SAMPLED_DECISION_KINDS, Timing,
};
use crate::support::sync::{Arc, unmodeled};
use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass};
use crate::vocabulary::error::{AcquireError, RequestError};
use crate::vocabulary::limits::Limits;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::Rejection;
use crate::vocabulary::reservation::Reservation;

use super::admission::{Admission, Ledger};
use super::dedup::{Dedup, Deduplication};
use super::estimate::{Estimator, Memo};
use super::observe::ObserveCounters;
use super::options::AcquireOptions;
use super::request::LlmRequest;

/// The shared state behind every clone of an [`LlmBulkhead`](crate::LlmBulkhead) and every
/// permit.
pub(crate) struct LlmCore {
    engine: Engine,
    /// Event listeners; shared with the subscriptions (which hold it weakly).
    listeners: unmodeled::Arc<Listeners>,
    /// Sizes calls that bring no reservation of their own (with a token budget only).
    estimator: unmodeled::Arc<dyn Estimator>,
    /// Panics of `estimator.observe`, caught and counted (see `crate::support::contain`).
    estimator_panics: unmodeled::AtomicU64,
    model: Box<str>,
    /// Its name and its tenant's, for tracing (empty when not given).
    name: Box<str>,
    tenant: Box<str>,
    /// Queue timeout of calls that set none.
    default_timeout: Option<Duration>,
    /// In-flight deduplication of `run_shared` (when configured).
    dedup: Option<Arc<Dedup>>,
    /// Observe-mode bypasses.
    observe: ObserveCounters,
}

/// What a call asks for, resolved once: its tokens, priority and class, the reservation behind
/// its tokens and the estimator's memo (when the bulkhead's estimator sized it). Compact (56
/// bytes): it waits in every acquire future that was not polled yet.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    reserved: u64,
    class: Option<AdmissionClass>,
    /// The reservation (meaningful with a token budget; zero without).
    reservation: Reservation,
    /// The estimator's memo (meaningful when `sized` is set).
    memo: Memo,
    priority: Priority,
    /// Whether the call has a reservation (a token budget), and whether the estimator sized it.
    budgeted: bool,
    sized: bool,
}

impl Call {
    /// A call of `reservation` (none without a token budget), sized by the estimator (`memo`)
    /// or given by the caller.
    #[inline]
    pub(crate) fn new(
        priority: Priority,
        class: Option<AdmissionClass>,
        reservation: Option<Reservation>,
        memo: Option<Memo>,
    ) -> Call {
        Call {
            reserved: reservation.map_or(0, |r| r.reserved()),
            class,
            reservation: reservation.unwrap_or(Reservation::ZERO),
            memo: memo.unwrap_or(Memo::EMPTY),
            priority,
            budgeted: reservation.is_some(),
            sized: memo.is_some(),
        }
    }

    /// What the call asks of the engine.
    #[inline]
    pub(crate) fn ask(&self) -> Ask {
        Ask {
            reserved: self.reserved,
            priority: self.priority,
            class: self.class,
        }
    }

    /// Its admission class (with classes).
    #[inline]
    pub(crate) fn class(&self) -> Option<AdmissionClass> {
        self.class
    }

    /// The reservation behind the call's tokens (none without a token budget).
    #[inline]
    pub(crate) fn reservation(&self) -> Option<Reservation> {
        self.budgeted.then_some(self.reservation)
    }

    /// The record of this call, admitted by `grant`, sampled if its `timing` says so (see
    /// `crate::events`: sampled listeners hear its later events too).
    #[inline]
    pub(crate) fn admission(&self, grant: Grant, timing: Option<Timing>) -> Admission {
        let ledger = Ledger::new(
            self.budgeted.then_some(self.reservation),
            self.sized.then_some(self.memo),
        );
        let mut admission = Admission::new(grant, ledger);
        if let Some(timing) = timing
            && timing.sampled
        {
            admission.mark_sampled();
        }
        admission
    }
}

/// What a fast-lane call asks (without its class) and the ledger its admission starts with:
/// its options' reservation with a token budget (`Err` without one: the estimator is the
/// general path's), nothing without a budget.
#[inline(always)]
pub(crate) fn fast_ask(has_budget: bool, options: &AcquireOptions) -> Result<(Ask, Ledger), ()> {
    let (reserved, ledger) = if has_budget {
        let reservation = options.reservation.ok_or(())?;
        (reservation.reserved(), Ledger::new(Some(reservation), None))
    } else {
        (0, Ledger::new(None, None))
    };
    let ask = Ask {
        reserved,
        priority: options.priority,
        class: None,
    };
    Ok((ask, ledger))
}

/// What [`LlmCore::admit`] decided.
#[derive(Debug)]
pub(crate) enum Admitted {
    /// Admitted now (announced).
    Now(Admission),
    /// Refused now (announced).
    Refused(Rejection),
    /// Waiting in the queue; the outcome is announced when it is picked up.
    Queued(WaiterHandle, Option<Timing>),
}

impl LlmCore {
    /// The core of a bulkhead: `engine` (built for its limits, default class and rate clock)
    /// with what makes it an LLM bulkhead.
    pub(crate) fn new(
        model: String,
        engine: Engine,
        estimator: unmodeled::Arc<dyn Estimator>,
        default_timeout: Option<Duration>,
        dedup: Option<Deduplication>,
        (name, tenant): (String, String),
    ) -> LlmCore {
        LlmCore {
            engine,
            listeners: unmodeled::Arc::new(Listeners::default()),
            estimator,
            estimator_panics: unmodeled::AtomicU64::new(0),
            model: model.into_boxed_str(),
            name: name.into_boxed_str(),
            tenant: tenant.into_boxed_str(),
            default_timeout,
            dedup: dedup.map(|config| Arc::new(Dedup::new(config))),
            observe: ObserveCounters::default(),
        }
    }

    /// The deduplication registry, when the bulkhead deduplicates.
    pub(crate) fn dedup(&self) -> Option<&Arc<Dedup>> {
        self.dedup.as_ref()
    }

    /// The observe-mode counters.
    pub(crate) fn observe_counters(&self) -> &ObserveCounters {
        &self.observe
    }

    #[inline]
    pub(crate) fn engine(&self) -> &Engine {
        &self.engine
    }

    pub(crate) fn listeners(&self) -> &unmodeled::Arc<Listeners> {
        &self.listeners
    }

    pub(crate) fn estimator(&self) -> &dyn Estimator {
        &*self.estimator
    }

    pub(crate) fn model(&self) -> &str {
        &self.model
    }

    pub(crate) fn name(&self) -> &str {
        &self.name
    }

    pub(crate) fn tenant(&self) -> &str {
        &self.tenant
    }

    /// Panics of the estimator's `observe` so far.
    pub(crate) fn estimator_panics(&self) -> u64 {
        self.estimator_panics.load(unmodeled::Ordering::Relaxed)
    }

    /// Counts a panic of the estimator's `observe`.
    pub(crate) fn count_estimator_panic(&self) {
        self.estimator_panics
            .fetch_add(1, unmodeled::Ordering::Relaxed);
    }

    /// The admission class of a call: the one it names (checked to be this bulkhead's), else
    /// the default class; `None` without classes.
    ///
    /// # Errors
    ///
    /// [`RequestError::ClassesNotConfigured`](crate::request::RequestError::ClassesNotConfigured) when a call names a class on a bulkhead without
    /// classes, [`RequestError::ForeignClass`](crate::request::RequestError::ForeignClass) when it names another bulkhead's class.
    #[inline]
    pub(crate) fn class_of(
        &self,
        options: &AcquireOptions,
    ) -> Result<Option<AdmissionClass>, RequestError> {
        match (self.engine.classes(), options.class) {
            (None, None) => Ok(None),
            (None, Some(class)) => Err(RequestError::ClassesNotConfigured { class }),
            (Some(classes), named) => classes.resolve(named).map(Some),
        }
    }

    /// Turns a call's input into what it asks of the bulkhead: its class, and the options'
    /// reservation, else the estimate (only with a token budget; without one nothing is
    /// estimated and an override is ignored).
    #[inline]
    pub(crate) fn resolve(
        &self,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<Call, RequestError> {
        let priority = options.priority;
        let class = self.class_of(&options)?;
        if !self.engine.has_budget() {
            return Ok(Call::new(priority, class, None, None));
        }
        let (reservation, memo) = match options.reservation {
            Some(r) => (r, None),
            None => {
                let estimate = self.estimator.estimate(request)?;
                (estimate.reservation()?, Some(estimate.memo()))
            }
        };
        Ok(Call::new(priority, class, Some(reservation), memo))
    }

    /// How long a call may wait in the queue: its own timeout, else the bulkhead's default,
    /// and its deadline, whichever comes first.
    pub(crate) fn bound(&self, options: AcquireOptions) -> Bound {
        Bound {
            timeout: options.timeout.or(self.default_timeout),
            deadline: options.deadline,
        }
    }

    /// The general door of an admission (see `try_admit` and `admit_in_place` for the two fast
    /// ones): asks the engine for `call` (queueing it if
    /// `wait` allows), builds the admission, and announces an immediate outcome. Refusals for
    /// the reasons in `untimed` (a bit per `RejectReason`: observe mode's race bypasses) are
    /// announced untimed, now or after a wait.
    ///
    /// `timing` is the call's, started by the caller ([`timing`](LlmCore::timing)) once per
    /// call: after estimation, before the decision.
    #[inline]
    pub(crate) fn admit(
        &self,
        call: Call,
        wait: Wait<'_>,
        untimed: u8,
        timing: Option<Timing>,
    ) -> Admitted {
        let timing = timing.map(|timing| timing.untimed(untimed));
        match self.engine.admit(call.ask(), wait) {
            Decision::Admitted(grant) => {
                let admission = call.admission(grant, timing);
                self.announce_admit(&admission, timing, None);
                Admitted::Now(admission)
            }
            Decision::Refused(rejection) => {
                self.announce_reject(&rejection, call.class(), timing, None);
                Admitted::Refused(rejection)
            }
            Decision::Queued(waiter) => Admitted::Queued(waiter, timing),
        }
    }

    /// [`admit`](LlmCore::admit), not inlined: the first poll's path for a class call or a
    /// timed decision, kept out of the in-place path's frame (inlined, it made the fast path's
    /// frame spill registers).
    #[inline(never)]
    fn admit_out_of_line(
        &self,
        call: Call,
        wait: Wait<'_>,
        untimed: u8,
        timing: Option<Timing>,
    ) -> Admitted {
        self.admit(call, wait, untimed, timing)
    }

    /// [`admit`](LlmCore::admit) for the first poll of an acquire future: a call admitted at
    /// once becomes the caller's permit in place (`permit`), anything else comes back as
    /// [`Admitted`] (announced as `admit` announces it). Without a class and without anyone
    /// timing decisions the decision is the engine's in-place one; otherwise `admit`'s.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn admit_in_place<P>(
        &self,
        call: Call,
        wait: Wait<'_>,
        untimed: u8,
        timing: Option<Timing>,
        permit: impl FnOnce(Admission) -> P,
    ) -> Result<P, Admitted> {
        if call.class().is_some() || timing.is_some() {
            return match self.admit_out_of_line(call, wait, untimed, timing) {
                Admitted::Now(admission) => Ok(permit(admission)),
                other => Err(other),
            };
        }
        // Nobody times decisions: nothing to announce (see `announce_admit`).
        self.engine
            .admit_in_place(call.ask(), wait, |grant| {
                permit(call.admission(grant, None))
            })
            .map_err(|decision| match decision {
                Decision::Admitted(grant) => Admitted::Now(call.admission(grant, None)),
                Decision::Refused(rejection) => Admitted::Refused(rejection),
                Decision::Queued(waiter) => Admitted::Queued(waiter, None),
            })
    }

    /// The fast lane of `try_acquire`: a call without a class, whose tokens are known without
    /// the estimator (no token budget, or the options carry a reservation), admitted by the
    /// engine's fast lane; for a call nobody times (the caller checked: its
    /// [`timing`](LlmCore::timing) is `None`). `None` (nothing changed) for anything
    /// else, which the general path ([`resolve`](LlmCore::resolve), then
    /// [`try_admit`](LlmCore::try_admit)) decides: it admits exactly what the general path
    /// would, with the same record.
    ///
    /// `permit` makes the caller's result of the admission in place; it is handed back with
    /// `Err`, for the general path.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit_fast<P, F: FnOnce(Admission) -> P>(
        &self,
        options: &AcquireOptions,
        permit: F,
    ) -> Result<P, F> {
        if options.class.is_some() || !self.engine.has_fast_lane() {
            return Err(permit);
        }
        if !self.engine.has_budget() {
            // Without a budget, the whole lane on its own: its ask and ledger are constants.
            let ask = Ask::slot(options.priority);
            return match self.engine.try_admit_fast(ask) {
                Some(grant) => Ok(permit(Admission::new(grant, Ledger::new(None, None)))),
                None => Err(permit),
            };
        }
        let Ok((ask, ledger)) = fast_ask(true, options) else {
            return Err(permit);
        };
        match self.engine.try_admit_fast(ask) {
            Some(grant) => Ok(permit(Admission::new(grant, ledger))),
            None => Err(permit),
        }
    }

    /// [`try_admit_fast`](LlmCore::try_admit_fast), returning the admission's parts for the
    /// caller to build its result from where it returns it (a permit built here and moved
    /// into a differently shaped result is copied, and the copy, read right after the
    /// writes that made it, stalls the CPU's store forwarding).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn fast_admission(&self, options: &AcquireOptions) -> Option<(Grant, Ledger)> {
        if options.class.is_some() || !self.engine.has_fast_lane() {
            return None;
        }
        if !self.engine.has_budget() {
            // As in `try_admit_fast`: the lane without a budget on its own.
            let grant = self.engine.try_admit_fast(Ask::slot(options.priority))?;
            return Some((grant, Ledger::new(None, None)));
        }
        let (ask, ledger) = fast_ask(true, options).ok()?;
        Some((self.engine.try_admit_fast(ask)?, ledger))
    }

    /// [`fast_admission`](LlmCore::fast_admission) on a bulkhead with rate windows and no
    /// classes: the windowed lane. `None` (nothing changed) for anything else.
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn windowed_admission(&self, options: &AcquireOptions) -> Option<(Grant, Ledger)> {
        if options.class.is_some() || !self.engine.has_window_lane() {
            return None;
        }
        let (ask, ledger) = fast_ask(self.engine.has_budget(), options).ok()?;
        Some((self.engine.try_admit_fast_windowed(ask)?, ledger))
    }

    /// [`try_admit_fast`](LlmCore::try_admit_fast) of a class call: within its class's
    /// reserved floors, for a call nobody times. `Err` (nothing changed) for anything else,
    /// as `try_admit_fast`.
    #[inline]
    pub(crate) fn try_admit_class_fast<const OUTLINED: bool, P>(
        &self,
        options: &AcquireOptions,
        permit: impl FnOnce(Admission) -> P,
    ) -> Result<P, ()> {
        let classes = self.engine.classes().ok_or(())?;
        let (mut ask, ledger) = fast_ask(self.engine.has_budget(), options)?;
        // A class that is not this bulkhead's is reported by the general path.
        ask.class = Some(classes.resolve(options.class).map_err(|_| ())?);
        match self.engine.try_admit_class_fast::<OUTLINED>(ask) {
            Some(grant) => Ok(permit(Admission::new(grant, ledger))),
            None => Err(()),
        }
    }

    /// [`try_admit_class_fast`](LlmCore::try_admit_class_fast)'s admission itself, for a door
    /// that builds its own result (the owned door, the acquire futures' first poll). `None`:
    /// nothing changed.
    #[inline]
    pub(crate) fn class_admission<const OUTLINED: bool>(
        &self,
        options: &AcquireOptions,
    ) -> Option<Admission> {
        self.try_admit_class_fast::<OUTLINED, _>(options, |admission| admission)
            .ok()
    }

    /// Admits `call` now or refuses it now (never queues), announcing the outcome, and makes
    /// the caller's permit of the admission with `permit`: `try_acquire`'s path, which builds
    /// its result in place (no intermediate [`Admitted`] to copy through).
    ///
    /// `timing` is the call's (see [`admit`](LlmCore::admit)).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn try_admit<P: Deref<Target = Admission>>(
        &self,
        call: Call,
        timing: Option<Timing>,
        permit: impl FnOnce(Admission) -> P,
    ) -> Result<P, AcquireError> {
        // Without a listener the result is returned as the engine builds it, in place: a
        // temporary would be copied, and a copy read right after the writes that built it
        // stalls the CPU's store forwarding (measured: a refusal took twice as long).
        if timing.is_none() {
            return self.decide_now(call, None, permit);
        }
        let result = self.decide_now(call, timing, permit);
        match &result {
            Ok(permit) => self.announce_admit(permit, timing, None),
            Err(AcquireError::Rejected(rejection)) => {
                self.announce_reject(rejection, call.class(), timing, None)
            }
            Err(AcquireError::Invalid(_)) => {}
        }
        result
    }

    /// The decision of [`try_admit`](LlmCore::try_admit), announced by the caller.
    #[cfg_attr(not(loom), inline(always))]
    fn decide_now<P>(
        &self,
        call: Call,
        timing: Option<Timing>,
        permit: impl FnOnce(Admission) -> P,
    ) -> Result<P, AcquireError> {
        let admitted = |grant| permit(call.admission(grant, timing));
        if call.class().is_none() {
            self.engine
                .try_admit(call.ask(), admitted, AcquireError::Rejected)
        } else {
            self.engine
                .try_admit_class(call.ask(), admitted, AcquireError::Rejected)
        }
    }

    /// Starts timing a decision if anyone will hear of it: a listener of decisions on every
    /// call, or a sampled listener when this call is sampled (see `crate::events`). Called
    /// once per call, where it starts (it decides the call's sampling: a second call would
    /// decide it again, for the next call); `None` lets the call take the fast lanes.
    #[inline]
    pub(crate) fn timing(&self) -> Option<Timing> {
        let mask = self.listeners.mask();
        if mask & (DECISION_KINDS | SAMPLED_CALL_KINDS) == 0 {
            return None;
        }
        let sampled = mask & SAMPLED_CALL_KINDS != 0 && self.listeners.sample();
        (sampled || mask & DECISION_KINDS != 0).then(|| Timing::start(sampled))
    }

    /// [`timing`](LlmCore::timing)'s decision without its clock read: `None` when nobody
    /// times the call, else whether it is sampled (its timing is `Timing::start(sampled)`).
    /// Decides the call's sampling, as `timing` does: called once per call. (`timing` spells
    /// the same test out: written as `timed().map(Timing::start)`, it cost `acquire_within`
    /// 5 instructions.)
    #[inline]
    pub(crate) fn timed(&self) -> Option<bool> {
        let mask = self.listeners.mask();
        if mask & (DECISION_KINDS | SAMPLED_CALL_KINDS) == 0 {
            return None;
        }
        let sampled = mask & SAMPLED_CALL_KINDS != 0 && self.listeners.sample();
        (sampled || mask & DECISION_KINDS != 0).then_some(sampled)
    }

    /// Whether no call's decision is timed now, for sure: [`timing`](LlmCore::timing) would
    /// say `None` without deciding a sampling (no listener of decisions, none sampled).
    #[inline]
    pub(crate) fn untimed(&self) -> bool {
        self.listeners.mask() & (DECISION_KINDS | SAMPLED_CALL_KINDS) == 0
    }

    /// Whether anyone listens to the decisions of calls that waited now (so their timing is
    /// worth a clock read): every call that waited is sampled.
    #[inline]
    pub(crate) fn wants_decisions(&self) -> bool {
        self.listeners.mask() & (DECISION_KINDS | SAMPLED_DECISION_KINDS) != 0
    }

    /// Emits the admit event of `admission` (no-op unless timing was started and anyone
    /// listens). `picked_at` is when a call that waited left the queue.
    #[inline]
    pub(crate) fn announce_admit(
        &self,
        admission: &Admission,
        timing: Option<Timing>,
        picked_at: Option<Instant>,
    ) {
        let Some(timing) = timing else { return };
        if !self.listeners.hears(EventKind::Admit, timing.sampled) {
            return;
        }
        let (decision_duration, queue_wait) =
            timing.durations(picked_at.unwrap_or_else(Instant::now));
        let grant: &Grant = admission.grant();
        let event = AdmitEvent {
            admission_id: grant.id(),
            limit_revision: grant.revision(),
            priority: grant.priority(),
            class: grant.class(),
            reserved_tokens: admission.reserved_tokens(),
            resources: grant.resources(),
            decision_duration,
            queue_wait,
        };
        self.listeners.emit(&Event::Admit(&event), timing.sampled);
    }

    /// Emits the reject event of `rejection` of a call of `class` (no-op unless timing was
    /// started and anyone listens).
    #[inline]
    pub(crate) fn announce_reject(
        &self,
        rejection: &Rejection,
        class: Option<AdmissionClass>,
        timing: Option<Timing>,
        picked_at: Option<Instant>,
    ) {
        let Some(timing) = timing else { return };
        if !self.listeners.hears(EventKind::Reject, timing.sampled) {
            return;
        }
        let (decision_duration, queue_wait) =
            timing.refusal_durations(rejection.reason(), picked_at.unwrap_or_else(Instant::now));
        let event = RejectEvent {
            reason: rejection.reason(),
            class,
            limit_revision: rejection.limit_revision(),
            detail: *rejection.detail(),
            decision_duration,
            queue_wait,
        };
        self.listeners.emit(&Event::Reject(&event), timing.sampled);
    }

    /// Returns `admission`'s borrowed slot now, keeping its tokens held until it settles (see
    /// [`Permit::abandon_borrowed_concurrency`](crate::Permit::abandon_borrowed_concurrency)),
    /// and announces it; `false` (nothing changed) unless the admission borrowed its slot and
    /// still holds it.
    pub(crate) fn abandon(&self, admission: &mut Admission, cause: AbandonCause) -> bool {
        if !self.engine.abandon(admission.grant_mut(), cause) {
            return false;
        }
        let sampled = admission.sampled();
        if self
            .listeners
            .hears(EventKind::BorrowedConcurrencyAbandon, sampled)
        {
            let event = BorrowedConcurrencyAbandonEvent {
                admission_id: admission.admission_id(),
                limit_revision: admission.limit_revision(),
                priority: admission.priority(),
                class: admission.class(),
                resources: admission.resources(),
                cause,
                held_tokens: admission.held_tokens(),
            };
            self.listeners
                .emit(&Event::BorrowedConcurrencyAbandon(&event), sampled);
        }
        true
    }

    /// Emits a reconfigure event. The caller holds no lock.
    pub(crate) fn announce_reconfigure(&self, previous: &Limits, current: &Limits) {
        if self.listeners.hears(EventKind::Reconfigure, true) {
            let event = ReconfigureEvent {
                previous: previous.clone(),
                current: current.clone(),
            };
            self.listeners.emit(&Event::Reconfigure(&event), true);
        }
    }
}
