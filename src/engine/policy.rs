//! The admission policy as pure functions of (state, limits, request): no atomics, no clock, no
//! allocation, so it can be property-tested against a reference model and reused unchanged by
//! every path that decides (fail-fast admission, advisory checks, queue hand-off).
//!
//! The order of checks is fixed (`docs/design.md` §D4): shutdown, then the priority-adjusted token
//! budget, then concurrency (a limit of 0 never queues), then the queue length. Admission
//! classes will slot their ceilings and floors in between budget and concurrency.

use super::classes::ClassCounts;
use super::limits::{Bounds, ClassCaps};
use super::state::{MAX_TOKENS, State};
use crate::vocabulary::admission_class::{AdmissionClass, Resources};
use crate::vocabulary::priority::Priority;
use crate::vocabulary::rejection::{
    CapacityDetail, ClassFacts, Constraint, NO_SLOT_CEILING, RejectReason, TokenBudgetDetail,
};
use crate::vocabulary::verdict::Verdict;

/// What a call asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Ask {
    /// Tokens to reserve (0 without a token budget).
    pub(crate) reserved: u64,
    pub(crate) priority: Priority,
    /// Its admission class (always one when the bulkhead has classes, never otherwise).
    pub(crate) class: Option<AdmissionClass>,
}

impl Ask {
    /// A call without a class on an engine without a token budget: a slot, at `priority`.
    #[inline]
    pub(crate) const fn slot(priority: Priority) -> Ask {
        Ask {
            reserved: 0,
            priority,
            class: None,
        }
    }
}

/// A class call's class as a decision sees it: its live counts (stable: the class is locked
/// while it decides) and its limits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ClassView {
    pub(crate) class: AdmissionClass,
    /// The class's calls in flight.
    pub(crate) slots: u32,
    /// The tokens the class holds.
    pub(crate) tokens: u64,
    pub(crate) caps: ClassCaps,
    /// Whether the word counts the class at its floors at least (`classes`, "Floors
    /// reserved").
    pub(crate) reserved: bool,
}

/// A class's floors of calls and of tokens under `caps`, as counts (what the class word's
/// `BEYOND` bit is written from).
pub(crate) fn floors_of(caps: &ClassCaps) -> ClassCounts {
    ClassCounts {
        slots: caps.protected_slots,
        tokens: caps.protected_tokens,
    }
}

impl ClassView {
    /// The class's floors of calls and of tokens, as counts.
    pub(crate) fn floors(&self) -> ClassCounts {
        floors_of(&self.caps)
    }

    /// What the word counts for this class with `slots` calls in flight and `tokens` held:
    /// those, or its floors where they are more while its floors are reserved.
    #[inline]
    pub(crate) fn counted(&self, slots: u32, tokens: u64) -> (u32, u64) {
        if self.reserved {
            (
                slots.max(self.caps.protected_slots),
                tokens.max(self.caps.protected_tokens),
            )
        } else {
            (slots, tokens)
        }
    }

    /// What an admission of `reserved` tokens adds to the word's slots and tokens in flight:
    /// one slot and its tokens, less what falls within a reserved floor.
    #[inline]
    pub(crate) fn added(&self, reserved: u64) -> (u32, u64) {
        let (slots, tokens) = self.counted(self.slots, self.tokens);
        // Saturating: a reservation no word can count is refused on the budget all the same.
        let (after_slots, after_tokens) =
            self.counted(self.slots + 1, self.tokens.saturating_add(reserved));
        (after_slots - slots, after_tokens - tokens)
    }

    /// What an admission of `reserved` tokens would borrow from the shared pool: its slot if
    /// the class is at or above its floor (a class without a floor always borrows), and its
    /// tokens beyond the class's free token floor.
    #[inline]
    pub(crate) fn borrow(&self, reserved: u64) -> Resources {
        Resources {
            borrowed_concurrency: self.slots >= self.caps.protected_slots,
            borrowed_tokens: reserved
                .saturating_sub(self.caps.protected_tokens.saturating_sub(self.tokens)),
        }
    }

    /// Calls of the class in flight beyond its floor when it has `slots` in flight.
    #[inline]
    pub(crate) fn borrowed_slots(&self, slots: u32) -> u32 {
        slots.saturating_sub(self.caps.protected_slots)
    }

    /// Tokens of the class beyond its floor when it holds `tokens`.
    #[inline]
    pub(crate) fn borrowed_tokens(&self, tokens: u64) -> u64 {
        tokens.saturating_sub(self.caps.protected_tokens)
    }
}

/// Whose turn a decision is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Turn {
    /// A call arriving now: it may not take a slot while anyone waits (no barging).
    Newcomer,
    /// The head of the wait queue, being handed free capacity.
    Head,
}

/// Why [`admit`] said no.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Refusal {
    /// The bulkhead is closed.
    Shutdown,
    /// The reservation does not fit the priority-adjusted budget.
    Budget,
    /// The class's token ceiling.
    ClassTokens,
    /// The class's ceiling of concurrent calls.
    ClassSlots,
    /// The call would borrow a slot the shared pool does not have (the rest is protected).
    SharedSlots,
    /// The call would borrow tokens the shared pool does not have.
    SharedTokens,
    /// Budget fits, but no slot is free for a newcomer: the limit is reached, the limit is 0,
    /// or callers are already waiting (newcomers never pass them).
    NoSlot,
}

impl Refusal {
    /// The reason a call that may not queue is refused with.
    pub(crate) fn reason(self) -> RejectReason {
        match self {
            Refusal::Shutdown => RejectReason::Shutdown,
            Refusal::Budget | Refusal::ClassTokens | Refusal::SharedTokens => {
                RejectReason::BudgetLimit
            }
            Refusal::NoSlot | Refusal::ClassSlots | Refusal::SharedSlots => {
                RejectReason::ConcurrencyLimit
            }
        }
    }

    /// Which limit bound (for a bulkhead with classes).
    pub(crate) fn constraint(self) -> Option<Constraint> {
        match self {
            Refusal::Shutdown => None,
            Refusal::Budget | Refusal::NoSlot => Some(Constraint::Global),
            Refusal::ClassTokens | Refusal::ClassSlots => Some(Constraint::AdmissionClass),
            Refusal::SharedSlots | Refusal::SharedTokens => {
                Some(Constraint::AdmissionClassProtection)
            }
        }
    }
}

/// The constraint of a refusal for `reason` that [`admit`] did not decide (the queue's own
/// reasons): global for the queue's limits and its timeout, none for a cancellation or a
/// close.
pub(crate) fn constraint_of(reason: RejectReason) -> Option<Constraint> {
    match reason {
        RejectReason::Shutdown | RejectReason::Aborted => None,
        _ => Some(Constraint::Global),
    }
}

/// Decides an admission now. On success returns the state with the slot and the tokens taken,
/// both at once.
///
/// A newcomer is judged in the fixed order (closed, budget, slot): its reason matches the
/// original's whenever several limits bind. The queue head has already waited for a slot, so
/// it is judged on the slot first: while none is free it keeps its place whatever its tokens
/// (a budget change must not refuse it before its turn), and once one is free its tokens must
/// fit too or it is refused `budget_limit` and the turn passes on.
#[inline]
pub(crate) fn admit(state: State, limits: &Bounds, ask: Ask, turn: Turn) -> Result<State, Refusal> {
    if state.is_closed() {
        return Err(Refusal::Shutdown);
    }
    match turn {
        Turn::Newcomer => {
            fits_budget(state, limits, ask)?;
            if state.has_waiters() || state.slots() >= limits.max_concurrent {
                return Err(Refusal::NoSlot);
            }
        }
        Turn::Head => {
            if state.slots() >= limits.max_concurrent {
                return Err(Refusal::NoSlot);
            }
            fits_budget(state, limits, ask)?;
        }
    }
    Ok(state.with_admission(ask.reserved))
}

/// Whether `ask`'s tokens fit the priority-adjusted budget on top of those in flight.
#[inline]
fn fits_budget(state: State, limits: &Bounds, ask: Ask) -> Result<(), Refusal> {
    fits_budget_adding(state, limits, ask, ask.reserved)
}

/// [`fits_budget`] for a call that adds `added` tokens to the word (its reservation, less
/// what falls within its class's reserved floor).
#[inline]
fn fits_budget_adding(state: State, limits: &Bounds, ask: Ask, added: u64) -> Result<(), Refusal> {
    match limits.token_budget {
        Some(budget) => {
            let effective = budget.effective(ask.priority);
            // Strict `>`: an exact fit admits. An overflowing sum cannot fit any budget, nor
            // can one the word cannot count (budgets are validated against `MAX_TOKENS`; the
            // second bound only matters to callers of this pure function that do not).
            match state.tokens().checked_add(added) {
                Some(total) if total <= effective && total <= MAX_TOKENS => Ok(()),
                _ => Err(Refusal::Budget),
            }
        }
        None => {
            debug_assert_eq!(ask.reserved, 0, "no budget, no tokens");
            Ok(())
        }
    }
}

/// Decides a class call's admission now (`docs/design.md` §D4): on success the state with its
/// slot, its tokens and what it borrows of the shared pool taken, all at once, and what it
/// borrowed.
///
/// The order: closed, the global budget, the class's token ceiling, its ceiling of calls,
/// the shared pool of slots for a call that borrows its slot (only when some class has a
/// floor), the shared pool of tokens for a call that borrows tokens (only when some class has
/// a token floor), then a global slot. The queue head is judged on the slot first, as in
/// [`admit`].
#[inline]
pub(crate) fn admit_class(
    state: State,
    limits: &Bounds,
    class: &ClassView,
    ask: Ask,
    turn: Turn,
) -> Result<(State, Resources), Refusal> {
    if state.is_closed() {
        return Err(Refusal::Shutdown);
    }
    // What the admission adds to the word: one slot and its tokens, less what falls within a
    // reserved floor (the word already counts that); with nothing reserved these checks are
    // `slots < max_concurrent` and `tokens + reserved <= budget`.
    let (added_slots, added_tokens) = class.added(ask.reserved);
    let no_slot = |state: State| {
        let full = state.slots() + added_slots > limits.max_concurrent;
        match turn {
            Turn::Newcomer => state.has_waiters() || full,
            Turn::Head => full,
        }
    };
    if turn == Turn::Head && no_slot(state) {
        return Err(Refusal::NoSlot);
    }
    fits_budget_adding(state, limits, ask, added_tokens)?;
    if let Some(max) = class.caps.max_tokens
        && class
            .tokens
            .checked_add(ask.reserved)
            .is_none_or(|t| t > max)
    {
        return Err(Refusal::ClassTokens);
    }
    if let Some(max) = class.caps.max_slots
        && class.slots >= max
    {
        return Err(Refusal::ClassSlots);
    }
    let borrow = class.borrow(ask.reserved);
    if limits.protected_concurrent > 0 && borrow.borrowed_concurrency {
        let capacity = limits
            .max_concurrent
            .saturating_sub(limits.protected_concurrent);
        if state.shared_slots() >= capacity {
            return Err(Refusal::SharedSlots);
        }
    }
    if let Some(budget) = limits.effective_budget(ask.priority)
        && limits.protected_tokens > 0
        && borrow.borrowed_tokens > 0
    {
        let capacity = budget.saturating_sub(limits.protected_tokens);
        if state
            .shared_tokens()
            .checked_add(borrow.borrowed_tokens)
            .is_none_or(|t| t > capacity)
        {
            return Err(Refusal::SharedTokens);
        }
    }
    if turn == Turn::Newcomer && no_slot(state) {
        return Err(Refusal::NoSlot);
    }
    let shared_slots = state.shared_slots() + u32::from(borrow.borrowed_concurrency);
    let shared_tokens = state.shared_tokens() + borrow.borrowed_tokens;
    let next = state
        .with_added(added_slots, added_tokens)
        .with_shared(shared_slots, shared_tokens);
    Ok((next, borrow))
}

/// [`admit`] or [`admit_class`], as the call has a class or not.
#[inline]
pub(crate) fn admit_any(
    state: State,
    limits: &Bounds,
    class: Option<&ClassView>,
    ask: Ask,
    turn: Turn,
) -> Result<(State, Resources), Refusal> {
    match class {
        Some(class) => admit_class(state, limits, class, ask, turn),
        None => admit(state, limits, ask, turn).map(|next| (next, Resources::NONE)),
    }
}

/// What happens to a call that found no free slot, given `pending` callers already waiting:
/// `Ok(())` means it may join the queue.
#[inline]
pub(crate) fn queue_or_refuse(limits: &Bounds, pending: u64) -> Result<(), RejectReason> {
    if limits.max_concurrent == 0 || limits.max_queue == 0 {
        // Zero concurrency is a kill switch: new work never queues behind it.
        Err(RejectReason::ConcurrencyLimit)
    } else if pending >= u64::from(limits.max_queue) {
        Err(RejectReason::QueueLimit)
    } else {
        Ok(())
    }
}

/// The capacity snapshot for a decision made on `state` under `limits`, for a call of `class`
/// (with classes) refused for `reason`.
pub(crate) fn detail(
    state: State,
    limits: &Bounds,
    pending: u64,
    ask: Ask,
    class: Option<&ClassView>,
    constraint: Option<Constraint>,
) -> CapacityDetail {
    let detail = global_detail(state, limits, pending, ask);
    match class {
        Some(class) => detail.with_class(constraint, class_facts(state, limits, class, ask)),
        None => detail,
    }
}

/// The class's and the shared pools' figures at a decision for `class`'s call (every derived
/// figure of [`ClassDetail`](crate::rejection::ClassDetail) and [`SharedCapacity`](crate::rejection::SharedCapacity)
/// is computed from these when read).
fn class_facts(state: State, limits: &Bounds, class: &ClassView, ask: Ask) -> ClassFacts {
    let caps = class.caps;
    let slot_capacity = limits
        .max_concurrent
        .saturating_sub(limits.protected_concurrent);
    let token_capacity = limits
        .effective_budget(ask.priority)
        .map_or(0, |budget| budget.saturating_sub(limits.protected_tokens));
    ClassFacts::new(
        class.class,
        [
            class.slots,
            caps.protected_slots,
            caps.max_slots.map_or(u32::from(NO_SLOT_CEILING), |max| {
                debug_assert!(max < u32::from(NO_SLOT_CEILING), "normalized away");
                max
            }),
            state.shared_slots(),
            slot_capacity,
        ],
        [
            class.tokens,
            caps.protected_tokens,
            caps.max_tokens.unwrap_or(0),
            state.shared_tokens(),
            token_capacity,
        ],
        caps.max_tokens.is_some(),
    )
}

/// The global part of a capacity snapshot (the whole snapshot of a call without a class).
#[cfg_attr(not(loom), inline(always))]
pub(crate) fn global_detail(
    state: State,
    limits: &Bounds,
    pending: u64,
    ask: Ask,
) -> CapacityDetail {
    CapacityDetail::new(
        limits.revision,
        u64::from(state.slots()),
        limits.max_concurrent,
        pending,
        limits.max_queue,
        limits.token_budget.map(|b| {
            TokenBudgetDetail::compute(
                b.budget,
                b.high_priority_reserve,
                ask.priority == Priority::High,
                state.tokens(),
                ask.reserved,
            )
        }),
    )
}

/// The advisory verdict for `ask` (of `class`, with classes) on `state`, `pending` callers
/// waiting, and the constraint behind a refusal.
pub(crate) fn verdict(
    state: State,
    limits: &Bounds,
    pending: u64,
    ask: Ask,
    class: Option<&ClassView>,
) -> (Verdict, Option<Constraint>) {
    let decided = match class {
        Some(class) => admit_class(state, limits, class, ask, Turn::Newcomer).map(|_| ()),
        None => admit(state, limits, ask, Turn::Newcomer).map(|_| ()),
    };
    match decided {
        Ok(()) => (Verdict::Admit, None),
        Err(Refusal::NoSlot) => match queue_or_refuse(limits, pending) {
            Ok(()) => (Verdict::Queue, None),
            Err(reason) => (Verdict::Reject(reason), Some(Constraint::Global)),
        },
        Err(refusal) => (Verdict::Reject(refusal.reason()), refusal.constraint()),
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::vocabulary::limits::Limits;

    fn state(slots: u32, tokens: u64) -> State {
        State::for_tests(slots, tokens)
    }

    fn admit_new(state: State, limits: &Bounds, ask: Ask) -> Result<State, Refusal> {
        admit(state, limits, ask, Turn::Newcomer)
    }

    fn ask(reserved: u64, priority: Priority) -> Ask {
        Ask {
            reserved,
            priority,
            class: None,
        }
    }

    #[test]
    fn shutdown_wins_over_every_capacity_check() {
        let limits = Bounds::of(&Limits::new(0, 0).with_token_budget(0, 0));
        let closed = State::INITIAL.with_closed();
        assert_eq!(
            admit_new(closed, &limits, ask(u64::MAX, Priority::High)),
            Err(Refusal::Shutdown)
        );
    }

    #[test]
    fn budget_is_checked_before_concurrency() {
        let limits = Bounds::of(&Limits::new(0, 0).with_token_budget(10, 0));
        assert_eq!(
            admit_new(State::INITIAL, &limits, ask(11, Priority::Normal)),
            Err(Refusal::Budget)
        );
        assert_eq!(
            admit_new(State::INITIAL, &limits, ask(10, Priority::Normal)),
            Err(Refusal::NoSlot)
        );
    }

    #[test]
    fn exact_fit_admits_and_takes_both_at_once() {
        let limits = Bounds::of(&Limits::new(0, 2).with_token_budget(1000, 0));
        let s = state(1, 400);
        let next = admit_new(s, &limits, ask(600, Priority::Normal)).unwrap();
        assert_eq!((next.slots(), next.tokens()), (2, 1000));
    }

    #[test]
    fn reserve_limits_normal_priority_only() {
        // B=2400, R=400: one 1100 request fits; a second is refused for normal, admitted for high.
        let limits = Bounds::of(&Limits::new(0, 4).with_token_budget(2400, 400));
        let s = state(1, 1100);
        assert_eq!(
            admit_new(s, &limits, ask(1100, Priority::Normal)),
            Err(Refusal::Budget)
        );
        assert_eq!(
            admit_new(s, &limits, ask(1100, Priority::High))
                .unwrap()
                .tokens(),
            2200
        );
    }

    #[test]
    fn reserve_above_budget_leaves_normal_nothing() {
        let limits = Bounds::of(&Limits::new(0, 4).with_token_budget(100, 500));
        assert_eq!(
            admit_new(State::INITIAL, &limits, ask(1, Priority::Normal)),
            Err(Refusal::Budget)
        );
        assert!(admit_new(State::INITIAL, &limits, ask(0, Priority::Normal)).is_ok());
        assert!(admit_new(State::INITIAL, &limits, ask(100, Priority::High)).is_ok());
    }

    #[test]
    fn budget_zero_admits_zero_token_requests_until_overrun() {
        let limits = Bounds::of(&Limits::new(0, 4).with_token_budget(0, 0));
        assert!(admit_new(State::INITIAL, &limits, ask(0, Priority::Normal)).is_ok());
        assert_eq!(
            admit_new(State::INITIAL, &limits, ask(1, Priority::High)),
            Err(Refusal::Budget)
        );
        // Tokens above the budget (an overrun or a shrink) refuse even 0-token requests.
        assert_eq!(
            admit_new(state(1, 5), &limits, ask(0, Priority::High)),
            Err(Refusal::Budget)
        );
    }

    #[test]
    fn overflowing_token_sum_is_a_budget_refusal() {
        let limits = Bounds::of(&Limits::new(0, 4).with_token_budget(MAX_TOKENS, 0));
        assert_eq!(
            admit_new(state(1, 2), &limits, ask(u64::MAX, Priority::High)),
            Err(Refusal::Budget)
        );
        assert_eq!(
            admit_new(state(1, 2), &limits, ask(MAX_TOKENS - 1, Priority::High)),
            Err(Refusal::Budget)
        );
        let full = admit_new(state(1, 1), &limits, ask(MAX_TOKENS - 1, Priority::High)).unwrap();
        assert_eq!((full.slots(), full.tokens()), (2, MAX_TOKENS));
    }

    #[test]
    fn a_total_the_word_cannot_count_is_refused_even_under_a_larger_budget() {
        // Budgets are validated against MAX_TOKENS; the pure policy still never produces a
        // state the word cannot hold.
        let limits = Bounds::of(&Limits::new(0, 4).with_token_budget(u64::MAX, 0));
        assert_eq!(
            admit_new(state(0, 0), &limits, ask(MAX_TOKENS + 1, Priority::High)),
            Err(Refusal::Budget)
        );
        assert!(admit_new(state(0, 0), &limits, ask(MAX_TOKENS, Priority::High)).is_ok());
    }

    #[test]
    fn waiters_block_newcomers_even_with_free_slots() {
        let limits = Bounds::of(&Limits::new(0, 4).with_max_queue(2));
        assert!(admit_new(state(1, 0), &limits, ask(0, Priority::Normal)).is_ok());
        let waiting = state(1, 0).with_waiters(true);
        assert_eq!(
            admit_new(waiting, &limits, ask(0, Priority::Normal)),
            Err(Refusal::NoSlot)
        );
        assert_eq!(
            verdict(waiting, &limits, 1, ask(0, Priority::Normal), None).0,
            Verdict::Queue
        );
        // The head of the queue is exactly who those free slots are for.
        let head = admit(waiting, &limits, ask(0, Priority::Normal), Turn::Head);
        assert_eq!(head.unwrap().slots(), 2);
    }

    #[test]
    fn the_head_keeps_its_place_until_a_slot_frees_whatever_its_tokens() {
        let limits = Bounds::of(
            &Limits::new(0, 1)
                .with_token_budget(300, 0)
                .with_max_queue(4),
        );
        // No slot and tokens that do not fit: a newcomer hears about the budget first...
        let full = state(1, 600).with_waiters(true);
        assert_eq!(
            admit_new(full, &limits, ask(400, Priority::Normal)),
            Err(Refusal::Budget)
        );
        // ...the head is told to keep waiting.
        let head = admit(full, &limits, ask(400, Priority::Normal), Turn::Head);
        assert_eq!(head, Err(Refusal::NoSlot));
        // Once a slot is free its tokens decide.
        let free = state(0, 0).with_waiters(true);
        let head = admit(free, &limits, ask(400, Priority::Normal), Turn::Head);
        assert_eq!(head, Err(Refusal::Budget));
        let head = admit(free, &limits, ask(100, Priority::Normal), Turn::Head);
        assert_eq!(head.map(|s| (s.slots(), s.tokens())), Ok((1, 100)));
    }

    #[test]
    fn zero_concurrency_never_queues() {
        let limits = Bounds::of(&Limits::new(0, 0).with_max_queue(10));
        assert_eq!(
            queue_or_refuse(&limits, 0),
            Err(RejectReason::ConcurrencyLimit)
        );
        let limits = Bounds::of(&Limits::new(0, 1).with_max_queue(2));
        assert_eq!(queue_or_refuse(&limits, 1), Ok(()));
        assert_eq!(queue_or_refuse(&limits, 2), Err(RejectReason::QueueLimit));
        assert_eq!(
            queue_or_refuse(&Bounds::of(&Limits::new(0, 1)), 0),
            Err(RejectReason::ConcurrencyLimit)
        );
    }

    #[test]
    fn detail_matches_the_upstream_example() {
        let limits = Bounds::of(
            &Limits::new(4, 8)
                .with_token_budget(2400, 400)
                .with_max_queue(3),
        );
        let d = detail(
            state(1, 1100),
            &limits,
            2,
            ask(1100, Priority::Normal),
            None,
            None,
        );
        assert_eq!(
            (
                d.limit_revision,
                d.in_flight,
                d.max_concurrent,
                d.pending,
                d.max_queue
            ),
            (4, 1, 8, 2, 3)
        );
        let t = d.token_budget.unwrap();
        assert_eq!(
            (
                t.budget,
                t.in_flight_tokens,
                t.effective_budget,
                t.available,
                t.requested
            ),
            (2400, 1100, 2000, 900, 1100)
        );
    }

    /// The reference model: the rules written as plainly as possible, in 128-bit arithmetic.
    fn reference(
        closed: bool,
        slots: u32,
        tokens: u64,
        limits: &Bounds,
        reserved: u64,
        high: bool,
        pending: u64,
    ) -> Verdict {
        if closed {
            return Verdict::Reject(RejectReason::Shutdown);
        }
        if let Some(b) = limits.token_budget {
            let reserve = if high {
                0
            } else {
                i128::from(b.high_priority_reserve)
            };
            let effective = (i128::from(b.budget) - reserve).max(0);
            if i128::from(tokens) + i128::from(reserved) > effective {
                return Verdict::Reject(RejectReason::BudgetLimit);
            }
        }
        if slots < limits.max_concurrent && pending == 0 {
            return Verdict::Admit;
        }
        if limits.max_concurrent == 0 {
            Verdict::Reject(RejectReason::ConcurrencyLimit)
        } else if pending < u64::from(limits.max_queue) {
            Verdict::Queue
        } else if limits.max_queue > 0 {
            Verdict::Reject(RejectReason::QueueLimit)
        } else {
            Verdict::Reject(RejectReason::ConcurrencyLimit)
        }
    }

    /// Token counts and budgets the word can hold, biased to the edges.
    fn edge_tokens() -> impl Strategy<Value = u64> {
        prop_oneof![
            0..4u64,
            1000..1100u64,
            (MAX_TOKENS - 3)..=MAX_TOKENS,
            0..=MAX_TOKENS
        ]
    }

    fn edge_u64() -> impl Strategy<Value = u64> {
        prop_oneof![
            0..4u64,
            1000..1100u64,
            (u64::MAX - 3)..=u64::MAX,
            any::<u64>()
        ]
    }

    proptest! {
        #[test]
        fn policy_agrees_with_the_reference_model(
            closed in any::<bool>(),
            slots in 0..6u32,
            tokens in edge_tokens(),
            max_concurrent in 0..6u32,
            max_queue in 0..3u32,
            budget in proptest::option::of((edge_tokens(), edge_u64())),
            reserved in edge_u64(),
            high in any::<bool>(),
            pending in 0..4u64,
        ) {
            let mut limits = Limits::new(1, max_concurrent).with_max_queue(max_queue);
            let tokens = if budget.is_some() { tokens } else { 0 };
            let reserved = if budget.is_some() { reserved } else { 0 };
            if let Some((b, r)) = budget {
                limits = limits.with_token_budget(b, r);
            }
            let mut s = state(slots, tokens);
            if closed {
                s = s.with_closed();
            }
            if pending > 0 {
                s = s.with_waiters(true);
            }
            let limits = Bounds::of(&limits);
            let priority = if high { Priority::High } else { Priority::Normal };
            let ask = Ask { reserved, priority, class: None };
            let (got, _) = verdict(s, &limits, pending, ask, None);
            prop_assert_eq!(got, reference(closed, slots, tokens, &limits, reserved, high, pending));
            if let Verdict::Admit = got {
                let next = admit_new(s, &limits, ask).unwrap();
                prop_assert_eq!(next.slots(), slots + 1);
                prop_assert_eq!(u128::from(next.tokens()), u128::from(tokens) + u128::from(reserved));
                prop_assert_eq!(next.epoch_bits(), s.epoch_bits());
            }
        }
    }
}
