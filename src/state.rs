//! The packed admission word: slots in flight, tokens in flight, the limits epoch and two flags,
//! updated together by one compare-and-swap.
//!
//! # Layout
//!
//! The *control half* is 64 bits:
//!
//! ```text
//!   63       62        61         60 ............... 22   21 ............... 0
//! +--------+---------+----------+----------------------+--------------------+
//! | CLOSED | WAITERS | DRAINING |   EPOCH (39 bits)    |  SLOTS (22 bits)   |
//! +--------+---------+----------+----------------------+--------------------+
//! ```
//!
//! - `SLOTS`: admissions holding a concurrency slot (at most [`MAX_SLOTS`]).
//! - `EPOCH`: which published limits snapshot is current (see `crate::limits`). Every
//!   `apply_limits` advances it, so an admission whose CAS expected the old epoch fails and is
//!   re-decided under the new limits: that is what makes `apply_limits` linearizable.
//! - `WAITERS`: set exactly while the FIFO wait queue is non-empty (it only changes under the
//!   queue lock). Newcomers never take a slot while it is set (no barging), and a release only
//!   touches the queue when it sees it, so an uncontended release never pays for a lock or a
//!   notification.
//! - `DRAINING`: set while a `drain()` waits for the bulkhead to become idle (no slot held, no
//!   waiter). Whatever makes it idle sees the flag in the same atomic operation, clears it and
//!   wakes the drainers; without a drainer, becoming idle costs nothing.
//! - `CLOSED`: set once by `close()`, never cleared.
//!
//! Without a token budget the word is exactly the control half (an `AtomicU64`). With a budget
//! it is 128 bits, control half high and in-flight tokens low (an `AtomicU128`):
//!
//! ```text
//!   127 ............................. 64   63 ............................... 0
//! +---------------------------------------+-----------------------------------+
//! |            control half               |     TOKENS in flight (u64)        |
//! +---------------------------------------+-----------------------------------+
//! ```
//!
//! Tokens get the full 64 bits, so any budget a `u64` can express is representable; a
//! reservation that would overflow the in-flight total is rejected (it cannot fit any budget),
//! never wrapped. The budget-less word stays 64 bits because a 128-bit CAS costs about 1.7x a
//! 64-bit one on x86-64 and a bulkhead without a budget has no tokens to store.
//!
//! # Why the epoch has 39 bits
//!
//! An admission loads the word, reads the limits published for the word's epoch and CASes. If
//! the epoch wrapped all the way around (2^39 `apply_limits` calls) while one admission sat
//! between its load and its CAS, and every other field came back to the same value, the CAS
//! could succeed with stale limits (ABA). `apply_limits` takes a mutex and validates a snapshot,
//! so 2^39 of them take more than half a day of uninterrupted reconfiguration; no admission
//! stalls that long between two adjacent instructions of a retry loop.
//!
//! # How the rest of the design fits
//!
//! - The FIFO wait queue (`crate::queue`) keeps its own length under its lock and publishes
//!   only "non-empty" here (`WAITERS`); a release that sees the bit hands free capacity to the
//!   queue head with the same kind of CAS as any admission, so the head's slot and tokens are
//!   taken in one step.
//! - Admission classes add one packed word per class (class slots and class tokens) beside this
//!   one, and their limits join the published snapshot under the same epoch. The pure policy
//!   grows class checks in the order RUST-DESIGN §4 fixes; the epoch check keeps class limits as
//!   linearizable as the global ones.
//!
//! # Memory ordering
//!
//! Every successful update is a `compare_exchange_weak(AcqRel, Acquire)`: a release's CAS is a
//! release operation that the next admission's CAS (or load) acquires, so whatever a permit
//! holder did before releasing happens-before the work of the admission that reuses its
//! capacity. Failed CASes and plain loads are `Acquire`, which also makes the limits published
//! before an epoch bump visible to whoever observes the bumped epoch.

use crossbeam_utils::{Backoff, CachePadded};

use crate::sync::atomic::{AtomicU64, AtomicU128, Ordering};

/// Bits of the control half that count slots.
pub(crate) const SLOT_BITS: u32 = 22;
/// Mask of the slot count inside the control half.
pub(crate) const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// Largest representable number of slots in flight, and so the largest `max_concurrent`.
pub(crate) const MAX_SLOTS: u32 = SLOT_MASK as u32;
/// Position of the epoch inside the control half.
pub(crate) const EPOCH_SHIFT: u32 = SLOT_BITS;
/// Width of the epoch.
pub(crate) const EPOCH_BITS: u32 = 39;
/// Mask of the epoch once shifted down.
pub(crate) const EPOCH_MAX: u64 = (1 << EPOCH_BITS) - 1;
/// Set while a drain waits for the bulkhead to become idle.
pub(crate) const DRAINING_BIT: u64 = 1 << 61;
/// Set while the wait queue is non-empty.
pub(crate) const WAITERS_BIT: u64 = 1 << 62;
/// Set once the bulkhead is closed.
pub(crate) const CLOSED_BIT: u64 = 1 << 63;

// The fields must tile the control half exactly.
const _: () = assert!(SLOT_BITS + EPOCH_BITS + 3 == 64);
const _: () = assert!(
    (EPOCH_MAX << EPOCH_SHIFT) & (DRAINING_BIT | WAITERS_BIT | CLOSED_BIT | SLOT_MASK) == 0
);

/// A decoded copy of the admission word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct State {
    ctl: u64,
    tokens: u64,
}

impl State {
    /// The state of a new bulkhead: nothing in flight, epoch 0, open.
    pub(crate) const INITIAL: State = State { ctl: 0, tokens: 0 };

    #[inline]
    pub(crate) fn slots(self) -> u32 {
        (self.ctl & SLOT_MASK) as u32
    }

    #[inline]
    pub(crate) fn tokens(self) -> u64 {
        self.tokens
    }

    #[inline]
    pub(crate) fn epoch(self) -> u64 {
        (self.ctl >> EPOCH_SHIFT) & EPOCH_MAX
    }

    #[inline]
    pub(crate) fn is_closed(self) -> bool {
        self.ctl & CLOSED_BIT != 0
    }

    #[inline]
    pub(crate) fn has_waiters(self) -> bool {
        self.ctl & WAITERS_BIT != 0
    }

    #[inline]
    pub(crate) fn is_draining(self) -> bool {
        self.ctl & DRAINING_BIT != 0
    }

    /// Whether a release that saw this state before it must serve the queue or the drainers.
    #[inline]
    pub(crate) fn needs_attention_on_release(self) -> bool {
        self.ctl & (WAITERS_BIT | DRAINING_BIT) != 0
    }

    /// Nothing in flight and nobody waiting.
    #[inline]
    pub(crate) fn is_idle(self) -> bool {
        self.ctl & (SLOT_MASK | WAITERS_BIT) == 0
    }

    #[inline]
    pub(crate) fn with_waiters(self, waiters: bool) -> State {
        State {
            ctl: set_bit(self.ctl, WAITERS_BIT, waiters),
            tokens: self.tokens,
        }
    }

    #[inline]
    pub(crate) fn with_draining(self, draining: bool) -> State {
        State {
            ctl: set_bit(self.ctl, DRAINING_BIT, draining),
            tokens: self.tokens,
        }
    }

    /// This state with one more slot and `tokens` more tokens in flight.
    ///
    /// The caller (the policy) has checked that the slot count stays within a limit that is at
    /// most [`MAX_SLOTS`] and that the token sum does not overflow.
    #[inline]
    pub(crate) fn with_admission(self, tokens: u64) -> State {
        debug_assert!(self.slots() < MAX_SLOTS, "slot count overflow");
        State {
            ctl: self.ctl + 1,
            tokens: self.tokens.checked_add(tokens).expect("token overflow"),
        }
    }

    /// This state with one slot and `tokens` tokens fewer in flight.
    #[cfg(test)]
    pub(crate) fn with_release(self, tokens: u64) -> State {
        State {
            ctl: self.ctl - 1,
            tokens: self.tokens - tokens,
        }
    }

    /// This state with the epoch advanced by one (wrapping within its field).
    #[inline]
    pub(crate) fn with_next_epoch(self) -> State {
        let epoch = (self.epoch() + 1) & EPOCH_MAX;
        let ctl = (self.ctl & !(EPOCH_MAX << EPOCH_SHIFT)) | (epoch << EPOCH_SHIFT);
        State {
            ctl,
            tokens: self.tokens,
        }
    }

    /// This state with `tokens` tokens in flight.
    #[inline]
    pub(crate) fn with_tokens(self, tokens: u64) -> State {
        State {
            ctl: self.ctl,
            tokens,
        }
    }

    #[inline]
    pub(crate) fn with_closed(self) -> State {
        State {
            ctl: self.ctl | CLOSED_BIT,
            tokens: self.tokens,
        }
    }

    #[inline]
    fn pack(self) -> u128 {
        (u128::from(self.ctl) << 64) | u128::from(self.tokens)
    }

    #[inline]
    fn unpack(raw: u128) -> State {
        State {
            ctl: (raw >> 64) as u64,
            tokens: raw as u64,
        }
    }
}

#[inline]
fn set_bit(ctl: u64, bit: u64, on: bool) -> u64 {
    if on { ctl | bit } else { ctl & !bit }
}

#[cfg(test)]
impl State {
    /// A state with `slots` slots and `tokens` tokens in flight, epoch 0, open, no waiters.
    pub(crate) fn for_tests(slots: u32, tokens: u64) -> State {
        assert!(slots <= MAX_SLOTS);
        State {
            ctl: u64::from(slots),
            tokens,
        }
    }
}

/// The atomic cell holding a [`State`]: 64 bits without a token budget, 128 with one.
///
/// Which variant a bulkhead uses is fixed at construction (the "feature shape"), so the match
/// in every operation is perfectly predicted.
#[derive(Debug)]
pub(crate) enum AtomicState {
    /// Control half only; the token count is always zero.
    Slots(CachePadded<AtomicU64>),
    /// Control half and token count.
    SlotsAndTokens(CachePadded<AtomicU128>),
}

impl AtomicState {
    pub(crate) fn new(with_tokens: bool) -> AtomicState {
        let initial = State::INITIAL;
        if with_tokens {
            AtomicState::SlotsAndTokens(CachePadded::new(AtomicU128::new(initial.pack())))
        } else {
            AtomicState::Slots(CachePadded::new(AtomicU64::new(initial.ctl)))
        }
    }

    /// Loads the current state (`Acquire`).
    #[inline]
    pub(crate) fn load(&self) -> State {
        match self {
            AtomicState::Slots(word) => State {
                ctl: word.load(Ordering::Acquire),
                tokens: 0,
            },
            AtomicState::SlotsAndTokens(word) => State::unpack(word.load(Ordering::Acquire)),
        }
    }

    /// Returns one slot and `tokens` tokens; returns the state before.
    ///
    /// A release decides nothing, so it is a plain `fetch_sub` rather than a CAS loop. It
    /// cannot borrow across fields: the releasing permit's slot and its `tokens` are part of
    /// the counts it subtracts from. `AcqRel` for the same reason as a CAS (module docs).
    #[inline]
    pub(crate) fn release(&self, tokens: u64) -> State {
        match self {
            AtomicState::Slots(word) => {
                debug_assert_eq!(tokens, 0, "a budget-less word cannot hold tokens");
                let before = State {
                    ctl: word.fetch_sub(1, Ordering::AcqRel),
                    tokens: 0,
                };
                debug_assert!(before.slots() > 0, "slot count underflow");
                before
            }
            AtomicState::SlotsAndTokens(word) => {
                let one = State { ctl: 1, tokens }.pack();
                let before = State::unpack(word.fetch_sub(one, Ordering::AcqRel));
                debug_assert!(before.slots() > 0 && before.tokens() >= tokens, "underflow");
                before
            }
        }
    }

    /// The generic CAS loop: `decide` maps the current state to the next one (plus a value to
    /// return) or to an error, which ends the loop without writing anything.
    ///
    /// A failed CAS hands back the value it found, and the loop re-decides from that value; it
    /// never re-loads separately. After a failure it backs off briefly (exponential spinning,
    /// no yielding), which keeps two cores from bouncing the word's cache line on every
    /// attempt. `decide` must be a pure function of the state it is given.
    #[inline]
    pub(crate) fn update<T, E>(
        &self,
        decide: impl FnMut(State) -> Result<(State, T), E>,
    ) -> Result<T, E> {
        match self {
            AtomicState::Slots(word) => cas_loop(&**word, decide),
            AtomicState::SlotsAndTokens(word) => cas_loop(&**word, decide),
        }
    }
}

/// The two physical words a [`State`] is stored in.
trait Word {
    type Raw: Copy;
    fn load(&self) -> Self::Raw;
    fn compare_exchange_weak(
        &self,
        current: Self::Raw,
        new: Self::Raw,
    ) -> Result<Self::Raw, Self::Raw>;
    fn decode(raw: Self::Raw) -> State;
    fn encode(state: State) -> Self::Raw;
}

impl Word for AtomicU64 {
    type Raw = u64;

    #[inline]
    fn load(&self) -> u64 {
        AtomicU64::load(self, Ordering::Acquire)
    }

    #[inline]
    fn compare_exchange_weak(&self, current: u64, new: u64) -> Result<u64, u64> {
        // AcqRel: see "Memory ordering" in the module docs.
        AtomicU64::compare_exchange_weak(self, current, new, Ordering::AcqRel, Ordering::Acquire)
    }

    #[inline]
    fn decode(raw: u64) -> State {
        State {
            ctl: raw,
            tokens: 0,
        }
    }

    #[inline]
    fn encode(state: State) -> u64 {
        debug_assert_eq!(state.tokens, 0, "a budget-less word cannot hold tokens");
        state.ctl
    }
}

impl Word for AtomicU128 {
    type Raw = u128;

    #[inline]
    fn load(&self) -> u128 {
        AtomicU128::load(self, Ordering::Acquire)
    }

    #[inline]
    fn compare_exchange_weak(&self, current: u128, new: u128) -> Result<u128, u128> {
        // AcqRel: see "Memory ordering" in the module docs.
        AtomicU128::compare_exchange_weak(self, current, new, Ordering::AcqRel, Ordering::Acquire)
    }

    #[inline]
    fn decode(raw: u128) -> State {
        State::unpack(raw)
    }

    #[inline]
    fn encode(state: State) -> u128 {
        state.pack()
    }
}

#[inline]
fn cas_loop<W: Word, T, E>(
    word: &W,
    mut decide: impl FnMut(State) -> Result<(State, T), E>,
) -> Result<T, E> {
    let backoff = Backoff::new();
    let mut current = word.load();
    loop {
        let (next, out) = decide(W::decode(current))?;
        match word.compare_exchange_weak(current, W::encode(next)) {
            Ok(_) => return Ok(out),
            Err(actual) => {
                current = actual;
                backoff.spin();
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
        assert_eq!(s.epoch(), 1);
        assert!(s.is_closed());
        assert!(!s.has_waiters());
        assert_eq!(State::unpack(s.pack()), s);
        let r = s.with_release(7);
        assert_eq!(
            (r.slots(), r.tokens(), r.epoch(), r.is_closed()),
            (1, 3, 1, true)
        );
    }

    #[test]
    fn epoch_wraps_inside_its_field() {
        let mut s = State::INITIAL;
        for _ in 0..3 {
            s = s.with_next_epoch();
        }
        assert_eq!(s.epoch(), 3);
        let top = State {
            ctl: (EPOCH_MAX << EPOCH_SHIFT) | 5 | WAITERS_BIT | DRAINING_BIT,
            tokens: 9,
        };
        let wrapped = top.with_next_epoch();
        assert_eq!(wrapped.epoch(), 0);
        assert_eq!(wrapped.slots(), 5);
        assert!(wrapped.has_waiters() && wrapped.is_draining());
        assert!(!wrapped.is_closed());
        assert_eq!(wrapped.tokens(), 9);
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
        assert_eq!(
            State::for_tests(3, 7)
                .with_closed()
                .with_waiters(true)
                .epoch(),
            0
        );
    }

    #[test]
    fn max_slots_fills_the_slot_field() {
        let full = State {
            ctl: u64::from(MAX_SLOTS),
            tokens: 0,
        };
        assert_eq!(full.slots(), MAX_SLOTS);
        assert_eq!(full.epoch(), 0);
        assert_eq!(MAX_SLOTS, 4_194_303);
    }

    #[test]
    fn tokens_use_all_64_bits() {
        let s = State::INITIAL.with_admission(u64::MAX);
        assert_eq!(State::unpack(s.pack()).tokens(), u64::MAX);
        assert_eq!(s.with_release(u64::MAX).tokens(), 0);
    }

    #[test]
    fn update_reuses_the_failed_value() {
        let cell = AtomicState::new(true);
        let out: Result<u32, ()> = cell.update(|s| Ok((s.with_admission(4), s.slots())));
        assert_eq!(out, Ok(0));
        let err: Result<(), u64> = cell.update(|s| Err(s.tokens()));
        assert_eq!(err, Err(4));
        assert_eq!(cell.load().slots(), 1);
    }

    #[test]
    fn release_subtracts_both_fields_without_borrowing() {
        for with_tokens in [false, true] {
            let cell = AtomicState::new(with_tokens);
            let t = if with_tokens { u64::MAX } else { 0 };
            cell.update(|s| {
                Ok::<_, ()>((s.with_next_epoch().with_admission(t).with_admission(0), ()))
            })
            .unwrap();
            let before = cell.release(t);
            assert_eq!((before.slots(), before.tokens()), (2, t));
            let after = cell.load();
            assert_eq!((after.slots(), after.tokens(), after.epoch()), (1, 0, 1));
        }
    }
}
