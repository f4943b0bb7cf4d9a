//! The packed admission word: slots in flight, tokens in flight, the low bits of the limits
//! epoch and three flags, in one `AtomicU64` updated by compare-and-swap.
//!
//! # Layout
//!
//! ```text
//!   63       62        61         60 .. 51      50 ........... 35   34 ................. 0
//! +--------+---------+----------+-------------+------------------+----------------------+
//! | CLOSED | WAITERS | DRAINING | EPOCH (10)  |  SLOTS (16 bits) |   TOKENS (35 bits)   |
//! +--------+---------+----------+-------------+------------------+----------------------+
//! ```
//!
//! - `TOKENS`: tokens held by admissions (always 0 without a token budget), at most
//!   [`MAX_TOKENS`] (2^35 - 1, about 34 billion): budgets are validated against it and a usage
//!   report that would push the total past it is refused.
//! - `SLOTS`: admissions holding a concurrency slot (at most [`MAX_SLOTS`], 65,535: far more
//!   calls in flight than any provider accepts from one process).
//! - `EPOCH`: the low bits of the limits epoch (the full 64-bit epoch lives beside the published
//!   limits, see `super::limits`). Every `apply_limits` advances it with a CAS, so an admission
//!   that read the word before the change fails its own CAS and is re-decided under the new
//!   limits. The low bits are not the only guard: an admission also checks the full epoch after
//!   committing, and undoes its commit in the one case the low bits cannot settle: 1,023 or more
//!   limit changes (2^`EPOCH_BITS` - 1) published between its read of the word and that check,
//!   a span of a few instructions unless the thread is descheduled inside it. While an undone
//!   commit is in the word, another decision can be refused on its tokens; ten bits put that
//!   out of reach in practice (a control plane changing the limits 1,000 times a second would
//!   need the thread to stay descheduled inside that span for over a second; with four bits,
//!   15 ms of preemption on an oversubscribed machine was enough, see `stress/tests/stress/phantom_probe.rs`).
//! - `WAITERS`: set exactly while the FIFO wait queue is non-empty (it only changes under the
//!   queue lock). Newcomers never take a slot while it is set (no barging), and a release only
//!   touches the queue when it sees it, so an uncontended release never pays for a lock or a
//!   notification.
//! - `DRAINING`: set while a `drain()` waits for the bulkhead to become idle (no slot held, no
//!   waiter). Whatever makes it idle sees the flag in the same atomic operation, clears it and
//!   wakes the drainers; without a drainer, becoming idle costs nothing.
//! - `CLOSED`: set once by `close()`, never cleared.
//!
//! Slots and tokens sharing one 64-bit word (rather than a 128-bit one) is what makes the
//! budgeted fast path as cheap as the budget-less one: one 64-bit CAS to admit and one
//! `fetch_sub` (a single wait-free `lock xadd` on x86-64) to release both the slot and the
//! tokens. The 128-bit word this replaced needed `cmpxchg16b` loops both ways: 1.5x the cost on
//! one thread and about 40 % less throughput on two (benches/README.md).
//!
//! # How the rest of the design fits
//!
//! - The FIFO wait queue (`super::queue`) keeps its own length under its lock and publishes
//!   only "non-empty" here (`WAITERS`); a release that sees the bit hands free capacity to the
//!   queue head with the same kind of CAS as any admission, so the head's slot and tokens are
//!   taken in one step.
//! - Admission classes add one packed word per class (class slots and class tokens) beside this
//!   one, and their limits join the published snapshot under the same epoch. The pure policy
//!   grows class checks in the order `docs/design.md` §D4 fixes; the epoch check keeps class limits as
//!   linearizable as the global ones.
//!
//! # Memory ordering
//!
//! Every successful update is a `compare_exchange_weak(AcqRel, Acquire)` and a release is a
//! `fetch_sub(AcqRel)`: a release is a release operation that the next admission's CAS (or
//! load) acquires, so whatever a permit holder did before releasing happens-before the work of
//! the admission that reuses its capacity. Failed CASes and plain loads are `Acquire`, which
//! also makes the limits published before an epoch bump visible to whoever observes it.

use crossbeam_utils::{Backoff, CachePadded};

use crate::support::sync::atomic::{AtomicU64, AtomicU128, Ordering};

/// Bits that count tokens in flight.
pub(crate) const TOKEN_BITS: u32 = 35;
/// Mask of the token count.
const TOKEN_MASK: u64 = (1 << TOKEN_BITS) - 1;
/// Largest representable number of tokens in flight, and so the largest budget.
pub(crate) const MAX_TOKENS: u64 = TOKEN_MASK;
/// Position of the slot count.
const SLOT_SHIFT: u32 = TOKEN_BITS;
/// Bits that count slots.
pub(crate) const SLOT_BITS: u32 = 16;
/// Mask of the slot count once shifted down.
const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// Largest representable number of slots in flight, and so the largest `max_concurrent`.
pub(crate) const MAX_SLOTS: u32 = SLOT_MASK as u32;
/// One slot, in place.
const ONE_SLOT: u64 = 1 << SLOT_SHIFT;
/// Position of the epoch's low bits.
const EPOCH_SHIFT: u32 = SLOT_SHIFT + SLOT_BITS;
/// How many low bits of the epoch the word carries (see the module docs for why ten). Under
/// loom, one: so that two limit changes already wrap it and the models reach the undo path.
#[cfg(not(loom))]
pub(crate) const EPOCH_BITS: u32 = 10;
#[cfg(loom)]
pub(crate) const EPOCH_BITS: u32 = 1;
/// Mask of the epoch's low bits once shifted down.
pub(crate) const EPOCH_MASK: u64 = (1 << EPOCH_BITS) - 1;
/// Set while a drain waits for the bulkhead to become idle.
const DRAINING_BIT: u64 = 1 << 61;
/// Set while the wait queue is non-empty.
const WAITERS_BIT: u64 = 1 << 62;
/// Set once the bulkhead is closed.
const CLOSED_BIT: u64 = 1 << 63;

// The fields must not overlap and must fit below the flags.
#[cfg(not(loom))]
const _: () = assert!(
    EPOCH_SHIFT + EPOCH_BITS == 61,
    "every bit below the flags is used"
);
const _: () = assert!(EPOCH_SHIFT + EPOCH_BITS <= 61);
const _: () = assert!(
    (EPOCH_MASK << EPOCH_SHIFT) & (SLOT_MASK << SLOT_SHIFT) == 0
        && (SLOT_MASK << SLOT_SHIFT) & TOKEN_MASK == 0
);

/// Position of the shared (borrowed) slots in the high half of a wide word.
const SHARED_SLOTS_SHIFT: u32 = 0;
/// Position of the shared (borrowed) tokens in the high half of a wide word.
const SHARED_TOKENS_SHIFT: u32 = SLOT_BITS;
/// Position of the count of abandoned, unsettled admissions in the high half of a wide word.
const ABANDONED_SHIFT: u32 = SHARED_TOKENS_SHIFT + TOKEN_BITS;
/// Bits that count abandoned, unsettled admissions.
const ABANDONED_BITS: u32 = 63 - ABANDONED_SHIFT;
/// Most admissions that may have abandoned their slot without settling yet, at once.
pub(crate) const MAX_ABANDONED: u32 = (1 << ABANDONED_BITS) - 1;
/// Set while the classes' floors are reserved in the word (see `super::classes`, "Floors
/// reserved"): the slots and tokens in flight then count every reserving class at its floor
/// at least.
const FLOORS_RESERVED_BIT: u64 = 1 << 63;
const _: () = assert!(ABANDONED_BITS >= 8 && ABANDONED_SHIFT + ABANDONED_BITS == 63);
// Stated in `Permit::abandon_borrowed_concurrency`'s documentation.
const _: () = assert!(MAX_ABANDONED == 4_095);

/// A decoded copy of the admission word.
///
/// `lo` is the word described in the module docs. `hi` exists only in the wide word of a
/// bulkhead with admission classes (see `super::classes`), where one 128-bit CAS decides a
/// class admission:
///
/// ```text
///   63          62 ........... 51   50 ................... 16   15 ............... 0
/// +-----------+-------------------+-----------------------------+--------------------+
/// | FLOORS    | ABANDONED (12)    |  SHARED TOKENS (35 bits)    | SHARED SLOTS (16)  |
/// | RESERVED  |                   |                             |                    |
/// +-----------+-------------------+-----------------------------+--------------------+
/// ```
///
/// - `SHARED SLOTS`: slots borrowed from the shared pool, `Σ_c max(0, in_flight_c −
///   protected_c)`; `SHARED TOKENS` likewise for tokens. Kept equal to those sums at every
///   moment (they change only in the same CAS as the class counts they derive from).
/// - `ABANDONED`: admissions that gave their borrowed slot back and hold tokens until they
///   settle; they keep the engine from being idle (a drain waits for them).
/// - `FLOORS RESERVED`: while set, `lo`'s slots and tokens count every class that reserves
///   its floors at its floor at least (`max(in_flight_c, protected_c)`), so that a call within
///   its class's floors is admitted and released on its class's word alone; the readers of
///   the figures subtract the idle floors (`super::classes`, "Floors reserved").
///
/// Without classes `hi` is always 0 and never stored: the narrow word is `lo` alone.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct State {
    lo: u64,
    hi: u64,
}

impl State {
    /// The state of a new bulkhead: nothing in flight, epoch 0, open.
    pub(crate) const INITIAL: State = State { lo: 0, hi: 0 };

    /// A narrow word as read from its atomic (no high half).
    #[inline]
    pub(crate) const fn narrow(lo: u64) -> State {
        State { lo, hi: 0 }
    }

    /// The narrow word of this state (its high half is 0 without classes).
    #[inline]
    pub(crate) const fn lo(self) -> u64 {
        self.lo
    }

    /// Whether any flag is set (closed, waiters, draining): the fast lane leaves such a word
    /// to the general path.
    #[inline]
    pub(crate) const fn has_flags(self) -> bool {
        self.lo & (CLOSED_BIT | WAITERS_BIT | DRAINING_BIT) != 0
    }

    #[inline]
    const fn with_lo(self, lo: u64) -> State {
        State { lo, hi: self.hi }
    }

    #[inline]
    pub(crate) fn slots(self) -> u32 {
        ((self.lo >> SLOT_SHIFT) & SLOT_MASK) as u32
    }

    #[inline]
    pub(crate) fn tokens(self) -> u64 {
        self.lo & TOKEN_MASK
    }

    /// The low [`EPOCH_BITS`] bits of the limits epoch.
    #[inline]
    pub(crate) fn epoch_bits(self) -> u64 {
        (self.lo >> EPOCH_SHIFT) & EPOCH_MASK
    }

    /// Whether this word was written under the full epoch `epoch` (as far as its low bits can
    /// tell).
    #[inline]
    pub(crate) fn matches_epoch(self, epoch: u64) -> bool {
        self.epoch_bits() == epoch & EPOCH_MASK
    }

    #[inline]
    pub(crate) fn is_closed(self) -> bool {
        self.lo & CLOSED_BIT != 0
    }

    #[inline]
    pub(crate) fn has_waiters(self) -> bool {
        self.lo & WAITERS_BIT != 0
    }

    #[inline]
    pub(crate) fn is_draining(self) -> bool {
        self.lo & DRAINING_BIT != 0
    }

    /// Whether a release that saw this state before it must serve the queue or the drainers.
    #[inline]
    pub(crate) fn needs_attention_on_release(self) -> bool {
        self.lo & (WAITERS_BIT | DRAINING_BIT) != 0
    }

    /// Nothing in flight, nobody waiting, no abandoned admission unsettled.
    #[inline]
    pub(crate) fn is_idle(self) -> bool {
        self.lo & ((SLOT_MASK << SLOT_SHIFT) | WAITERS_BIT) == 0 && self.abandoned() == 0
    }

    #[inline]
    pub(crate) fn with_waiters(self, waiters: bool) -> State {
        self.with_lo(set_bit(self.lo, WAITERS_BIT, waiters))
    }

    #[inline]
    pub(crate) fn with_draining(self, draining: bool) -> State {
        self.with_lo(set_bit(self.lo, DRAINING_BIT, draining))
    }

    /// This state with one more slot and `tokens` more tokens in flight.
    ///
    /// The caller (the policy) has checked that the slot count stays within a limit that is at
    /// most [`MAX_SLOTS`] and the token total within [`MAX_TOKENS`].
    #[inline]
    pub(crate) fn with_admission(self, tokens: u64) -> State {
        debug_assert!(self.slots() < MAX_SLOTS, "slot count overflow");
        debug_assert!(
            self.tokens()
                .checked_add(tokens)
                .is_some_and(|t| t <= MAX_TOKENS),
            "token count overflow"
        );
        self.with_lo(self.lo + ONE_SLOT + tokens)
    }

    /// This state without the admission `with_admission(tokens)` added.
    #[inline]
    pub(crate) fn without_admission(self, tokens: u64) -> State {
        debug_assert!(self.slots() > 0 && self.tokens() >= tokens, "underflow");
        self.with_lo(self.lo - ONE_SLOT - tokens)
    }

    /// This state with the epoch's low bits advanced by one (wrapping within their field).
    #[inline]
    pub(crate) fn with_next_epoch(self) -> State {
        let bits = (self.epoch_bits() + 1) & EPOCH_MASK;
        self.with_lo((self.lo & !(EPOCH_MASK << EPOCH_SHIFT)) | (bits << EPOCH_SHIFT))
    }

    /// This state with `tokens` tokens in flight, or `None` if that cannot be represented.
    #[inline]
    pub(crate) fn with_tokens(self, tokens: u64) -> Option<State> {
        (tokens <= MAX_TOKENS).then_some(self.with_lo((self.lo & !TOKEN_MASK) | tokens))
    }

    #[inline]
    pub(crate) fn with_closed(self) -> State {
        self.with_lo(self.lo | CLOSED_BIT)
    }

    /// Slots borrowed from the shared pool (0 without classes).
    #[inline]
    pub(crate) fn shared_slots(self) -> u32 {
        ((self.hi >> SHARED_SLOTS_SHIFT) & SLOT_MASK) as u32
    }

    /// Tokens borrowed from the shared pool (0 without classes).
    #[inline]
    pub(crate) fn shared_tokens(self) -> u64 {
        (self.hi >> SHARED_TOKENS_SHIFT) & TOKEN_MASK
    }

    /// Admissions that abandoned their slot and have not settled (0 without classes).
    #[inline]
    pub(crate) fn abandoned(self) -> u32 {
        ((self.hi >> ABANDONED_SHIFT) as u32) & MAX_ABANDONED
    }

    /// Whether the classes' floors are reserved in the slots and tokens (never without
    /// classes).
    #[inline]
    pub(crate) fn floors_reserved(self) -> bool {
        self.hi & FLOORS_RESERVED_BIT != 0
    }

    #[inline]
    pub(crate) fn with_floors_reserved(self, reserved: bool) -> State {
        State {
            lo: self.lo,
            hi: set_bit(self.hi, FLOORS_RESERVED_BIT, reserved),
        }
    }

    /// This state with `slots` slots and `tokens` tokens in flight (the caller keeps them
    /// within [`MAX_SLOTS`] and [`MAX_TOKENS`]).
    #[inline]
    pub(crate) fn with_counts(self, slots: u32, tokens: u64) -> State {
        debug_assert!(slots <= MAX_SLOTS && tokens <= MAX_TOKENS);
        self.with_lo(
            (self.lo & !((SLOT_MASK << SLOT_SHIFT) | TOKEN_MASK))
                | (u64::from(slots) << SLOT_SHIFT)
                | tokens,
        )
    }

    /// This state with `slots` more slots and `tokens` more tokens in flight (a class
    /// admission while the floors are reserved may add less than one slot and its tokens).
    /// The caller (the policy) has checked that both stay within their limits.
    #[inline]
    pub(crate) fn with_added(self, slots: u32, tokens: u64) -> State {
        debug_assert!(
            self.slots() + slots <= MAX_SLOTS
                && self
                    .tokens()
                    .checked_add(tokens)
                    .is_some_and(|t| t <= MAX_TOKENS),
            "slot or token count overflow"
        );
        self.with_lo(self.lo + (u64::from(slots) << SLOT_SHIFT) + tokens)
    }

    /// This state with the shared-pool figures replaced. The caller keeps them within their
    /// fields (they never exceed the slots and tokens in flight).
    #[inline]
    pub(crate) fn with_shared(self, slots: u32, tokens: u64) -> State {
        debug_assert!(slots <= MAX_SLOTS && tokens <= MAX_TOKENS);
        let kept =
            self.hi & !((SLOT_MASK << SHARED_SLOTS_SHIFT) | (TOKEN_MASK << SHARED_TOKENS_SHIFT));
        State {
            lo: self.lo,
            hi: kept | (u64::from(slots) << SHARED_SLOTS_SHIFT) | (tokens << SHARED_TOKENS_SHIFT),
        }
    }

    /// This state with `abandoned` admissions abandoned and unsettled (at most
    /// [`MAX_ABANDONED`]).
    #[inline]
    pub(crate) fn with_abandoned(self, abandoned: u32) -> State {
        debug_assert!(abandoned <= MAX_ABANDONED);
        let kept = self.hi & !(u64::from(MAX_ABANDONED) << ABANDONED_SHIFT);
        State {
            lo: self.lo,
            hi: kept | (u64::from(abandoned) << ABANDONED_SHIFT),
        }
    }

    #[inline]
    fn wide(self) -> u128 {
        (u128::from(self.hi) << 64) | u128::from(self.lo)
    }

    #[inline]
    fn from_wide(word: u128) -> State {
        State {
            lo: word as u64,
            hi: (word >> 64) as u64,
        }
    }
}

#[inline]
fn set_bit(word: u64, bit: u64, on: bool) -> u64 {
    if on { word | bit } else { word & !bit }
}

#[cfg(test)]
impl State {
    /// A state with `slots` slots and `tokens` tokens in flight, epoch 0, open, no waiters.
    pub(crate) fn for_tests(slots: u32, tokens: u64) -> State {
        assert!(slots <= MAX_SLOTS && tokens <= MAX_TOKENS);
        State {
            lo: (u64::from(slots) << SLOT_SHIFT) | tokens,
            hi: 0,
        }
    }
}

/// The atomic cell holding a [`State`], alone on its cache line: the narrow 64-bit word, or
/// (with admission classes) the wide 128-bit one.
///
/// Both cells exist (the one not in use stays zero and costs a cache line), so that a path
/// that knows which word it uses (the fast lane and the release of an admission without a
/// class use the narrow one; only an engine without classes has such admissions) reaches it
/// without checking; the general methods check `wide`, fixed at construction.
#[derive(Debug)]
pub(crate) struct AtomicState {
    narrow: CachePadded<AtomicU64>,
    wide: CachePadded<AtomicU128>,
    /// Whether the wide word is the one in use (admission classes).
    is_wide: bool,
}

impl AtomicState {
    /// A narrow word (no admission classes).
    pub(crate) fn narrow() -> AtomicState {
        AtomicState {
            narrow: CachePadded::new(AtomicU64::new(State::INITIAL.lo)),
            wide: CachePadded::new(AtomicU128::new(0)),
            is_wide: false,
        }
    }

    /// A wide word (with admission classes).
    pub(crate) fn wide() -> AtomicState {
        AtomicState {
            narrow: CachePadded::new(AtomicU64::new(0)),
            wide: CachePadded::new(AtomicU128::new(State::INITIAL.wide())),
            is_wide: true,
        }
    }

    /// The narrow word itself: the one in use on an engine without admission classes (the
    /// caller knows it has none; on an engine with classes this cell is unused).
    #[inline]
    pub(crate) fn narrow_word(&self) -> &AtomicU64 {
        debug_assert!(!self.is_wide, "the narrow word of an engine with classes");
        &self.narrow
    }

    /// Loads the current state (`Acquire`).
    #[inline]
    pub(crate) fn load(&self) -> State {
        if self.is_wide {
            State::from_wide(self.wide.load(Ordering::Acquire))
        } else {
            State {
                lo: self.narrow.load(Ordering::Acquire),
                hi: 0,
            }
        }
    }

    /// One compare-and-swap from `current` to `next`: `Err` carries the value found instead.
    /// `AcqRel` / `Acquire` (see "Memory ordering" in the module docs).
    #[inline]
    pub(crate) fn compare_exchange(&self, current: State, next: State) -> Result<(), State> {
        if self.is_wide {
            self.wide
                .compare_exchange_weak(
                    current.wide(),
                    next.wide(),
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .map(|_| ())
                .map_err(State::from_wide)
        } else {
            debug_assert!(next.hi == 0, "a narrow word has no high half");
            self.narrow
                .compare_exchange_weak(current.lo, next.lo, Ordering::AcqRel, Ordering::Acquire)
                .map(|_| ())
                .map_err(|lo| State { lo, hi: 0 })
        }
    }

    /// Returns one slot and `tokens` tokens of the narrow word (an admission without a class,
    /// so an engine without classes); returns the state before.
    ///
    /// A release decides nothing, so it is one `fetch_sub` (wait-free) rather than a CAS loop.
    /// It cannot borrow across fields: the releasing permit's slot and its `tokens` are part of
    /// the counts it subtracts from. `AcqRel` for the same reason as a CAS (module docs). (The
    /// wide word's releases also move the shared-pool figures: [`release_wide`].)
    ///
    /// [`release_wide`]: AtomicState::release_wide
    #[inline]
    pub(crate) fn release(&self, tokens: u64) -> State {
        let before = State {
            lo: self
                .narrow_word()
                .fetch_sub(ONE_SLOT + tokens, Ordering::AcqRel),
            hi: 0,
        };
        debug_assert!(
            before.slots() > 0 && before.tokens() >= tokens,
            "slot or token count underflow"
        );
        before
    }

    /// Returns `slots` slots (one, or none while the floors are reserved and the class stays
    /// within its floor) and `tokens` tokens of the wide word, and `shared_slots` and
    /// `shared_tokens` of the shared pool's figures, in one `fetch_sub`; returns the states
    /// before and after.
    ///
    /// The same argument as [`release`](AtomicState::release): nothing is decided, and no
    /// field can borrow from the one above it, because every amount is part of the count it
    /// is taken from (the caller holds the class's lock, so its class's borrowed figures are
    /// part of the shared ones). One read-modify-write instead of a load and a CAS loop (on
    /// x86-64 without `cmpxchg16b` enabled at compile time, one call through
    /// `portable-atomic`'s run-time dispatch instead of two).
    #[inline]
    pub(crate) fn release_wide(
        &self,
        slots: u32,
        tokens: u64,
        shared_slots: u32,
        shared_tokens: u64,
    ) -> (State, State) {
        debug_assert!(
            self.is_wide,
            "only a class admission moves the shared figures"
        );
        let word = &self.wide;
        let delta = State {
            lo: (u64::from(slots) << SLOT_SHIFT) + tokens,
            hi: 0,
        }
        .with_shared(shared_slots, shared_tokens);
        let before = State::from_wide(word.fetch_sub(delta.wide(), Ordering::AcqRel));
        debug_assert!(
            before.slots() >= slots
                && before.tokens() >= tokens
                && before.shared_slots() >= shared_slots
                && before.shared_tokens() >= shared_tokens,
            "slot, token or shared count underflow"
        );
        (before, State::from_wide(before.wide() - delta.wide()))
    }

    /// A CAS loop for an update that always applies: `f` maps the current state to the next;
    /// returns the state written.
    #[inline]
    pub(crate) fn modify(&self, mut f: impl FnMut(State) -> State) -> State {
        self.update(|s| {
            let next = f(s);
            Ok::<_, core::convert::Infallible>((next, next))
        })
        .unwrap_or_else(|never| match never {})
    }

    /// A CAS loop for updates that do not depend on the limits: `decide` maps the current
    /// state to the next one (plus a value to return) or to an error, which ends the loop
    /// without writing anything.
    ///
    /// A failed CAS hands back the value it found, and the loop re-decides from that value; it
    /// never re-loads separately. After a failure it backs off briefly (exponential spinning,
    /// no yielding), which keeps two cores from bouncing the word's cache line on every
    /// attempt. `decide` must be a pure function of the state it is given.
    #[inline]
    pub(crate) fn update<T, E>(
        &self,
        mut decide: impl FnMut(State) -> Result<(State, T), E>,
    ) -> Result<T, E> {
        let backoff = Backoff::new();
        let mut current = self.load();
        loop {
            let (next, out) = decide(current)?;
            match self.compare_exchange(current, next) {
                Ok(()) => return Ok(out),
                Err(actual) => {
                    current = actual;
                    backoff.spin();
                }
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn fields_round_trip() {
        let s = State::INITIAL
            .with_admission(7)
            .with_admission(3)
            .with_next_epoch()
            .with_closed();
        assert_eq!(s.slots(), 2);
        assert_eq!(s.tokens(), 10);
        assert_eq!(s.epoch_bits(), 1);
        assert!(
            s.matches_epoch(1) && s.matches_epoch(1 + (1 << EPOCH_BITS)) && !s.matches_epoch(2)
        );
        assert!(s.is_closed());
        assert!(!s.has_waiters());
        let r = s.without_admission(7);
        assert_eq!(
            (r.slots(), r.tokens(), r.epoch_bits(), r.is_closed()),
            (1, 3, 1, true)
        );
    }

    #[test]
    fn epoch_bits_wrap_inside_their_field() {
        let mut s = State::INITIAL;
        for _ in 0..3 {
            s = s.with_next_epoch();
        }
        assert_eq!(s.epoch_bits(), 3);
        let top = State::for_tests(5, 9)
            .with_waiters(true)
            .with_draining(true);
        let mut wrapped = top;
        for _ in 0..=EPOCH_MASK {
            wrapped = wrapped.with_next_epoch();
        }
        assert_eq!(wrapped, top, "2^EPOCH_BITS steps come back");
        let once = top.with_next_epoch();
        assert_eq!(once.epoch_bits(), 1);
        assert_eq!((once.slots(), once.tokens()), (5, 9));
        assert!(once.has_waiters() && once.is_draining() && !once.is_closed());
    }

    #[test]
    fn flags_are_independent() {
        let s = State::for_tests(0, 0);
        assert!(s.is_idle());
        let waiting = s.with_waiters(true);
        assert!(waiting.has_waiters() && !waiting.is_idle() && !waiting.is_draining());
        let draining = waiting.with_draining(true).with_waiters(false);
        assert!(draining.is_draining() && draining.is_idle() && !draining.has_waiters());
        assert_eq!(draining.with_draining(false), s);
        assert!(!State::for_tests(1, 0).is_idle());
        assert!(
            State::for_tests(0, 5).is_idle(),
            "tokens alone do not make it busy"
        );
        assert_eq!(
            State::for_tests(3, 7)
                .with_closed()
                .with_waiters(true)
                .epoch_bits(),
            0
        );
    }

    #[test]
    fn field_maxima_fill_their_fields() {
        let full = State::for_tests(MAX_SLOTS, MAX_TOKENS);
        assert_eq!((full.slots(), full.tokens()), (MAX_SLOTS, MAX_TOKENS));
        assert_eq!(full.epoch_bits(), 0);
        assert!(!full.is_closed() && !full.has_waiters() && !full.is_draining());
        assert_eq!(MAX_SLOTS, 65_535);
        assert_eq!(MAX_TOKENS, 34_359_738_367);
        assert_eq!(full.with_tokens(MAX_TOKENS + 1), None);
        assert_eq!(full.with_tokens(0).map(State::slots), Some(MAX_SLOTS));
    }

    #[test]
    fn update_reuses_the_failed_value() {
        let cell = AtomicState::narrow();
        let out: Result<u32, ()> = cell.update(|s| Ok((s.with_admission(4), s.slots())));
        assert_eq!(out, Ok(0));
        let err: Result<(), u64> = cell.update(|s| Err(s.tokens()));
        assert_eq!(err, Err(4));
        assert_eq!(cell.load().slots(), 1);
    }

    #[test]
    fn release_subtracts_both_fields_without_borrowing() {
        let cell = AtomicState::narrow();
        cell.update(|s| {
            Ok::<_, ()>((
                s.with_next_epoch()
                    .with_admission(MAX_TOKENS)
                    .with_admission(0),
                (),
            ))
        })
        .unwrap();
        let before = cell.release(MAX_TOKENS);
        assert_eq!((before.slots(), before.tokens()), (2, MAX_TOKENS));
        let after = cell.load();
        assert_eq!(
            (after.slots(), after.tokens(), after.epoch_bits()),
            (1, 0, 1)
        );
        assert_eq!(cell.release(0).slots(), 1);
        assert!(cell.load().is_idle());
    }

    #[test]
    fn a_wide_release_subtracts_every_field_exactly_and_leaves_the_rest() {
        let cell = AtomicState::wide();
        // Every field at its largest where a borrow would show: full token counts, the
        // shared figures at their maximum, waiters, an epoch and abandoned admissions.
        let full = State::INITIAL
            .with_next_epoch()
            .with_waiters(true)
            .with_admission(MAX_TOKENS)
            .with_admission(0)
            .with_shared(MAX_SLOTS, MAX_TOKENS)
            .with_abandoned(MAX_ABANDONED)
            .with_floors_reserved(true);
        cell.update(|_| Ok::<_, ()>((full, ()))).unwrap();
        let (before, after) = cell.release_wide(1, MAX_TOKENS, 1, MAX_TOKENS);
        assert_eq!(before, full);
        assert_eq!(after, cell.load());
        assert_eq!(
            (
                after.slots(),
                after.tokens(),
                after.shared_slots(),
                after.shared_tokens()
            ),
            (1, 0, MAX_SLOTS - 1, 0)
        );
        assert_eq!(
            (
                after.epoch_bits(),
                after.has_waiters(),
                after.abandoned(),
                after.floors_reserved()
            ),
            (1, true, MAX_ABANDONED, true)
        );
        let (_, last) = cell.release_wide(1, 0, MAX_SLOTS - 1, 0);
        assert_eq!(
            (last.slots(), last.tokens(), last.shared_slots()),
            (0, 0, 0)
        );
        assert_eq!(last.abandoned(), MAX_ABANDONED);
        assert!(last.floors_reserved());
    }
}
