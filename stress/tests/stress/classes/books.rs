//! Shared books: the callers' tallies per class, the packed ledger of slot holders, the `solo`
//! book, and the live checks of every admission, abandonment and settlement.

use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    LlmBulkhead, Priority, RejectReason, admission::AdmissionId, classes::AdmissionClass,
    classes::Resources,
};

use super::config::Revisions;
use super::heard::Heard;
use crate::caller_model::{Model, Settled};
use crate::chaos::runtime::{Rt, Task, Tasks};

/// The most classes a scenario has (the ledger packs 16 bits per class).
pub(crate) const MAX_CLASSES: usize = 4;

pub(crate) fn reason_index(reason: RejectReason) -> usize {
    RejectReason::ALL.iter().position(|&r| r == reason).unwrap()
}

pub(crate) fn bump(counter: &AtomicU64) {
    counter.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

pub(crate) fn load(counter: &AtomicU64) -> u64 {
    counter.load(Ordering::Relaxed)
}

/// What the scenario varies.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plane {
    /// Nothing (only stale and invalid snapshots): every limit fixed, checked exactly.
    Fixed,
    /// The class limits, the budget, the reserve and the queue; `max_concurrent` stays.
    ClassesVary,
    /// Everything, `max_concurrent` 0 included.
    Varying,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Setup {
    pub(crate) seed: u64,
    pub(crate) plane: Plane,
    /// Every admission settles with usage, so each class's `reserved + overrun == consumed +
    /// refunded` holds without correction.
    pub(crate) always_usage: bool,
    pub(crate) listen: bool,
    pub(crate) workers: u64,
    /// Operations per worker before the close can happen.
    pub(crate) ops: u64,
}

impl Setup {
    pub(crate) fn new(plane: Plane, workers: u64, ops: u64) -> Setup {
        Setup {
            seed: crate::chaos::fresh_seed(),
            plane,
            always_usage: false,
            listen: false,
            workers,
            ops: ops * crate::chaos::scale(),
        }
    }

    pub(crate) fn always_usage(mut self) -> Setup {
        self.always_usage = true;
        self
    }

    pub(crate) fn listen(mut self) -> Setup {
        self.listen = true;
        self
    }
}

/// The callers' sums for one class, compared with its statistics at the end.
#[derive(Default)]
pub(crate) struct ClassBook {
    /// Calls of the class the bulkhead decided (a result, or polled and then cancelled).
    pub(crate) decided: AtomicU64,
    pub(crate) admitted: AtomicU64,
    pub(crate) seen: [AtomicU64; 6],
    /// Polled, then cancelled before their result: each counted as a refusal.
    pub(crate) vanished: AtomicU64,
    pub(crate) post_close_refused: AtomicU64,
    pub(crate) reserved: AtomicU64,
    pub(crate) unused_reserved: AtomicU64,
    pub(crate) consumed: AtomicU64,
    pub(crate) overrun: AtomicU64,
    pub(crate) refunded: AtomicU64,
    pub(crate) reheld: AtomicU64,
    pub(crate) borrowed_admissions: AtomicU64,
    pub(crate) borrowed_tokens: AtomicU64,
    pub(crate) abandoned_manual: AtomicU64,
    pub(crate) abandoned_deadline: AtomicU64,
    /// Runs with a deadline that ran to their end (not cut).
    pub(crate) deadline_kept: AtomicU64,
    pub(crate) effective_reports: AtomicU64,
}

impl ClassBook {
    pub(crate) fn seen(&self, reason: RejectReason) -> u64 {
        load(&self.seen[reason_index(reason)])
    }

    /// Books a settled admission (the model already includes the settlement's move).
    pub(crate) fn settled(&self, model: &Model, settled: &Settled) {
        add(&self.reserved, model.reserved());
        match settled.usage {
            Some(u) => add(&self.consumed, u.total()),
            None => add(&self.unused_reserved, model.reserved()),
        }
        add(&self.overrun, model.overrun);
        add(&self.refunded, model.refunded);
        add(&self.reheld, model.reheld);
    }
}

/// Counts outside the classes.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) unpolled: AtomicU64,
    pub(crate) invalid: AtomicU64,
    pub(crate) limit_changes: AtomicU64,
    pub(crate) refused_snapshots: AtomicU64,
    pub(crate) drains_started: AtomicU64,
    pub(crate) drains_resolved: AtomicU64,
}

/// Slot holders per class, counted by the callers in one word (16 bits a class), so a single
/// read gives every class at one moment. A caller counts itself after its admission and
/// uncounts itself before it gives its slot back (release, drop or abandonment), so every
/// count is at most what the class really holds at that moment.
#[derive(Default)]
pub(crate) struct Ledger {
    word: AtomicU64,
    pub(crate) peaks: [AtomicU64; MAX_CLASSES],
    pub(crate) peak_total: AtomicU64,
}

impl Ledger {
    pub(crate) fn counts(word: u64) -> [u64; MAX_CLASSES] {
        core::array::from_fn(|c| (word >> (16 * c)) & 0xFFFF)
    }

    pub(crate) fn read(&self) -> [u64; MAX_CLASSES] {
        Ledger::counts(self.word.load(Ordering::Acquire))
    }
}

/// Slots and tokens held in one class by admissions one task knows of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Own {
    pub(crate) slots: u64,
    pub(crate) tokens: u64,
}

/// The call as its caller asked it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Call {
    pub(crate) class: usize,
    pub(crate) priority: Priority,
}

/// One admission as its holder tracks it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Held {
    pub(crate) class: usize,
    pub(crate) id: AdmissionId,
    pub(crate) resources: Resources,
    /// Counted in the ledger (not yet uncounted).
    pub(crate) in_ledger: bool,
    /// Gave its slot back (manually).
    pub(crate) abandoned: bool,
}

/// Everything the tasks of one scenario share.
pub(crate) struct Shared {
    pub(crate) setup: Setup,
    pub(crate) bulkhead: LlmBulkhead,
    pub(crate) rt: Rt,
    /// The class handles, in class order.
    pub(crate) handles: Vec<AdmissionClass>,
    /// The class of calls that name none.
    pub(crate) default: usize,
    /// The class only worker 0 uses.
    pub(crate) solo: usize,
    /// A class of another bulkhead (refused as invalid).
    pub(crate) foreign: AdmissionClass,
    pub(crate) revisions: Revisions,
    pub(crate) classes: Vec<ClassBook>,
    pub(crate) tally: Tally,
    pub(crate) ledger: Ledger,
    /// The `solo` class's slots and tokens, exactly (only worker 0 touches the class).
    pub(crate) solo_book: Mutex<Own>,
    pub(crate) heard: Arc<Heard>,
    pub(crate) closed: AtomicBool,
    pub(crate) peak_queue: AtomicU64,
    pub(crate) ops_done: AtomicU64,
    pub(crate) workers_done: AtomicU64,
    /// The scenario's tasks (their first panic is kept and raised again at the end).
    pub(crate) tasks: Arc<Tasks>,
}

impl Shared {
    pub(crate) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) -> Task {
        self.tasks.spawn(&self.rt, task)
    }

    pub(crate) fn failed(&self) -> bool {
        self.tasks.failed()
    }

    pub(crate) fn rethrow(&self) {
        self.tasks.rethrow();
    }

    pub(crate) fn book(&self, class: usize) -> &ClassBook {
        &self.classes[class]
    }

    /// Counts a holder of `class` admitted at `revision`, and checks the ledger: no class
    /// above the largest ceiling in force since then, nor the total above `max_concurrent`
    /// (the newest holder of a class, or of the bulkhead, was admitted at a revision at least
    /// this one's, when fewer than its ceiling held slots); with fixed limits, the borrowed
    /// slots within the shared pool.
    fn enter(&self, class: usize, revision: u64) {
        let word = self
            .ledger
            .word
            .fetch_add(1 << (16 * class), Ordering::AcqRel)
            + (1 << (16 * class));
        let counts = Ledger::counts(word);
        let total: u64 = counts.iter().sum();
        self.ledger.peaks[class].fetch_max(counts[class], Ordering::Relaxed);
        self.ledger.peak_total.fetch_max(total, Ordering::Relaxed);
        if let Some(max) = self
            .revisions
            .max_since(revision, |caps| caps.ceiling(class))
        {
            assert!(
                counts[class] <= max,
                "{} holders of class {class}, its ceiling at most {max} since revision \
                 {revision}: {counts:?}",
                counts[class]
            );
        }
        let max = self
            .revisions
            .max_since(revision, |caps| Some(u64::from(caps.max_concurrent)))
            .unwrap();
        assert!(
            total <= max,
            "{total} holders, max_concurrent at most {max} since revision {revision}"
        );
        if self.setup.plane == Plane::Fixed {
            self.check_fixed(counts);
        }
    }

    /// With fixed limits: every class within its ceiling, and the borrowed slots within the
    /// shared pool when some class has a floor (protection applies).
    pub(crate) fn check_fixed(&self, counts: [u64; MAX_CLASSES]) {
        let caps = self.revisions.get(0);
        let mut borrowed = 0;
        for (c, &n) in counts.iter().enumerate().take(self.handles.len()) {
            if let Some(max) = caps.ceiling(c) {
                assert!(
                    n <= max,
                    "{n} holders of class {c}, ceiling {max}: {counts:?}"
                );
            }
            borrowed += n.saturating_sub(caps.floor(c));
        }
        if caps.floors() > 0 {
            assert!(
                borrowed <= caps.shared_slots(),
                "{borrowed} borrowed slots held, the shared pool has {}: {counts:?} {caps:?}",
                caps.shared_slots()
            );
        }
    }

    /// Uncounts a holder (before its slot is given back), once.
    pub(crate) fn leave(&self, held: &mut Held) {
        if held.in_ledger {
            held.in_ledger = false;
            self.ledger
                .word
                .fetch_sub(1 << (16 * held.class), Ordering::AcqRel);
        }
    }

    /// An admission of `call`: checks it against the limits of its revision, the caller's
    /// own holdings in the class (`own`, a lower bound of the class's) and, for `solo`, the
    /// exact book; counts it (in the ledger if `in_ledger`).
    pub(crate) fn admitted(
        &self,
        admission: Facts,
        call: Call,
        own: Option<Own>,
        in_ledger: bool,
    ) -> Held {
        let c = call.class;
        assert_eq!(
            admission.class(),
            Some(self.handles[c]),
            "admitted in its class"
        );
        assert_eq!(admission.priority(), call.priority);
        let revision = admission.limit_revision();
        let caps = self.revisions.get(revision);
        let reserved = admission.reservation().expect("a budget").reserved();
        assert_eq!(admission.held_tokens(), reserved);
        let resources = admission.resources();
        let context = || format!("{resources:?} of {reserved} tokens in class {c} at {caps:?}");
        assert!(resources.borrowed_tokens <= reserved, "{}", context());
        assert!(
            resources.borrowed_tokens >= reserved.saturating_sub(caps.token_floor(c)),
            "tokens beyond the token floor are borrowed: {}",
            context()
        );
        if caps.floor(c) == 0 {
            assert!(
                resources.borrowed_concurrency,
                "no floor: borrowed, {}",
                context()
            );
        }
        if let Some(own) = own {
            if own.slots >= caps.floor(c) {
                assert!(
                    resources.borrowed_concurrency,
                    "the caller alone holds {own:?}: {}",
                    context()
                );
            }
            let free_floor = caps.token_floor(c).saturating_sub(own.tokens);
            assert!(
                resources.borrowed_tokens >= reserved.saturating_sub(free_floor),
                "the caller alone holds {own:?}: {}",
                context()
            );
        }
        assert!(admission.holds_slot());
        if c == self.solo {
            let mut book = self.solo_book.lock().unwrap();
            let expected = Resources::new(
                book.slots >= caps.floor(c),
                reserved.saturating_sub(caps.token_floor(c).saturating_sub(book.tokens)),
            );
            assert_eq!(resources, expected, "solo holds {book:?}: {}", context());
            if let Some(max) = caps.ceiling(c) {
                assert!(book.slots < max, "solo holds {book:?}: {}", context());
            }
            if let Some(max) = caps.token_ceiling(c) {
                assert!(
                    book.tokens + reserved <= max,
                    "solo holds {book:?}: {}",
                    context()
                );
            }
            book.slots += 1;
            book.tokens += reserved;
        }
        let book = self.book(c);
        bump(&book.decided);
        bump(&book.admitted);
        add(
            &book.borrowed_admissions,
            u64::from(resources.borrowed_concurrency),
        );
        add(&book.borrowed_tokens, resources.borrowed_tokens);
        if in_ledger {
            self.enter(c, revision);
        }
        Held {
            class: c,
            id: admission.admission_id(),
            resources,
            in_ledger,
            abandoned: false,
        }
    }

    /// A usage report moved `held`'s hold from `before` to `after` tokens.
    pub(crate) fn moved(&self, held: &Held, before: u64, after: u64) {
        if held.class == self.solo {
            let mut book = self.solo_book.lock().unwrap();
            book.tokens = book.tokens + after - before;
        }
    }

    /// Gives the slot back by hand through `abandon` (which must answer exactly whether the
    /// slot was borrowed and still held), uncounting the holder first.
    pub(crate) fn abandon(&self, held: &mut Held, abandon: impl FnOnce() -> bool) {
        let expected = held.resources.borrowed_concurrency && !held.abandoned;
        if expected {
            self.leave(held);
            if held.class == self.solo {
                self.solo_book.lock().unwrap().slots -= 1;
            }
        }
        assert_eq!(abandon(), expected, "abandon of {held:?}");
        if expected {
            held.abandoned = true;
            bump(&self.book(held.class).abandoned_manual);
        }
    }

    /// The admission settled (or is about to) holding `hold` tokens; the caller already left
    /// the ledger if it could.
    pub(crate) fn settle(&self, held: &mut Held, hold: u64) {
        self.leave(held);
        if held.class == self.solo {
            let mut book = self.solo_book.lock().unwrap();
            book.slots -= u64::from(!held.abandoned);
            book.tokens -= hold;
        }
    }

    /// A call cancelled before its result (decided, and so refused, iff it was polled).
    pub(crate) fn vanished(&self, class: usize, polled: bool) {
        if polled {
            bump(&self.book(class).decided);
            bump(&self.book(class).vanished);
        } else {
            bump(&self.tally.unpolled);
        }
    }

    /// A refusal the caller saw: counted, and its detail checked.
    pub(crate) fn refused(
        &self,
        rejection: &async_bulkhead_llm::Rejection,
        call: Call,
        closed_before: bool,
    ) {
        let reason = rejection.reason();
        assert_ne!(
            reason,
            RejectReason::Aborted,
            "only a dropped call is aborted"
        );
        let book = self.book(call.class);
        bump(&book.decided);
        bump(&book.seen[reason_index(reason)]);
        if closed_before {
            assert_eq!(reason, RejectReason::Shutdown, "refused after close()");
            bump(&book.post_close_refused);
        }
        self.check_detail(rejection, call);
    }
}

/// What `admitted` checks of an admission, read from a permit's admission or a run context.
pub(crate) struct Facts {
    admission_id: async_bulkhead_llm::admission::AdmissionId,
    class: Option<async_bulkhead_llm::classes::AdmissionClass>,
    priority: async_bulkhead_llm::Priority,
    limit_revision: u64,
    reservation: Option<async_bulkhead_llm::Reservation>,
    held_tokens: u64,
    resources: Resources,
    holds_slot: bool,
}

impl Facts {
    pub(crate) fn of(a: &async_bulkhead_llm::admission::Admission) -> Facts {
        Facts {
            admission_id: a.admission_id(),
            class: a.class(),
            priority: a.priority(),
            limit_revision: a.limit_revision(),
            reservation: a.reservation(),
            held_tokens: a.held_tokens(),
            resources: a.resources(),
            holds_slot: a.holds_slot(),
        }
    }

    pub(crate) fn of_context(a: &async_bulkhead_llm::RunContext<'_>) -> Facts {
        Facts {
            admission_id: a.admission_id().expect("admitted"),
            class: a.class(),
            priority: a.priority(),
            limit_revision: a.limit_revision(),
            reservation: a.reservation(),
            held_tokens: a.held_tokens(),
            resources: a.resources(),
            holds_slot: a.holds_slot(),
        }
    }

    fn admission_id(&self) -> async_bulkhead_llm::admission::AdmissionId {
        self.admission_id
    }
    fn class(&self) -> Option<async_bulkhead_llm::classes::AdmissionClass> {
        self.class
    }
    fn priority(&self) -> async_bulkhead_llm::Priority {
        self.priority
    }
    fn limit_revision(&self) -> u64 {
        self.limit_revision
    }
    fn reservation(&self) -> Option<async_bulkhead_llm::Reservation> {
        self.reservation
    }
    fn held_tokens(&self) -> u64 {
        self.held_tokens
    }
    fn resources(&self) -> Resources {
        self.resources
    }
    fn holds_slot(&self) -> bool {
        self.holds_slot
    }
}
