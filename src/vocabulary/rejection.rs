//! Capacity refusals: why a call may not run now, and the capacity snapshot taken at the
//! moment of the decision (what a gateway puts in a 429/503 body).

use core::fmt;
use std::time::Duration;

use crate::vocabulary::admission_class::AdmissionClass;

/// Why a call was refused.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::RejectReason;
///
/// assert_eq!(RejectReason::BudgetLimit.as_str(), "budget_limit");
/// assert_eq!(RejectReason::Shutdown.to_string(), "shutdown");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum RejectReason {
    /// The bulkhead is closed.
    Shutdown,
    /// No concurrency slot is free (or `max_concurrent` is 0) and the call may not queue.
    ConcurrencyLimit,
    /// The reservation does not fit in the priority-adjusted token budget.
    BudgetLimit,
    /// No slot is free and the wait queue is full.
    QueueLimit,
    /// The call waited in the queue longer than its timeout.
    Timeout,
    /// The waiting call was cancelled (its future dropped).
    Aborted,
    /// A rate window (requests or tokens per window, see
    /// [`RateLimits`](crate::rate::RateLimits)) has no room for the call now;
    /// [`Rejection::retry_after`] says when it would.
    RateLimit,
}

impl RejectReason {
    /// Every reason, in declaration order. A slice, so that adding a reason (the enum is
    /// `#[non_exhaustive]`) changes no type.
    pub const ALL: &'static [RejectReason] = &[
        RejectReason::Shutdown,
        RejectReason::ConcurrencyLimit,
        RejectReason::BudgetLimit,
        RejectReason::QueueLimit,
        RejectReason::Timeout,
        RejectReason::Aborted,
        RejectReason::RateLimit,
    ];

    /// The reason's wire name, as the JavaScript original spells it.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::RejectReason::QueueLimit.as_str(), "queue_limit");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectReason::Shutdown => "shutdown",
            RejectReason::ConcurrencyLimit => "concurrency_limit",
            RejectReason::BudgetLimit => "budget_limit",
            RejectReason::QueueLimit => "queue_limit",
            RejectReason::Timeout => "timeout",
            RejectReason::Aborted => "aborted",
            RejectReason::RateLimit => "rate_limit",
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Which rate window refused a `rate_limit` refusal ([`Rejection::rate_window`]): the
/// bulkhead's own windows, or those of the call's admission class
/// ([`ClassLimits::rate`](crate::classes::ClassLimits::rate)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum RateWindow {
    /// The bulkhead's requests window.
    Requests,
    /// The bulkhead's tokens window.
    Tokens,
    /// The call's admission class's requests window.
    ClassRequests,
    /// The call's admission class's tokens window.
    ClassTokens,
}

impl RateWindow {
    /// The window of a class's pair (`class`) or the bulkhead's, the tokens one (`tokens`) or
    /// the requests one.
    pub(crate) const fn of(class: bool, tokens: bool) -> RateWindow {
        match (class, tokens) {
            (false, false) => RateWindow::Requests,
            (false, true) => RateWindow::Tokens,
            (true, false) => RateWindow::ClassRequests,
            (true, true) => RateWindow::ClassTokens,
        }
    }

    /// The window's wire name.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::rate::RateWindow::ClassTokens.as_str(), "class_tokens");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            RateWindow::Requests => "requests",
            RateWindow::Tokens => "tokens",
            RateWindow::ClassRequests => "class_requests",
            RateWindow::ClassTokens => "class_tokens",
        }
    }
}

/// Which level of a tenant-within-global admission refused a call: the tenant's own limits or
/// the global ones above every tenant (see
/// [`LlmBulkhead::try_acquire_within`](crate::LlmBulkhead::try_acquire_within)). A refusal
/// by a bulkhead used on its own has no scope ([`Rejection::scope`] is `None`).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, rejection::Scope};
///
/// let global = LlmBulkhead::builder("gpt-4o", 8).build()?;
/// let tenant = LlmBulkhead::builder("gpt-4o", 1).tenant("acme").build()?;
/// let request = LlmRequest::new();
/// let _held = tenant.try_acquire_within(&global, &request, AcquireOptions::new())?;
/// let err = tenant.try_acquire_within(&global, &request, AcquireOptions::new()).unwrap_err();
/// assert_eq!(err.rejection().unwrap().scope(), Some(Scope::Tenant));
/// assert_eq!(Scope::Tenant.as_str(), "tenant");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Scope {
    /// The tenant's own limits refused the call (the global ones were not asked).
    Tenant,
    /// The global limits refused the call (its tenant's limits had room; nothing was counted
    /// against the tenant).
    Global,
}

impl Scope {
    /// The scope's wire name: `tenant` or `global`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::rejection::Scope::Global.as_str(), "global");
    /// ```
    pub const fn as_str(self) -> &'static str {
        match self {
            Scope::Tenant => "tenant",
            Scope::Global => "global",
        }
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The capacity snapshot taken when a decision was made.
///
/// All figures come from one consistent reading of the admission word and the limits in force
/// at that instant.
///
/// With the `serde` feature it serializes as a flat object of its fields (`token_budget`
/// omitted without a token budget, `constraint` when no limit bound), followed, for a decision
/// with admission classes, by the computed `admission_class` ([`ClassDetail`](crate::rejection::ClassDetail)) and
/// `shared_capacity` ([`SharedCapacity`](crate::rejection::SharedCapacity)), which are omitted otherwise.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
///
/// let bulkhead = LlmBulkhead::builder("claude-sonnet-4", 4)
///     .token_budget(TokenBudget::new(2400).high_priority_reserve(400))
///     .build()?;
/// let opts = AcquireOptions::new().reservation(Reservation::new(100, 1000)?);
/// let _held = bulkhead.try_acquire(&LlmRequest::new(), opts)?;
/// let rejection = bulkhead.try_acquire(&LlmRequest::new(), opts).unwrap_err();
/// let budget = rejection.rejection().unwrap().detail().token_budget.unwrap();
/// assert_eq!(
///     (budget.budget, budget.in_flight_tokens, budget.effective_budget, budget.available, budget.requested),
///     (2400, 1100, 2000, 900, 1100),
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy)]
#[non_exhaustive]
pub struct CapacityDetail {
    /// Revision of the limits in force at the decision.
    pub limit_revision: u64,
    /// Slots held at the decision.
    pub in_flight: u64,
    /// The concurrency limit in force.
    pub max_concurrent: u32,
    /// Calls waiting in the queue at the decision.
    pub pending: u64,
    /// The queue limit in force.
    pub max_queue: u32,
    /// The token picture, present iff the bulkhead has a token budget.
    pub token_budget: Option<TokenBudgetDetail>,
    /// Which limit bound, when the bulkhead has admission classes and a limit did (none for
    /// `shutdown` and `aborted`).
    pub constraint: Option<Constraint>,
    /// The refusal's reason (a rejection's detail only; see [`Rejection`] for why it is here).
    reason: Option<RejectReason>,
    /// A rejection's detail only, packed in one word (so that a snapshot is built with one
    /// store for all of it): the level that refused in a tenant-within-global admission (bits
    /// `SCOPE_SHIFT..`: 0 none, 1 tenant, 2 global); for a `rate_limit` refusal, whether the
    /// tokens window refused (`RATE_TOKENS`), whether its class's (`RATE_CLASS`), and when
    /// the call would fit, in milliseconds
    /// rounded up, or seconds beyond about 1.55 days (the low bits, `RETRY_NEVER`: never).
    refusal: u32,
    /// The class and shared-pool figures of a class decision, packed (see [`ClassFacts`]);
    /// read them with [`admission_class`](CapacityDetail::admission_class) and
    /// [`shared_capacity`](CapacityDetail::shared_capacity).
    class: Option<ClassFacts>,
}

impl CapacityDetail {
    /// A snapshot of figures decided elsewhere (a ledger shared by replicas, another process),
    /// in this crate's vocabulary: the limits' revision, calls in flight and their cap, calls
    /// waiting and the queue's cap, and the token figures if there is a budget. With
    /// [`Rejection::budget_limit`] or [`Rejection::rate_limit`] it makes a refusal a gateway
    /// answers exactly as it answers its own bulkhead's. (The engine builds the global part of
    /// its own snapshots with it: no class figures, no constraint.)
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::rejection::{CapacityDetail, TokenBudgetDetail};
    ///
    /// let tokens = TokenBudgetDetail::compute(200_000, 0, false, 199_500, 1_200);
    /// let detail = CapacityDetail::new(7, 3, 64, 0, 0, Some(tokens));
    /// assert_eq!((detail.limit_revision, detail.in_flight), (7, 3));
    /// assert_eq!(detail.token_budget.unwrap().available, 500);
    /// ```
    #[cfg_attr(not(loom), inline(always))]
    pub const fn new(
        limit_revision: u64,
        in_flight: u64,
        max_concurrent: u32,
        pending: u64,
        max_queue: u32,
        token_budget: Option<TokenBudgetDetail>,
    ) -> CapacityDetail {
        CapacityDetail {
            limit_revision,
            in_flight,
            max_concurrent,
            pending,
            max_queue,
            token_budget,
            constraint: None,
            reason: None,
            refusal: 0,
            class: None,
        }
    }

    /// This snapshot with the figures of a class decision.
    pub(crate) fn with_class(mut self, constraint: Option<Constraint>, facts: ClassFacts) -> Self {
        self.constraint = constraint;
        self.class = Some(facts);
        self
    }

    /// The call's admission class at the decision, with admission classes: its calls and
    /// tokens in flight against its floors and ceilings.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::*;
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits, rejection::Constraint};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .admission_classes(
    ///         AdmissionClasses::new("batch")
    ///             .class("premium", ClassLimits::new().protected_concurrent(2))
    ///             .class("batch", ClassLimits::new().max_concurrent(1)),
    ///     )
    ///     .build()?;
    /// let _batch = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// let detail = err.rejection().unwrap().detail();
    /// assert_eq!(detail.constraint, Some(Constraint::AdmissionClass));
    /// let class = detail.admission_class().unwrap();
    /// assert_eq!((class.class.id(), class.in_flight, class.max_concurrent), ("batch", 1, Some(1)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn admission_class(&self) -> Option<ClassDetail> {
        let facts = self.class?;
        let [slots, protected, max_slots, _, _] = facts.slots();
        let max_slots = (max_slots != u64::from(NO_SLOT_CEILING)).then_some(max_slots);
        let [tokens, protected_tokens, max_tokens, _, _] = facts.tokens();
        let max_tokens = facts.has_token_ceiling().then_some(max_tokens);
        Some(ClassDetail {
            class: facts.class,
            in_flight: slots,
            protected_concurrent: protected,
            protected_concurrent_in_use: slots.min(protected),
            borrowed_concurrent: slots.saturating_sub(protected),
            available_protected_concurrent: protected.saturating_sub(slots),
            max_concurrent: max_slots,
            available_concurrent: max_slots.map(|max| max.saturating_sub(slots)),
            token_budget: self.token_budget.map(|budget| ClassTokenDetail {
                in_flight_tokens: tokens,
                protected_in_flight_tokens: protected_tokens,
                protected_tokens_in_use: tokens.min(protected_tokens),
                borrowed_in_flight_tokens: tokens.saturating_sub(protected_tokens),
                available_protected_tokens: protected_tokens.saturating_sub(tokens),
                max_in_flight_tokens: max_tokens,
                available: max_tokens.map(|max| max.saturating_sub(tokens)),
                requested: budget.requested,
            }),
        })
    }

    /// The shared pools at the decision, with admission classes: the capacity no class
    /// protects, what calls beyond their floors borrow of it, and what this call would borrow.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::*;
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 3)
    ///     .admission_classes(
    ///         AdmissionClasses::new("batch")
    ///             .class("premium", ClassLimits::new().protected_concurrent(2))
    ///             .class("batch", ClassLimits::new()),
    ///     )
    ///     .build()?;
    /// let _batch = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// let pool = err.rejection().unwrap().detail().shared_capacity().unwrap().concurrency;
    /// assert_eq!((pool.capacity, pool.in_use, pool.available, pool.requested_borrowed), (1, 1, 0, 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn shared_capacity(&self) -> Option<SharedCapacity> {
        let facts = self.class?;
        let [slots, protected, _, shared_slots, slot_capacity] = facts.slots();
        let [tokens, protected_tokens, _, shared_tokens, token_capacity] = facts.tokens();
        Some(SharedCapacity {
            concurrency: SharedPool::compute(
                slot_capacity,
                shared_slots,
                u64::from(slots >= protected),
            ),
            token_budget: self.token_budget.map(|budget| {
                let r = budget.requested;
                let free_floor = protected_tokens.saturating_sub(tokens);
                SharedPool::compute(token_capacity, shared_tokens, r.saturating_sub(free_floor))
            }),
        })
    }

    /// Whether the call's reservation exceeds what the limits in force let it hold even with
    /// nothing in flight: the budget its priority may use
    /// ([`TokenBudgetDetail::can_never_fit`](crate::rejection::TokenBudgetDetail::can_never_fit)) or its class's token ceiling
    /// ([`ClassTokenDetail::can_never_fit`](crate::rejection::ClassTokenDetail::can_never_fit)). Such a call cannot succeed by being retried
    /// unchanged; an HTTP gateway answers it 413 rather than 429 (see [`HttpRefusal`](crate::http::HttpRefusal)).
    ///
    /// [`HttpRefusal`]: crate::http::HttpRefusal
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::*;
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4).token_budget(TokenBudget::new(1000)).build()?;
    /// let too_big = AcquireOptions::new().reservation(Reservation::new(500, 1000)?);
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), too_big).unwrap_err();
    /// assert!(err.rejection().unwrap().detail().can_never_fit());
    ///
    /// let _held = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new().reservation(Reservation::new(0, 600)?))?;
    /// let later = AcquireOptions::new().reservation(Reservation::new(0, 600)?);
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), later).unwrap_err();
    /// assert!(!err.rejection().unwrap().detail().can_never_fit()); // fits once the first call ends
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn can_never_fit(&self) -> bool {
        self.token_budget
            .is_some_and(|budget| budget.can_never_fit())
            || self
                .admission_class()
                .and_then(|class| class.token_budget)
                .is_some_and(|tokens| tokens.can_never_fit())
    }
}

impl CapacityDetail {
    /// The wait of a rate refusal (`None`: never fits).
    fn retry_after(&self) -> Option<Duration> {
        let value = u64::from(self.refusal & RETRY_VALUE);
        if self.refusal & RETRY_SECONDS != 0 {
            Some(Duration::from_secs(value))
        } else {
            (value != u64::from(RETRY_NEVER)).then(|| Duration::from_millis(value))
        }
    }

    /// Whether this is the snapshot of a rate refusal that can never fit its window.
    pub(crate) fn rate_never_fits(&self) -> bool {
        self.reason == Some(RejectReason::RateLimit)
            && self.refusal & (RETRY_SECONDS | RETRY_VALUE) == RETRY_NEVER
    }

    /// Whether a rate refusal came from the tokens window.
    fn rate_tokens(&self) -> bool {
        self.refusal & RATE_TOKENS != 0
    }

    /// Whether a rate refusal came from the call's admission class's windows.
    fn rate_class(&self) -> bool {
        self.refusal & RATE_CLASS != 0
    }

    /// The level that refused.
    fn scope(&self) -> Option<Scope> {
        match self.refusal >> SCOPE_SHIFT {
            1 => Some(Scope::Tenant),
            2 => Some(Scope::Global),
            _ => None,
        }
    }

    /// Marks the level that refused.
    fn set_scope(&mut self, scope: Scope) {
        let bits = match scope {
            Scope::Tenant => 1,
            Scope::Global => 2,
        };
        self.refusal = (self.refusal & !(3 << SCOPE_SHIFT)) | bits << SCOPE_SHIFT;
    }
}

/// `CapacityDetail::refusal`'s fields.
const SCOPE_SHIFT: u32 = 30;
const RATE_TOKENS: u32 = 1 << 29;
const RATE_CLASS: u32 = 1 << 28;
/// A rate refusal's wait: whole milliseconds (rounded up) in 27 bits, up to about 1.55 days
/// (beyond the longest window, a day); a longer wait (usage charged far beyond a window's
/// limit) in whole seconds (rounded up, up to about 4.25 years), flagged `RETRY_SECONDS`; all
/// ones in milliseconds: never.
const RETRY_SECONDS: u32 = 1 << 27;
const RETRY_VALUE: u32 = RETRY_SECONDS - 1;
const RETRY_NEVER: u32 = RETRY_VALUE;

impl PartialEq for CapacityDetail {
    /// Compares the figures (the class figures included), not the reason.
    fn eq(&self, other: &CapacityDetail) -> bool {
        self.limit_revision == other.limit_revision
            && self.in_flight == other.in_flight
            && self.max_concurrent == other.max_concurrent
            && self.pending == other.pending
            && self.max_queue == other.max_queue
            && self.token_budget == other.token_budget
            && self.constraint == other.constraint
            && self.class == other.class
    }
}

impl Eq for CapacityDetail {}

impl fmt::Debug for CapacityDetail {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut d = f.debug_struct("CapacityDetail");
        d.field("limit_revision", &self.limit_revision)
            .field("in_flight", &self.in_flight)
            .field("max_concurrent", &self.max_concurrent)
            .field("pending", &self.pending)
            .field("max_queue", &self.max_queue)
            .field("token_budget", &self.token_budget)
            .field("constraint", &self.constraint);
        if self.class.is_some() {
            d.field("shared_capacity", &self.shared_capacity())
                .field("admission_class", &self.admission_class());
        }
        d.finish()
    }
}

/// A class ceiling of this many slots is stored as "none" in [`ClassFacts`] (a class ceiling
/// of `MAX_CONCURRENT` can never bind and is normalized away when limits are validated).
pub(crate) const NO_SLOT_CEILING: u16 = u16::MAX;

/// Bits of each slot figure in [`ClassFacts`] (`MAX_CONCURRENT` fits).
const SLOT_BITS: u32 = 16;
/// Bits of each token figure (`MAX_TOKENS` fits).
const TOKEN_BITS: u32 = 35;
const FIGURES: usize = 5;
/// Where the token figures start, after the slot figures.
const TOKENS_AT: u32 = SLOT_BITS * FIGURES as u32;
/// The last bit: whether the class has a token ceiling.
const TOKEN_CEILING_BIT: u32 = TOKENS_AT + TOKEN_BITS * FIGURES as u32;

const _: () = assert!(TOKEN_CEILING_BIT == 255);

/// The raw figures of a class decision, packed into 40 bytes so that a [`Rejection`] stays
/// within the 128 bytes the compiler copies inline (every derived figure is computed when
/// read). Five slot figures of 16 bits: the class's in flight, its floor, its ceiling
/// ([`NO_SLOT_CEILING`] for none), the shared pool's in use and its capacity. Five token
/// figures of 35 bits: the same for tokens (the shared pool's capacity for the call's
/// priority). Then one bit saying whether the class has a token ceiling: 256 bits in all,
/// kept in plain integer fields (the optimizer keeps those in registers; arrays it would not).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct ClassFacts {
    class: AdmissionClass,
    w0: u64,
    w1: u64,
    w2: u64,
    w3: u32,
    w4: u16,
    w5: u16,
}

impl ClassFacts {
    /// Packs the figures. Slots are at most `MAX_CONCURRENT`, tokens at most `MAX_TOKENS`.
    #[inline]
    pub(crate) fn new(
        class: AdmissionClass,
        slots: [u32; FIGURES],
        tokens: [u64; FIGURES],
        has_token_ceiling: bool,
    ) -> ClassFacts {
        let mut words = [0u64; 4];
        for (i, &value) in slots.iter().enumerate() {
            debug_assert!(value < 1 << SLOT_BITS, "a slot figure fits 16 bits");
            set_bits(
                &mut words,
                SLOT_BITS * i as u32,
                SLOT_BITS,
                u64::from(value),
            );
        }
        for (i, &value) in tokens.iter().enumerate() {
            debug_assert!(value < 1 << TOKEN_BITS, "a token figure fits 35 bits");
            set_bits(
                &mut words,
                TOKENS_AT + TOKEN_BITS * i as u32,
                TOKEN_BITS,
                value,
            );
        }
        set_bits(
            &mut words,
            TOKEN_CEILING_BIT,
            1,
            u64::from(has_token_ceiling),
        );
        ClassFacts {
            class,
            w0: words[0],
            w1: words[1],
            w2: words[2],
            w3: words[3] as u32,
            w4: (words[3] >> 32) as u16,
            w5: (words[3] >> 48) as u16,
        }
    }

    fn words(&self) -> [u64; 4] {
        [
            self.w0,
            self.w1,
            self.w2,
            u64::from(self.w3) | u64::from(self.w4) << 32 | u64::from(self.w5) << 48,
        ]
    }

    fn slots(&self) -> [u64; FIGURES] {
        let words = self.words();
        core::array::from_fn(|i| get_bits(&words, SLOT_BITS * i as u32, SLOT_BITS))
    }

    fn tokens(&self) -> [u64; FIGURES] {
        let words = self.words();
        core::array::from_fn(|i| get_bits(&words, TOKENS_AT + TOKEN_BITS * i as u32, TOKEN_BITS))
    }

    fn has_token_ceiling(&self) -> bool {
        get_bits(&self.words(), TOKEN_CEILING_BIT, 1) == 1
    }
}

/// Sets `width` (at most 64) bits at bit `offset` of a 256-bit little-endian number.
#[inline]
fn set_bits(words: &mut [u64; 4], offset: u32, width: u32, value: u64) {
    let (word, shift) = ((offset / 64) as usize, offset % 64);
    words[word] |= value << shift;
    if shift + width > 64 {
        words[word + 1] |= value >> (64 - shift);
    }
}

/// Reads `width` (at most 64) bits at bit `offset` of a 256-bit little-endian number.
fn get_bits(words: &[u64; 4], offset: u32, width: u32) -> u64 {
    let (word, shift) = ((offset / 64) as usize, offset % 64);
    let mut value = words[word] >> shift;
    if shift + width > 64 {
        value |= words[word + 1] << (64 - shift);
    }
    if width == 64 {
        value
    } else {
        value & ((1 << width) - 1)
    }
}

/// Which limit bound a refusal, with admission classes.
///
/// # Examples
///
/// ```
/// assert_eq!(async_bulkhead_llm::rejection::Constraint::AdmissionClassProtection.as_str(), "admission_class_protection");
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Constraint {
    /// A global limit (the budget, `max_concurrent`, the queue, its timeout).
    Global,
    /// The call's class's own ceiling.
    AdmissionClass,
    /// Another class's protected floor: the shared pool had no room for what the call borrows.
    AdmissionClassProtection,
}

impl Constraint {
    /// The constraint's wire name.
    pub const fn as_str(self) -> &'static str {
        match self {
            Constraint::Global => "global",
            Constraint::AdmissionClass => "admission_class",
            Constraint::AdmissionClassProtection => "admission_class_protection",
        }
    }
}

impl fmt::Display for Constraint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The shared pool at a decision: the capacity no class protects (`max_concurrent` minus the
/// classes' floors, and the priority-adjusted budget minus their token floors), what calls
/// beyond their floors borrow of it, and what the call would borrow.
///
/// # Examples
///
/// ```
/// let pool = async_bulkhead_llm::rejection::SharedPool::compute(1, 1, 1);
/// assert_eq!((pool.capacity, pool.in_use, pool.available, pool.requested_borrowed), (1, 1, 0, 1));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SharedPool {
    /// Capacity of the shared pool.
    pub capacity: u64,
    /// Borrowed by calls in flight beyond their classes' floors.
    pub in_use: u64,
    /// `capacity - in_use`, at least 0.
    pub available: u64,
    /// What this call borrows (1 slot or 0; its tokens beyond its class's free floor).
    pub requested_borrowed: u64,
}

impl SharedPool {
    /// The pool of `capacity`, `in_use` borrowed, for a call borrowing `requested_borrowed`.
    pub const fn compute(capacity: u64, in_use: u64, requested_borrowed: u64) -> SharedPool {
        SharedPool {
            capacity,
            in_use,
            available: capacity.saturating_sub(in_use),
            requested_borrowed,
        }
    }
}

/// The shared pools of slots and (with a token budget) of tokens.
///
/// With the `serde` feature it serializes as `{"concurrency": {..}, "token_budget": {..}}`,
/// `token_budget` omitted without a token budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct SharedCapacity {
    /// The shared pool of concurrent calls.
    pub concurrency: SharedPool,
    /// The shared pool of tokens, with a token budget.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub token_budget: Option<SharedPool>,
}

/// The call's admission class at a decision.
///
/// With the `serde` feature it serializes as an object of these fields, the class as its id;
/// a ceiling the class does not have (and what is available under it) is `null`, and
/// `token_budget` is omitted without a token budget.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClassDetail {
    /// The class.
    pub class: AdmissionClass,
    /// The class's calls in flight.
    pub in_flight: u64,
    /// Its protected floor of concurrent calls.
    pub protected_concurrent: u64,
    /// Calls in flight within the floor: `min(in_flight, protected_concurrent)`.
    pub protected_concurrent_in_use: u64,
    /// Calls in flight beyond the floor (borrowed from the shared pool).
    pub borrowed_concurrent: u64,
    /// `protected_concurrent - in_flight`, at least 0.
    pub available_protected_concurrent: u64,
    /// Its ceiling of concurrent calls, if any.
    pub max_concurrent: Option<u64>,
    /// `max_concurrent - in_flight`, at least 0 (`None` without a ceiling).
    pub available_concurrent: Option<u64>,
    /// The class's tokens, with a token budget.
    #[cfg_attr(feature = "serde", serde(skip_serializing_if = "Option::is_none"))]
    pub token_budget: Option<ClassTokenDetail>,
}

/// The token side of a [`ClassDetail`](crate::rejection::ClassDetail).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct ClassTokenDetail {
    /// Tokens the class holds in flight.
    pub in_flight_tokens: u64,
    /// Its protected floor of tokens.
    pub protected_in_flight_tokens: u64,
    /// Tokens held within the floor.
    pub protected_tokens_in_use: u64,
    /// Tokens held beyond the floor (borrowed from the shared pool).
    pub borrowed_in_flight_tokens: u64,
    /// `protected_in_flight_tokens - in_flight_tokens`, at least 0.
    pub available_protected_tokens: u64,
    /// Its ceiling of tokens, if any.
    pub max_in_flight_tokens: Option<u64>,
    /// `max_in_flight_tokens - in_flight_tokens`, at least 0 (`None` without a ceiling).
    pub available: Option<u64>,
    /// The call's reservation.
    pub requested: u64,
}

impl ClassTokenDetail {
    /// Whether the call's reservation exceeds the class's token ceiling: it would be refused
    /// even if the class held nothing, so retrying it unchanged cannot succeed while these
    /// limits are in force.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::*;
    /// use async_bulkhead_llm::{classes::AdmissionClasses, classes::ClassLimits};
    ///
    /// let bulkhead = LlmBulkhead::builder("m", 4)
    ///     .token_budget(TokenBudget::new(10_000))
    ///     .admission_classes(AdmissionClasses::new("batch").class("batch", ClassLimits::new().max_in_flight_tokens(1_000)))
    ///     .build()?;
    /// let options = AcquireOptions::new().reservation(Reservation::new(500, 1_000)?);
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), options).unwrap_err();
    /// let class = err.rejection().unwrap().detail().admission_class().unwrap();
    /// assert!(class.token_budget.unwrap().can_never_fit()); // 1,500 > 1,000
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn can_never_fit(&self) -> bool {
        match self.max_in_flight_tokens {
            Some(max) => self.requested > max,
            None => false,
        }
    }
}

/// The token side of a [`CapacityDetail`](crate::rejection::CapacityDetail).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::rejection::TokenBudgetDetail;
///
/// let d = TokenBudgetDetail::compute(2400, 400, false, 1100, 1100);
/// assert_eq!((d.effective_budget, d.available), (2000, 900));
/// let high = TokenBudgetDetail::compute(2400, 400, true, 1100, 1100);
/// assert_eq!((high.effective_budget, high.available), (2400, 1300));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize))]
#[non_exhaustive]
pub struct TokenBudgetDetail {
    /// The token budget in force.
    pub budget: u64,
    /// Tokens held by admitted calls.
    pub in_flight_tokens: u64,
    /// The budget this call's priority may use: the whole budget for high priority,
    /// `budget - high_priority_reserve` (at least 0) for normal priority.
    pub effective_budget: u64,
    /// `effective_budget - in_flight_tokens`, at least 0.
    pub available: u64,
    /// The call's reservation.
    pub requested: u64,
}

impl TokenBudgetDetail {
    /// The detail for a call of `requested` tokens, `high` priority or not, against `budget`
    /// with `reserve` kept for high priority and `in_flight_tokens` held.
    ///
    /// # Examples
    ///
    /// ```
    /// let d = async_bulkhead_llm::rejection::TokenBudgetDetail::compute(100, 500, false, 0, 1);
    /// assert_eq!(d.effective_budget, 0); // a reserve above the budget leaves normal traffic nothing
    /// ```
    pub const fn compute(
        budget: u64,
        reserve: u64,
        high: bool,
        in_flight_tokens: u64,
        requested: u64,
    ) -> TokenBudgetDetail {
        let effective_budget = if high {
            budget
        } else {
            budget.saturating_sub(reserve)
        };
        TokenBudgetDetail {
            budget,
            in_flight_tokens,
            effective_budget,
            available: effective_budget.saturating_sub(in_flight_tokens),
            requested,
        }
    }

    /// Whether the call's reservation exceeds the budget its priority may use
    /// (`requested > effective_budget`): it would be refused even with nothing in flight, so
    /// retrying it unchanged cannot succeed while these limits are in force (a smaller
    /// reservation, or high priority when the reserve is what it lacks, might).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::rejection::TokenBudgetDetail;
    ///
    /// assert!(TokenBudgetDetail::compute(1000, 0, false, 0, 1500).can_never_fit());
    /// // Refused now (900 in flight), but it fits once they finish.
    /// assert!(!TokenBudgetDetail::compute(1000, 0, false, 900, 1000).can_never_fit());
    /// // Only the high-priority reserve is beyond its reach.
    /// assert!(TokenBudgetDetail::compute(1000, 200, false, 0, 900).can_never_fit());
    /// assert!(!TokenBudgetDetail::compute(1000, 200, true, 0, 900).can_never_fit());
    /// ```
    pub const fn can_never_fit(&self) -> bool {
        self.requested > self.effective_budget
    }
}

/// A refusal: the reason, the limit revision that decided it, and the capacity snapshot.
///
/// Rejections are cheap to build (no allocation, no clock read) and `Copy`. With the `serde`
/// feature a rejection serializes as `{"reason": .., "limit_revision": .., "detail": {..}}`
/// (the detail as [`CapacityDetail`](crate::rejection::CapacityDetail) does); [`HttpRefusal`](crate::http::HttpRefusal) turns it into
/// an HTTP status and a provider-shaped error body.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 1).initial_revision(7).build()?;
/// let _first = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
/// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
/// let rejection = err.rejection().unwrap();
/// assert_eq!(rejection.reason(), RejectReason::ConcurrencyLimit);
/// assert_eq!(rejection.limit_revision(), 7);
/// assert_eq!(rejection.detail().in_flight, 1);
/// assert_eq!(
///     rejection.to_string(),
///     "bulkhead rejected: concurrency_limit (1 of 1 slots in flight)",
/// );
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// The reason is kept inside the detail (a private field) so that a rejection is exactly its
/// 128-byte detail: a larger value is copied by a `memcpy` call at every layer it crosses.
///
/// Two rejections are equal when everything they say is: the reason, the scope, the rate
/// window and its wait, and the snapshot's figures.
#[derive(Clone, Copy)]
pub struct Rejection {
    detail: CapacityDetail,
}

impl PartialEq for Rejection {
    fn eq(&self, other: &Rejection) -> bool {
        // The snapshot's own equality compares its figures only; the reason and the refusal's
        // fields (scope, window, wait) are the rejection's.
        self.detail == other.detail
            && self.detail.reason == other.detail.reason
            && self.detail.refusal == other.detail.refusal
    }
}

impl Eq for Rejection {}

impl Rejection {
    #[cfg_attr(not(loom), inline(always))]
    pub(crate) fn new(reason: RejectReason, mut detail: CapacityDetail) -> Rejection {
        detail.reason = Some(reason);
        Rejection { detail }
    }

    /// Why the call was refused.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// bulkhead.close();
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().reason(), RejectReason::Shutdown);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reason(&self) -> RejectReason {
        self.detail
            .reason
            .expect("a rejection's detail carries its reason")
    }

    /// Revision of the limits that decided the refusal.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 0).initial_revision(3).build()?;
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().limit_revision(), 3);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn limit_revision(&self) -> u64 {
        self.detail.limit_revision
    }

    /// The level that refused the call, for a tenant-within-global admission
    /// ([`LlmBulkhead::try_acquire_within`](crate::LlmBulkhead::try_acquire_within) and its
    /// kin); `None` for a refusal of a bulkhead used on its own.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, rejection::Scope};
    ///
    /// let global = LlmBulkhead::builder("m", 0).build()?;
    /// let tenant = LlmBulkhead::builder("m", 4).build()?;
    /// let err = tenant.try_acquire_within(&global, &LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().scope(), Some(Scope::Global));
    /// let alone = global.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(alone.rejection().unwrap().scope(), None);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn scope(&self) -> Option<Scope> {
        self.detail.scope()
    }

    /// For a `rate_limit` refusal, when the call would fit if nothing else arrived
    /// (milliseconds, rounded up; whole seconds, rounded up, for a wait beyond about 1.55
    /// days, which only usage charged far beyond a window's limit makes); `None` for any other
    /// refusal, and for a call that can never fit its window (more tokens than the window
    /// allows).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    /// use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
    ///
    /// let clock = ManualClock::new();
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .rate_limits(RateLimits::per_minute().requests(60)) // one a second, 60 at once
    ///     .rate_clock(RateClock::manual(&clock))
    ///     .build()?;
    /// for _ in 0..60 {
    ///     drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
    /// }
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().retry_after(), Some(Duration::from_secs(1)));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn retry_after(&self) -> Option<Duration> {
        if self.detail.reason != Some(RejectReason::RateLimit) {
            return None;
        }
        self.detail.retry_after()
    }

    /// Which window refused a `rate_limit` refusal (`None` for any other refusal).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    /// use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits, RateWindow};
    ///
    /// let clock = ManualClock::new();
    /// let bulkhead = LlmBulkhead::builder("m", 8)
    ///     .rate_limits(RateLimits::per_minute().requests(1))
    ///     .rate_clock(RateClock::manual(&clock))
    ///     .build()?;
    /// drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().rate_window(), Some(RateWindow::Requests));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn rate_window(&self) -> Option<RateWindow> {
        if self.detail.reason != Some(RejectReason::RateLimit) {
            return None;
        }
        Some(RateWindow::of(
            self.detail.rate_class(),
            self.detail.rate_tokens(),
        ))
    }

    /// A `budget_limit` refusal decided elsewhere (see [`CapacityDetail::new`]): answered as
    /// the bulkhead's own (429, or 413 when the reservation exceeds the budget it may use).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{RejectReason, http::HttpRefusal};
    /// use async_bulkhead_llm::rejection::{CapacityDetail, Rejection, Scope, TokenBudgetDetail};
    ///
    /// let tokens = TokenBudgetDetail::compute(200_000, 0, false, 199_500, 1_200);
    /// let refused = Rejection::budget_limit(CapacityDetail::new(0, 3, 64, 0, 0, Some(tokens)))
    ///     .scoped(Scope::Global);
    /// assert_eq!((refused.reason(), refused.http_status()), (RejectReason::BudgetLimit, 429));
    /// assert_eq!(HttpRefusal::from(refused).status, 429);
    /// ```
    pub fn budget_limit(detail: CapacityDetail) -> Rejection {
        Rejection::new(RejectReason::BudgetLimit, detail)
    }

    /// A `rate_limit` refusal decided elsewhere (see [`CapacityDetail::new`]): the window that
    /// refused and when the call would fit if nothing else arrived (`None`: never, it asks more
    /// than the window's whole limit: 413), answered as the bulkhead's own.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::rate::RateWindow;
    /// use async_bulkhead_llm::rejection::{CapacityDetail, Rejection};
    ///
    /// let detail = CapacityDetail::new(0, 1, 64, 0, 0, None);
    /// let refused = Rejection::rate_limit(detail, RateWindow::Requests, Some(Duration::from_millis(1_500)));
    /// assert_eq!(refused.retry_after(), Some(Duration::from_millis(1_500)));
    /// assert_eq!(refused.rate_window(), Some(RateWindow::Requests));
    /// assert_eq!(refused.http_status(), 429);
    /// ```
    pub fn rate_limit(
        detail: CapacityDetail,
        window: RateWindow,
        retry_after: Option<Duration>,
    ) -> Rejection {
        Rejection::rate(detail, window, retry_after)
    }

    /// This refusal, named as a refusal of `scope` (a tenant's, or a global level's such as a
    /// ledger shared by replicas): shown in its message, its JSON body and metrics.
    pub fn scoped(self, scope: Scope) -> Rejection {
        self.with_scope(scope)
    }

    /// A `rate_limit` rejection: which window refused and when the call would fit.
    pub(crate) fn rate(
        mut detail: CapacityDetail,
        window: RateWindow,
        retry_after: Option<Duration>,
    ) -> Rejection {
        let ms = match retry_after {
            Some(wait) => match u32::try_from(wait.as_nanos().div_ceil(1_000_000)) {
                Ok(ms) if ms < RETRY_NEVER => ms,
                _ => {
                    let seconds = wait.as_nanos().div_ceil(1_000_000_000);
                    RETRY_SECONDS
                        | u32::try_from(seconds).map_or(RETRY_VALUE, |s| s.min(RETRY_VALUE))
                }
            },
            None => RETRY_NEVER,
        };
        let bits = match window {
            RateWindow::Requests => 0,
            RateWindow::Tokens => RATE_TOKENS,
            RateWindow::ClassRequests => RATE_CLASS,
            RateWindow::ClassTokens => RATE_CLASS | RATE_TOKENS,
        };
        detail.refusal = (detail.refusal
            & !(RATE_CLASS | RATE_TOKENS | RETRY_SECONDS | RETRY_VALUE))
            | bits
            | ms;
        Rejection::new(RejectReason::RateLimit, detail)
    }

    /// This rejection, named as a refusal of `scope`.
    pub(crate) fn with_scope(mut self, scope: Scope) -> Rejection {
        self.detail.set_scope(scope);
        self
    }

    /// The capacity snapshot taken at the decision.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let bulkhead = LlmBulkhead::builder("m", 0).build()?;
    /// let err = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().detail().max_concurrent, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn detail(&self) -> &CapacityDetail {
        &self.detail
    }
}

impl fmt::Display for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let d = &self.detail;
        let reason = self.reason();
        if let Some(scope) = d.scope() {
            write!(f, "{scope} ")?;
        }
        write!(f, "bulkhead rejected: {reason} (")?;
        let class = d.admission_class();
        let class = class.as_ref();
        match (reason, d.constraint) {
            (RejectReason::ConcurrencyLimit, Some(Constraint::AdmissionClass)) => {
                let c = class.expect("a class decision carries its class");
                write!(
                    f,
                    "class {:?}: {} of {} slots in flight",
                    c.class.id(),
                    c.in_flight,
                    c.max_concurrent.unwrap_or(0)
                )?;
                return f.write_str(")");
            }
            (RejectReason::BudgetLimit, Some(Constraint::AdmissionClass)) => {
                let c = class.expect("a class decision carries its class");
                let t = c.token_budget.expect("a class token decision has a budget");
                write!(
                    f,
                    "class {:?}: requested {} tokens, {} of {} in flight",
                    c.class.id(),
                    t.requested,
                    t.in_flight_tokens,
                    t.max_in_flight_tokens.unwrap_or(0)
                )?;
                return f.write_str(")");
            }
            (reason, Some(Constraint::AdmissionClassProtection)) => {
                let c = class.expect("a class decision carries its class");
                let shared = d
                    .shared_capacity()
                    .expect("a protection decision has a pool");
                let (what, pool) = match reason {
                    RejectReason::BudgetLimit => {
                        ("tokens", shared.token_budget.expect("a token pool"))
                    }
                    _ => ("slots", shared.concurrency),
                };
                write!(
                    f,
                    "class {:?} would borrow {} shared {what}, {} of {} available: the rest is protected for other classes",
                    c.class.id(),
                    pool.requested_borrowed,
                    pool.available,
                    pool.capacity
                )?;
                return f.write_str(")");
            }
            _ => {}
        }
        match reason {
            RejectReason::Shutdown => f.write_str("the bulkhead is closed")?,
            RejectReason::ConcurrencyLimit if d.max_concurrent == 0 => {
                f.write_str("max_concurrent is 0")?
            }
            RejectReason::ConcurrencyLimit if d.pending > 0 => write!(
                f,
                "{} of {} slots in flight, {} calls already waiting",
                d.in_flight, d.max_concurrent, d.pending
            )?,
            RejectReason::ConcurrencyLimit => {
                write!(f, "{} of {} slots in flight", d.in_flight, d.max_concurrent)?
            }
            RejectReason::BudgetLimit => match &d.token_budget {
                Some(t) => write!(
                    f,
                    "requested {} tokens, {} of effective budget {} available, {} in flight",
                    t.requested, t.available, t.effective_budget, t.in_flight_tokens
                )?,
                None => f.write_str("token budget exhausted")?,
            },
            RejectReason::QueueLimit => {
                write!(f, "{} of {} queue places taken", d.pending, d.max_queue)?
            }
            RejectReason::Timeout => f.write_str("no slot was granted before the queue timeout")?,
            RejectReason::Aborted => f.write_str("the waiting call was cancelled")?,
            RejectReason::RateLimit => {
                if d.rate_class() {
                    f.write_str("its admission class's ")?;
                } else {
                    f.write_str("the ")?;
                }
                match (d.rate_tokens(), d.retry_after()) {
                    (true, Some(wait)) => write!(f, "tokens window is full for {wait:?}")?,
                    (false, Some(wait)) => write!(f, "requests window is full for {wait:?}")?,
                    (true, None) => f.write_str("tokens window allows fewer tokens")?,
                    (false, None) => f.write_str("requests window allows none")?,
                }
            }
        }
        f.write_str(")")
    }
}

impl fmt::Debug for Rejection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Rejection")
            .field("reason", &self.reason())
            .field("detail", &self.detail)
            .finish()
    }
}

impl std::error::Error for Rejection {}

/// `Serialize` for the refusal vocabulary: reasons and constraints as their wire names, the
/// detail with its computed class figures.
#[cfg(feature = "serde")]
mod serialize {
    use serde::ser::{Serialize, SerializeStruct, Serializer};

    use super::{CapacityDetail, Constraint, RejectReason, Rejection};

    impl Serialize for RejectReason {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_str(self.as_str())
        }
    }

    impl Serialize for Constraint {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.serialize_str(self.as_str())
        }
    }

    impl Serialize for CapacityDetail {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let class = self.admission_class();
            let shared = self.shared_capacity();
            let fields = 5
                + usize::from(self.token_budget.is_some())
                + usize::from(self.constraint.is_some())
                + usize::from(class.is_some())
                + usize::from(shared.is_some());
            let mut s = serializer.serialize_struct("CapacityDetail", fields)?;
            s.serialize_field("limit_revision", &self.limit_revision)?;
            s.serialize_field("in_flight", &self.in_flight)?;
            s.serialize_field("max_concurrent", &self.max_concurrent)?;
            s.serialize_field("pending", &self.pending)?;
            s.serialize_field("max_queue", &self.max_queue)?;
            match &self.token_budget {
                Some(budget) => s.serialize_field("token_budget", budget)?,
                None => s.skip_field("token_budget")?,
            }
            match &self.constraint {
                Some(constraint) => s.serialize_field("constraint", constraint)?,
                None => s.skip_field("constraint")?,
            }
            match &class {
                Some(class) => s.serialize_field("admission_class", class)?,
                None => s.skip_field("admission_class")?,
            }
            match &shared {
                Some(shared) => s.serialize_field("shared_capacity", shared)?,
                None => s.skip_field("shared_capacity")?,
            }
            s.end()
        }
    }

    impl Serialize for Rejection {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            let retry = self.retry_after().map(|wait| wait.as_millis() as u64);
            let window = self.rate_window();
            let fields = 3
                + usize::from(self.scope().is_some())
                + usize::from(retry.is_some())
                + usize::from(window.is_some());
            let mut s = serializer.serialize_struct("Rejection", fields)?;
            s.serialize_field("reason", &self.reason())?;
            match self.scope() {
                Some(scope) => s.serialize_field("scope", scope.as_str())?,
                None => s.skip_field("scope")?,
            }
            match window {
                Some(window) => s.serialize_field("rate_window", window.as_str())?,
                None => s.skip_field("rate_window")?,
            }
            match retry {
                Some(ms) => s.serialize_field("retry_after_ms", &ms)?,
                None => s.skip_field("retry_after_ms")?,
            }
            s.serialize_field("limit_revision", &self.limit_revision())?;
            s.serialize_field("detail", &self.detail)?;
            s.end()
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn class_facts_round_trip_every_width_and_fit_the_budget() {
        let class = AdmissionClass::new("facts", 3);
        let max = (1u64 << TOKEN_BITS) - 1;
        for (slots, tokens, ceiling) in [
            ([0; 5], [0; 5], false),
            ([65_535, 0, 65_535, 1, 40_000], [max, 1, max, 7, max], true),
            ([1, 2, 3, 4, 5], [12_345, max - 1, 0, 1 << 34, 99], true),
            ([65_535; 5], [max; 5], false),
        ] {
            let facts = ClassFacts::new(class, slots, tokens, ceiling);
            assert_eq!(facts.tokens(), tokens);
            assert_eq!(facts.has_token_ceiling(), ceiling);
            assert_eq!(facts.slots(), slots.map(u64::from));
        }
        assert_eq!(core::mem::size_of::<ClassFacts>(), 40);
        assert_eq!(core::mem::size_of::<Rejection>(), 128);
    }

    #[test]
    fn rejections_equal_only_when_everything_they_say_is_equal() {
        let detail = CapacityDetail::new(3, 1, 1, 0, 0, None);
        let full = Rejection::new(RejectReason::ConcurrencyLimit, detail);
        let closed = Rejection::new(RejectReason::Shutdown, detail);
        // The same figures, and the snapshots compare equal: the figures are all they hold.
        assert_eq!(full.detail(), closed.detail());
        assert_eq!(full, Rejection::new(RejectReason::ConcurrencyLimit, detail));
        // A different reason, scope, window or wait is a different refusal.
        assert_ne!(full, closed);
        assert_ne!(full, full.scoped(Scope::Tenant));
        assert_ne!(full.scoped(Scope::Tenant), full.scoped(Scope::Global));
        assert_eq!(full.scoped(Scope::Global), full.scoped(Scope::Global));
        let soon =
            Rejection::rate_limit(detail, RateWindow::Requests, Some(Duration::from_secs(1)));
        assert_ne!(
            soon,
            Rejection::rate_limit(detail, RateWindow::Requests, Some(Duration::from_secs(2)))
        );
        assert_ne!(
            soon,
            Rejection::rate_limit(detail, RateWindow::Tokens, Some(Duration::from_secs(1)))
        );
        assert_ne!(
            soon,
            Rejection::rate_limit(detail, RateWindow::Requests, None)
        );
        assert_eq!(
            soon,
            Rejection::rate_limit(detail, RateWindow::Requests, Some(Duration::from_secs(1)))
        );
    }
}
