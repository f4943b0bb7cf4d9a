//! The vocabulary of admission classes: [`AdmissionClass`](crate::classes::AdmissionClass) (a cheap handle to one configured
//! class), [`ClassLimits`](crate::classes::ClassLimits) (a class's floors and ceilings), [`Resources`](crate::classes::Resources) (what an admission
//! borrowed from the shared pool) and [`AbandonCause`](crate::classes::AbandonCause).

use crate::support::sync::unmodeled::{Mutex, OnceLock};
use crate::vocabulary::rate_limits::RateLimits;
use core::fmt;
use std::collections::HashMap;

/// One admission class, resolved once from its id with
/// [`LlmBulkhead::class`](crate::LlmBulkhead::class) and passed to
/// [`AcquireOptions::class`](crate::AcquireOptions::class). `Copy` and one word: using it costs
/// nothing. With the `serde` feature it serializes as its id.
///
/// A handle names a class id *at a position* in a bulkhead's class order: two bulkheads
/// configured with the same id at the same position share the handle, and a bulkhead refuses
/// a handle whose id it does not have at that position
/// ([`RequestError::ForeignClass`](crate::request::RequestError::ForeignClass)).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, classes::AdmissionClasses, classes::ClassLimits, LlmBulkhead, LlmRequest};
///
/// let bulkhead = LlmBulkhead::builder("m", 4)
///     .admission_classes(
///         AdmissionClasses::new("standard")
///             .class("premium", ClassLimits::new().protected_concurrent(2))
///             .class("standard", ClassLimits::new()),
///     )
///     .build()?;
/// let premium = bulkhead.class("premium")?;
/// assert_eq!(premium.id(), "premium");
/// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new().class(premium))?;
/// assert_eq!(permit.class(), Some(premium));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy)]
pub struct AdmissionClass(&'static ClassInfo);

/// What a handle points to: interned once per (id, position) for the life of the process, so
/// building bulkheads again and again does not grow memory.
#[derive(Debug)]
struct ClassInfo {
    id: &'static str,
    index: u16,
}

impl AdmissionClass {
    /// The handle of class `id` at position `index`.
    pub(crate) fn new(id: &str, index: u16) -> AdmissionClass {
        type Table = HashMap<(&'static str, u16), &'static ClassInfo>;
        static CLASSES: OnceLock<Mutex<Table>> = OnceLock::new();
        let mut classes =
            crate::support::sync::unmodeled::lock(CLASSES.get_or_init(Mutex::default));
        if let Some(&info) = classes.get(&(id, index)) {
            return AdmissionClass(info);
        }
        let id: &'static str = Box::leak(id.to_owned().into_boxed_str());
        let info: &'static ClassInfo = Box::leak(Box::new(ClassInfo { id, index }));
        classes.insert((id, index), info);
        AdmissionClass(info)
    }

    /// The class id, as configured.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .admission_classes(AdmissionClasses::new("batch").class("batch", ClassLimits::new()))
    ///     .build()?;
    /// assert_eq!(bulkhead.default_class().unwrap().id(), "batch");
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn id(&self) -> &'static str {
        self.0.id
    }

    /// The class's position in the bulkhead's class order (the order it was configured in,
    /// and the order of [`ClassesStats::classes`](crate::stats::ClassesStats)): handy to index a
    /// per-class array of metrics.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits, LlmBulkhead};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .admission_classes(AdmissionClasses::new("a").class("a", ClassLimits::new()).class("b", ClassLimits::new()))
    ///     .build()?;
    /// assert_eq!(bulkhead.class("b")?.index(), 1);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn index(&self) -> u16 {
        self.0.index
    }
}

impl PartialEq for AdmissionClass {
    fn eq(&self, other: &AdmissionClass) -> bool {
        core::ptr::eq(self.0, other.0)
    }
}

impl Eq for AdmissionClass {}

impl core::hash::Hash for AdmissionClass {
    fn hash<H: core::hash::Hasher>(&self, state: &mut H) {
        core::ptr::hash(self.0, state);
    }
}

impl fmt::Debug for AdmissionClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AdmissionClass({:?})", self.0.id)
    }
}

impl fmt::Display for AdmissionClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0.id)
    }
}

#[cfg(feature = "serde")]
impl serde::Serialize for AdmissionClass {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.0.id)
    }
}

/// The limits of one admission class: a protected floor (capacity no other class may borrow)
/// and a ceiling, for concurrent calls and for tokens in flight. Every field is optional: an
/// omitted floor is 0, an omitted ceiling leaves the class governed by the global limits only.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::classes::ClassLimits;
///
/// let premium = ClassLimits::new()
///     .protected_concurrent(2)
///     .max_concurrent(6)
///     .protected_in_flight_tokens(4_000);
/// assert_eq!(premium.protected_concurrent, Some(2));
/// assert_eq!(premium.max_in_flight_tokens, None);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[cfg_attr(feature = "serde", serde(default))]
#[non_exhaustive]
pub struct ClassLimits {
    /// Calls in flight reserved for this class: other classes never borrow them, even idle.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub protected_concurrent: Option<u32>,
    /// Most calls of this class in flight at once.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub max_concurrent: Option<u32>,
    /// Tokens in flight reserved for this class (needs a token budget).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub protected_in_flight_tokens: Option<u64>,
    /// Most tokens this class may hold in flight at once (needs a token budget).
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub max_in_flight_tokens: Option<u64>,
    /// Requests and tokens per window for this class's calls, on top of the bulkhead's own
    /// windows (a call is admitted only when it fits both). Needs rate windows on the
    /// bulkhead's builder (globally or on a class) for the engine to keep them.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub rate: Option<RateLimits>,
}

impl ClassLimits {
    /// No floor, no ceiling.
    pub const fn new() -> ClassLimits {
        ClassLimits {
            protected_concurrent: None,
            max_concurrent: None,
            protected_in_flight_tokens: None,
            max_in_flight_tokens: None,
            rate: None,
        }
    }

    /// Sets the protected floor of concurrent calls.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn protected_concurrent(mut self, slots: u32) -> ClassLimits {
        self.protected_concurrent = Some(slots);
        self
    }

    /// Sets the ceiling of concurrent calls. A ceiling of
    /// [`MAX_CONCURRENT`](crate::limits::MAX_CONCURRENT) can never bind, and the bulkhead reports it
    /// as no ceiling.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn max_concurrent(mut self, slots: u32) -> ClassLimits {
        self.max_concurrent = Some(slots);
        self
    }

    /// Sets the protected floor of tokens in flight.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn protected_in_flight_tokens(mut self, tokens: u64) -> ClassLimits {
        self.protected_in_flight_tokens = Some(tokens);
        self
    }

    /// Sets the ceiling of tokens in flight.
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn max_in_flight_tokens(mut self, tokens: u64) -> ClassLimits {
        self.max_in_flight_tokens = Some(tokens);
        self
    }

    /// Sets the class's rate limits (requests and tokens per window), counted on windows of its
    /// own beside the bulkhead's.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
    /// use async_bulkhead_llm::classes::{AdmissionClasses, ClassLimits};
    /// use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
    ///
    /// let clock = ManualClock::new();
    /// let batch = ClassLimits::new().rate(RateLimits::new(Duration::from_secs(1)).requests(2));
    /// let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
    ///     .admission_classes(
    ///         AdmissionClasses::new("interactive")
    ///             .class("interactive", ClassLimits::new())
    ///             .class("batch", batch),
    ///     )
    ///     .rate_clock(RateClock::manual(&clock))
    ///     .build()?;
    /// let batch = bulkhead.class("batch").unwrap();
    /// let call = |options: AcquireOptions| bulkhead.try_acquire(&LlmRequest::new(), options);
    /// drop((call(AcquireOptions::new().class(batch))?, call(AcquireOptions::new().class(batch))?));
    /// let refused = call(AcquireOptions::new().class(batch)).unwrap_err();
    /// assert_eq!(refused.rejection().unwrap().reason(), RejectReason::RateLimit);
    /// assert_eq!(refused.rejection().unwrap().retry_after(), Some(Duration::from_millis(500)));
    /// assert!(call(AcquireOptions::new()).is_ok()); // the other class has no window
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub const fn rate(mut self, rate: RateLimits) -> ClassLimits {
        self.rate = Some(rate);
        self
    }

    /// These limits as a snapshot reports them: a floor of 0 is omitted, a ceiling kept.
    pub(crate) fn normalized(self) -> ClassLimits {
        ClassLimits {
            protected_concurrent: self.protected_concurrent.filter(|&n| n > 0),
            protected_in_flight_tokens: self.protected_in_flight_tokens.filter(|&n| n > 0),
            ..self
        }
    }
}

/// What an admission borrowed from the shared pool when it was admitted (fixed at that
/// moment). Without admission classes nothing is ever borrowed.
///
/// A class's calls first fill its protected floor; a call beyond it *borrows* its slot from
/// the shared pool (the capacity no class protects), and the part of its tokens beyond the
/// class's token floor likewise. A class without a floor borrows for every call.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::classes::Resources;
///
/// assert_eq!(Resources::NONE, Resources::new(false, 0));
/// assert!(!Resources::NONE.borrowed_concurrency);
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct Resources {
    /// Whether the call's slot was borrowed (its class was at or above its floor).
    pub borrowed_concurrency: bool,
    /// Tokens of its reservation beyond its class's free token floor.
    pub borrowed_tokens: u64,
}

impl Resources {
    /// What a call borrowed: its slot or not, and `borrowed_tokens` (to compare with an
    /// admission's [`resources`](crate::admission::Admission::resources)).
    ///
    /// # Examples
    ///
    /// ```
    /// let r = async_bulkhead_llm::classes::Resources::new(true, 40);
    /// assert_eq!((r.borrowed_concurrency, r.borrowed_tokens), (true, 40));
    /// ```
    pub const fn new(borrowed_concurrency: bool, borrowed_tokens: u64) -> Resources {
        Resources {
            borrowed_concurrency,
            borrowed_tokens,
        }
    }

    /// Nothing borrowed.
    pub const NONE: Resources = Resources {
        borrowed_concurrency: false,
        borrowed_tokens: 0,
    };
}

/// Why an admission gave its borrowed slot back before settling.
///
/// # Examples
///
/// ```
/// assert_eq!(async_bulkhead_llm::classes::AbandonCause::Deadline.as_str(), "deadline");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum AbandonCause {
    /// Its holder called `abandon_borrowed_concurrency`.
    Manual,
    /// The `run` option `borrowed_concurrency_deadline` expired.
    Deadline,
}

impl AbandonCause {
    /// Every cause, in declaration order.
    pub const ALL: &'static [AbandonCause] = &[AbandonCause::Manual, AbandonCause::Deadline];

    /// The cause's wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            AbandonCause::Manual => "manual",
            AbandonCause::Deadline => "deadline",
        }
    }
}

impl fmt::Display for AbandonCause {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}
