//! Limits as values: [`Limits`] (a complete, versioned snapshot), its parts ([`BudgetLimits`](crate::limits::BudgetLimits), [`RateLimits`](crate::rate::RateLimits),
//! [`ClassLimitsTable`](crate::classes::ClassLimitsTable)), what applying one did ([`ApplyOutcome`](crate::limits::ApplyOutcome)) and the ceilings the
//! admission word can count. How the engine validates, publishes and reads them is the engine's
//! (`engine/limits.rs`).

use crate::vocabulary::admission_class::ClassLimits;
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rate_limits::RateLimits;

/// The largest limit revision: 2^53 - 1, so revisions survive a round trip through JSON and
/// JavaScript control planes unchanged.
pub const MAX_REVISION: u64 = (1 << 53) - 1;

/// The largest `max_concurrent` the admission word can count: 2^16 - 1 (65,535 calls in flight).
pub const MAX_CONCURRENT: u32 = (1 << 16) - 1;

/// The largest token budget the admission word can count: 2^35 - 1 (about 34 billion tokens in
/// flight). Usage reports cannot push the tokens in flight past it either.
pub const MAX_BUDGET: u64 = (1 << 35) - 1;

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
    /// Requests and tokens per window (rate limits), present iff the bulkhead was built with
    /// them (see [`RateLimits`]).
    #[cfg_attr(
        feature = "serde",
        serde(default, skip_serializing_if = "Option::is_none")
    )]
    pub rate: Option<RateLimits>,
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
            rate: None,
        }
    }

    /// These limits with the rate limits `rate` (requests and tokens per window).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, rate::RateLimits};
    ///
    /// let limits = Limits::new(1, 8).with_rate(RateLimits::per_minute().requests(500));
    /// assert_eq!(limits.rate.unwrap().requests, Some(500));
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn with_rate(mut self, rate: RateLimits) -> Limits {
        self.rate = Some(rate);
        self
    }

    /// These limits with the admission classes' limits `classes`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{classes::ClassLimits, classes::ClassLimitsTable, Limits};
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

/// What an `apply_limits` did: [`LlmBulkhead::apply_limits`](crate::LlmBulkhead::apply_limits)
/// (`ApplyOutcome<Limits>`) or [`Bulkhead::apply_limits`](crate::Bulkhead::apply_limits)
/// (`ApplyOutcome<BulkheadLimits>`).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{limits::ApplyOutcome, Limits, LlmBulkhead};
///
/// let bulkhead = LlmBulkhead::builder("m", 1).initial_revision(5).build()?;
/// let outcome = bulkhead.apply_limits(Limits::new(5, 9))?;
/// assert_eq!(outcome, ApplyOutcome::Stale { current: Limits::new(5, 1) });
/// assert!(!outcome.is_applied());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum ApplyOutcome<L = Limits> {
    /// The snapshot is now in force.
    Applied {
        /// The limits it replaced.
        previous: L,
        /// The limits now in force (the snapshot as installed).
        current: L,
    },
    /// The snapshot's revision was not greater than the current one; nothing changed and the
    /// rest of the snapshot was not examined.
    Stale {
        /// The limits still in force.
        current: L,
    },
}

impl<L> ApplyOutcome<L> {
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
    pub fn current(&self) -> &L {
        match self {
            ApplyOutcome::Applied { current, .. } | ApplyOutcome::Stale { current } => current,
        }
    }

    /// The outcome with its limits turned into another form (a face's own limits type).
    pub(crate) fn map<M>(self, mut f: impl FnMut(L) -> M) -> ApplyOutcome<M> {
        match self {
            ApplyOutcome::Applied { previous, current } => ApplyOutcome::Applied {
                previous: f(previous),
                current: f(current),
            },
            ApplyOutcome::Stale { current } => ApplyOutcome::Stale {
                current: f(current),
            },
        }
    }
}

/// The limits of every admission class, in their configured order: what
/// [`Limits::admission_classes`] holds.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{classes::ClassLimits, classes::ClassLimitsTable};
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
