//! Versioned limits inside the engine: the public snapshot's validation, what a decision reads
//! of it ([`Bounds`], [`ClassCaps`]), and the double-buffered copy that admissions read without
//! locking.
//!
//! # Publication protocol
//!
//! The limits in force live in two slots of atomics; the *epoch*, a 64-bit counter stored
//! beside them, says which slot is current (`epoch & 1`), and the admission word (see
//! `super::state`) carries the epoch's low bits. Writers are serialised by the engine's limits
//! mutex. To install a snapshot, a writer
//!
//! 1. stores it into the *other* slot (`Release` stores),
//! 2. advances the word's epoch bits with a CAS: the linearization point of the change, then
//! 3. stores the next epoch (`Release`).
//!
//! A reader (see `Engine::decide`) loads the epoch, the word and the epoch again. If the two
//! epoch loads differ, a writer finished meanwhile and it reads again; otherwise the word's
//! epoch is that value, or that value plus one if a writer is between steps 2 and 3 (the word's
//! bits tell which), and the reader never waits for that writer: the slot it names was complete
//! before step 2, which the reader's `Acquire` load of the word saw. It reads that slot
//! (`Acquire` loads) and decides:
//!
//! - A *commit* is a CAS of the word expecting the value it read, then one more load of the
//!   epoch. A writer whose step 2 came between the reader's load and its CAS changed the word,
//!   so the CAS fails and the reader decides again, unless so many writers passed that the
//!   word's bits wrapped around to the same value. That takes 2^`EPOCH_BITS` writers, all but
//!   the last of which stored their epoch before the CAS could see the word again, so the epoch
//!   load after the CAS rules it out unless it moved that far; then the reader undoes its commit
//!   and decides again. A torn read of the slot needs the writer two epochs on, which starts
//!   only after the next writer's step 2, so it always comes with a failed CAS or that undo.
//! - A *refusal* commits nothing, so it is returned only if no later epoch was stored after the
//!   slot was read: the writer that would overwrite that slot had not started (the seqlock read
//!   pattern).

use crossbeam_utils::CachePadded;

use std::time::Duration;

use super::rate::RateBounds;
use super::state::{MAX_SLOTS, MAX_TOKENS};
use crate::support::sync::atomic::{AtomicU64, Ordering};
use crate::vocabulary::admission_class::ClassLimits;
use crate::vocabulary::error::{ClassField, ClassLimitsError, LimitsError};
use crate::vocabulary::limits::{
    BudgetLimits, ClassLimitsTable, Limits, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION,
};
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rate_limits::RateLimits;

// The public ceilings are what the admission word counts.
const _: () = assert!(crate::vocabulary::limits::MAX_CONCURRENT == MAX_SLOTS);
const _: () = assert!(crate::vocabulary::limits::MAX_BUDGET == MAX_TOKENS);

/// What a decision reads of the limits in force: the global limits and, with admission
/// classes, the sums of the classes' floors (each class's own limits are read with
/// [`PublishedLimits::read_class`]). `Copy`: nothing here allocates.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Bounds {
    pub(crate) revision: u64,
    pub(crate) max_concurrent: u32,
    pub(crate) max_queue: u32,
    pub(crate) token_budget: Option<BudgetLimits>,
    /// The sum of the classes' protected floors of concurrent calls (0 without classes).
    pub(crate) protected_concurrent: u32,
    /// The sum of the classes' protected floors of tokens (0 without classes).
    pub(crate) protected_tokens: u64,
}

impl Bounds {
    /// The budget a call of `priority` may fill, `None` without a token budget.
    #[inline]
    pub(crate) fn effective_budget(&self, priority: Priority) -> Option<u64> {
        self.token_budget.map(|b| b.effective(priority))
    }

    /// The global limits of `limits` (the sums are filled in by the publication).
    #[cfg(test)]
    pub(crate) fn of(limits: &Limits) -> Bounds {
        Bounds {
            revision: limits.revision,
            max_concurrent: limits.max_concurrent,
            max_queue: limits.max_queue,
            token_budget: limits.token_budget,
            protected_concurrent: 0,
            protected_tokens: 0,
        }
    }
}

/// A class's reserved floors under one epoch of the limits (see
/// [`PublishedLimits::read_floors`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Floors {
    pub(crate) slots: u32,
    pub(crate) tokens: u64,
}

/// One class's limits as a decision reads them: floors (0 when omitted) and ceilings.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClassCaps {
    pub(crate) protected_slots: u32,
    pub(crate) max_slots: Option<u32>,
    pub(crate) protected_tokens: u64,
    pub(crate) max_tokens: Option<u64>,
}

impl ClassCaps {
    fn of(limits: &ClassLimits) -> ClassCaps {
        ClassCaps {
            protected_slots: limits.protected_concurrent.unwrap_or(0),
            max_slots: limits.max_concurrent,
            protected_tokens: limits.protected_in_flight_tokens.unwrap_or(0),
            max_tokens: limits.max_in_flight_tokens,
        }
    }
}

/// Checks everything but the revision (its range and its order, which the caller checks first,
/// so a stale snapshot is reported as stale without being examined), in the order of
/// `docs/design.md` §U8.2: the global limits, the budget's shape, the classes' shape (the ids
/// the bulkhead was built with, `class_ids`), each class, then the floors' sums against the new
/// limits.
pub(crate) fn validate(
    next: &Limits,
    has_budget: bool,
    has_rate: bool,
    has_windows: bool,
    class_ids: Option<&[&str]>,
) -> Result<(), LimitsError> {
    debug_assert!(next.revision <= MAX_REVISION, "checked first by the caller");
    if next.max_concurrent > MAX_CONCURRENT {
        return Err(LimitsError::MaxConcurrentTooLarge {
            value: next.max_concurrent,
            max: MAX_CONCURRENT,
        });
    }
    match (has_budget, next.token_budget) {
        (true, None) => return Err(LimitsError::TokenBudgetRequired),
        (false, Some(_)) => return Err(LimitsError::TokenBudgetNotConfigured),
        (true, Some(b)) if b.budget > MAX_BUDGET => {
            return Err(LimitsError::BudgetTooLarge {
                value: b.budget,
                max: MAX_BUDGET,
            });
        }
        _ => {}
    }
    match (has_rate, next.rate) {
        (true, None) => return Err(LimitsError::RateLimitsRequired),
        (false, Some(_)) => return Err(LimitsError::RateLimitsNotConfigured),
        (_, Some(rate)) => validate_rate(&rate, has_budget)?,
        (false, None) => {}
    }
    let table = match (class_ids, &next.admission_classes) {
        (None, None) => return Ok(()),
        (Some(_), None) => return Err(LimitsError::AdmissionClassesRequired),
        (None, Some(_)) => return Err(LimitsError::AdmissionClassesNotConfigured),
        (Some(ids), Some(table)) => {
            let same = table.len() == ids.len() && ids.iter().all(|id| table.get(id).is_some());
            if !same {
                return Err(LimitsError::ClassIdsMismatch);
            }
            table
        }
    };
    for (id, limits) in table.iter() {
        validate_class(id, limits, has_budget, has_windows).map_err(LimitsError::Class)?;
    }
    let (slots, tokens) = floor_sums(table.iter().map(|(_, limits)| limits));
    if slots > u64::from(next.max_concurrent) {
        return Err(LimitsError::ProtectedConcurrentSumTooLarge {
            sum: slots,
            max_concurrent: next.max_concurrent,
        });
    }
    if let Some(b) = next.token_budget
        && tokens > b.budget
    {
        return Err(LimitsError::ProtectedTokensSumTooLarge {
            sum: tokens,
            budget: b.budget,
        });
    }
    Ok(())
}

/// The shortest and the longest rate window.
pub(crate) const MIN_RATE_WINDOW: Duration = Duration::from_millis(1);
pub(crate) const MAX_RATE_WINDOW: Duration = Duration::from_secs(86_400);

/// Checks rate limits: a window of 1 ms to 1 day, at least one limit, each at least 1, a
/// tokens window only with a token budget (what it counts are reservations).
pub(crate) fn validate_rate(rate: &RateLimits, has_budget: bool) -> Result<(), LimitsError> {
    if rate.window < MIN_RATE_WINDOW || rate.window > MAX_RATE_WINDOW {
        return Err(LimitsError::RateWindowOutOfRange {
            window: rate.window,
        });
    }
    if rate.requests.is_none() && rate.tokens.is_none()
        || rate.requests == Some(0)
        || rate.tokens == Some(0)
    {
        return Err(LimitsError::RateLimitsEmpty);
    }
    if rate.tokens.is_some() && !has_budget {
        return Err(LimitsError::RateTokensNeedBudget);
    }
    // At most a unit per nanosecond (a window counts time in units' shares of it).
    let window_ns = rate.window.as_nanos();
    for limit in [rate.requests, rate.tokens].into_iter().flatten() {
        if u128::from(limit) > window_ns {
            return Err(LimitsError::RateLimitTooHigh {
                limit,
                window: rate.window,
            });
        }
    }
    Ok(())
}

/// Checks one class's limits (`docs/design.md` §U6.1 step 4, after the id): each field within
/// what the word counts, each floor at most its ceiling, token fields only with a budget, rate
/// limits as the bulkhead's are checked and only on an engine that keeps windows
/// (`has_windows`: always at build, where a class's rate limits make them).
pub(crate) fn validate_class(
    id: &str,
    limits: &ClassLimits,
    has_budget: bool,
    has_windows: bool,
) -> Result<(), ClassLimitsError> {
    let class = || id.to_owned();
    let fields = [
        (
            ClassField::ProtectedConcurrent,
            limits.protected_concurrent.map(u64::from),
            u64::from(MAX_CONCURRENT),
        ),
        (
            ClassField::MaxConcurrent,
            limits.max_concurrent.map(u64::from),
            u64::from(MAX_CONCURRENT),
        ),
        (
            ClassField::ProtectedInFlightTokens,
            limits.protected_in_flight_tokens,
            MAX_BUDGET,
        ),
        (
            ClassField::MaxInFlightTokens,
            limits.max_in_flight_tokens,
            MAX_BUDGET,
        ),
    ];
    for (field, value, max) in fields {
        if let Some(value) = value
            && value > max
        {
            return Err(ClassLimitsError::TooLarge {
                class: class(),
                field,
                value,
                max,
            });
        }
    }
    if let (Some(max), protected) = (
        limits.max_concurrent,
        limits.protected_concurrent.unwrap_or(0),
    ) && protected > max
    {
        return Err(ClassLimitsError::ProtectedAboveMax {
            class: class(),
            field: ClassField::ProtectedConcurrent,
            protected: u64::from(protected),
            max: u64::from(max),
        });
    }
    if let (Some(max), protected) = (
        limits.max_in_flight_tokens,
        limits.protected_in_flight_tokens.unwrap_or(0),
    ) && protected > max
    {
        return Err(ClassLimitsError::ProtectedAboveMax {
            class: class(),
            field: ClassField::ProtectedInFlightTokens,
            protected,
            max,
        });
    }
    if !has_budget {
        if limits.protected_in_flight_tokens.is_some() {
            return Err(ClassLimitsError::TokensWithoutBudget {
                class: class(),
                field: ClassField::ProtectedInFlightTokens,
            });
        }
        if limits.max_in_flight_tokens.is_some() {
            return Err(ClassLimitsError::TokensWithoutBudget {
                class: class(),
                field: ClassField::MaxInFlightTokens,
            });
        }
    }
    if let Some(rate) = &limits.rate {
        let refused = |error| ClassLimitsError::Rate {
            class: class(),
            error: Box::new(error),
        };
        if !has_windows {
            return Err(refused(LimitsError::RateLimitsNotConfigured));
        }
        validate_rate(rate, has_budget).map_err(refused)?;
    }
    Ok(())
}

/// The sums of the floors of `classes`: `(concurrent calls, tokens)`, in 64 bits (they cannot
/// overflow: each field is at most `MAX_BUDGET` and there are fewer than 2^16 classes).
pub(crate) fn floor_sums<'a>(classes: impl Iterator<Item = &'a ClassLimits>) -> (u64, u64) {
    classes.fold((0, 0), |(slots, tokens), limits| {
        (
            slots + u64::from(limits.protected_concurrent.unwrap_or(0)),
            tokens + limits.protected_in_flight_tokens.unwrap_or(0),
        )
    })
}

/// One published copy of the limits, as atomics (see the module docs).
#[derive(Debug, Default)]
struct LimitsSlot {
    revision: AtomicU64,
    /// `max_concurrent` in the low 32 bits, `max_queue` in the high 32.
    concurrency: AtomicU64,
    budget: AtomicU64,
    reserve: AtomicU64,
    /// With classes: the sum of the floors of concurrent calls in the low 32 bits (at most
    /// `MAX_CONCURRENT`), unused high bits.
    protected_concurrent: AtomicU64,
    /// With classes: the sum of the floors of tokens.
    protected_tokens: AtomicU64,
    /// With classes: each class's limits.
    classes: Box<[ClassSlot]>,
    /// With rate windows: the bulkhead's.
    rate: RateSlot,
}

/// One pair of windows' published figures (0: that window not configured).
#[derive(Debug, Default)]
struct RateSlot {
    /// The window in nanoseconds, the requests and the tokens per window.
    window: AtomicU64,
    requests: AtomicU64,
    tokens: AtomicU64,
    /// Each window's ticks per nanosecond (see `rate::per_ns`).
    requests_per_ns: AtomicU64,
    tokens_per_ns: AtomicU64,
}

impl RateSlot {
    fn store(&self, rate: Option<&RateLimits>) {
        let rate = RateBounds::of(rate);
        // Release: pairs with the Acquire loads in `read`, see the module docs.
        self.window.store(rate.window_ns, Ordering::Release);
        self.requests.store(rate.requests, Ordering::Release);
        self.tokens.store(rate.tokens, Ordering::Release);
        self.requests_per_ns
            .store(rate.requests_per_ns, Ordering::Release);
        self.tokens_per_ns
            .store(rate.tokens_per_ns, Ordering::Release);
    }

    #[inline]
    fn read(&self) -> RateBounds {
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        RateBounds {
            window_ns: self.window.load(Ordering::Acquire),
            requests: self.requests.load(Ordering::Acquire),
            tokens: self.tokens.load(Ordering::Acquire),
            requests_per_ns: self.requests_per_ns.load(Ordering::Acquire),
            tokens_per_ns: self.tokens_per_ns.load(Ordering::Acquire),
        }
    }
}

/// One class's published limits.
#[derive(Debug, Default)]
struct ClassSlot {
    /// The floor of concurrent calls in the low 32 bits; the ceiling in the high 32
    /// (`u32::MAX`: none; ceilings are at most `MAX_CONCURRENT`).
    concurrency: AtomicU64,
    protected_tokens: AtomicU64,
    /// The ceiling of tokens (`u64::MAX`: none; ceilings are at most `MAX_BUDGET`).
    max_tokens: AtomicU64,
    /// The class's rate windows (all 0 without).
    rate: RateSlot,
}

/// How a published ceiling says "none".
const NO_SLOT_CEILING: u32 = u32::MAX;
const NO_TOKEN_CEILING: u64 = u64::MAX;

/// The double-buffered limits that admissions read without a lock, and the full epoch.
#[derive(Debug)]
pub(crate) struct PublishedLimits {
    /// Which slot is current: `epoch & 1`. Its low bits are also in the admission word.
    epoch: CachePadded<AtomicU64>,
    slots: [CachePadded<LimitsSlot>; 2],
    has_budget: bool,
    has_classes: bool,
}

impl PublishedLimits {
    /// Publishes `initial` for epoch 0.
    pub(crate) fn new(initial: &Limits) -> PublishedLimits {
        let classes = initial
            .admission_classes
            .as_ref()
            .map_or(0, ClassLimitsTable::len);
        let slot = || {
            CachePadded::new(LimitsSlot {
                classes: (0..classes).map(|_| ClassSlot::default()).collect(),
                ..LimitsSlot::default()
            })
        };
        let published = PublishedLimits {
            epoch: CachePadded::new(AtomicU64::new(0)),
            slots: [slot(), slot()],
            has_budget: initial.token_budget.is_some(),
            has_classes: initial.admission_classes.is_some(),
        };
        published.store(0, initial);
        published.set_epoch(0);
        published
    }

    /// The current epoch (`Acquire`: pairs with the `Release` store in `set_epoch`, so the slot
    /// it names is complete).
    #[inline]
    pub(crate) fn epoch(&self) -> u64 {
        self.epoch.load(Ordering::Acquire)
    }

    /// Stores `limits` into the slot of `epoch` (step 1 of the module docs). The caller holds
    /// the limits mutex and `epoch` is the current epoch plus one.
    pub(crate) fn store(&self, epoch: u64, limits: &Limits) {
        let slot = &self.slots[(epoch & 1) as usize];
        // Release: pairs with the Acquire loads in `read`, see the module docs.
        slot.revision.store(limits.revision, Ordering::Release);
        let concurrency = u64::from(limits.max_concurrent) | (u64::from(limits.max_queue) << 32);
        slot.concurrency.store(concurrency, Ordering::Release);
        if let Some(b) = limits.token_budget {
            slot.budget.store(b.budget, Ordering::Release);
            slot.reserve
                .store(b.high_priority_reserve, Ordering::Release);
        }
        slot.rate.store(limits.rate.as_ref());
        if let Some(table) = &limits.admission_classes {
            let (floors, tokens) = floor_sums(table.iter().map(|(_, limits)| limits));
            slot.protected_concurrent.store(floors, Ordering::Release);
            slot.protected_tokens.store(tokens, Ordering::Release);
            debug_assert_eq!(table.len(), slot.classes.len());
            for (class, (_, limits)) in slot.classes.iter().zip(table.iter()) {
                let caps = ClassCaps::of(limits);
                let concurrency = u64::from(caps.protected_slots)
                    | (u64::from(caps.max_slots.unwrap_or(NO_SLOT_CEILING)) << 32);
                class.concurrency.store(concurrency, Ordering::Release);
                class
                    .protected_tokens
                    .store(caps.protected_tokens, Ordering::Release);
                class.max_tokens.store(
                    caps.max_tokens.unwrap_or(NO_TOKEN_CEILING),
                    Ordering::Release,
                );
                class.rate.store(limits.rate.as_ref());
            }
        }
    }

    /// Stores the full epoch (step 3 of the module docs), after the word's bits advanced.
    pub(crate) fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
    }

    /// Reads the rate windows' figures of the slot of `epoch` (as [`read`](Self::read): only
    /// trustworthy if the epoch is still current afterwards).
    #[inline]
    pub(crate) fn read_rate(&self, epoch: u64) -> RateBounds {
        self.slots[(epoch & 1) as usize].rate.read()
    }

    /// Reads class `index`'s rate windows' figures of the slot of `epoch` (trustworthy as
    /// [`read_rate`](Self::read_rate) is).
    #[inline]
    pub(crate) fn read_class_rate(&self, epoch: u64, index: usize) -> RateBounds {
        self.slots[(epoch & 1) as usize].classes[index].rate.read()
    }

    /// Reads the slot of `epoch`. Only trustworthy if the epoch is still current afterwards
    /// (see the module docs).
    #[inline]
    pub(crate) fn read(&self, epoch: u64) -> Bounds {
        let slot = &self.slots[(epoch & 1) as usize];
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        let revision = slot.revision.load(Ordering::Acquire);
        let concurrency = slot.concurrency.load(Ordering::Acquire);
        let token_budget = if self.has_budget {
            Some(BudgetLimits {
                budget: slot.budget.load(Ordering::Acquire),
                high_priority_reserve: slot.reserve.load(Ordering::Acquire),
            })
        } else {
            None
        };
        let (protected_concurrent, protected_tokens) = if self.has_classes {
            (
                slot.protected_concurrent.load(Ordering::Acquire) as u32,
                slot.protected_tokens.load(Ordering::Acquire),
            )
        } else {
            (0, 0)
        };
        Bounds {
            revision,
            max_concurrent: concurrency as u32,
            max_queue: (concurrency >> 32) as u32,
            token_budget,
            protected_concurrent,
            protected_tokens,
        }
    }

    /// What the fast lane of an admission reads of the slot of `epoch` (trustworthy as
    /// [`read`](PublishedLimits::read) is): `(revision, max_concurrent, the budget a call of
    /// `priority` may fill)`, the budget `u64::MAX` without one (nothing is reserved then).
    /// `has_budget` is whether these limits have one: the caller's (inlined, a constant
    /// `false` reads two figures).
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn read_fast(
        &self,
        has_budget: bool,
        epoch: u64,
        priority: Priority,
    ) -> (u64, u32, u64) {
        debug_assert_eq!(has_budget, self.has_budget);
        let slot = &self.slots[(epoch & 1) as usize];
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        let revision = slot.revision.load(Ordering::Acquire);
        let max_concurrent = slot.concurrency.load(Ordering::Acquire) as u32;
        let budget = if has_budget {
            let budget = slot.budget.load(Ordering::Acquire);
            match priority {
                Priority::High => budget,
                Priority::Normal => budget.saturating_sub(slot.reserve.load(Ordering::Acquire)),
            }
        } else {
            u64::MAX
        };
        (revision, max_concurrent, budget)
    }

    /// The revision of the slot of `epoch`.
    #[inline]
    pub(crate) fn revision(&self, epoch: u64) -> u64 {
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        self.slots[(epoch & 1) as usize]
            .revision
            .load(Ordering::Acquire)
    }

    /// The high-priority reserve of the slot of `epoch` (0 without a budget).
    #[inline]
    pub(crate) fn reserve(&self, epoch: u64) -> u64 {
        if self.has_budget {
            // Acquire: pairs with the Release stores in `store`, see the module docs.
            self.slots[(epoch & 1) as usize]
                .reserve
                .load(Ordering::Acquire)
        } else {
            0
        }
    }

    /// Reads class `index`'s floors from the slot of `epoch` (trustworthy as [`read`] is):
    /// its reserved slots and tokens, what a call within the floors is decided on. Its ceilings
    /// are not read: a floor is at most its ceiling (checked by the limits' validation,
    /// `ProtectedAboveMax`), so a count within a floor is within the ceiling too.
    #[inline]
    pub(crate) fn read_floors(&self, epoch: u64, index: usize) -> Floors {
        let class = &self.slots[(epoch & 1) as usize].classes[index];
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        let floors = Floors {
            slots: class.concurrency.load(Ordering::Acquire) as u32,
            tokens: class.protected_tokens.load(Ordering::Acquire),
        };
        debug_assert!({
            let caps = self.read_class(epoch, index);
            caps.max_slots.is_none_or(|max| floors.slots <= max)
                && caps.max_tokens.is_none_or(|max| floors.tokens <= max)
        });
        floors
    }

    /// Reads class `index`'s limits from the slot of `epoch` (trustworthy as [`read`] is).
    #[inline]
    pub(crate) fn read_class(&self, epoch: u64, index: usize) -> ClassCaps {
        let class = &self.slots[(epoch & 1) as usize].classes[index];
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        let concurrency = class.concurrency.load(Ordering::Acquire);
        let max_slots = (concurrency >> 32) as u32;
        let max_tokens = class.max_tokens.load(Ordering::Acquire);
        ClassCaps {
            protected_slots: concurrency as u32,
            max_slots: (max_slots != NO_SLOT_CEILING).then_some(max_slots),
            protected_tokens: class.protected_tokens.load(Ordering::Acquire),
            max_tokens: (max_tokens != NO_TOKEN_CEILING).then_some(max_tokens),
        }
    }
}

/// `limits` as the engine keeps and reports them: classes in their construction order (`order`;
/// at construction, the order given) with floors of 0 and ceilings of `MAX_CONCURRENT` slots
/// omitted.
pub(super) fn normalized(mut limits: Limits, order: Option<&[&'static str]>) -> Limits {
    if let Some(table) = limits.admission_classes.take() {
        // In the classes' order (fixed at construction; the published caps are stored by
        // position), with floors of 0 omitted.
        let ids: Vec<String> = match order {
            Some(order) => order.iter().map(|&id| id.to_owned()).collect(),
            None => table.iter().map(|(id, _)| id.to_owned()).collect(),
        };
        let mut ordered = ClassLimitsTable::new();
        for id in ids {
            let mut class = table
                .get(&id)
                .expect("validated: the same ids")
                .normalized();
            // A ceiling of `MAX_CONCURRENT` calls can never bind: no ceiling (so a refusal's
            // packed class figures can use that value for "none", see `ClassFacts`).
            class.max_concurrent = class.max_concurrent.filter(|&n| n < MAX_CONCURRENT);
            ordered.insert(id, class);
        }
        limits.admission_classes = Some(ordered);
    }
    limits
}
