//! Building the bulkhead, and converting between the crate's values and the model's.

use std::sync::Once;

use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits, RateWindow};
use async_bulkhead_llm::{
    AcquireOptions, Limits, LlmBulkhead, LlmRequest, Priority, RejectReason, Rejection,
    Reservation, RunContext, Stats, TokenBudget, TokenUsage, admission::Admission,
    admission::AdmissionId, builder::ConfigError, classes::AbandonCause, classes::AdmissionClass,
    classes::AdmissionClasses, classes::ClassLimits, classes::ClassLimitsTable, classes::Resources,
    dedup::Deduplication, events::Event, limits::MAX_BUDGET, limits::MAX_CONCURRENT,
    limits::MAX_REVISION, observe::ShadowId, observe::ShadowReasons, rejection::CapacityDetail,
    rejection::Constraint as CrateConstraint, rejection::SharedPool, request::RequestError,
};

use super::flights::{DedupKind, PANICKING_MODEL};
use super::harness::{Call, Config, MAX_CHARS};
use super::limits::check_class;
use super::rate::{Rate, WindowRefusal, check_rate, repair_rate};
use super::values::{
    Borrowed, CLASS_IDS, Cause, ClassCaps, ClassDetail, ClassStats, ClassTable, ClassTokenDetail,
    ClassesStats, Constraint, Detail, MAX_CLASSES, MODEL_NAME, ModelBypass, ModelLimits,
    ModelStats, ObserveFigures, Observed, Pool, Reason, Refused, Shadow, Snapshot, TokenDetail,
    TokenStats,
};

/// The payload of the `by_key` function's panic (kept out of the test output).
const KEY_PANIC: &str = "the model's key function refuses this request";

/// The `by_key` function of [`DedupKind::ByModel`]: the request's model name; none is an empty
/// key (the call opts out); [`PANICKING_MODEL`] panics (the call opts out, counted).
fn key_by_model(request: &LlmRequest) -> String {
    match request.model.as_deref() {
        Some(PANICKING_MODEL) => std::panic::panic_any(KEY_PANIC),
        Some(model) => model.to_owned(),
        None => String::new(),
    }
}

/// Silences the key function's panics (the crate catches and counts them); every other panic
/// reaches the hook in place.
fn quiet_key_panics() {
    static QUIET: Once = Once::new();
    QUIET.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if info.payload().downcast_ref::<&str>() != Some(&KEY_PANIC) {
                previous(info);
            }
        }));
    });
}

/// The crate's set of an observe set of the model.
pub(crate) fn shadow_reasons(set: Shadow) -> ShadowReasons {
    ShadowReasons::new(
        set.reasons()
            .into_iter()
            .map(|r| RejectReason::ALL[r as usize]),
    )
    .expect("the model's sets hold only reasons that may be bypassed")
}

/// A bypass id as the model compares it (the driver numbers them in the order they began).
pub(crate) fn shadow_raw(id: ShadowId) -> u128 {
    id.to_uuid().as_u128()
}

/// A class handle the model does not know (another bulkhead's, or one whose id or index is
/// not its position's).
pub(crate) const NOT_OURS: usize = usize::MAX;

/// Builds the bulkhead for `config`: first the raw values, whose out-of-range ones the builder
/// must refuse in its documented order (crate config.rs `build`; classes design §U6.1), then
/// the clamped global values with the raw classes, then everything repaired. Answers the
/// bulkhead, its limits, its default class, and whether the builder refused the classes.
pub(crate) fn build(
    config: &Config,
    clock: &ManualClock,
) -> (LlmBulkhead, ModelLimits, Option<usize>, bool) {
    let classes = config
        .classes
        .as_ref()
        .map(|c| (c.default, &c.caps[..c.caps.len().min(MAX_CLASSES)]));
    let builder = |max_concurrent: u32,
                   initial_revision,
                   budget: Option<(u64, u64)>,
                   classes,
                   rate: Option<Rate>| {
        let mut builder = LlmBulkhead::builder(MODEL_NAME, max_concurrent as usize)
            .max_queue(config.max_queue as usize)
            .initial_revision(initial_revision);
        if let Some((budget, reserve)) = budget {
            builder = builder.token_budget(TokenBudget::new(budget).high_priority_reserve(reserve));
        }
        if let Some((default, caps)) = classes {
            builder = builder.admission_classes(admission_classes(default, caps));
        }
        // Every bulkhead reads the harness's clock (class windows too).
        builder = builder.rate_clock(RateClock::manual(clock));
        if let Some(rate) = rate {
            builder = builder.rate_limits(rate_limits(rate));
        }
        match config.dedup {
            None => {}
            Some(DedupKind::ByRequest) => builder = builder.deduplication(Deduplication::new()),
            Some(DedupKind::ByModel) => {
                quiet_key_panics();
                builder = builder.deduplication(Deduplication::by_key(key_by_model));
            }
        }
        builder.build()
    };
    let global = if config.max_concurrent > MAX_CONCURRENT {
        Some(ConfigError::MaxConcurrentTooLarge {
            value: config.max_concurrent as usize,
            max: MAX_CONCURRENT as usize,
        })
    } else if config.initial_revision > MAX_REVISION {
        Some(ConfigError::InitialRevisionTooLarge {
            value: config.initial_revision,
            max: MAX_REVISION,
        })
    } else {
        match config.budget {
            Some((budget, _)) if budget > MAX_BUDGET => Some(ConfigError::BudgetTooLarge {
                value: budget,
                max: MAX_BUDGET,
            }),
            Some((budget, reserve)) if reserve > budget => {
                Some(ConfigError::ReserveExceedsBudget { reserve, budget })
            }
            _ => None,
        }
    };
    let limits = ModelLimits {
        revision: config.initial_revision.min(MAX_REVISION),
        max_concurrent: config.max_concurrent.min(MAX_CONCURRENT),
        max_queue: config.max_queue,
        budget: config.budget.map(|(budget, reserve)| {
            let budget = budget.min(MAX_BUDGET);
            (budget, reserve.min(budget))
        }),
        classes: None,
        // Rate limits are checked after the global values, before the classes (crate
        // builder.rs `build`, engine/limits.rs `validate_rate`); refused ones are repaired.
        rate: config
            .rate
            .and_then(|rate| repair_rate(rate, config.budget.is_some())),
    };
    let rate_error = config
        .rate
        .and_then(|rate| check_rate(rate, config.budget.is_some()).err())
        .map(ConfigError::RateLimits);
    let budget = limits.budget.map(|(budget, _)| budget);
    let raw = builder(
        config.max_concurrent,
        config.initial_revision,
        config.budget,
        classes,
        config.rate,
    );
    let class_error = classes.and_then(|(_, caps)| class_config_error(caps, limits, budget));
    let later_error = rate_error.or(class_error.clone());
    assert_eq!(
        raw.as_ref().err(),
        global.as_ref().or(later_error.as_ref()),
        "the builder's verdict on {config:?}"
    );
    if global.is_some() {
        let clamped = builder(
            limits.max_concurrent,
            limits.revision,
            limits.budget,
            classes,
            config.rate,
        );
        assert_eq!(
            clamped.as_ref().err(),
            later_error.as_ref(),
            "the builder's verdict on the classes and rate limits of {config:?}"
        );
    }
    let repaired = classes.map(|(default, caps)| {
        let caps = repair(caps, limits.max_concurrent, budget);
        (default % caps.len(), caps)
    });
    let bulkhead = match raw {
        Ok(bulkhead) if later_error.is_none() => bulkhead,
        _ => builder(
            limits.max_concurrent,
            limits.revision,
            limits.budget,
            repaired.as_ref().map(|(d, caps)| (*d, &caps[..])),
            limits.rate,
        )
        .expect("a clamped and repaired configuration builds"),
    };
    let limits = ModelLimits {
        classes: repaired.as_ref().map(|(_, caps)| {
            let entries: Vec<_> = caps
                .iter()
                .enumerate()
                .map(|(i, caps)| (CLASS_IDS[i], caps.normalized()))
                .collect();
            ClassTable::new(&entries)
        }),
        ..limits
    };
    let refused = class_error.is_some();
    (
        bulkhead,
        limits,
        repaired.map(|(default, _)| default),
        refused,
    )
}

fn admission_classes(default: usize, caps: &[ClassCaps]) -> AdmissionClasses {
    let default = CLASS_IDS[if caps.is_empty() {
        0
    } else {
        default % caps.len()
    }];
    caps.iter()
        .enumerate()
        .fold(AdmissionClasses::new(default), |classes, (i, caps)| {
            classes.class(CLASS_IDS[i], class_limits(caps))
        })
}

/// What the builder must refuse of `caps` (design §U6.1; the default class is always
/// configured, and ids are never blank or repeated here): no class, a class's limits, the
/// floor sums.
fn class_config_error(
    caps: &[ClassCaps],
    limits: ModelLimits,
    budget: Option<u64>,
) -> Option<ConfigError> {
    if caps.is_empty() {
        return Some(ConfigError::NoClasses);
    }
    for (i, caps) in caps.iter().enumerate() {
        if let Err(error) = check_class(CLASS_IDS[i], caps, budget.is_some(), true) {
            return Some(ConfigError::Class(error));
        }
    }
    let slots: u64 = caps.iter().map(ClassCaps::floor).sum();
    let tokens: u64 = caps.iter().map(ClassCaps::token_floor).sum();
    if slots > u64::from(limits.max_concurrent) {
        return Some(ConfigError::ProtectedConcurrentSumTooLarge {
            sum: slots,
            max_concurrent: limits.max_concurrent,
        });
    }
    match budget {
        Some(budget) if tokens > budget => Some(ConfigError::ProtectedTokensSumTooLarge {
            sum: tokens,
            budget,
        }),
        _ => None,
    }
}

/// `caps` made valid (see [`Classes`](super::harness::Classes)).
fn repair(caps: &[ClassCaps], max_concurrent: u32, budget: Option<u64>) -> Vec<ClassCaps> {
    let mut caps: Vec<ClassCaps> = caps
        .iter()
        .map(|c| {
            let max_concurrent = c.max_concurrent.map(|n| n.min(MAX_CONCURRENT));
            let max_tokens = c.max_tokens.map(|n| n.min(MAX_BUDGET));
            let mut floor = c.protected_concurrent.map(|n| n.min(MAX_CONCURRENT));
            let mut token_floor = c.protected_tokens.map(|n| n.min(MAX_BUDGET));
            if let (Some(f), Some(max)) = (floor, max_concurrent) {
                floor = Some(f.min(max));
            }
            if let (Some(f), Some(max)) = (token_floor, max_tokens) {
                token_floor = Some(f.min(max));
            }
            ClassCaps {
                protected_concurrent: floor,
                max_concurrent,
                protected_tokens: token_floor.filter(|_| budget.is_some()),
                max_tokens: max_tokens.filter(|_| budget.is_some()),
                rate: c.rate.and_then(|rate| repair_rate(rate, budget.is_some())),
            }
        })
        .collect();
    if caps.is_empty() {
        caps.push(ClassCaps::default());
    }
    if caps.iter().map(ClassCaps::floor).sum::<u64>() > u64::from(max_concurrent) {
        caps.iter_mut().for_each(|c| c.protected_concurrent = None);
    }
    if let Some(budget) = budget
        && caps.iter().map(ClassCaps::token_floor).sum::<u64>() > budget
    {
        caps.iter_mut().for_each(|c| c.protected_tokens = None);
    }
    caps
}

pub(crate) fn class_limits(caps: &ClassCaps) -> ClassLimits {
    let mut limits = ClassLimits::new();
    limits.protected_concurrent = caps.protected_concurrent;
    limits.max_concurrent = caps.max_concurrent;
    limits.protected_in_flight_tokens = caps.protected_tokens;
    limits.max_in_flight_tokens = caps.max_tokens;
    limits.rate = caps.rate.map(rate_limits);
    limits
}

fn caps_of(limits: &ClassLimits) -> ClassCaps {
    ClassCaps {
        protected_concurrent: limits.protected_concurrent,
        max_concurrent: limits.max_concurrent,
        protected_tokens: limits.protected_in_flight_tokens,
        max_tokens: limits.max_in_flight_tokens,
        rate: limits.rate.as_ref().map(rate_of),
    }
}

/// The position of `class` among `handles` (the bulkhead's classes, in order), checking its
/// id and index; [`NOT_OURS`] otherwise.
pub(crate) fn class_index(class: AdmissionClass, handles: &[AdmissionClass]) -> usize {
    match handles.iter().position(|&h| h == class) {
        Some(i) if class.id() == CLASS_IDS[i] && usize::from(class.index()) == i => i,
        _ => NOT_OURS,
    }
}

/// The crate's rate limits of the model's.
pub(crate) fn rate_limits(rate: Rate) -> RateLimits {
    let mut limits = RateLimits::new(std::time::Duration::from_nanos(rate.window_ns));
    if let Some(requests) = rate.requests {
        limits = limits.requests(requests);
    }
    if let Some(tokens) = rate.tokens {
        limits = limits.tokens(tokens);
    }
    limits
}

/// The model's rate limits of the crate's.
pub(crate) fn rate_of(rate: &RateLimits) -> Rate {
    Rate {
        window_ns: u64::try_from(rate.window.as_nanos()).expect("a window in range"),
        requests: rate.requests,
        tokens: rate.tokens,
    }
}

pub(crate) fn reason_of(reason: RejectReason) -> Reason {
    match reason {
        RejectReason::Shutdown => Reason::Shutdown,
        RejectReason::ConcurrencyLimit => Reason::ConcurrencyLimit,
        RejectReason::BudgetLimit => Reason::BudgetLimit,
        RejectReason::QueueLimit => Reason::QueueLimit,
        RejectReason::Timeout => Reason::Timeout,
        RejectReason::Aborted => Reason::Aborted,
        RejectReason::RateLimit => Reason::RateLimit,
        other => panic!("a reason the model does not know: {other:?}"),
    }
}

pub(crate) fn limits_of(limits: &Limits) -> ModelLimits {
    ModelLimits {
        revision: limits.revision,
        max_concurrent: limits.max_concurrent,
        max_queue: limits.max_queue,
        budget: limits
            .token_budget
            .map(|b| (b.budget, b.high_priority_reserve)),
        classes: limits.admission_classes.as_ref().map(|table| {
            let entries: Vec<_> = table
                .iter()
                .map(|(id, limits)| {
                    let id = CLASS_IDS.iter().find(|&&known| known == id).unwrap_or(&"?");
                    (*id, caps_of(limits))
                })
                .collect();
            ClassTable::new(&entries[..entries.len().min(MAX_CLASSES)])
        }),
        rate: limits.rate.as_ref().map(rate_of),
    }
}

pub(crate) fn limits_from(limits: &Snapshot) -> Limits {
    let mut next =
        Limits::new(limits.revision, limits.max_concurrent).with_max_queue(limits.max_queue);
    if let Some((budget, reserve)) = limits.budget {
        next = next.with_token_budget(budget, reserve);
    }
    if let Some(classes) = &limits.classes {
        next = next.with_admission_classes(
            classes
                .iter()
                .fold(ClassLimitsTable::new(), |table, (id, caps)| {
                    table.with(*id, class_limits(caps))
                }),
        );
    }
    if let Some(rate) = limits.rate {
        next = next.with_rate(rate_limits(rate));
    }
    next
}

fn constraint_of(constraint: CrateConstraint) -> Constraint {
    match constraint {
        CrateConstraint::Global => Constraint::Global,
        CrateConstraint::AdmissionClass => Constraint::AdmissionClass,
        CrateConstraint::AdmissionClassProtection => Constraint::AdmissionClassProtection,
        other => panic!("a constraint the model does not know: {other:?}"),
    }
}

fn pool_of(p: &SharedPool) -> Pool {
    Pool {
        capacity: p.capacity,
        in_use: p.in_use,
        available: p.available,
        requested_borrowed: p.requested_borrowed,
    }
}

pub(crate) fn detail_of(d: &CapacityDetail, handles: &[AdmissionClass]) -> Detail {
    Detail {
        limit_revision: d.limit_revision,
        in_flight: d.in_flight,
        max_concurrent: d.max_concurrent,
        pending: d.pending,
        max_queue: d.max_queue,
        tokens: d.token_budget.map(|t| TokenDetail {
            budget: t.budget,
            in_flight_tokens: t.in_flight_tokens,
            effective_budget: t.effective_budget,
            available: t.available,
            requested: t.requested,
        }),
        constraint: d.constraint.map(constraint_of),
        shared: d.shared_capacity().map(|s| {
            (
                pool_of(&s.concurrency),
                s.token_budget.as_ref().map(pool_of),
            )
        }),
        class: d.admission_class().map(|c| ClassDetail {
            class: class_index(c.class, handles),
            in_flight: c.in_flight,
            protected_concurrent: c.protected_concurrent,
            protected_concurrent_in_use: c.protected_concurrent_in_use,
            borrowed_concurrent: c.borrowed_concurrent,
            available_protected_concurrent: c.available_protected_concurrent,
            max_concurrent: c.max_concurrent,
            available_concurrent: c.available_concurrent,
            tokens: c.token_budget.map(|t| ClassTokenDetail {
                in_flight_tokens: t.in_flight_tokens,
                protected_tokens: t.protected_in_flight_tokens,
                protected_tokens_in_use: t.protected_tokens_in_use,
                borrowed_tokens: t.borrowed_in_flight_tokens,
                available_protected_tokens: t.available_protected_tokens,
                max_tokens: t.max_in_flight_tokens,
                available: t.available,
                requested: t.requested,
            }),
        }),
    }
}

pub(crate) fn refused_of(rejection: &Rejection, handles: &[AdmissionClass]) -> Refused {
    let refused = Refused {
        reason: reason_of(rejection.reason()),
        detail: detail_of(rejection.detail(), handles),
        rate: rejection.rate_window().map(|window| WindowRefusal {
            class: matches!(window, RateWindow::ClassRequests | RateWindow::ClassTokens),
            tokens: matches!(window, RateWindow::Tokens | RateWindow::ClassTokens),
            retry_after_ms: rejection.retry_after().map(|wait| {
                let ms = wait.as_millis();
                assert_eq!(
                    wait,
                    std::time::Duration::from_millis(ms as u64),
                    "whole milliseconds"
                );
                ms as u64
            }),
        }),
    };
    assert_eq!(
        rejection.retry_after().is_some(),
        refused
            .rate
            .is_some_and(|rate| rate.retry_after_ms.is_some()),
        "a retry-after only for a rate refusal that may fit"
    );
    if let Some(rate) = refused.rate {
        // A window's refusal is answered 429, or 413 for a call that can never fit (crate
        // http.rs `Rejection::http_status`).
        assert_eq!(
            rejection.http_status(),
            if rate.retry_after_ms.is_some() {
                429
            } else {
                413
            },
            "the HTTP status of {rejection:?}"
        );
    }
    assert_eq!(
        rejection.limit_revision(),
        refused.detail.limit_revision,
        "a rejection's revision is its detail's"
    );
    refused
}

pub(crate) fn usage_of(usage: Option<TokenUsage>) -> Option<(u64, u64)> {
    usage.map(|u| (u.input(), u.output()))
}

pub(crate) fn borrowed_of(resources: Resources) -> Borrowed {
    Borrowed {
        slot: resources.borrowed_concurrency,
        tokens: resources.borrowed_tokens,
    }
}

fn cause_of(cause: AbandonCause) -> Cause {
    match cause {
        AbandonCause::Manual => Cause::Manual,
        AbandonCause::Deadline => Cause::Deadline,
        other => panic!("a cause the model does not know: {other:?}"),
    }
}

fn class_of(class: Option<AdmissionClass>, handles: &[AdmissionClass]) -> Option<usize> {
    class.map(|c| class_index(c, handles))
}

/// What an admission shows through its permit or run context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct View {
    pub(crate) id: AdmissionId,
    pub(crate) held: u64,
    pub(crate) reservation: Option<(u64, u64)>,
    pub(crate) revision: u64,
    pub(crate) high: bool,
    pub(crate) class: Option<usize>,
    pub(crate) borrowed: Borrowed,
    pub(crate) holds_slot: bool,
    pub(crate) usage: Option<(u64, u64)>,
    pub(crate) sequence: u64,
}

pub(crate) fn view_of(a: &Admission, handles: &[AdmissionClass]) -> View {
    View {
        id: a.admission_id(),
        held: a.held_tokens(),
        reservation: a.reservation().map(|r| (r.input(), r.max_output())),
        revision: a.limit_revision(),
        high: a.priority() == Priority::High,
        class: class_of(a.class(), handles),
        borrowed: borrowed_of(a.resources()),
        holds_slot: a.holds_slot(),
        usage: usage_of(a.usage()),
        sequence: a.usage_sequence(),
    }
}

/// What a bypassed call shows through its run context.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct BypassView {
    /// The shadow id (as the driver numbers it).
    pub(crate) shadow: u128,
    pub(crate) reason: Reason,
    pub(crate) detail: Option<Detail>,
    pub(crate) raced: bool,
    pub(crate) reservation: Option<(u64, u64)>,
    pub(crate) revision: u64,
    pub(crate) high: bool,
    pub(crate) class: Option<usize>,
    pub(crate) usage: Option<(u64, u64)>,
    pub(crate) sequence: u64,
    /// What a bypass never has: an admission id, held tokens, borrowed resources, a slot.
    pub(crate) admission_id: Option<AdmissionId>,
    pub(crate) held: u64,
    pub(crate) borrowed: Borrowed,
    pub(crate) holds_slot: bool,
}

/// What the model expects a bypassed call's context to show (its shadow id numbered `shadow`).
pub(crate) fn bypass_view(shadow: u128, bypass: &ModelBypass) -> BypassView {
    BypassView {
        shadow,
        reason: bypass.reason,
        detail: bypass.detail,
        raced: bypass.raced,
        reservation: bypass.reservation,
        revision: bypass.revision,
        high: bypass.high,
        class: bypass.class,
        usage: bypass.reported,
        sequence: bypass.sequence,
        admission_id: None,
        held: 0,
        borrowed: Borrowed::default(),
        holds_slot: false,
    }
}

/// What a callback sees of its call: an admission or a bypass.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Seen {
    Admitted(View),
    Bypassed(BypassView),
}

/// The call a `run` (or `run_shared`) callback runs, through its context.
pub(crate) fn seen_of_context(ctx: &RunContext<'_>, handles: &[AdmissionClass]) -> Seen {
    let reservation = ctx.reservation().map(|r| (r.input(), r.max_output()));
    let high = ctx.priority() == Priority::High;
    let class = class_of(ctx.class(), handles);
    let usage = usage_of(ctx.usage());
    let borrowed = borrowed_of(ctx.resources());
    match (ctx.bypass(), ctx.admission_id()) {
        (None, Some(id)) => Seen::Admitted(View {
            id,
            held: ctx.held_tokens(),
            reservation,
            revision: ctx.limit_revision(),
            high,
            class,
            borrowed,
            holds_slot: ctx.holds_slot(),
            usage,
            sequence: ctx.usage_sequence(),
        }),
        (bypass, admission_id) => {
            let bypass = bypass.expect("a call neither admitted nor bypassed");
            // The context's accessors agree with its bypass.
            assert_eq!(
                (
                    ctx.limit_revision(),
                    ctx.priority(),
                    ctx.class(),
                    ctx.reservation()
                ),
                (
                    bypass.limit_revision,
                    bypass.priority,
                    bypass.class,
                    bypass.reservation
                ),
                "a bypassed context's accessors"
            );
            Seen::Bypassed(BypassView {
                shadow: shadow_raw(bypass.shadow_id),
                reason: reason_of(bypass.reason),
                detail: bypass.detail.map(|d| detail_of(&d, handles)),
                raced: bypass.raced,
                reservation,
                revision: bypass.limit_revision,
                high: bypass.priority == Priority::High,
                class: class_of(bypass.class, handles),
                usage,
                sequence: ctx.usage_sequence(),
                admission_id,
                held: ctx.held_tokens(),
                borrowed,
                holds_slot: ctx.holds_slot(),
            })
        }
    }
}

pub(crate) fn stats_of(s: &Stats, handles: &[AdmissionClass]) -> ModelStats {
    let by_reason = |counts: &async_bulkhead_llm::stats::RejectionCounts| {
        core::array::from_fn(|i| counts.get(RejectReason::ALL[i]))
    };
    let abandoned =
        |total: u64, by: &async_bulkhead_llm::stats::AbandonCounts| (total, by.manual, by.deadline);
    ModelStats {
        limits: limits_of(&s.limits),
        closed: s.closed,
        in_flight: s.in_flight,
        abandoned_in_flight: s.abandoned_in_flight,
        abandoned: abandoned(
            s.borrowed_concurrency_abandoned,
            &s.borrowed_concurrency_abandoned_by_cause,
        ),
        pending: s.pending,
        admitted: s.admitted,
        released: s.released,
        rejected: s.rejected,
        rejected_by_reason: by_reason(&s.rejected_by_reason),
        tokens: s.token_budget.map(|t| TokenStats {
            budget: t.budget,
            high_priority_reserve: t.high_priority_reserve,
            in_flight_tokens: t.in_flight_tokens,
            available: t.available,
            total_reserved: t.total_reserved,
            total_consumed: t.total_consumed,
            total_refunded: t.total_refunded,
            total_overrun: t.total_overrun,
            total_reheld: t.total_reheld,
            total_returned_unreported: t.total_returned_unreported,
        }),
        listener_panics: s.listener_panics,
        dedup: s.deduplication.map(|d| (d.active, d.hits, d.key_panics)),
        observe: s.observe.map(|o| ObserveFigures {
            bypassed: o.bypassed,
            race_bypassed: o.race_bypassed,
            by_reason: by_reason(&o.bypassed_by_reason),
            usage_reported: o.usage_reported,
            input_tokens: o.total_input_tokens,
            output_tokens: o.total_output_tokens,
        }),
        classes: s.admission_classes.as_ref().map(|c| ClassesStats {
            default_class: class_index(c.default_class, handles),
            shared: (
                c.shared.max_concurrent,
                c.shared.in_flight,
                c.shared.available_concurrent,
            ),
            shared_tokens: c
                .shared
                .token_budget
                .map(|t| (t.budget, t.in_flight_tokens, t.available)),
            classes: c
                .classes
                .iter()
                .map(|k| ClassStats {
                    class: class_index(k.class, handles),
                    limits: caps_of(&k.limits),
                    slots: (
                        k.in_flight,
                        k.protected_concurrent_in_use,
                        k.borrowed_concurrent,
                    ),
                    tokens: (
                        k.in_flight_tokens,
                        k.protected_tokens_in_use,
                        k.borrowed_in_flight_tokens,
                    ),
                    admitted: k.admitted,
                    released: k.released,
                    abandoned: abandoned(
                        k.borrowed_concurrency_abandoned,
                        &k.borrowed_concurrency_abandoned_by_cause,
                    ),
                    rejected: k.rejected,
                    rejected_by_reason: by_reason(&k.rejected_by_reason),
                    total_reserved: k.total_reserved,
                    total_consumed: k.total_consumed,
                    total_refunded: k.total_refunded,
                    total_overrun: k.total_overrun,
                    total_reheld: k.total_reheld,
                    total_returned_unreported: k.total_returned_unreported,
                    total_borrowed_admissions: k.total_borrowed_admissions,
                    total_borrowed_tokens_reserved: k.total_borrowed_tokens_reserved,
                })
                .collect(),
        }),
    }
}

/// An event as the model records it. Never panics (a listener's panic would be caught and
/// counted): what the model does not know shows as a disagreement instead.
pub(crate) fn observe(event: &Event<'_>, handles: &[AdmissionClass]) -> Observed {
    match event {
        Event::Admit(e) => Observed::Admit {
            revision: e.limit_revision,
            class: class_of(e.class, handles),
            borrowed: borrowed_of(e.resources),
            reserved: e.reserved_tokens,
            high: e.priority == Priority::High,
        },
        Event::Reject(e) if e.limit_revision == e.detail.limit_revision => Observed::Reject {
            class: class_of(e.class, handles),
            refused: Refused {
                reason: reason_of(e.reason),
                detail: detail_of(&e.detail, handles),
                rate: None,
            },
        },
        Event::Usage(e) => Observed::Usage {
            revision: e.limit_revision,
            class: class_of(e.class, handles),
            sequence: e.sequence,
            reserved: e.reserved_tokens,
            previous_held: e.previous_held_tokens,
            held: e.held_tokens,
            usage: (e.usage.input(), e.usage.output()),
        },
        Event::Release(e) => Observed::Release {
            revision: e.limit_revision,
            class: class_of(e.class, handles),
            borrowed: borrowed_of(e.resources),
            reserved: e.reserved_tokens,
            held: e.held_tokens,
            refunded: e.refunded_tokens,
            returned: e.returned_tokens,
            returned_total: e.returned_total_tokens,
            sequence: e.usage_sequence,
            usage: usage_of(e.usage),
        },
        Event::Reconfigure(e) => Observed::Reconfigure {
            previous: limits_of(&e.previous),
            current: limits_of(&e.current),
        },
        Event::BorrowedConcurrencyAbandon(e) => Observed::Abandon {
            revision: e.limit_revision,
            high: e.priority == Priority::High,
            class: class_of(e.class, handles),
            borrowed: borrowed_of(e.resources),
            cause: cause_of(e.cause),
            held: e.held_tokens,
        },
        Event::Bypass(e) => Observed::Bypass {
            shadow: shadow_raw(e.shadow_id),
            revision: e.limit_revision,
            high: e.priority == Priority::High,
            class: class_of(e.class, handles),
            reason: reason_of(e.reason),
            detail: e.detail.map(|d| detail_of(&d, handles)),
            reservation: e.reservation.map(|r| (r.input(), r.max_output())),
            raced: e.raced,
        },
        Event::BypassUsage(e) => Observed::BypassUsage {
            shadow: shadow_raw(e.shadow_id),
            revision: e.limit_revision,
            high: e.priority == Priority::High,
            class: class_of(e.class, handles),
            reason: reason_of(e.reason),
            sequence: e.sequence,
            reservation: e.reservation.map(|r| (r.input(), r.max_output())),
            usage: (e.usage.input(), e.usage.output()),
            output_cap: e.output_cap,
            output_remaining: e.output_remaining,
            over_reservation: e.over_reservation,
            progressive: e
                .progressive
                .map(|p| (p.remaining_output_tokens, p.safety_margin_tokens)),
        },
        Event::BypassRelease(e) => Observed::BypassRelease {
            shadow: shadow_raw(e.shadow_id),
            revision: e.limit_revision,
            high: e.priority == Priority::High,
            class: class_of(e.class, handles),
            reason: reason_of(e.reason),
            reservation: e.reservation.map(|r| (r.input(), r.max_output())),
            sequence: e.usage_sequence,
            usage: usage_of(e.usage),
        },
        Event::Dedup(e) => Observed::Dedup {
            class: class_of(e.class, handles),
            followers: e.followers,
        },
        other => Observed::Other(format!("{other:?}")),
    }
}

/// The request and options of a call naming `class`, or the error building its explicit
/// reservation.
pub(crate) fn prepare(
    call: &Call,
    class: Option<AdmissionClass>,
) -> Result<(LlmRequest, AcquireOptions), RequestError> {
    let mut request = LlmRequest::new();
    match call.model % 4 {
        1 => request = request.model("gpt-4o"),
        2 => request = request.model("claude-sonnet-4"),
        3 => request = request.model("GPT-4o-mini"),
        _ => {}
    }
    request = request.user("x".repeat((call.chars % MAX_CHARS) as usize));
    if call.has_max_tokens {
        request = request.max_tokens(call.max_tokens);
    }
    if call.has_extra_input {
        request = request.extra_input_tokens(call.extra_input);
    }
    let mut options = AcquireOptions::new().priority(if call.high {
        Priority::High
    } else {
        Priority::Normal
    });
    if let Some(class) = class {
        options = options.class(class);
    }
    if call.explicit {
        options = options.reservation(Reservation::new(call.input, call.max_output)?);
    }
    Ok((request, options))
}
