//! [`Engine`]: the engine's parts assembled (the admission word, the published limits and their
//! writer, the wait queue, the drainers' signal, the counters, the class table), its
//! construction, and what reads it without deciding anything. The doors, the release and the
//! waiting methods are in their own files (`admission`, `release`, `waiting`, `class_path`).

use core::fmt;

use crossbeam_utils::Backoff;

use super::classes::Classes;
use super::counters::Hub;
use super::limits::normalized;
use super::limits::{Bounds, PublishedLimits};
use super::policy::ClassView;
use super::queue::WaitQueue;
use super::rate::{RateClock, Windows};
use super::state::{AtomicState, State};
use crate::support::sync::atomic::{AtomicU64, Ordering};
use crate::support::sync::{Mutex, lock};
use crate::vocabulary::limits::Limits;

/// The engine shared by every clone of a bulkhead and every permit.
pub(crate) struct Engine {
    /// The packed admission word (written by every admission and release; cache-padded).
    pub(super) state: AtomicState,
    /// The limits in force, readable without a lock (see `limits`).
    pub(super) published: PublishedLimits,
    /// Serialises limit writers and holds the authoritative copy of the limits in force.
    pub(super) writer: Mutex<Limits>,
    /// Calls waiting for a slot, in arrival order (see `queue`).
    pub(super) queue: WaitQueue,
    /// Notified when the engine becomes idle while a drain waits (see `drain`).
    pub(super) drained: event_listener::Event,
    /// Counts those notifications, so a woken drainer knows an idle moment happened.
    pub(super) idle_generation: AtomicU64,
    /// Cumulative counters, sharded per thread.
    pub(super) counters: Hub,
    /// Whether the limits carry a token budget (fixed at construction).
    pub(super) has_budget: bool,
    /// The admission classes, when the engine has them (fixed at construction).
    pub(super) classes: Option<Classes>,
    /// Neither a token budget nor classes (fixed at construction): see `passes_slots`.
    pub(super) passes_slots: bool,
    /// The rate windows, when the engine has them (fixed at construction). Boxed: their
    /// cache-padded words would otherwise raise the engine's alignment (measured: 5
    /// instructions more per admission + release without windows).
    pub(super) windows: Option<Box<Windows>>,
    /// Neither classes nor rate windows (fixed at construction): see `has_fast_lane`.
    pub(super) fast_lane: bool,
    /// Rate windows and no classes (fixed at construction): see `has_window_lane`.
    pub(super) window_lane: bool,
}

/// What [`Engine::occupancy`] reads: who occupies the engine at one moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Occupancy {
    /// Admissions not settled yet (a slot held, or a borrowed slot given back early with its
    /// tokens still held).
    pub(crate) active: u64,
    /// Calls waiting in the queue.
    pub(crate) queued: u64,
    /// Nothing in flight, nobody waiting, no abandoned admission unsettled.
    pub(crate) idle: bool,
}

impl Engine {
    /// An engine enforcing `limits` (already validated; with admission classes iff
    /// `limits.admission_classes`, calls naming none going to class `default_class`), with
    /// nothing in flight.
    pub(crate) fn new(limits: Limits, default_class: usize) -> Engine {
        Engine::with_rate_clock(limits, default_class, RateClock::system())
    }

    /// [`new`](Engine::new), its rate windows (if the limits have them) reading `clock`.
    pub(crate) fn with_rate_clock(
        limits: Limits,
        default_class: usize,
        clock: RateClock,
    ) -> Engine {
        let limits = normalized(limits, None);
        let classes = limits.admission_classes.as_ref().map(|table| {
            let ids: Vec<&str> = table.iter().map(|(id, _)| id).collect();
            Classes::new(&ids, default_class)
        });
        let class_count = classes.as_ref().map_or(0, |c| c.handles().len());
        // Windows iff rate limits are configured anywhere: the bulkhead's, or a class's (then
        // every class has a pair, so that `apply_limits` may give any class windows).
        let class_rates = limits
            .admission_classes
            .as_ref()
            .is_some_and(|table| table.iter().any(|(_, class)| class.rate.is_some()));
        let windows = (limits.rate.is_some() || class_rates)
            .then(|| Box::new(Windows::new(clock, class_count)));
        let has_budget = limits.token_budget.is_some();
        let engine = Engine {
            state: if classes.is_some() {
                AtomicState::wide()
            } else {
                AtomicState::narrow()
            },
            published: PublishedLimits::new(&limits),
            has_budget,
            writer: Mutex::new(limits),
            queue: WaitQueue::new(),
            drained: event_listener::Event::new(),
            idle_generation: AtomicU64::new(0),
            counters: Hub::new(class_count),
            passes_slots: !has_budget && classes.is_none(),
            fast_lane: classes.is_none() && windows.is_none(),
            window_lane: classes.is_none() && windows.is_some(),
            classes,
            windows,
        };
        if engine.classes.is_some() {
            // Nothing in flight: the floors are reserved from the start if any class has one.
            engine.recount_classes(true, |s| s);
        }
        engine
    }

    /// Whether the limits carry a token budget.
    #[inline]
    pub(crate) fn has_budget(&self) -> bool {
        self.has_budget
    }

    /// Whether a release may pass its slot straight to the queue head (`pass_slot`): an
    /// engine without a token budget or classes, where a slot is all a waiter needs.
    #[inline]
    pub(super) fn passes_slots(&self) -> bool {
        self.passes_slots
    }

    /// Whether admissions may take the plain fast lane: an engine without admission classes
    /// or rate windows.
    #[inline]
    pub(crate) fn has_fast_lane(&self) -> bool {
        self.fast_lane
    }

    /// Whether a call without a class may take the windowed lane
    /// ([`try_admit_fast_windowed`](Engine::try_admit_fast_windowed)): an engine with rate
    /// windows and without admission classes.
    #[inline]
    pub(crate) fn has_window_lane(&self) -> bool {
        self.window_lane
    }

    /// Whether the engine has rate windows.
    #[inline]
    pub(crate) fn has_rate(&self) -> bool {
        self.windows.is_some()
    }

    // ----- reading -----

    /// A consistent (word, limits) pair, without a lock: the word at one moment and the
    /// limits in force at that moment.
    pub(super) fn snapshot(&self) -> (State, Bounds) {
        let backoff = Backoff::new();
        loop {
            let before = self.published.epoch();
            let state = self.state.load();
            let seen = self.published.epoch();
            if let Some(epoch) = word_epoch(before, seen, state) {
                let limits = self.published.read(epoch);
                if self.published.epoch() <= epoch {
                    return (state, limits);
                }
            }
            // Waiting for a writer between its steps: a wait loom can explore.
            crate::support::sync::spin_wait(&backoff);
        }
    }

    /// The limits in force (with admission classes, their floors of 0 omitted).
    pub(crate) fn limits(&self) -> Limits {
        lock(&self.writer).clone()
    }

    /// Revision of the limits in force.
    pub(crate) fn revision(&self) -> u64 {
        self.snapshot().1.revision
    }

    /// Who occupies the engine now: the admissions not settled yet (those holding a slot, and
    /// those that gave their borrowed slot back but still hold their tokens), the calls waiting
    /// in the queue, and whether it is idle (nothing in flight, nobody waiting, no abandoned
    /// admission unsettled). One load of the word (and, while the classes' floors are
    /// reserved, a read of the class words) and one of the queue's length.
    pub(crate) fn occupancy(&self) -> Occupancy {
        let state = self.in_flight_of(self.state.load());
        Occupancy {
            active: u64::from(state.slots()) + u64::from(state.abandoned()),
            queued: self.queue.len(),
            idle: state.is_idle(),
        }
    }

    /// Whether the engine has been closed.
    pub(crate) fn is_closed(&self) -> bool {
        self.state.load().is_closed()
    }

    // ----- drain -----

    /// Wakes the drainers if `state` (just written) is idle and someone drains.
    pub(super) fn idle_check(&self, state: State) {
        if state.is_idle() && state.is_draining() {
            self.notify_drained();
        }
    }

    #[cold]
    pub(super) fn notify_drained(&self) {
        // Clear the flag first: a drainer that re-arms after the notification waits for the
        // next idle moment, and one that was armed sees the generation move.
        let _ = self.state.update(|s| {
            if s.is_draining() {
                Ok((s.with_draining(false), ()))
            } else {
                Err(())
            }
        });
        // Release: pairs with the drainers' Acquire loads of the generation.
        self.idle_generation.fetch_add(1, Ordering::Release);
        self.drained.notify(usize::MAX);
    }
}

/// What a decision saw: the word, the limits, and (for a class call) its class.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Seen {
    pub(crate) state: State,
    pub(crate) bounds: Bounds,
    pub(crate) class: Option<ClassView>,
}

impl Seen {
    pub(crate) fn global(state: State, bounds: Bounds) -> Seen {
        Seen {
            state,
            bounds,
            class: None,
        }
    }

    pub(crate) fn class(state: State, bounds: Bounds, view: ClassView) -> Seen {
        Seen {
            state,
            bounds,
            class: Some(view),
        }
    }
}

impl fmt::Debug for Engine {
    /// Never blocks: reads the admission word and the published limits only.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (state, limits) = self.snapshot();
        let state = self.in_flight_of(state);
        let mut d = f.debug_struct("Engine");
        d.field("in_flight", &state.slots())
            .field("closed", &state.is_closed())
            .field("limits", &limits);
        if self.has_budget {
            d.field("in_flight_tokens", &state.tokens());
        }
        d.finish_non_exhaustive()
    }
}

/// The full epoch of the limits `word` was written under, from two loads of the published
/// epoch made just before (`before`) and just after (`seen`) the word was read; `None` if a
/// writer finished a change between them.
///
/// Writers advance the word's epoch bits and only then store the next epoch, so while the two
/// loads agree the word's epoch is `seen` or, if a writer is between its two steps, `seen + 1`;
/// the bits tell which. Nothing waits for that writer: its new slot was complete before it
/// advanced the bits.
#[inline]
pub(super) fn word_epoch(before: u64, seen: u64, word: State) -> Option<u64> {
    if before != seen {
        None
    } else if word.matches_epoch(seen) {
        Some(seen)
    } else {
        debug_assert!(word.matches_epoch(seen + 1));
        Some(seen + 1)
    }
}
