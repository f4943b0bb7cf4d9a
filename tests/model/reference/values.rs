//! The values the model works with (limits, calls, permits, waiters) and what the
//! harness compares between the crate and the model (refusals, events, reports, stats).

use std::fmt::Debug;

/// The bulkhead's model name, unknown to the ratio table (fallback 4.0 chars per token,
/// design §U13.3).
pub(crate) const MODEL_NAME: &str = "model-under-test";
/// Maximum output of a request without `max_tokens` (design §U1.4: the budget's output cap,
/// default 2048).
pub(crate) const DEFAULT_OUTPUT_CAP: u64 = 2048;

/// Why a call was refused (design §U1.3, without the deduplication reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reason {
    Shutdown,
    ConcurrencyLimit,
    BudgetLimit,
    QueueLimit,
    Timeout,
    Aborted,
}

/// In the crate's declaration order (`RejectReason::ALL`).
pub(crate) const REASONS: [Reason; 6] = [
    Reason::Shutdown,
    Reason::ConcurrencyLimit,
    Reason::BudgetLimit,
    Reason::QueueLimit,
    Reason::Timeout,
    Reason::Aborted,
];

/// The versioned limits (design §U8.1, without admission classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ModelLimits {
    pub(crate) revision: u64,
    pub(crate) max_concurrent: u32,
    pub(crate) max_queue: u32,
    /// `(budget B, high-priority reserve R)`.
    pub(crate) budget: Option<(u64, u64)>,
}

/// The capacity snapshot of a decision (design §U1.6: a refusal's capacity detail, without
/// classes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Detail {
    pub(crate) limit_revision: u64,
    pub(crate) in_flight: u64,
    pub(crate) max_concurrent: u32,
    pub(crate) pending: u64,
    pub(crate) max_queue: u32,
    pub(crate) tokens: Option<TokenDetail>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TokenDetail {
    pub(crate) budget: u64,
    pub(crate) in_flight_tokens: u64,
    pub(crate) effective_budget: u64,
    pub(crate) available: u64,
    pub(crate) requested: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    pub(crate) reason: Reason,
    pub(crate) detail: Detail,
}

/// A resolved call (design §U3.1): its priority and its reservation `(input, max_output)`,
/// none without a token budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) high: bool,
    pub(crate) reservation: Option<(u64, u64)>,
}

impl Ask {
    /// `r = input + max_output` (design §U4.1); 0 without a budget. Resolution checked the sum.
    pub(crate) fn reserved(&self) -> u64 {
        self.reservation.map_or(0, |(input, output)| input + output)
    }
}

/// An admission as its permit sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ModelPermit {
    pub(crate) revision: u64,
    pub(crate) high: bool,
    pub(crate) reservation: Option<(u64, u64)>,
    /// Tokens it contributes to the tokens in flight (design §U4.2).
    pub(crate) held: u64,
    /// Cumulative usage reported so far, per-field maximum (design §U4.3).
    pub(crate) reported: Option<(u64, u64)>,
    pub(crate) sequence: u64,
}

impl ModelPermit {
    pub(crate) fn reserved(&self) -> u64 {
        self.reservation.map_or(0, |(input, output)| input + output)
    }
}

/// Where a waiting call is (crate queue.rs: queued, handed a slot, or refused, until its future
/// picks the outcome up).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum WaiterState {
    Queued,
    /// Handed a slot and its tokens at this revision; not yet picked up.
    Handed {
        revision: u64,
    },
    /// Refused while waiting (already counted); not yet picked up.
    Refused(Refused),
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct ModelWaiter {
    pub(crate) key: u64,
    pub(crate) ask: Ask,
    pub(crate) state: WaiterState,
}

/// How a newcomer is refused before the queue is considered.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Shutdown,
    Budget,
    NoSlot,
}

/// What an `acquire` did at its first poll.
pub(crate) enum Started {
    Admitted(ModelPermit),
    Refused(Refused),
    Queued(u64),
}

/// An event as recorded (the fields that are not timing).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum Observed {
    Admit {
        revision: u64,
        reserved: u64,
        high: bool,
    },
    Reject(Refused),
    Usage {
        revision: u64,
        sequence: u64,
        reserved: u64,
        previous_held: u64,
        held: u64,
        usage: (u64, u64),
    },
    Release {
        revision: u64,
        reserved: u64,
        held: u64,
        refunded: u64,
        sequence: u64,
        usage: Option<(u64, u64)>,
    },
    Reconfigure {
        previous: ModelLimits,
        current: ModelLimits,
    },
    Other(String),
}

/// A usage report's snapshot: what a report answers (design §U4.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct UsageSnapshot {
    pub(crate) limit_revision: u64,
    pub(crate) sequence: u64,
    pub(crate) reserved: u64,
    pub(crate) held: u64,
    pub(crate) consumed: u64,
    pub(crate) output_cap: Option<u64>,
    pub(crate) output_remaining: Option<u64>,
    pub(crate) over_reservation: bool,
}

/// A settlement's report (crate permit.rs `ReleaseReport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Settled {
    pub(crate) held_tokens: u64,
    pub(crate) refunded_tokens: u64,
    pub(crate) overrun_tokens: u64,
    pub(crate) usage: Option<(u64, u64)>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum LimitsOutcome {
    Applied {
        previous: ModelLimits,
        current: ModelLimits,
    },
    Stale {
        current: ModelLimits,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ModelVerdict {
    Admit,
    Queue,
    Reject(Reason),
}

/// `stats()` (design §U12, merged into one block as the crate's stats.rs documents).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ModelStats {
    pub(crate) limits: ModelLimits,
    pub(crate) closed: bool,
    pub(crate) in_flight: u64,
    pub(crate) pending: u64,
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    pub(crate) rejected: u64,
    pub(crate) rejected_by_reason: [u64; 6],
    pub(crate) tokens: Option<TokenStats>,
    pub(crate) listener_panics: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TokenStats {
    pub(crate) budget: u64,
    pub(crate) high_priority_reserve: u64,
    pub(crate) in_flight_tokens: u64,
    pub(crate) available: u64,
    pub(crate) total_reserved: u64,
    pub(crate) total_consumed: u64,
    pub(crate) total_refunded: u64,
    pub(crate) total_overrun: u64,
}

/// How one move of a hold is booked.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Booking {
    pub(crate) overrun: u64,
    pub(crate) refunded: u64,
    pub(crate) reheld: u64,
}

/// Books a move of a hold from `old` to `new` tokens for an admission that reserved `r`
/// (crate usage.rs "Booking (our Q4 fix)"; Q4): what rises above `r` is overrun, what rises
/// back up to `r` re-holds tokens refunded earlier (and is taken off the refunds), and every
/// fall is refunded. So for an admission settled with usage,
/// `r + overrun == consumed + refunded - reheld` whatever path its hold took.
pub(crate) fn book(r: u64, old: u64, new: u64) -> Booking {
    if new >= old {
        Booking {
            overrun: new.max(r) - old.max(r),
            refunded: 0,
            reheld: new.min(r) - old.min(r),
        }
    } else {
        Booking {
            overrun: 0,
            refunded: old - new,
            reheld: 0,
        }
    }
}

/// A cumulative total as the crate shows it: saturating at `u64::MAX` (crate stats.rs).
pub(crate) fn saturate(total: u128) -> u64 {
    u64::try_from(total).unwrap_or(u64::MAX)
}
