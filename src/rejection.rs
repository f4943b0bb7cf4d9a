//! Capacity refusals: why a call may not run now, and the capacity snapshot taken at the
//! moment of the decision (what a gateway puts in a 429/503 body).

use core::fmt;

use crate::admission_class::AdmissionClass;

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
        }
    }
}

impl fmt::Display for RejectReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The capacity snapshot taken when a decision was made.
///
/// All figures come from one consistent reading of the admission word and the limits in force
/// at that instant.
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// The shared pool (capacity no class protects), with admission classes.
    pub shared_capacity: Option<SharedCapacity>,
    /// The call's class, with admission classes.
    pub admission_class: Option<ClassDetail>,
}

/// Which limit bound a refusal, with admission classes.
///
/// # Examples
///
/// ```
/// assert_eq!(async_bulkhead_llm::Constraint::AdmissionClassProtection.as_str(), "admission_class_protection");
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
/// let pool = async_bulkhead_llm::SharedPool::compute(1, 1, 1);
/// assert_eq!((pool.capacity, pool.in_use, pool.available, pool.requested_borrowed), (1, 1, 0, 1));
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct SharedCapacity {
    /// The shared pool of concurrent calls.
    pub concurrency: SharedPool,
    /// The shared pool of tokens, with a token budget.
    pub token_budget: Option<SharedPool>,
}

/// The call's admission class at a decision.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    pub token_budget: Option<ClassTokenDetail>,
}

/// The token side of a [`ClassDetail`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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

/// The token side of a [`CapacityDetail`].
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::TokenBudgetDetail;
///
/// let d = TokenBudgetDetail::compute(2400, 400, false, 1100, 1100);
/// assert_eq!((d.effective_budget, d.available), (2000, 900));
/// let high = TokenBudgetDetail::compute(2400, 400, true, 1100, 1100);
/// assert_eq!((high.effective_budget, high.available), (2400, 1300));
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
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
    /// let d = async_bulkhead_llm::TokenBudgetDetail::compute(100, 500, false, 0, 1);
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
}

/// A refusal: the reason, the limit revision that decided it, and the capacity snapshot.
///
/// Rejections are cheap to build (no allocation, no clock read) and `Copy`.
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
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rejection {
    reason: RejectReason,
    detail: CapacityDetail,
}

impl Rejection {
    pub(crate) fn new(reason: RejectReason, detail: CapacityDetail) -> Rejection {
        Rejection { reason, detail }
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
        self.reason
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
        write!(f, "bulkhead rejected: {} (", self.reason)?;
        let class = d.admission_class.as_ref();
        match (self.reason, d.constraint) {
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
                let shared = d.shared_capacity.expect("a protection decision has a pool");
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
        match self.reason {
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
        }
        f.write_str(")")
    }
}

impl std::error::Error for Rejection {}
