//! Rate windows: requests and tokens per window (see [`RateLimits`](crate::rate::RateLimits)),
//! decided in the admission before the word, and the clock they read ([`RateClock`]). The
//! engine's operations on them (charging at the doors, giving back, corrections) are in
//! `rate_path`, as the class table's are in `class_path`.
//!
//! # The algorithm
//!
//! Each window is a GCRA (generic cell rate algorithm) kept as one timestamp, its theoretical
//! arrival time `tat`, counted in the window's own ticks: a tick is one unit's share of the
//! window (`window / limit`), so a call of `n` units costs exactly `n` ticks and nothing is
//! rounded per call. A call of `n` units at tick `now` is admitted iff
//! `max(tat, now) + n - now <= limit`, which moves `tat` there with one CAS. So the window
//! lets `limit` units through at once after a quiet window, and at most
//! `limit * (t + window) / window` in any span `t` (a token bucket of `limit` refilled at
//! `limit / window`). A refused call is told exactly when it would fit if nothing else arrived:
//! the start of tick `max(tat, now) + n - limit`. A call of more units than `limit` can never
//! fit. (A limit counts at most one unit per nanosecond of its window, so a tick is at least a
//! nanosecond; a change of limits moves each `tat` to the new ticks, under the writer's lock.)
//!
//! A call is charged to the requests window (1 unit) and then to the tokens window (its
//! reservation) before the admission word is decided (a call of a class with windows of its
//! own: to the bulkhead's pair, then to its class's, each pair on its own words, a refusal by
//! the class's giving the bulkhead's charge back); a refusal by either takes nothing (a
//! charge already made is given back), and a refusal by the word (no slot, no tokens, closed)
//! gives the charges back. A call that queues keeps its charge while it waits and gets it back
//! if the wait ends refused. A settled call's tokens charge is corrected to its reported usage
//! (input + output, as providers bill), and a report beyond its reservation is charged when it
//! arrives, so the window converges on what the provider bills. A permit dropped without any
//! usage known keeps its reservation charged.
//!
//! A charge given back moves `tat` back by what it added: exact unless `tat` was behind `now`
//! when it was charged (an idle window), where the give-back leaves the idle time spent
//! (conservative: never more admitted than the limits allow). A decision racing `apply_limits`
//! reads the window's figures of one epoch, as the word's decision does, and charges a word
//! only on that epoch's ticks (each word carries its epoch's tag); one that meets a word on
//! other ticks waits for the writer's rescale (a leaf lock the writer holds from publishing the
//! epoch until every word is rescaled), then decides again.
//!
//! # The clock
//!
//! [`RateClock::system`] (the default) reads a process-wide coarse clock, an atomic that a
//! thread (`bulkhead-rate-clock`, started with the first bulkhead that uses it) advances every
//! millisecond: a decision costs one relaxed load, not a clock read. Its lag behind real time
//! (about a millisecond, more if the thread is descheduled) makes a decision at most that much
//! stricter, and lets at most `limit * lag / window` more through over a long run.
//! [`RateClock::precise`] reads `Instant::now()` every decision; [`RateClock::manual`] is moved
//! by hand (tests, simulations); with the `tokio` feature [`RateClock::tokio`] reads tokio's
//! clock (paused-clock friendly).

use core::fmt;
use std::time::{Duration, Instant};

use crossbeam_utils::CachePadded;

use crate::support::sync::atomic::{AtomicU64, Ordering, update};
use crate::support::sync::{Arc, Mutex, MutexGuard, lock, unmodeled};

/// Where a bulkhead's rate windows read the time.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, RejectReason};
/// use async_bulkhead_llm::rate::{ManualClock, RateClock, RateLimits};
///
/// let clock = ManualClock::new();
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
///     .rate_limits(RateLimits::new(Duration::from_secs(1)).requests(2))
///     .rate_clock(RateClock::manual(&clock))
///     .build()?;
/// let call = || bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new());
/// drop((call()?, call()?));
/// let refused = call().unwrap_err();
/// assert_eq!(refused.rejection().unwrap().reason(), RejectReason::RateLimit);
/// assert_eq!(refused.rejection().unwrap().retry_after(), Some(Duration::from_millis(500)));
/// clock.advance(Duration::from_millis(500));
/// assert!(call().is_ok());
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone)]
pub struct RateClock {
    source: Source,
}

#[derive(Clone)]
enum Source {
    /// The process-wide coarse clock.
    System,
    /// `Instant::now()` at every read.
    Precise,
    /// Moved by hand.
    Manual(Arc<AtomicU64>),
    /// tokio's clock, from the instant the clock was made.
    #[cfg(feature = "tokio")]
    Tokio(tokio::time::Instant),
}

impl RateClock {
    /// The process-wide coarse clock (the default): one relaxed load per decision, about a
    /// millisecond behind real time (see the `rate` module).
    pub fn system() -> RateClock {
        RateClock {
            source: Source::System,
        }
    }

    /// `Instant::now()` at every decision (exact; a clock read per decision).
    pub fn precise() -> RateClock {
        RateClock {
            source: Source::Precise,
        }
    }

    /// The time `clock` says, moved by hand: for tests and simulations.
    pub fn manual(clock: &ManualClock) -> RateClock {
        RateClock {
            source: Source::Manual(Arc::clone(&clock.now)),
        }
    }

    /// tokio's clock (`tokio::time::Instant::now()`): a paused runtime's virtual time in tests.
    #[cfg(feature = "tokio")]
    #[cfg_attr(docsrs, doc(cfg(feature = "tokio")))]
    pub fn tokio() -> RateClock {
        RateClock {
            source: Source::Tokio(tokio::time::Instant::now()),
        }
    }

    /// Starts what the clock needs (the coarse clock's thread).
    pub(crate) fn start(&self) {
        if let Source::System = self.source {
            coarse::start();
        }
    }

    /// Nanoseconds since the process's origin on this clock.
    #[inline]
    pub(crate) fn now_ns(&self) -> u64 {
        match &self.source {
            Source::System => coarse::now_ns(),
            Source::Precise => since_origin(Instant::now()),
            Source::Manual(now) => now.load(Ordering::Acquire),
            #[cfg(feature = "tokio")]
            Source::Tokio(start) => {
                let elapsed = tokio::time::Instant::now().saturating_duration_since(*start);
                u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX)
            }
        }
    }
}

impl Default for RateClock {
    fn default() -> RateClock {
        RateClock::system()
    }
}

impl fmt::Debug for RateClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = match self.source {
            Source::System => "system",
            Source::Precise => "precise",
            Source::Manual(_) => "manual",
            #[cfg(feature = "tokio")]
            Source::Tokio(_) => "tokio",
        };
        f.debug_tuple("RateClock").field(&name).finish()
    }
}

/// A clock moved by hand, for [`RateClock::manual`]: it starts at a day past the process's
/// origin and moves only when told.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// let clock = async_bulkhead_llm::rate::ManualClock::new();
/// let start = clock.now();
/// clock.advance(Duration::from_millis(250));
/// assert_eq!(clock.now() - start, Duration::from_millis(250));
/// ```
#[derive(Clone)]
pub struct ManualClock {
    now: Arc<AtomicU64>,
}

/// Where a manual clock starts (a day): far enough that a window's idle credit is full.
const MANUAL_START: u64 = 86_400_000_000_000;

impl ManualClock {
    /// A clock at its start.
    pub fn new() -> ManualClock {
        ManualClock {
            now: Arc::new(AtomicU64::new(MANUAL_START)),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn advance(&self, by: Duration) {
        let by = u64::try_from(by.as_nanos()).unwrap_or(u64::MAX);
        self.now.fetch_add(by, Ordering::AcqRel);
    }

    /// The time on the clock, since the process's origin.
    pub fn now(&self) -> Duration {
        Duration::from_nanos(self.now.load(Ordering::Acquire))
    }
}

impl Default for ManualClock {
    fn default() -> ManualClock {
        ManualClock::new()
    }
}

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ManualClock")
            .field("now", &self.now())
            .finish()
    }
}

/// The process's origin of every clock here.
fn origin() -> Instant {
    static ORIGIN: unmodeled::OnceLock<Instant> = unmodeled::OnceLock::new();
    *ORIGIN.get_or_init(Instant::now)
}

fn since_origin(at: Instant) -> u64 {
    u64::try_from(at.saturating_duration_since(origin()).as_nanos()).unwrap_or(u64::MAX)
}

/// The coarse clock: an atomic a thread advances every millisecond (under loom, a precise read:
/// the models use manual clocks).
mod coarse {
    use std::time::{Duration, Instant};

    use super::{since_origin, unmodeled};

    static NOW: unmodeled::AtomicU64 = unmodeled::AtomicU64::new(0);
    static STARTED: unmodeled::Once = unmodeled::Once::new();

    /// How often the thread advances the clock.
    const TICK: Duration = Duration::from_millis(1);

    pub(super) fn start() {
        if cfg!(loom) {
            return;
        }
        STARTED.call_once(|| {
            NOW.fetch_max(since_origin(Instant::now()), unmodeled::Ordering::Relaxed);
            let spawned = std::thread::Builder::new()
                .name("bulkhead-rate-clock".to_owned())
                .spawn(|| {
                    loop {
                        std::thread::sleep(TICK);
                        NOW.fetch_max(since_origin(Instant::now()), unmodeled::Ordering::Relaxed);
                    }
                });
            // Without the thread (none can be spawned), reads fall back to the real clock.
            if spawned.is_err() {
                NOW.store(u64::MAX, unmodeled::Ordering::Relaxed);
            }
        });
    }

    #[inline]
    pub(super) fn now_ns() -> u64 {
        if cfg!(loom) {
            return since_origin(Instant::now());
        }
        match NOW.load(unmodeled::Ordering::Relaxed) {
            u64::MAX => since_origin(Instant::now()),
            now => now,
        }
    }
}

/// The window figures a decision reads (of one epoch of the limits): 0 for a window not
/// configured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct RateBounds {
    pub(crate) window_ns: u64,
    pub(crate) requests: u64,
    pub(crate) tokens: u64,
    /// Each window's ticks per nanosecond as a 64-bit fraction (`per_ns`, see [`Scale`]).
    pub(crate) requests_per_ns: u64,
    pub(crate) tokens_per_ns: u64,
}

impl RateBounds {
    fn requests(&self) -> Scale {
        Scale {
            window_ns: self.window_ns,
            limit: self.requests,
            per_ns: self.requests_per_ns,
        }
    }

    fn tokens(&self) -> Scale {
        Scale {
            window_ns: self.window_ns,
            limit: self.tokens,
            per_ns: self.tokens_per_ns,
        }
    }

    /// The bounds of `rate` (all 0 without).
    pub(crate) fn of(rate: Option<&crate::vocabulary::rate_limits::RateLimits>) -> RateBounds {
        rate.map_or_else(RateBounds::default, |rate| {
            let window_ns = u64::try_from(rate.window.as_nanos()).unwrap_or(u64::MAX);
            let (requests, tokens) = (rate.requests.unwrap_or(0), rate.tokens.unwrap_or(0));
            RateBounds {
                window_ns,
                requests,
                tokens,
                requests_per_ns: per_ns(requests, window_ns),
                tokens_per_ns: per_ns(tokens, window_ns),
            }
        })
    }
}

/// `limit / window_ns` as a 64-bit fraction, rounded down (at most `u64::MAX`: `limit` is at
/// most `window_ns`).
pub(crate) fn per_ns(limit: u64, window_ns: u64) -> u64 {
    if window_ns == 0 {
        return 0;
    }
    u64::try_from((u128::from(limit) << 64) / u128::from(window_ns)).unwrap_or(u64::MAX)
}

/// One window's time scale: it counts time in ticks of `window / limit` (one unit's share of
/// the window), so that a call of `n` units costs exactly `n` ticks and the window is `limit`
/// ticks long: no rounding accumulates, a burst after a quiet window is exactly `limit`.
/// (`limit` is at most `window` in nanoseconds, checked by the limits' validation, so a tick is
/// at least a nanosecond and the clock's ticks fit in 64 bits.)
#[derive(Clone, Copy, Debug)]
struct Scale {
    window_ns: u64,
    /// Units per window (0: no window).
    limit: u64,
    /// `limit / window_ns` as a 64-bit fraction, rounded down: ticks per nanosecond.
    per_ns: u64,
}

impl Scale {
    /// The tick `now_ns` falls in: `floor(now_ns * limit / window_ns)`, without a division.
    /// The fraction's estimate is at most one tick short (`per_ns` is short of the exact
    /// ratio by less than one part in 2^64, so `now_ns * per_ns / 2^64` is short of
    /// `now_ns * limit / window_ns` by less than `now_ns / 2^64`, less than one), and one
    /// exact comparison corrects it.
    #[inline]
    fn ticks(self, now_ns: u64) -> u64 {
        let ticks = ((u128::from(now_ns) * u128::from(self.per_ns)) >> 64) as u64;
        let next_starts = u128::from(ticks + 1) * u128::from(self.window_ns);
        ticks + u64::from(next_starts <= u128::from(now_ns) * u128::from(self.limit))
    }

    /// When tick `ticks` starts, in nanoseconds (rounded up).
    #[inline]
    fn ns(self, ticks: u64) -> u64 {
        let ns = (u128::from(ticks) * u128::from(self.window_ns))
            .div_ceil(u128::from(self.limit.max(1)));
        u64::try_from(ns).unwrap_or(u64::MAX)
    }
}

/// What a call was charged (units of each window: 1 request, its reservation in tokens), to
/// give back exactly.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Charge {
    requests: u64,
    tokens: u64,
}

/// Which window refused a call, and when it would fit (`None`: never, it asks more than the
/// window's whole limit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RateRefusal {
    pub(crate) tokens: bool,
    pub(crate) retry_after: Option<Duration>,
}

/// An engine's windows: the bulkhead's pair of words, each admission class's (with classes),
/// and the clock they read.
pub(crate) struct Windows {
    global: Words,
    classes: Box<[Words]>,
    clock: RateClock,
    /// Held by a writer from the publication of a new epoch until every word is on its ticks
    /// (a leaf lock: nothing is locked under it). A decision that meets a word on another
    /// epoch's ticks waits on it instead of spinning.
    rescaling: Mutex<()>,
}

/// One pair of windows (requests, tokens): each one's word, its `tat` in its ticks tagged
/// with the limits' epoch whose ticks they are.
pub(crate) struct Words {
    requests: CachePadded<AtomicU64>,
    tokens: CachePadded<AtomicU64>,
}

/// A window's word: the tag of the limits' epoch in the high `TAG_BITS` bits (the ticks are
/// that epoch's), its `tat` in the rest (56 bits of ticks: at most a tick a nanosecond, so
/// about 2.2 years of the clock).
const TAG_BITS: u32 = 8;
const TICK_BITS: u32 = 64 - TAG_BITS;
const TICKS: u64 = (1 << TICK_BITS) - 1;

/// The tag of `epoch`.
#[inline]
pub(crate) fn tag_of(epoch: u64) -> u64 {
    epoch & ((1 << TAG_BITS) - 1)
}

#[inline]
fn word(tag: u64, ticks: u64) -> u64 {
    (tag << TICK_BITS) | ticks.min(TICKS)
}

/// A window's word is on another epoch's ticks than the decision's: a change of limits is
/// being installed (or the decision read old limits); decide again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stale;

impl Windows {
    /// Windows reading `clock`: the bulkhead's, and `classes` classes' pairs.
    pub(crate) fn new(clock: RateClock, classes: usize) -> Windows {
        clock.start();
        Windows {
            global: Words::new(),
            classes: (0..classes).map(|_| Words::new()).collect(),
            clock,
            rescaling: Mutex::new(()),
        }
    }

    /// Held by the writer from the publication of a new epoch until its rescale is done.
    pub(crate) fn rescaling(&self) -> MutexGuard<'_, ()> {
        lock(&self.rescaling)
    }

    /// Waits for a writer's rescale under way, if any (a decision met a word on another
    /// epoch's ticks).
    #[cold]
    pub(crate) fn wait_for_rescale(&self) {
        drop(lock(&self.rescaling));
    }

    /// The clock's time now, in nanoseconds.
    #[inline]
    pub(crate) fn now_ns(&self) -> u64 {
        self.clock.now_ns()
    }

    /// The bulkhead's pair.
    #[inline]
    pub(crate) fn global(&self) -> &Words {
        &self.global
    }

    /// Class `index`'s pair (`None` on an engine without classes).
    #[inline]
    pub(crate) fn class(&self, index: usize) -> Option<&Words> {
        self.classes.get(index)
    }

    /// Every class's pair, in class order.
    pub(crate) fn classes(&self) -> &[Words] {
        &self.classes
    }

    /// Charges a call of `tokens` to the bulkhead's windows at the clock's time (see
    /// [`Words::charge`]).
    #[inline]
    pub(crate) fn charge(
        &self,
        tag: u64,
        bounds: RateBounds,
        tokens: u64,
    ) -> Result<Result<Charge, RateRefusal>, Stale> {
        self.global.charge(tag, bounds, tokens, self.clock.now_ns())
    }

    /// What a call of `tokens` is charged under `bounds`.
    #[inline]
    pub(crate) fn charge_of(bounds: RateBounds, tokens: u64) -> Charge {
        Charge {
            requests: u64::from(bounds.requests > 0),
            tokens: if bounds.tokens > 0 { tokens } else { 0 },
        }
    }
}

impl Words {
    fn new() -> Words {
        Words {
            requests: CachePadded::new(AtomicU64::new(0)),
            tokens: CachePadded::new(AtomicU64::new(0)),
        }
    }

    /// Charges a call of `tokens` to every window of `bounds` (the limits of the epoch tagged
    /// `tag`) at `now_ns`, or refuses it (nothing charged); `Stale` (nothing charged) when a
    /// window's word is on another epoch's ticks.
    #[inline]
    pub(crate) fn charge(
        &self,
        tag: u64,
        bounds: RateBounds,
        tokens: u64,
        now_ns: u64,
    ) -> Result<Result<Charge, RateRefusal>, Stale> {
        let charge = Windows::charge_of(bounds, tokens);
        match take(
            &self.requests,
            tag,
            charge.requests,
            bounds.requests(),
            now_ns,
        )? {
            Ok(()) => {}
            Err(retry_after) => {
                return Ok(Err(RateRefusal {
                    tokens: false,
                    retry_after,
                }));
            }
        }
        let taken = take(&self.tokens, tag, charge.tokens, bounds.tokens(), now_ns);
        match taken {
            Ok(Ok(())) => Ok(Ok(charge)),
            other => {
                give_back(&self.requests, charge.requests);
                other.map(|refused| {
                    Err(RateRefusal {
                        tokens: true,
                        retry_after: refused.err().flatten(),
                    })
                })
            }
        }
    }

    /// [`charge`](Words::charge) on an admission's fast lane: the charge, or `None` (nothing
    /// charged) when a window refuses or is on another epoch's ticks (the general path
    /// decides again, and refuses with the figures a rejection carries).
    #[inline(always)]
    pub(crate) fn charge_fast(
        &self,
        tag: u64,
        bounds: &RateBounds,
        tokens: u64,
        now_ns: u64,
    ) -> Option<Charge> {
        let charge = Windows::charge_of(*bounds, tokens);
        if !take_fast(
            &self.requests,
            tag,
            charge.requests,
            bounds.requests(),
            now_ns,
        ) {
            return None;
        }
        if !take_fast(&self.tokens, tag, charge.tokens, bounds.tokens(), now_ns) {
            give_back(&self.requests, charge.requests);
            return None;
        }
        Some(charge)
    }

    /// Whether a call of `tokens` would fit every window of `bounds` at `now_ns`, charging
    /// nothing (an advisory check: another call may take the room first).
    pub(crate) fn would_fit(
        &self,
        tag: u64,
        bounds: RateBounds,
        tokens: u64,
        now_ns: u64,
    ) -> Result<bool, Stale> {
        let charge = Windows::charge_of(bounds, tokens);
        for (window, units, scale) in [
            (&self.requests, charge.requests, bounds.requests()),
            (&self.tokens, charge.tokens, bounds.tokens()),
        ] {
            if units == 0 || scale.limit == 0 {
                continue;
            }
            let current = window.load(Ordering::Acquire);
            if judge(current, tag, units, scale, scale.ticks(now_ns), now_ns)?.is_err() {
                return Ok(false);
            }
        }
        Ok(true)
    }

    /// Gives `charge` back (the call was not admitted after all): units, the same on every
    /// epoch's ticks.
    #[inline]
    pub(crate) fn refund(&self, charge: Charge) {
        give_back(&self.requests, charge.requests);
        give_back(&self.tokens, charge.tokens);
    }

    /// Moves a call's tokens charge from `from` tokens to `to` (its reported usage) at
    /// `now_ns`: more is charged now without refusing (the tokens were used), less is given
    /// back.
    pub(crate) fn correct(
        &self,
        tag: u64,
        bounds: RateBounds,
        from: u64,
        to: u64,
        now_ns: u64,
    ) -> Result<(), Stale> {
        let scale = bounds.tokens();
        if scale.limit == 0 {
            return Ok(());
        }
        if to <= from {
            give_back(&self.tokens, from - to);
            return Ok(());
        }
        let now = scale.ticks(now_ns);
        let more = to - from;
        let mut current = self.tokens.load(Ordering::Acquire);
        loop {
            if current >> TICK_BITS != tag {
                return Err(Stale);
            }
            let next = word(tag, (current & TICKS).max(now).saturating_add(more));
            match self.tokens.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(actual) => current = actual,
            }
        }
    }

    /// Moves each window's word to the epoch tagged `tag` and its limits `next` (a change of
    /// limits) at `now_ns`: the units charged and not yet drained stay charged (so a raised
    /// limit's new room is there at once), counted in the new ticks. Called by the writer,
    /// under the limits' lock, once the new epoch is published: decisions that meet the old
    /// tag meanwhile decide again.
    pub(crate) fn rescale(&self, previous: RateBounds, next: RateBounds, tag: u64, now_ns: u64) {
        for (window, old, new) in [
            (&self.requests, previous.requests(), next.requests()),
            (&self.tokens, previous.tokens(), next.tokens()),
        ] {
            let _ = update(window, |current| {
                let ticks = current & TICKS;
                Some(if old.limit == 0 || new.limit == 0 {
                    word(tag, 0)
                } else {
                    let behind = ticks.saturating_sub(old.ticks(now_ns)).min(new.limit);
                    word(tag, new.ticks(now_ns) + behind)
                })
            });
        }
    }

    /// What each window has left at `now_ns`, and when it is whole again (for rate-limit
    /// headers).
    pub(crate) fn status(
        &self,
        tag: u64,
        bounds: RateBounds,
        now_ns: u64,
    ) -> Result<RateStatus, Stale> {
        let window = |window: &AtomicU64, scale: Scale| {
            let current = window.load(Ordering::Acquire);
            if current >> TICK_BITS != tag {
                return Err(Stale);
            }
            let now = scale.ticks(now_ns);
            let tat = current & TICKS;
            let behind = tat.saturating_sub(now).min(scale.limit);
            Ok(WindowStatus {
                limit: scale.limit,
                remaining: scale.limit - behind,
                reset: Duration::from_nanos(scale.ns(tat).saturating_sub(now_ns)),
            })
        };
        Ok(RateStatus {
            requests: match bounds.requests > 0 {
                true => Some(window(&self.requests, bounds.requests())?),
                false => None,
            },
            tokens: match bounds.tokens > 0 {
                true => Some(window(&self.tokens, bounds.tokens())?),
                false => None,
            },
        })
    }
}

/// A bulkhead's rate windows now ([`LlmBulkhead::rate_status`](crate::LlmBulkhead::rate_status)):
/// what a gateway's rate-limit headers show.
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
///     .rate_limits(RateLimits::new(Duration::from_secs(10)).requests(10))
///     .rate_clock(RateClock::manual(&clock))
///     .build()?;
/// drop(bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?);
/// let requests = bulkhead.rate_status().unwrap().requests.unwrap();
/// assert_eq!((requests.limit, requests.remaining), (10, 9));
/// assert_eq!(requests.reset, Duration::from_secs(1)); // whole again in one request's time
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct RateStatus {
    /// The requests window, if configured.
    pub requests: Option<WindowStatus>,
    /// The tokens window, if configured.
    pub tokens: Option<WindowStatus>,
}

/// One window's figures now: its limit, what it would let through at once, and how long until
/// it is whole again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct WindowStatus {
    /// Units (requests or tokens) per window.
    pub limit: u64,
    /// Units it would let through at once now.
    pub remaining: u64,
    /// How long until it is whole again (nothing else arriving).
    pub reset: Duration,
}

/// Adds `units` to the window's `tat` if they fit at `now_ns` (on the ticks of the epoch
/// tagged `tag`); else when they would (`None`: never, more than the window's whole limit);
/// `Stale` when the word is on another epoch's ticks.
///
/// Orderings: a window's word publishes nothing but itself (its tag and `tat` are one value),
/// so its read-modify-writes need no ordering among themselves; `AcqRel` / `Acquire` order them
/// after the caller's `Acquire` reads of the epoch and the slot, so that a word carrying the
/// tag the writer stores after publishing an epoch is never paired with that epoch's
/// predecessor's figures unnoticed (the tag comparison catches it either way).
#[inline]
fn take(
    window: &AtomicU64,
    tag: u64,
    units: u64,
    scale: Scale,
    now_ns: u64,
) -> Result<Result<(), Option<Duration>>, Stale> {
    if units == 0 || scale.limit == 0 {
        return Ok(Ok(()));
    }
    let now = scale.ticks(now_ns);
    let mut current = window.load(Ordering::Acquire);
    loop {
        let next = match judge(current, tag, units, scale, now, now_ns)? {
            Ok(next) => next,
            Err(wait) => return Ok(Err(wait)),
        };
        match window.compare_exchange_weak(
            current,
            word(tag, next),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return Ok(Ok(())),
            Err(actual) => current = actual,
        }
    }
}

/// [`take`] on an admission's fast lane: whether `units` were added to the window's `tat`
/// (`false`, nothing added: they do not fit now, or the word is on another epoch's ticks).
/// Orderings as `take`'s. It repeats [`judge`]'s two checks rather than call it: without the
/// refusal's `retry_after` to keep, the admission is 7 instructions shorter (measured).
#[inline(always)]
fn take_fast(window: &AtomicU64, tag: u64, units: u64, scale: Scale, now_ns: u64) -> bool {
    // No units: no window (or nothing to count on it).
    if units == 0 {
        return true;
    }
    let now = scale.ticks(now_ns);
    let mut current = window.load(Ordering::Acquire);
    loop {
        if current >> TICK_BITS != tag {
            return false;
        }
        let next = (current & TICKS).max(now).saturating_add(units);
        if next - now > scale.limit {
            return false;
        }
        match window.compare_exchange_weak(
            current,
            word(tag, next),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return true,
            Err(actual) => current = actual,
        }
    }
}

/// The decision on a window's word `current` (on the ticks of the epoch tagged `tag`) for
/// `units` at tick `now` (`now_ns`): `Ok(tat)` after charging them if they fit, else when they
/// would (`None`: never, more than the window's whole limit); `Stale` when the word is on
/// another epoch's ticks.
#[inline]
fn judge(
    current: u64,
    tag: u64,
    units: u64,
    scale: Scale,
    now: u64,
    now_ns: u64,
) -> Result<Result<u64, Option<Duration>>, Stale> {
    if current >> TICK_BITS != tag {
        return Err(Stale);
    }
    if units > scale.limit {
        return Ok(Err(None));
    }
    let next = (current & TICKS).max(now).saturating_add(units);
    if next - now > scale.limit {
        // It fits once the clock reaches the tick `next - limit`.
        let at = scale.ns(next - scale.limit);
        return Ok(Err(Some(Duration::from_nanos(at.saturating_sub(now_ns)))));
    }
    Ok(Ok(next))
}

/// Moves a window's `tat` back by `units` (what a charge added), keeping its tag.
#[inline]
fn give_back(window: &AtomicU64, units: u64) {
    if units > 0 {
        let _ = update(window, |current| {
            Some((current & !TICKS) | (current & TICKS).saturating_sub(units))
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `floor(now_ns * limit / window_ns)`, by division.
    fn exact(now_ns: u64, limit: u64, window_ns: u64) -> u64 {
        u64::try_from(u128::from(now_ns) * u128::from(limit) / u128::from(window_ns)).unwrap()
    }

    fn scale(limit: u64, window_ns: u64) -> Scale {
        Scale {
            window_ns,
            limit,
            per_ns: per_ns(limit, window_ns),
        }
    }

    #[test]
    fn a_tick_is_the_exact_floor_where_the_estimate_falls_one_short() {
        let minute = 60_000_000_000;
        // Limits that divide the window and ones that do not, one a nanosecond (the ratio 1,
        // whose fraction saturates), and a prime window.
        let windows = [
            (60, minute),
            (7, minute),
            (90_000, minute),
            (1_000_000_007, minute),
            (minute, minute),
            (3, 1_000_000_007),
        ];
        let mut short = 0;
        for (limit, window_ns) in windows {
            let scale = scale(limit, window_ns);
            // The starts of ticks (where the estimate falls short, if anywhere), the ns before
            // them, and times up to 2^56 ns (about 2.2 years).
            let mut times = Vec::new();
            for k in [
                1u64,
                2,
                3,
                1_000,
                1 << 20,
                1 << 30,
                1 << 40,
                (1 << 56) / window_ns * limit,
            ] {
                let start = scale.ns(k);
                if start < 1 << 56 {
                    times.extend([start.saturating_sub(1), start, start + 1]);
                }
            }
            let mut x = 0x9E37_79B9_7F4A_7C15_u64;
            for _ in 0..10_000 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                times.push(x >> 8);
            }
            for now_ns in times {
                let estimate = ((u128::from(now_ns) * u128::from(scale.per_ns)) >> 64) as u64;
                let want = exact(now_ns, limit, window_ns);
                assert!(want - estimate <= 1, "{now_ns} ns on {limit} / {window_ns}");
                short += usize::from(estimate != want);
                assert_eq!(
                    scale.ticks(now_ns),
                    want,
                    "{now_ns} ns on {limit} / {window_ns}"
                );
            }
        }
        // The correction is exercised, not only asserted.
        assert!(short > 0);
    }
}
