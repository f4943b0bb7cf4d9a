//! [`tracing`] events for a bulkhead's lifecycle (feature `tracing`): [`trace_events`](crate::observability::trace_events)
//! subscribes a listener that turns admit, reject, usage, abandonment, bypass and release
//! events into `DEBUG` events of the target `async_bulkhead_llm`, each carrying the
//! admission id (or the bypass's shadow id), so one request can be followed through the logs.
//!
//! The spans are not here: with the feature on, the crate opens a `DEBUG` span
//! `llm_bulkhead.queue_wait` around every wait in the queue and `llm_bulkhead.run` around every
//! [`run`](crate::LlmBulkhead::run) (in the LLM wing, where the waits and runs are); events
//! delivered while a call is inside one of them are recorded inside it.

use std::num::NonZeroU32;

use crate::events::{Event, EventKind, Subscription};
use crate::llm::bulkhead::LlmBulkhead;

/// The target of every event.
const TARGET: &str = "async_bulkhead_llm";

/// The kinds [`trace_events`](crate::observability::trace_events) listens to.
const TRACED: [EventKind; 6] = [
    EventKind::Admit,
    EventKind::Reject,
    EventKind::Usage,
    EventKind::Release,
    EventKind::BorrowedConcurrencyAbandon,
    EventKind::Bypass,
];

/// Logs every call's lifecycle of `bulkhead` as `DEBUG` events (target `async_bulkhead_llm`)
/// until the returned subscription is dropped:
///
/// | message | fields |
/// |---|---|
/// | `admitted` | `model`, `bulkhead`, `tenant`, `admission_id`, `class`, `priority`, `reserved_tokens`, `limit_revision`, `decision_us`, `queue_wait_us` |
/// | `rejected` | `model`, `bulkhead`, `tenant`, `reason`, `class`, `limit_revision`, `in_flight`, `max_concurrent`, `pending`, `max_queue`, `in_flight_tokens`, `budget`, `requested_tokens`, `available_tokens`, `constraint`, `decision_us`, `queue_wait_us` |
/// | `usage` | `model`, `bulkhead`, `tenant`, `admission_id`, `sequence`, `input_tokens`, `output_tokens`, `previous_held_tokens`, `held_tokens`, `over_reservation` |
/// | `released` | `model`, `bulkhead`, `tenant`, `admission_id`, `held_tokens`, `refunded_tokens`, `returned_total_tokens`, `usage_sequence`, `input_tokens`, `output_tokens` |
/// | `borrowed slot abandoned` | `model`, `bulkhead`, `tenant`, `admission_id`, `cause`, `held_tokens` |
/// | `bypassed` | `model`, `bulkhead`, `tenant`, `shadow_id`, `reason`, `raced` |
///
/// Token fields are absent where the bulkhead has no budget or the call no usage. Every call
/// pays the delivery (and the decision's two clock reads); [`trace_events_sampled`](crate::observability::trace_events_sampled) traces a
/// sample instead.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, observability::trace_events};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
/// let _tracing = trace_events(&bulkhead);
/// // With a subscriber at DEBUG for `async_bulkhead_llm`, this logs `admitted` then `released`.
/// bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?.release(None);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn trace_events(bulkhead: &LlmBulkhead) -> Subscription {
    let names = Names::of(bulkhead);
    bulkhead.on_events(TRACED, move |event| trace(&names, event))
}

/// Like [`trace_events`](crate::observability::trace_events), for one call in `every` on each thread and every call that waited
/// in the queue (see [`LlmBulkhead::on_events_sampled`]).
///
/// # Examples
///
/// ```
/// use std::num::NonZeroU32;
/// use async_bulkhead_llm::{LlmBulkhead, observability::trace_events_sampled};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 4).build()?;
/// let _tracing = trace_events_sampled(&bulkhead, NonZeroU32::new(100).unwrap());
/// # Ok::<(), async_bulkhead_llm::builder::ConfigError>(())
/// ```
pub fn trace_events_sampled(bulkhead: &LlmBulkhead, every: NonZeroU32) -> Subscription {
    let names = Names::of(bulkhead);
    bulkhead.on_events_sampled(TRACED, every, move |event| trace(&names, event))
}

/// What every line names: the bulkhead's model, its name and its tenant's.
struct Names {
    model: Box<str>,
    bulkhead: Box<str>,
    tenant: Box<str>,
}

impl Names {
    fn of(bulkhead: &LlmBulkhead) -> Names {
        Names {
            model: bulkhead.model().into(),
            bulkhead: bulkhead.name().into(),
            tenant: bulkhead.tenant().into(),
        }
    }
}

/// Microseconds, for a log line.
fn micros(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

fn trace(names: &Names, event: &Event<'_>) {
    match event {
        Event::Admit(e) => tracing::debug!(
            target: TARGET,
            model = names.model.as_ref(),
            bulkhead = names.bulkhead.as_ref(),
            tenant = names.tenant.as_ref(),
            admission_id = %e.admission_id,
            class = e.class.map(display),
            priority = e.priority.as_str(),
            reserved_tokens = e.reserved_tokens,
            limit_revision = e.limit_revision,
            decision_us = micros(e.decision_duration),
            queue_wait_us = micros(e.queue_wait),
            "admitted"
        ),
        Event::Reject(e) => {
            let tokens = e.detail.token_budget;
            tracing::debug!(
                target: TARGET,
                model = names.model.as_ref(),
                bulkhead = names.bulkhead.as_ref(),
                tenant = names.tenant.as_ref(),
                reason = e.reason.as_str(),
                class = e.class.map(display),
                limit_revision = e.limit_revision,
                in_flight = e.detail.in_flight,
                max_concurrent = e.detail.max_concurrent,
                pending = e.detail.pending,
                max_queue = e.detail.max_queue,
                in_flight_tokens = tokens.map(|t| t.in_flight_tokens),
                budget = tokens.map(|t| t.budget),
                requested_tokens = tokens.map(|t| t.requested),
                available_tokens = tokens.map(|t| t.available),
                constraint = e.detail.constraint.map(display),
                decision_us = micros(e.decision_duration),
                queue_wait_us = micros(e.queue_wait),
                "rejected"
            )
        }
        Event::Usage(e) => tracing::debug!(
            target: TARGET,
            model = names.model.as_ref(),
            bulkhead = names.bulkhead.as_ref(),
            tenant = names.tenant.as_ref(),
            admission_id = %e.admission_id,
            sequence = e.sequence,
            input_tokens = e.usage.input(),
            output_tokens = e.usage.output(),
            previous_held_tokens = e.previous_held_tokens,
            held_tokens = e.held_tokens,
            over_reservation = e.over_reservation,
            "usage"
        ),
        Event::Release(e) => tracing::debug!(
            target: TARGET,
            model = names.model.as_ref(),
            bulkhead = names.bulkhead.as_ref(),
            tenant = names.tenant.as_ref(),
            admission_id = %e.admission_id,
            held_tokens = e.held_tokens,
            refunded_tokens = e.refunded_tokens,
            returned_total_tokens = e.returned_total_tokens,
            usage_sequence = e.usage_sequence,
            input_tokens = e.usage.map(|u| u.input()),
            output_tokens = e.usage.map(|u| u.output()),
            "released"
        ),
        Event::BorrowedConcurrencyAbandon(e) => tracing::debug!(
            target: TARGET,
            model = names.model.as_ref(),
            bulkhead = names.bulkhead.as_ref(),
            tenant = names.tenant.as_ref(),
            admission_id = %e.admission_id,
            cause = %e.cause,
            held_tokens = e.held_tokens,
            "borrowed slot abandoned"
        ),
        Event::Bypass(e) => tracing::debug!(
            target: TARGET,
            model = names.model.as_ref(),
            bulkhead = names.bulkhead.as_ref(),
            tenant = names.tenant.as_ref(),
            shadow_id = %e.shadow_id,
            reason = e.reason.as_str(),
            raced = e.raced,
            "bypassed"
        ),
        _ => {}
    }
}
