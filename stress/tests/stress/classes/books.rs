//! What the tasks of one class scenario share: the kit's scene, a book per class (the kit's
//! callers' sums, and what only classes have: borrowing, abandonments, deadlines), the kit's
//! ledger counting holders per class, the `solo` book, and the live checks of every
//! admission, abandonment and settlement.

use std::ops::Deref;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    Priority, admission::AdmissionId, classes::AdmissionClass, classes::Resources,
};

use super::config::Revisions;
pub(crate) use crate::kit::books::MAX_CLASSES;
use crate::kit::books::{Book, Heard, Ledger, add, bump};
use crate::kit::scene::{Scene, Setup};

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

/// The callers' sums for one class: the kit's book (decided, admitted, refused by reason,
/// cancelled, token bookings, effective reports), and what only classes have.
#[derive(Default)]
pub(crate) struct ClassBook {
    pub(crate) calls: Book,
    pub(crate) borrowed_admissions: AtomicU64,
    pub(crate) borrowed_tokens: AtomicU64,
    pub(crate) abandoned_manual: AtomicU64,
    pub(crate) abandoned_deadline: AtomicU64,
    /// Runs with a deadline that ran to their end (not cut).
    pub(crate) deadline_kept: AtomicU64,
}

impl ClassBook {
    /// A class's book, keeping every settled admission's trace if a listener hears them.
    pub(crate) fn new(tracing: bool) -> ClassBook {
        ClassBook {
            calls: if tracing {
                Book::tracing()
            } else {
                Book::default()
            },
            ..ClassBook::default()
        }
    }
}

impl Deref for ClassBook {
    type Target = Book;

    fn deref(&self) -> &Book {
        &self.calls
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
    pub(crate) setup: Setup<Plane>,
    pub(crate) scene: Scene,
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
    /// Slot holders per class.
    pub(crate) ledger: Ledger,
    /// The `solo` class's slots and tokens, exactly (only worker 0 touches the class).
    pub(crate) solo_book: Mutex<Own>,
    pub(crate) heard: Arc<Heard>,
    /// Invalid snapshots and budgets refused (each with its exact error).
    pub(crate) refused_snapshots: AtomicU64,
}

impl Deref for Shared {
    type Target = Scene;

    fn deref(&self) -> &Scene {
        &self.scene
    }
}

impl Shared {
    pub(crate) fn book(&self, class: usize) -> &ClassBook {
        &self.classes[class]
    }

    /// Counts a holder of `class` admitted at `revision`, and checks the ledger: no class
    /// above the largest ceiling in force since then, nor the total above `max_concurrent`
    /// (the newest holder of a class, or of the bulkhead, was admitted at a revision at least
    /// this one's, when fewer than its ceiling held slots); with fixed limits, the borrowed
    /// slots within the shared pool.
    fn enter(&self, class: usize, revision: u64) {
        let counts = self.ledger.enter(class);
        let total: u64 = counts.iter().sum();
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
            self.ledger.leave(held.class);
        }
    }

    /// An admission of `call`: checks it against the limits of its revision, the caller's
    /// own holdings in the class (`own`, a lower bound of the class's) and, for `solo`, the
    /// exact book; counts it (in the ledger if `in_ledger`). A call made after `close()`
    /// returned (`closed_before`) must not be admitted.
    pub(crate) fn admitted(
        &self,
        admission: Facts,
        call: Call,
        closed_before: bool,
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
        book.admitted(closed_before);
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
        self.book(class).vanished(polled);
    }

    /// A refusal the caller saw: counted, and its detail checked.
    pub(crate) fn refused(
        &self,
        rejection: &async_bulkhead_llm::Rejection,
        call: Call,
        closed_before: bool,
    ) {
        self.book(call.class)
            .refused(rejection.reason(), closed_before);
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
