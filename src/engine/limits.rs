//! Versioned limits: the public snapshot type, its validation, and the double-buffered copy that
//! admissions read without locking.
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

use super::state::{MAX_SLOTS, MAX_TOKENS};
use crate::admission_class::ClassLimits;
use crate::error::{ClassField, ClassLimitsError, LimitsError};
use crate::priority::Priority;
use crate::sync::atomic::{AtomicU64, Ordering};

/// The largest limit revision: 2^53 - 1, so revisions survive a round trip through JSON and
/// JavaScript control planes unchanged.
pub const MAX_REVISION: u64 = (1 << 53) - 1;

/// The largest `max_concurrent` the admission word can count: 2^16 - 1 (65,535 calls in flight).
pub const MAX_CONCURRENT: u32 = MAX_SLOTS;

/// The largest token budget the admission word can count: 2^35 - 1 (about 34 billion tokens in
/// flight). Usage reports cannot push the tokens in flight past it either.
pub const MAX_BUDGET: u64 = MAX_TOKENS;

/// A complete, versioned set of limits: what [`LlmBulkhead::limits`](crate::LlmBulkhead::limits)
/// returns and what [`LlmBulkhead::apply_limits`](crate::LlmBulkhead::apply_limits) installs.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Limits, LlmBulkhead, TokenBudget};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
///     .token_budget(TokenBudget::new(100_000))
///     .build()?;
/// let mut next = bulkhead.limits();
/// next.revision += 1;
/// next.max_concurrent = 16;
/// bulkhead.apply_limits(next)?;
/// assert_eq!(bulkhead.limits(), Limits::new(1, 16).with_token_budget(100_000, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct Limits {
    /// Version of this snapshot; each applied snapshot must be strictly greater.
    pub revision: u64,
    /// Hard ceiling on calls in flight; 0 refuses everything (a fail-closed kill switch).
    pub max_concurrent: u32,
    /// How many calls may wait for a slot; 0 means never wait.
    #[cfg_attr(feature = "serde", serde(default))]
    pub max_queue: u32,
    /// The token budget, present iff the bulkhead was built with one.
    #[cfg_attr(feature = "serde", serde(default))]
    pub token_budget: Option<BudgetLimits>,
    /// The admission classes' limits, in their configured order, present iff the bulkhead was
    /// built with admission classes (and then naming exactly its classes).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub admission_classes: Option<ClassLimitsTable>,
}

impl Limits {
    /// Limits at `revision` with `max_concurrent` slots, no queue and no token budget.
    ///
    /// # Examples
    ///
    /// ```
    /// let limits = async_bulkhead_llm::Limits::new(3, 10);
    /// assert_eq!((limits.revision, limits.max_concurrent, limits.max_queue), (3, 10, 0));
    /// assert!(limits.token_budget.is_none());
    /// ```
    pub const fn new(revision: u64, max_concurrent: u32) -> Limits {
        Limits {
            revision,
            max_concurrent,
            max_queue: 0,
            token_budget: None,
            admission_classes: None,
        }
    }

    /// These limits with the admission classes' limits `classes`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{ClassLimits, ClassLimitsTable, Limits};
    ///
    /// let limits = Limits::new(2, 8).with_admission_classes(
    ///     ClassLimitsTable::new().with("premium", ClassLimits::new().protected_concurrent(2)),
    /// );
    /// assert_eq!(limits.admission_classes.unwrap().get("premium").unwrap().protected_concurrent, Some(2));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn with_admission_classes(mut self, classes: ClassLimitsTable) -> Limits {
        self.admission_classes = Some(classes);
        self
    }

    /// These limits with a queue of `max_queue` places.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::Limits::new(1, 2).with_max_queue(5).max_queue, 5);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn with_max_queue(mut self, max_queue: u32) -> Limits {
        self.max_queue = max_queue;
        self
    }

    /// These limits with a token budget of `budget` tokens, `high_priority_reserve` of them
    /// usable only by high-priority calls.
    ///
    /// # Examples
    ///
    /// ```
    /// let limits = async_bulkhead_llm::Limits::new(1, 2).with_token_budget(1000, 100);
    /// assert_eq!(limits.token_budget.unwrap().budget, 1000);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn with_token_budget(mut self, budget: u64, high_priority_reserve: u64) -> Limits {
        self.token_budget = Some(BudgetLimits {
            budget,
            high_priority_reserve,
        });
        self
    }

    /// The budget a call of `priority` may fill: the whole budget for high priority, the budget
    /// minus the reserve (at least 0) for normal priority; `None` without a token budget.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, Priority};
    ///
    /// let limits = Limits::new(0, 4).with_token_budget(2400, 400);
    /// assert_eq!(limits.effective_budget(Priority::Normal), Some(2000));
    /// assert_eq!(limits.effective_budget(Priority::High), Some(2400));
    /// assert_eq!(Limits::new(0, 4).effective_budget(Priority::High), None);
    /// ```
    pub const fn effective_budget(&self, priority: Priority) -> Option<u64> {
        match self.token_budget {
            Some(b) => Some(b.effective(priority)),
            None => None,
        }
    }
}

/// The token-budget part of [`Limits`].
///
/// # Examples
///
/// ```
/// let b = async_bulkhead_llm::Limits::new(0, 1).with_token_budget(500, 50).token_budget.unwrap();
/// assert_eq!((b.budget, b.high_priority_reserve), (500, 50));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct BudgetLimits {
    /// Ceiling on tokens reserved by calls in flight at the same time.
    pub budget: u64,
    /// Tokens of the budget only high-priority calls may use. At runtime it may exceed the
    /// budget, which leaves normal-priority calls nothing.
    pub high_priority_reserve: u64,
}

impl BudgetLimits {
    #[inline]
    pub(crate) const fn effective(&self, priority: Priority) -> u64 {
        match priority {
            Priority::High => self.budget,
            Priority::Normal => self.budget.saturating_sub(self.high_priority_reserve),
        }
    }
}

/// What [`LlmBulkhead::apply_limits`](crate::LlmBulkhead::apply_limits) did.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{ApplyOutcome, Limits, LlmBulkhead};
///
/// let bulkhead = LlmBulkhead::builder("m", 1).initial_revision(5).build()?;
/// let outcome = bulkhead.apply_limits(Limits::new(5, 9))?;
/// assert_eq!(outcome, ApplyOutcome::Stale { current: Limits::new(5, 1) });
/// assert!(!outcome.is_applied());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyOutcome {
    /// The snapshot is now in force.
    Applied {
        /// The limits it replaced.
        previous: Limits,
        /// The limits now in force (the snapshot as installed).
        current: Limits,
    },
    /// The snapshot's revision was not greater than the current one; nothing changed and the
    /// rest of the snapshot was not examined.
    Stale {
        /// The limits still in force.
        current: Limits,
    },
}

impl ApplyOutcome {
    /// Whether the snapshot was installed.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// assert!(bulkhead.apply_limits(Limits::new(1, 2))?.is_applied());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn is_applied(&self) -> bool {
        matches!(self, ApplyOutcome::Applied { .. })
    }

    /// The limits in force after the call.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// assert_eq!(bulkhead.apply_limits(Limits::new(1, 2))?.current(), &Limits::new(1, 2));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn current(&self) -> &Limits {
        match self {
            ApplyOutcome::Applied { current, .. } | ApplyOutcome::Stale { current } => current,
        }
    }
}

/// The limits of every admission class, in their configured order: what
/// [`Limits::admission_classes`] holds.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{ClassLimits, ClassLimitsTable};
///
/// let mut table = ClassLimitsTable::new()
///     .with("premium", ClassLimits::new().protected_concurrent(2))
///     .with("batch", ClassLimits::new().max_concurrent(4));
/// table.insert("batch", ClassLimits::new().max_concurrent(1));
/// let ids: Vec<&str> = table.iter().map(|(id, _)| id).collect();
/// assert_eq!(ids, ["premium", "batch"]);
/// assert_eq!(table.get("batch").unwrap().max_concurrent, Some(1));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ClassLimitsTable {
    entries: Vec<(String, ClassLimits)>,
}

impl ClassLimitsTable {
    /// An empty table.
    pub const fn new() -> ClassLimitsTable {
        ClassLimitsTable {
            entries: Vec::new(),
        }
    }

    /// This table with `limits` for class `id` (replacing, or added at the end).
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn with(mut self, id: impl Into<String>, limits: ClassLimits) -> ClassLimitsTable {
        self.insert(id, limits);
        self
    }

    /// Sets the limits of class `id` (replacing them in place, or adding the class at the end);
    /// returns the limits replaced.
    pub fn insert(&mut self, id: impl Into<String>, limits: ClassLimits) -> Option<ClassLimits> {
        let id = id.into();
        match self.entries.iter_mut().find(|(have, _)| *have == id) {
            Some((_, slot)) => Some(core::mem::replace(slot, limits)),
            None => {
                self.entries.push((id, limits));
                None
            }
        }
    }

    /// The limits of class `id`.
    pub fn get(&self, id: &str) -> Option<&ClassLimits> {
        self.entries
            .iter()
            .find(|(have, _)| have == id)
            .map(|(_, limits)| limits)
    }

    /// The classes and their limits, in order.
    pub fn iter(&self) -> impl ExactSizeIterator<Item = (&str, &ClassLimits)> {
        self.entries
            .iter()
            .map(|(id, limits)| (id.as_str(), limits))
    }

    /// The number of classes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table names no class.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for ClassLimitsTable {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(Some(self.entries.len()))?;
        for (id, limits) in &self.entries {
            map.serialize_entry(id, limits)?;
        }
        map.end()
    }
}

#[cfg(feature = "serde")]
impl<'de> serde::Deserialize<'de> for ClassLimitsTable {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = ClassLimitsTable;
            fn expecting(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
                f.write_str("a map of admission class ids to their limits")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<ClassLimitsTable, A::Error> {
                let mut table = ClassLimitsTable::new();
                while let Some((id, limits)) = map.next_entry::<String, ClassLimits>()? {
                    // A repeated id keeps the last value, in the first one's place (as JSON
                    // object semantics would).
                    table.insert(id, limits);
                }
                Ok(table)
            }
        }
        deserializer.deserialize_map(Visit)
    }
}

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
        validate_class(id, limits, has_budget).map_err(LimitsError::Class)?;
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

/// Checks one class's limits (`docs/design.md` §U6.1 step 4, after the id): each field within
/// what the word counts, each floor at most its ceiling, token fields only with a budget.
pub(crate) fn validate_class(
    id: &str,
    limits: &ClassLimits,
    has_budget: bool,
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
            }
        }
    }

    /// Stores the full epoch (step 3 of the module docs), after the word's bits advanced.
    pub(crate) fn set_epoch(&self, epoch: u64) {
        self.epoch.store(epoch, Ordering::Release);
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
    #[inline]
    pub(crate) fn read_fast(&self, epoch: u64, priority: Priority) -> (u64, u32, u64) {
        let slot = &self.slots[(epoch & 1) as usize];
        // Acquire: pairs with the Release stores in `store`, see the module docs.
        let revision = slot.revision.load(Ordering::Acquire);
        let max_concurrent = slot.concurrency.load(Ordering::Acquire) as u32;
        let budget = if self.has_budget {
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
