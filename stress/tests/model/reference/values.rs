//! The values the model works with (limits, calls, permits, waiters) and what the
//! harness compares between the crate and the model (refusals, events, reports, stats).

use std::fmt::Debug;

use super::rate::{Rate, WindowRefusal};

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
    /// A rate window refused the call (crate src/engine/rate.rs module docs).
    RateLimit,
}

/// In the crate's declaration order (`RejectReason::ALL`).
pub(crate) const REASONS: [Reason; 7] = [
    Reason::Shutdown,
    Reason::ConcurrencyLimit,
    Reason::BudgetLimit,
    Reason::QueueLimit,
    Reason::Timeout,
    Reason::Aborted,
    Reason::RateLimit,
];

/// The ids of the admission classes a configuration may have, in construction order (a
/// bulkhead with `n` classes has the first `n`). Ids are kept verbatim (design §U6.1), so one
/// has spaces around it.
pub(crate) const CLASS_IDS: [&str; MAX_CLASSES] = ["premium", "standard", "batch", " spare "];
/// At most this many classes in a configuration.
pub(crate) const MAX_CLASSES: usize = 4;
/// An id no configuration has (for snapshots naming the wrong classes).
pub(crate) const UNKNOWN_CLASS: &str = "gold";

/// The versioned limits (design §U8.1).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ModelLimits {
    pub(crate) revision: u64,
    pub(crate) max_concurrent: u32,
    pub(crate) max_queue: u32,
    /// `(budget B, high-priority reserve R)`.
    pub(crate) budget: Option<(u64, u64)>,
    /// The classes' limits, in construction order, iff the bulkhead has classes.
    pub(crate) classes: Option<ClassTable>,
    /// The bulkhead's rate windows (`Limits::rate`).
    pub(crate) rate: Option<Rate>,
}

/// One class's floors and ceilings (design §U6.1), as given: `None` is omitted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ClassCaps {
    pub protected_concurrent: Option<u32>,
    pub max_concurrent: Option<u32>,
    pub protected_tokens: Option<u64>,
    pub max_tokens: Option<u64>,
    /// The class's own rate windows (`ClassLimits::rate`).
    pub rate: Option<Rate>,
}

impl ClassCaps {
    /// An omitted floor is 0 (design §U6.1).
    pub(crate) fn floor(&self) -> u64 {
        u64::from(self.protected_concurrent.unwrap_or(0))
    }

    pub(crate) fn token_floor(&self) -> u64 {
        self.protected_tokens.unwrap_or(0)
    }

    /// As a snapshot reports it: a floor of 0 is omitted, a ceiling appears iff set, except a
    /// ceiling of `MAX_CONCURRENT` slots, which can never bind (design §U8.1).
    pub(crate) fn normalized(self) -> ClassCaps {
        ClassCaps {
            protected_concurrent: self.protected_concurrent.filter(|&n| n > 0),
            protected_tokens: self.protected_tokens.filter(|&n| n > 0),
            max_concurrent: self
                .max_concurrent
                .filter(|&n| n < async_bulkhead_llm::limits::MAX_CONCURRENT),
            ..self
        }
    }
}

/// A table of class limits: `(id, caps)` in order, `len` of them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClassTable {
    pub(crate) len: usize,
    pub(crate) entries: [(&'static str, ClassCaps); MAX_CLASSES],
}

impl ClassTable {
    pub(crate) fn new(entries: &[(&'static str, ClassCaps)]) -> ClassTable {
        let mut table = ClassTable {
            len: entries.len(),
            entries: [("", ClassCaps::default()); MAX_CLASSES],
        };
        table.entries[..entries.len()].copy_from_slice(entries);
        table
    }

    pub(crate) fn iter(&self) -> impl Iterator<Item = &(&'static str, ClassCaps)> {
        self.entries[..self.len].iter()
    }

    pub(crate) fn caps(&self, class: usize) -> ClassCaps {
        self.entries[class].1
    }
}

/// A limits snapshot as given to `apply_limits`: its class part may name any ids, in any order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Snapshot {
    pub(crate) revision: u64,
    pub(crate) max_concurrent: u32,
    pub(crate) max_queue: u32,
    pub(crate) budget: Option<(u64, u64)>,
    pub(crate) classes: Option<Vec<(&'static str, ClassCaps)>>,
    pub(crate) rate: Option<Rate>,
}

/// Which limit bound a decision, with classes (design §U6.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Constraint {
    Global,
    AdmissionClass,
    AdmissionClassProtection,
}

/// The capacity snapshot of a decision (design §U1.6, and with classes §U6.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Detail {
    pub(crate) limit_revision: u64,
    pub(crate) in_flight: u64,
    pub(crate) max_concurrent: u32,
    pub(crate) pending: u64,
    pub(crate) max_queue: u32,
    pub(crate) tokens: Option<TokenDetail>,
    pub(crate) constraint: Option<Constraint>,
    /// `(slots, tokens)`: the shared pools.
    pub(crate) shared: Option<(Pool, Option<Pool>)>,
    pub(crate) class: Option<ClassDetail>,
}

/// A shared pool at a decision (design §U6.5): `{capacity, in_use, available,
/// requested_borrowed}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Pool {
    pub(crate) capacity: u64,
    pub(crate) in_use: u64,
    pub(crate) available: u64,
    pub(crate) requested_borrowed: u64,
}

/// The call's class at a decision (design §U6.5).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClassDetail {
    /// The class's position in construction order.
    pub(crate) class: usize,
    pub(crate) in_flight: u64,
    pub(crate) protected_concurrent: u64,
    pub(crate) protected_concurrent_in_use: u64,
    pub(crate) borrowed_concurrent: u64,
    pub(crate) available_protected_concurrent: u64,
    pub(crate) max_concurrent: Option<u64>,
    pub(crate) available_concurrent: Option<u64>,
    pub(crate) tokens: Option<ClassTokenDetail>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClassTokenDetail {
    pub(crate) in_flight_tokens: u64,
    pub(crate) protected_tokens: u64,
    pub(crate) protected_tokens_in_use: u64,
    pub(crate) borrowed_tokens: u64,
    pub(crate) available_protected_tokens: u64,
    pub(crate) max_tokens: Option<u64>,
    pub(crate) available: Option<u64>,
    pub(crate) requested: u64,
}

/// What an admission borrowed from the shared pool, fixed at commit (design §U7.1).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Borrowed {
    pub(crate) slot: bool,
    pub(crate) tokens: u64,
}

/// Why an admission gave its borrowed slot back (design §U7.2, §U7.3), in the crate's order
/// (`AbandonCause::ALL`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cause {
    Manual,
    Deadline,
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
    /// For a `rate_limit` refusal, which window refused and its `retry_after` (none for any
    /// other refusal; a reject event carries neither, so the events compare none).
    pub(crate) rate: Option<WindowRefusal>,
}

/// A resolved call (design §U3.1): its class (none without classes), its priority and its
/// reservation `(input, max_output)`, none without a token budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    pub(crate) class: Option<usize>,
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
    pub(crate) class: Option<usize>,
    pub(crate) borrowed: Borrowed,
    /// False once it gave its borrowed slot back (design §U7.2).
    pub(crate) holds_slot: bool,
    pub(crate) high: bool,
    pub(crate) reservation: Option<(u64, u64)>,
    /// Tokens it contributes to the tokens in flight (design §U4.2).
    pub(crate) held: u64,
    /// Cumulative usage reported so far, per-field maximum (design §U4.3).
    pub(crate) reported: Option<(u64, u64)>,
    pub(crate) sequence: u64,
    /// Tokens its usage reports removed from its hold (gross).
    pub(crate) refunded: u64,
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
    /// Handed a slot and its tokens at this revision, borrowing this; not yet picked up.
    Handed {
        revision: u64,
        borrowed: Borrowed,
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

/// How a call is refused before the queue is considered, in the judging order (design §D4,
/// §U6.4).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    Shutdown,
    Budget,
    ClassTokenCeiling,
    ClassSlotCeiling,
    SlotProtection,
    TokenProtection,
    NoSlot,
}

impl Refusal {
    /// The reason and the constraint (design §U6.4); `no_slot` is the reason of a missing slot.
    pub(crate) fn reason(self, no_slot: Reason) -> (Reason, Option<Constraint>) {
        match self {
            Refusal::Shutdown => (Reason::Shutdown, None),
            Refusal::Budget => (Reason::BudgetLimit, Some(Constraint::Global)),
            Refusal::ClassTokenCeiling => (Reason::BudgetLimit, Some(Constraint::AdmissionClass)),
            Refusal::ClassSlotCeiling => {
                (Reason::ConcurrencyLimit, Some(Constraint::AdmissionClass))
            }
            Refusal::SlotProtection => (
                Reason::ConcurrencyLimit,
                Some(Constraint::AdmissionClassProtection),
            ),
            Refusal::TokenProtection => (
                Reason::BudgetLimit,
                Some(Constraint::AdmissionClassProtection),
            ),
            Refusal::NoSlot => (no_slot, Some(Constraint::Global)),
        }
    }
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
        class: Option<usize>,
        borrowed: Borrowed,
        reserved: u64,
        high: bool,
    },
    Reject {
        class: Option<usize>,
        refused: Refused,
    },
    Usage {
        revision: u64,
        class: Option<usize>,
        sequence: u64,
        reserved: u64,
        previous_held: u64,
        held: u64,
        usage: (u64, u64),
    },
    Release {
        revision: u64,
        class: Option<usize>,
        borrowed: Borrowed,
        reserved: u64,
        held: u64,
        refunded: u64,
        returned: u64,
        returned_total: u64,
        sequence: u64,
        usage: Option<(u64, u64)>,
    },
    Reconfigure {
        previous: ModelLimits,
        current: ModelLimits,
    },
    Abandon {
        revision: u64,
        high: bool,
        class: Option<usize>,
        borrowed: Borrowed,
        cause: Cause,
        held: u64,
    },
    /// A bypass began; `shadow` numbers the bypasses in the order they began (the recorder
    /// keeps the raw id, which the driver numbers before comparing).
    Bypass {
        shadow: u128,
        revision: u64,
        high: bool,
        class: Option<usize>,
        reason: Reason,
        detail: Option<Detail>,
        reservation: Option<(u64, u64)>,
        raced: bool,
    },
    /// An effective usage report of a bypassed call.
    BypassUsage {
        shadow: u128,
        revision: u64,
        high: bool,
        class: Option<usize>,
        reason: Reason,
        sequence: u64,
        reservation: Option<(u64, u64)>,
        usage: (u64, u64),
        output_cap: Option<u64>,
        output_remaining: Option<u64>,
        over_reservation: bool,
        progressive: Option<(u64, u64)>,
    },
    /// A bypassed call ended.
    BypassRelease {
        shadow: u128,
        revision: u64,
        high: bool,
        class: Option<usize>,
        reason: Reason,
        reservation: Option<(u64, u64)>,
        sequence: u64,
        usage: Option<(u64, u64)>,
    },
    /// A follower joined a shared call; `followers` counts the joins of that call so far.
    Dedup {
        class: Option<usize>,
        followers: u64,
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
    /// The hold returned at release.
    pub(crate) returned_tokens: u64,
    /// The reports' refunds plus `returned_tokens`.
    pub(crate) returned_total_tokens: u64,
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
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ModelStats {
    pub(crate) limits: ModelLimits,
    pub(crate) closed: bool,
    pub(crate) in_flight: u64,
    pub(crate) abandoned_in_flight: u64,
    /// `(total, manual, deadline)`.
    pub(crate) abandoned: (u64, u64, u64),
    pub(crate) pending: u64,
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    pub(crate) rejected: u64,
    pub(crate) rejected_by_reason: [u64; 7],
    pub(crate) tokens: Option<TokenStats>,
    pub(crate) listener_panics: u64,
    pub(crate) classes: Option<ClassesStats>,
    /// `(active, hits, key_panics)`, with deduplication.
    pub(crate) dedup: Option<(u64, u64, u64)>,
    /// Once a call was bypassed.
    pub(crate) observe: Option<ObserveFigures>,
}

/// The observe-mode part of `stats()` (crate stats.rs `ObserveStats`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct ObserveFigures {
    pub(crate) bypassed: u64,
    pub(crate) race_bypassed: u64,
    pub(crate) by_reason: [u64; 7],
    pub(crate) usage_reported: u64,
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
}

/// The refusals an observe-mode call may bypass, as bits `1 << reason` (crate options.rs
/// `ShadowReasons`: budget, concurrency, queue limit, timeout).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Shadow(pub(crate) u8);

impl Shadow {
    /// The set an operation picks (see `Op::Run`'s `observe`): none (enforce), or a set.
    pub(crate) fn pick(observe: u8) -> Option<Shadow> {
        let bits =
            |reasons: &[Reason]| Shadow(reasons.iter().fold(0, |bits, &r| bits | 1 << r as u8));
        match observe % 6 {
            0 => None,
            1 => Some(bits(&[
                Reason::BudgetLimit,
                Reason::ConcurrencyLimit,
                Reason::QueueLimit,
                Reason::Timeout,
            ])),
            2 => Some(bits(&[Reason::BudgetLimit])),
            3 => Some(bits(&[Reason::Timeout])),
            4 => Some(bits(&[Reason::ConcurrencyLimit, Reason::QueueLimit])),
            _ => Some(Shadow(0)),
        }
    }

    pub(crate) fn contains(self, reason: Reason) -> bool {
        self.0 & 1 << reason as u8 != 0
    }

    pub(crate) fn reasons(self) -> Vec<Reason> {
        REASONS
            .iter()
            .copied()
            .filter(|&r| self.contains(r))
            .collect()
    }
}

/// A bypassed call (crate observe.rs `Bypass` and `BypassCall`): the refusal it runs past and
/// its usage so far. It holds nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ModelBypass {
    /// Numbers the bypasses in the order they began.
    pub(crate) shadow: u128,
    pub(crate) reason: Reason,
    pub(crate) detail: Option<Detail>,
    pub(crate) raced: bool,
    pub(crate) reservation: Option<(u64, u64)>,
    pub(crate) revision: u64,
    pub(crate) high: bool,
    pub(crate) class: Option<usize>,
    pub(crate) reported: Option<(u64, u64)>,
    pub(crate) sequence: u64,
}

impl ModelBypass {
    pub(crate) fn reserved(&self) -> u64 {
        self.reservation.map_or(0, |(input, output)| input + output)
    }
}

/// The class part of `stats()` (design §U12, §U6.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClassesStats {
    pub(crate) default_class: usize,
    /// `(capacity, in use, available)` of the shared slots.
    pub(crate) shared: (u64, u64, u64),
    /// The same for the shared tokens (against the raw budget), with a budget.
    pub(crate) shared_tokens: Option<(u64, u64, u64)>,
    pub(crate) classes: Vec<ClassStats>,
}

/// One class's figures (design §U6.3).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ClassStats {
    pub(crate) class: usize,
    pub(crate) limits: ClassCaps,
    /// `(in_flight, protected in use, borrowed)`.
    pub(crate) slots: (u64, u64, u64),
    /// `(in_flight_tokens, protected in use, borrowed)`.
    pub(crate) tokens: (u64, u64, u64),
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    /// `(total, manual, deadline)`.
    pub(crate) abandoned: (u64, u64, u64),
    pub(crate) rejected: u64,
    pub(crate) rejected_by_reason: [u64; 7],
    pub(crate) total_reserved: u64,
    pub(crate) total_consumed: u64,
    pub(crate) total_refunded: u64,
    pub(crate) total_overrun: u64,
    pub(crate) total_reheld: u64,
    pub(crate) total_returned_unreported: u64,
    pub(crate) total_borrowed_admissions: u64,
    pub(crate) total_borrowed_tokens_reserved: u64,
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
    pub(crate) total_reheld: u64,
    pub(crate) total_returned_unreported: u64,
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
/// back up to `r` re-holds tokens refunded earlier, and every fall is refunded (all gross). So
/// a hold is always `r + overrun + reheld - refunded`, and for an admission settled with
/// usage `r + overrun + reheld == consumed + refunded` whatever path its hold took.
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
