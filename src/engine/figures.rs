//! Statistics figures: what the engine reports for a [`Stats`](crate::Stats) snapshot, read
//! at one moment (live figures from the word and the class words, cumulative ones summed from
//! the per-thread shards).

use crate::vocabulary::admission_class::{AbandonCause, AdmissionClass, ClassLimits};
use crate::vocabulary::rejection::RejectReason;

use super::assembly::Engine;
use super::classes::ClassCounts;
use super::counters::{ClassCounter, Counter, Totals};
use crate::vocabulary::limits::{ClassLimitsTable, Limits};

/// Figures read for a statistics snapshot (see `crate::stats`).
#[derive(Clone, Debug)]
pub(crate) struct Figures {
    pub(crate) limits: Limits,
    pub(crate) closed: bool,
    pub(crate) in_flight: u64,
    /// Admissions that gave their borrowed slot back and have not settled.
    pub(crate) abandoned_in_flight: u64,
    pub(crate) in_flight_tokens: u64,
    pub(crate) pending: u64,
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    pub(crate) rejected: [u64; RejectReason::ALL.len()],
    pub(crate) reserved: u64,
    pub(crate) consumed: u64,
    /// Gross: tokens removed from holds (see `crate::stats::TokenBudgetStats`).
    pub(crate) refunded: u64,
    pub(crate) overrun: u64,
    /// Tokens added back to holds below their reservations.
    pub(crate) reheld: u64,
    /// Tokens of holds returned by releases that knew no usage.
    pub(crate) returned_unreported: u64,
    /// Effective usage reports.
    pub(crate) usage_reports: u64,
    /// Admissions that abandoned their borrowed slot, by cause.
    pub(crate) abandoned: [u64; AbandonCause::ALL.len()],
    /// With admission classes.
    pub(crate) classes: Option<ClassesFigures>,
}

/// The classes' part of [`Figures`].
#[derive(Clone, Debug)]
pub(crate) struct ClassesFigures {
    pub(crate) default_class: AdmissionClass,
    /// The shared pool's capacity of slots (`max_concurrent` minus the floors).
    pub(crate) shared_capacity: u64,
    /// Slots borrowed from the shared pool, and tokens.
    pub(crate) shared_slots: u64,
    pub(crate) shared_tokens: u64,
    /// The sum of the token floors.
    pub(crate) protected_tokens: u64,
    pub(crate) classes: Vec<ClassFigures>,
}

/// One class's part of [`Figures`].
#[derive(Clone, Debug)]
pub(crate) struct ClassFigures {
    pub(crate) class: AdmissionClass,
    pub(crate) limits: ClassLimits,
    pub(crate) in_flight: u64,
    pub(crate) in_flight_tokens: u64,
    pub(crate) protected_concurrent: u64,
    pub(crate) protected_tokens: u64,
    /// The class's counters, by [`ClassCounter`].
    totals: Totals,
}

impl ClassFigures {
    pub(crate) fn get(&self, counter: ClassCounter) -> u64 {
        self.totals.get(Counter::Class(self.class.index(), counter))
    }
}

impl Engine {
    /// Everything a statistics snapshot reports, read at one moment.
    pub(crate) fn figures(&self) -> Figures {
        // Counters first, then the word: an admission whose count we see (Acquire, pairing
        // with the shard's Release store) has its slot in the word we read after, so
        // `admitted - in_flight` never counts a call as released before it was; it may lag
        // calls completing right now, and is exact once the callers are synchronised with us.
        let totals = self.counters.totals();
        let limits = self.limits();
        let (state, bounds) = self.snapshot();
        let state = self.in_flight_of(state);
        let admitted = totals.get(Counter::Admitted);
        let in_flight = u64::from(state.slots());
        // Slots handed to waiters that have not picked them up are in flight but not yet
        // admitted; admissions that abandoned their slot are unsettled but hold none.
        let handed = totals
            .get(Counter::HandedOut)
            .saturating_sub(totals.get(Counter::HandedBack));
        let unsettled = in_flight.saturating_sub(handed) + u64::from(state.abandoned());
        let classes = self.classes.as_ref().map(|classes| ClassesFigures {
            default_class: classes.default_class(),
            shared_capacity: u64::from(
                bounds
                    .max_concurrent
                    .saturating_sub(bounds.protected_concurrent),
            ),
            shared_slots: u64::from(state.shared_slots()),
            shared_tokens: state.shared_tokens(),
            protected_tokens: bounds.protected_tokens,
            classes: classes
                .handles()
                .iter()
                .zip(
                    limits
                        .admission_classes
                        .iter()
                        .flat_map(ClassLimitsTable::iter),
                )
                .map(|(&class, (_, class_limits))| {
                    let ClassCounts { slots, tokens } = classes.counts(class);
                    ClassFigures {
                        class,
                        limits: *class_limits,
                        in_flight: u64::from(slots),
                        in_flight_tokens: tokens,
                        protected_concurrent: u64::from(
                            class_limits.protected_concurrent.unwrap_or(0),
                        ),
                        protected_tokens: class_limits.protected_in_flight_tokens.unwrap_or(0),
                        totals: totals.clone(),
                    }
                })
                .collect(),
        });
        Figures {
            limits,
            closed: state.is_closed(),
            in_flight,
            abandoned_in_flight: u64::from(state.abandoned()),
            in_flight_tokens: state.tokens(),
            pending: self.queue.len(),
            admitted,
            // Every admission either holds a slot, abandoned it unsettled, or has been settled.
            released: admitted.saturating_sub(unsettled),
            rejected: core::array::from_fn(|i| totals.rejected(RejectReason::ALL[i])),
            reserved: totals.get(Counter::Reserved),
            consumed: totals.get(Counter::Consumed),
            refunded: totals.get(Counter::Refunded),
            overrun: totals.get(Counter::Overrun),
            reheld: totals.get(Counter::Reheld),
            returned_unreported: totals.get(Counter::ReturnedUnreported),
            usage_reports: totals.get(Counter::UsageReports),
            abandoned: core::array::from_fn(|i| {
                totals.get(Counter::Abandoned(AbandonCause::ALL[i]))
            }),
            classes,
        }
    }
}
