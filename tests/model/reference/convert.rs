//! Building the bulkhead, and converting between the crate's values and the model's.

use async_bulkhead_llm::{
    AcquireOptions, CapacityDetail, ConfigError, Event, Limits, LlmBulkhead, LlmRequest,
    MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION, Priority, RejectReason, Rejection, RequestError,
    Reservation, Stats, TokenBudget, TokenUsage,
};

use super::harness::{Call, Config, MAX_CHARS};
use super::values::{
    Detail, MODEL_NAME, ModelLimits, ModelStats, Observed, Reason, Refused, TokenDetail, TokenStats,
};

/// Builds the bulkhead for `config`: first the raw values, whose out-of-range ones the builder
/// must refuse in its documented order (crate config.rs `build`), then the clamped ones.
pub(crate) fn build(config: &Config) -> (LlmBulkhead, ModelLimits) {
    let builder = |max_concurrent, initial_revision, budget: Option<(u64, u64)>| {
        let mut builder = LlmBulkhead::builder(MODEL_NAME, max_concurrent)
            .max_queue(config.max_queue)
            .initial_revision(initial_revision);
        if let Some((budget, reserve)) = budget {
            builder = builder.token_budget(TokenBudget::new(budget).high_priority_reserve(reserve));
        }
        builder.build()
    };
    let expected = if config.max_concurrent > MAX_CONCURRENT {
        Some(ConfigError::MaxConcurrentTooLarge {
            value: config.max_concurrent,
            max: MAX_CONCURRENT,
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
    let raw = builder(
        config.max_concurrent,
        config.initial_revision,
        config.budget,
    );
    assert_eq!(
        raw.as_ref().err(),
        expected.as_ref(),
        "the builder's verdict on {config:?}"
    );
    let limits = ModelLimits {
        revision: config.initial_revision.min(MAX_REVISION),
        max_concurrent: config.max_concurrent.min(MAX_CONCURRENT),
        max_queue: config.max_queue,
        budget: config.budget.map(|(budget, reserve)| {
            let budget = budget.min(MAX_BUDGET);
            (budget, reserve.min(budget))
        }),
    };
    let bulkhead = match raw {
        Ok(bulkhead) => bulkhead,
        Err(_) => builder(limits.max_concurrent, limits.revision, limits.budget)
            .expect("a clamped configuration builds"),
    };
    (bulkhead, limits)
}

pub(crate) fn reason_of(reason: RejectReason) -> Reason {
    match reason {
        RejectReason::Shutdown => Reason::Shutdown,
        RejectReason::ConcurrencyLimit => Reason::ConcurrencyLimit,
        RejectReason::BudgetLimit => Reason::BudgetLimit,
        RejectReason::QueueLimit => Reason::QueueLimit,
        RejectReason::Timeout => Reason::Timeout,
        RejectReason::Aborted => Reason::Aborted,
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
    }
}

pub(crate) fn limits_from(limits: ModelLimits) -> Limits {
    let next = Limits::new(limits.revision, limits.max_concurrent).with_max_queue(limits.max_queue);
    match limits.budget {
        Some((budget, reserve)) => next.with_token_budget(budget, reserve),
        None => next,
    }
}

pub(crate) fn detail_of(d: &CapacityDetail) -> Detail {
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
    }
}

pub(crate) fn refused_of(rejection: &Rejection) -> Refused {
    let refused = Refused {
        reason: reason_of(rejection.reason()),
        detail: detail_of(rejection.detail()),
    };
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

pub(crate) fn stats_of(s: &Stats) -> ModelStats {
    let by_reason = core::array::from_fn(|i| s.rejected_by_reason.get(RejectReason::ALL[i]));
    ModelStats {
        limits: limits_of(&s.limits),
        closed: s.closed,
        in_flight: s.in_flight,
        pending: s.pending,
        admitted: s.admitted,
        released: s.released,
        rejected: s.rejected,
        rejected_by_reason: by_reason,
        tokens: s.token_budget.map(|t| TokenStats {
            budget: t.budget,
            high_priority_reserve: t.high_priority_reserve,
            in_flight_tokens: t.in_flight_tokens,
            available: t.available,
            total_reserved: t.total_reserved,
            total_consumed: t.total_consumed,
            total_refunded: t.total_refunded,
            total_overrun: t.total_overrun,
        }),
        listener_panics: s.listener_panics,
    }
}

pub(crate) fn observe(event: &Event<'_>) -> Observed {
    match event {
        Event::Admit(e) => Observed::Admit {
            revision: e.limit_revision,
            reserved: e.reserved_tokens,
            high: e.priority == Priority::High,
        },
        Event::Reject(e) => Observed::Reject(Refused {
            reason: reason_of(e.reason),
            detail: {
                assert_eq!(e.limit_revision, e.detail.limit_revision);
                detail_of(&e.detail)
            },
        }),
        Event::Usage(e) => Observed::Usage {
            revision: e.limit_revision,
            sequence: e.sequence,
            reserved: e.reserved_tokens,
            previous_held: e.previous_held_tokens,
            held: e.held_tokens,
            usage: (e.usage.input(), e.usage.output()),
        },
        Event::Release(e) => Observed::Release {
            revision: e.limit_revision,
            reserved: e.reserved_tokens,
            held: e.held_tokens,
            refunded: e.refunded_tokens,
            sequence: e.usage_sequence,
            usage: usage_of(e.usage),
        },
        Event::Reconfigure(e) => Observed::Reconfigure {
            previous: limits_of(&e.previous),
            current: limits_of(&e.current),
        },
        other => Observed::Other(format!("{other:?}")),
    }
}

/// The request and options of a call, or the error building its explicit reservation.
pub(crate) fn prepare(call: &Call) -> Result<(LlmRequest, AcquireOptions), RequestError> {
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
    if call.explicit {
        options = options.reservation(Reservation::new(call.input, call.max_output)?);
    }
    Ok((request, options))
}
