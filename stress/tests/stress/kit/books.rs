//! The books several families keep: the callers' sums for a scope (the whole bulkhead, or one
//! admission class) and their exact check against the scope's statistics, the ledger of slot
//! holders the callers keep themselves, and what the listener heard (events counted per scope,
//! every admission followed from its admit event to its release event).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use async_bulkhead_llm::{
    RejectReason, Stats, TokenUsage, admission::AdmissionId, classes::AbandonCause,
    classes::AdmissionClass, classes::Resources, events::Event, stats::ClassStats,
    stats::RejectionCounts, stats::TokenBudgetStats,
};

use crate::caller_model::{Model, Settled};

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

/// `reserved + overrun + reheld - refunded - consumed - returned_unreported`: the tokens in
/// flight at every quiet point (crate `TokenBudgetStats`), `None` once a total saturated.
pub(crate) fn token_balance(t: &TokenBudgetStats) -> Option<i128> {
    let totals = [
        t.total_reserved,
        t.total_overrun,
        t.total_reheld,
        t.total_refunded,
        t.total_consumed,
        t.total_returned_unreported,
    ];
    let [reserved, overrun, reheld, refunded, consumed, returned] = totals.map(i128::from);
    (!totals.contains(&u64::MAX))
        .then_some(reserved + overrun + reheld - refunded - consumed - returned)
}

/// What the listener should have heard of one admission, from its admit to its release event.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Trace {
    pub(crate) reserved: u64,
    pub(crate) usage_events: u64,
    /// Sum of the usage events' `delta_tokens`.
    pub(crate) delta_sum: i128,
    pub(crate) held_at_release: u64,
    pub(crate) refunded_at_release: u64,
    pub(crate) usage: Option<TokenUsage>,
}

impl Trace {
    /// The trace of an admission its caller settled (the model includes the settlement).
    pub(crate) fn of(model: &Model, settled: &Settled) -> Trace {
        let reserved = model.reserved();
        Trace {
            reserved,
            usage_events: model.sequence,
            delta_sum: i128::from(settled.held) - i128::from(reserved),
            held_at_release: settled.held,
            refunded_at_release: settled.refunded,
            usage: settled.usage,
        }
    }
}

/// The callers' sums for one scope (the whole bulkhead, or one class), compared with its
/// statistics at the end ([`Book::check`]).
#[derive(Default)]
pub(crate) struct Book {
    /// Calls the bulkhead decided: returned a result, or were polled and then cancelled.
    pub(crate) decided: AtomicU64,
    pub(crate) admitted: AtomicU64,
    /// Refusals the callers saw, by reason.
    seen: [AtomicU64; RejectReason::ALL.len()],
    /// Calls polled (so decided) and cancelled before their result: each counted as a refusal
    /// (aborted, or whatever refused it before the caller gave up).
    pub(crate) vanished: AtomicU64,
    /// Acquire futures dropped before their first poll (decided nothing).
    pub(crate) unpolled: AtomicU64,
    /// Refusals (all `shutdown`) of calls that started after `close()` returned.
    pub(crate) post_close_refused: AtomicU64,
    /// Reports that changed the cumulative usage or the hold (each is a usage event).
    pub(crate) effective_reports: AtomicU64,
    reserved: AtomicU64,
    /// Reservations of admissions settled without any usage (booked as returned unreported).
    pub(crate) unused_reserved: AtomicU64,
    consumed: AtomicU64,
    overrun: AtomicU64,
    refunded: AtomicU64,
    reheld: AtomicU64,
    /// What the listener should hear of every settled admission, if kept.
    traces: Option<Mutex<HashMap<AdmissionId, Trace>>>,
}

impl Book {
    /// A book that also keeps every settled admission's [`Trace`], for a listener to match.
    pub(crate) fn tracing() -> Book {
        Book {
            traces: Some(Mutex::default()),
            ..Book::default()
        }
    }

    pub(crate) fn seen(&self, reason: RejectReason) -> u64 {
        load(&self.seen[reason_index(reason)])
    }

    /// A decided call (its admission or refusal is booked on its own).
    pub(crate) fn decided(&self) {
        bump(&self.decided);
    }

    /// An admission (not yet decided: a `run` is decided once its future is done).
    pub(crate) fn admit(&self, closed_before: bool) {
        assert!(!closed_before, "admitted after close() returned");
        bump(&self.admitted);
    }

    /// A call decided and admitted.
    pub(crate) fn admitted(&self, closed_before: bool) {
        self.decided();
        self.admit(closed_before);
    }

    /// A call decided and refused, as its caller saw it; after the close, only `shutdown`.
    pub(crate) fn refused(&self, reason: RejectReason, closed_before: bool) {
        assert_ne!(
            reason,
            RejectReason::Aborted,
            "only a dropped call is aborted"
        );
        self.decided();
        bump(&self.seen[reason_index(reason)]);
        if closed_before {
            assert_eq!(reason, RejectReason::Shutdown, "refused after close()");
            bump(&self.post_close_refused);
        }
    }

    /// A call cancelled before its result: decided (and refused) iff it was polled.
    pub(crate) fn vanished(&self, polled: bool) {
        if polled {
            self.decided();
            bump(&self.vanished);
        } else {
            bump(&self.unpolled);
        }
    }

    /// Books a settled admission `id` (the model already includes the settlement's move).
    pub(crate) fn settled(&self, id: AdmissionId, model: &Model, settled: &Settled) {
        add(&self.reserved, model.reserved());
        match settled.usage {
            Some(u) => add(&self.consumed, u.total()),
            None => add(&self.unused_reserved, model.reserved()),
        }
        add(&self.overrun, model.overrun);
        add(&self.refunded, model.refunded);
        add(&self.reheld, model.reheld);
        if let Some(traces) = &self.traces {
            let previous = traces.lock().unwrap().insert(id, Trace::of(model, settled));
            assert!(previous.is_none(), "admission id {id} settled twice");
        }
    }

    /// Checks the scope's `figures` against these sums: every decided call counted exactly
    /// once (admitted or refused, by reason as the callers saw it, the cancelled ones as
    /// refusals), every admission released, every token booking equal to the callers' models,
    /// `reserved + overrun + reheld == consumed + refunded + returned_unreported`, and nothing
    /// returned unreported when every admission settled with usage. `at` names the scope in
    /// the messages.
    pub(crate) fn check(&self, f: &Figures, always_usage: bool, at: impl Fn(&str) -> String) {
        let by = f.by;
        assert_eq!(
            f.admitted,
            load(&self.admitted),
            "{}",
            at("admissions the callers saw")
        );
        assert_eq!(f.released, f.admitted, "{}", at("every admission released"));
        assert_eq!(
            f.admitted + f.rejected,
            load(&self.decided),
            "{}",
            at("admitted + rejected == decided calls")
        );
        let seen: u64 = RejectReason::ALL.iter().map(|&r| self.seen(r)).sum();
        assert_eq!(
            f.rejected,
            seen + load(&self.vanished),
            "{}",
            at(&format!(
                "refusals: seen + cancelled after their first poll ({by:?})"
            ))
        );
        for &reason in RejectReason::ALL {
            assert!(
                by.get(reason) >= self.seen(reason),
                "{}",
                at(&format!(
                    "{reason}: {} counted, {} seen",
                    by.get(reason),
                    self.seen(reason)
                ))
            );
        }
        assert!(by.aborted <= load(&self.vanished), "{}", at("aborted"));
        assert!(
            by.shutdown >= load(&self.post_close_refused),
            "{}",
            at("shutdown")
        );

        // The token books.
        let unused = load(&self.unused_reserved);
        assert_eq!(
            [
                f.reserved,
                f.consumed,
                f.overrun,
                f.refunded,
                f.reheld,
                f.returned_unreported
            ],
            [
                load(&self.reserved),
                load(&self.consumed),
                load(&self.overrun),
                load(&self.refunded),
                load(&self.reheld),
                unused
            ],
            "{}",
            at(
                "token books (reserved, consumed, overrun, refunded (gross), reheld, returned \
                unreported == the reservations of admissions settled without usage)"
            )
        );
        if always_usage {
            assert_eq!(unused, 0, "{}", at("every admission settled with usage"));
        }
        assert_eq!(
            f.reserved + f.overrun + f.reheld,
            f.consumed + f.refunded + f.returned_unreported,
            "{}",
            at("reserved + overrun + reheld == consumed + refunded + returned")
        );
    }
}

/// A scope's figures (the whole bulkhead, or one class), as its statistics give them.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Figures {
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    pub(crate) rejected: u64,
    pub(crate) by: RejectionCounts,
    pub(crate) reserved: u64,
    pub(crate) consumed: u64,
    pub(crate) overrun: u64,
    pub(crate) refunded: u64,
    pub(crate) reheld: u64,
    pub(crate) returned_unreported: u64,
}

impl Figures {
    /// The whole bulkhead's (it has a token budget).
    pub(crate) fn of(stats: &Stats) -> Figures {
        let t = stats.token_budget.expect("a token budget");
        Figures {
            admitted: stats.admitted,
            released: stats.released,
            rejected: stats.rejected,
            by: stats.rejected_by_reason,
            reserved: t.total_reserved,
            consumed: t.total_consumed,
            overrun: t.total_overrun,
            refunded: t.total_refunded,
            reheld: t.total_reheld,
            returned_unreported: t.total_returned_unreported,
        }
    }

    /// One class's.
    pub(crate) fn of_class(s: &ClassStats) -> Figures {
        Figures {
            admitted: s.admitted,
            released: s.released,
            rejected: s.rejected,
            by: s.rejected_by_reason,
            reserved: s.total_reserved,
            consumed: s.total_consumed,
            overrun: s.total_overrun,
            refunded: s.total_refunded,
            reheld: s.total_reheld,
            returned_unreported: s.total_returned_unreported,
        }
    }
}

/// Slot holders per class (a bulkhead without classes counts in class 0), counted by the
/// callers in one word (16 bits a class), so that a single read gives every class at one
/// moment. A caller counts itself after its admission and uncounts itself before it gives its
/// slot back (release, drop or abandonment), so every count is at most what the class (or the
/// bulkhead) really holds at that moment.
#[derive(Default)]
pub(crate) struct Ledger {
    word: AtomicU64,
    peaks: [AtomicU64; MAX_CLASSES],
    peak_total: AtomicU64,
}

impl Ledger {
    pub(crate) fn counts(word: u64) -> [u64; MAX_CLASSES] {
        core::array::from_fn(|c| (word >> (16 * c)) & 0xFFFF)
    }

    pub(crate) fn read(&self) -> [u64; MAX_CLASSES] {
        Ledger::counts(self.word.load(Ordering::Acquire))
    }

    /// Counts a holder of `class`; returns every class's count right after.
    pub(crate) fn enter(&self, class: usize) -> [u64; MAX_CLASSES] {
        let one = 1 << (16 * class);
        let counts = Ledger::counts(self.word.fetch_add(one, Ordering::AcqRel) + one);
        self.peaks[class].fetch_max(counts[class], Ordering::Relaxed);
        self.peak_total
            .fetch_max(counts.iter().sum(), Ordering::Relaxed);
        counts
    }

    /// Uncounts a holder of `class`.
    pub(crate) fn leave(&self, class: usize) {
        self.word.fetch_sub(1 << (16 * class), Ordering::AcqRel);
    }

    /// Counts a holder of a bulkhead without classes, never more than `ceiling` at once.
    pub(crate) fn enter_within(&self, ceiling: u64) {
        let holders = self.enter(0)[0];
        assert!(
            holders <= ceiling,
            "{holders} holders at once, max_concurrent at most {ceiling}"
        );
    }

    pub(crate) fn peak(&self, class: usize) -> u64 {
        load(&self.peaks[class])
    }

    pub(crate) fn peak_total(&self) -> u64 {
        load(&self.peak_total)
    }

    /// At the end: nobody holds anything, and there were never more than `ceiling` at once.
    pub(crate) fn check_empty(&self, ceiling: u64) {
        assert_eq!(self.read(), [0; MAX_CLASSES], "the ledger");
        assert!(
            self.peak_total() <= ceiling,
            "{} holders at once, max_concurrent at most {ceiling}",
            self.peak_total()
        );
    }
}

/// What the listener heard of one scope (the bulkhead, or one class).
#[derive(Default)]
pub(crate) struct ScopeHeard {
    pub(crate) admits: AtomicU64,
    pub(crate) releases: AtomicU64,
    pub(crate) usages: AtomicU64,
    pub(crate) rejects: [AtomicU64; RejectReason::ALL.len()],
    /// Manual and deadline abandonments of borrowed slots.
    pub(crate) abandons: [AtomicU64; 2],
    pub(crate) reserved: AtomicU64,
    pub(crate) borrowed_admissions: AtomicU64,
    pub(crate) borrowed_tokens: AtomicU64,
}

impl ScopeHeard {
    pub(crate) fn rejects(&self, reason: RejectReason) -> u64 {
        load(&self.rejects[reason_index(reason)])
    }
}

/// An admission between its admit and release events, as the listener follows it.
struct Open {
    class: Option<AdmissionClass>,
    resources: Resources,
    abandoned: bool,
    revision: u64,
    reserved: u64,
    held: u64,
    sequence: u64,
    delta_sum: i128,
}

#[derive(Default)]
struct Follow {
    open: HashMap<AdmissionId, Open>,
    /// The trace of every admission released.
    closed: HashMap<AdmissionId, Trace>,
    /// Inconsistencies seen (a panic in a listener would only be counted, not reported): the
    /// first 20, and how many in all.
    errors: Vec<String>,
    error_count: u64,
}

impl Follow {
    fn error(&mut self, message: String) {
        self.error_count += 1;
        if self.errors.len() < 20 {
            self.errors.push(message);
        }
    }
}

/// What the listener heard, checked event by event against the admission it belongs to: an
/// admission is admitted once; its usage events come between its admit and release events,
/// in sequence (1, 2, ...), each moving the hold from where the last left it, with the
/// admission's reservation, revision and class; its release comes once, with the hold, the
/// usage sequence, the reservation, the revision, the class and the resources its events
/// announced (reservation + the usage deltas == the hold released); an abandonment of its
/// borrowed slot comes at most once, inside it, with its class and resources; nobody borrows
/// more tokens than it reserves; and on a bulkhead with classes every event names one (on one
/// without, none does).
pub(crate) struct Heard {
    classes: bool,
    scopes: [ScopeHeard; MAX_CLASSES],
    pub(crate) reconfigures: AtomicU64,
    follow: Mutex<Follow>,
}

impl Heard {
    /// The listener of a bulkhead with admission classes (`classes`) or without.
    pub(crate) fn new(classes: bool) -> Heard {
        Heard {
            classes,
            scopes: Default::default(),
            reconfigures: AtomicU64::new(0),
            follow: Mutex::default(),
        }
    }

    /// What it heard of class `class` (of the bulkhead, for a bulkhead without classes: 0).
    pub(crate) fn scope(&self, class: usize) -> &ScopeHeard {
        &self.scopes[class]
    }

    /// The scope of an event of `class`; an event unlike the bulkhead (a class where it has
    /// none, or none where it has classes) is an error, counted in scope 0.
    fn scope_of(&self, class: Option<AdmissionClass>, follow: &mut Follow, what: &str) -> usize {
        match (class, self.classes) {
            (Some(class), true) => usize::from(class.index()),
            (None, false) => 0,
            (class, _) => {
                follow.error(format!("{what} of class {class:?}"));
                0
            }
        }
    }

    pub(crate) fn hear(&self, event: &Event<'_>) {
        let mut follow = self.follow.lock().unwrap();
        let follow = &mut *follow;
        match event {
            Event::Admit(e) => {
                let id = e.admission_id;
                let h = &self.scopes[self.scope_of(e.class, follow, "admit event")];
                bump(&h.admits);
                add(&h.reserved, e.reserved_tokens);
                add(&h.borrowed_tokens, e.resources.borrowed_tokens);
                add(
                    &h.borrowed_admissions,
                    u64::from(e.resources.borrowed_concurrency),
                );
                if e.resources.borrowed_tokens > e.reserved_tokens {
                    follow.error(format!("{e:?}: borrows more than it reserves"));
                }
                let open = Open {
                    class: e.class,
                    resources: e.resources,
                    abandoned: false,
                    revision: e.limit_revision,
                    reserved: e.reserved_tokens,
                    held: e.reserved_tokens,
                    sequence: 0,
                    delta_sum: 0,
                };
                if follow.open.insert(id, open).is_some() || follow.closed.contains_key(&id) {
                    follow.error(format!("admission {id} admitted twice"));
                }
            }
            Event::Usage(e) => {
                let id = e.admission_id;
                bump(&self.scopes[self.scope_of(e.class, follow, "usage event")].usages);
                let Some(open) = follow.open.get_mut(&id) else {
                    return follow.error(format!("usage event of {id} outside its admission"));
                };
                let expected = (
                    open.sequence + 1,
                    open.held,
                    i128::from(e.held_tokens) - i128::from(open.held),
                    open.reserved,
                    open.revision,
                    open.class,
                );
                let seen = (
                    e.sequence,
                    e.previous_held_tokens,
                    e.delta_tokens,
                    e.reserved_tokens,
                    e.limit_revision,
                    e.class,
                );
                open.sequence = e.sequence;
                open.held = e.held_tokens;
                open.delta_sum += e.delta_tokens;
                if seen != expected {
                    follow.error(format!(
                        "usage event of {id}: (sequence, previous held, delta, reserved, \
                         revision, class) {seen:?}, expected {expected:?}"
                    ));
                }
            }
            Event::BorrowedConcurrencyAbandon(e) => {
                let id = e.admission_id;
                let cause = usize::from(e.cause == AbandonCause::Deadline);
                bump(&self.scopes[self.scope_of(e.class, follow, "abandon event")].abandons[cause]);
                match follow.open.get_mut(&id) {
                    Some(a)
                        if a.class == e.class
                            && a.resources == e.resources
                            && e.resources.borrowed_concurrency
                            && !a.abandoned =>
                    {
                        a.abandoned = true;
                    }
                    _ => follow.error(format!("abandon outside a borrowed admission: {e:?}")),
                }
            }
            Event::Release(e) => {
                let id = e.admission_id;
                bump(&self.scopes[self.scope_of(e.class, follow, "release event")].releases);
                let Some(open) = follow.open.remove(&id) else {
                    return follow.error(format!("release event of {id} outside its admission"));
                };
                let expected = (
                    open.held,
                    open.sequence,
                    open.reserved,
                    open.revision,
                    open.class,
                    open.resources,
                );
                let seen = (
                    e.held_tokens,
                    e.usage_sequence,
                    e.reserved_tokens,
                    e.limit_revision,
                    e.class,
                    e.resources,
                );
                if seen != expected {
                    follow.error(format!(
                        "release event of {id}: (held, usage sequence, reserved, revision, \
                         class, resources) {seen:?}, expected {expected:?}"
                    ));
                }
                if i128::from(open.reserved) + open.delta_sum != i128::from(e.held_tokens) {
                    follow.error(format!(
                        "release event of {id}: reserved {} + usage deltas {} != held {}",
                        open.reserved, open.delta_sum, e.held_tokens
                    ));
                }
                let trace = Trace {
                    reserved: e.reserved_tokens,
                    usage_events: e.usage_sequence,
                    delta_sum: open.delta_sum,
                    held_at_release: e.held_tokens,
                    refunded_at_release: e.refunded_tokens,
                    usage: e.usage,
                };
                follow.closed.insert(id, trace);
            }
            Event::Reject(e) => {
                let h = &self.scopes[self.scope_of(e.class, follow, "reject event")];
                bump(&h.rejects[reason_index(e.reason)]);
            }
            Event::Reconfigure(_) => bump(&self.reconfigures),
            _ => {}
        }
    }

    /// At the end: no inconsistency heard, every admission released.
    pub(crate) fn check_consistent(&self) {
        let follow = self.follow.lock().unwrap();
        assert_eq!(
            follow.error_count, 0,
            "the listener heard inconsistencies (the first 20): {:#?}",
            follow.errors
        );
        assert!(
            follow.open.is_empty(),
            "{} admissions never released",
            follow.open.len()
        );
    }

    /// Every admission the callers settled, as they modelled it in `books` (tracing books),
    /// is exactly what the listener heard of it, and the listener heard of no other.
    pub(crate) fn check_traces<'b>(&self, books: impl IntoIterator<Item = &'b Book>) {
        let follow = self.follow.lock().unwrap();
        let mut modelled = 0;
        for book in books {
            let traces = book
                .traces
                .as_ref()
                .expect("a tracing book")
                .lock()
                .unwrap();
            modelled += traces.len();
            for (id, expected) in traces.iter() {
                assert_eq!(
                    follow.closed.get(id),
                    Some(expected),
                    "admission {id}: heard vs. modelled"
                );
            }
        }
        assert_eq!(
            follow.closed.len(),
            modelled,
            "admissions heard vs. modelled"
        );
    }
}
