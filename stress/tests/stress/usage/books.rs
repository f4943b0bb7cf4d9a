//! Shared tallies: the callers' sums, their ledger of holders, and the listener's books.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use async_bulkhead_llm::{
    AcquireError, LlmBulkhead, RejectReason, admission::AdmissionId, events::Event,
    events::Subscription,
};

use super::callers::Setup;
use super::plan::Trace;
use crate::caller_model::{Model, Settled};

/// Sums the callers keep, compared with the bulkhead's statistics at the end.
#[derive(Default)]
pub(crate) struct Tally {
    pub(crate) admitted: AtomicU64,
    /// Reports whose returned sequence increased.
    pub(crate) effective_reports: AtomicU64,
    reserved: AtomicU64,
    /// Reservations of admissions settled without any usage (they book nothing).
    unused_reserved: AtomicU64,
    consumed: AtomicU64,
    overrun: AtomicU64,
    refunded: AtomicU64,
    reheld: AtomicU64,
    refused: AtomicU64,
    /// Callers that finished.
    pub(crate) done: AtomicU64,
    traces: Mutex<HashMap<AdmissionId, Trace>>,
}

impl Tally {
    pub(crate) fn refused(&self, error: AcquireError) {
        match error {
            AcquireError::Rejected(rejection) => self.refused_for(rejection.reason()),
            AcquireError::Invalid(error) => panic!("valid input refused: {error}"),
            other => panic!("an error this test does not know: {other}"),
        }
    }

    pub(crate) fn refused_for(&self, reason: RejectReason) {
        match reason {
            RejectReason::BudgetLimit
            | RejectReason::ConcurrencyLimit
            | RejectReason::QueueLimit
            | RejectReason::Timeout
            | RejectReason::Shutdown => {
                self.refused.fetch_add(1, Ordering::Relaxed);
            }
            other => panic!("unexpected refusal {other}"),
        }
    }

    /// Books a settled admission (the model already includes the settlement's move).
    pub(crate) fn settled(&self, id: AdmissionId, model: &Model, settled: Settled) {
        let r = model.reserved();
        self.reserved.fetch_add(r, Ordering::Relaxed);
        match settled.usage {
            Some(u) => self.consumed.fetch_add(u.total(), Ordering::Relaxed),
            None => self.unused_reserved.fetch_add(r, Ordering::Relaxed),
        };
        self.overrun.fetch_add(model.overrun, Ordering::Relaxed);
        self.refunded.fetch_add(model.refunded, Ordering::Relaxed);
        self.reheld.fetch_add(model.reheld, Ordering::Relaxed);
        let trace = Trace {
            reserved: r,
            usage_events: model.sequence,
            delta_sum: i128::from(settled.held) - i128::from(r),
            held_at_release: settled.held,
            refunded_at_release: settled.refunded,
            usage: settled.usage,
        };
        let previous = self.traces.lock().unwrap().insert(id, trace);
        assert!(previous.is_none(), "admission id {id} settled twice");
    }
}

/// Admitted callers holding their permit, counted by the callers themselves: a caller counts
/// itself after it was admitted and uncounts itself before it settles, so the ledger never
/// exceeds what the bulkhead really holds.
pub(crate) struct Ledger {
    holders: AtomicU64,
    ceiling: u64,
    peak: AtomicU64,
}

impl Ledger {
    fn new(ceiling: u32) -> Ledger {
        Ledger {
            holders: AtomicU64::new(0),
            ceiling: u64::from(ceiling),
            peak: AtomicU64::new(0),
        }
    }

    pub(crate) fn enter(&self) {
        let holders = self.holders.fetch_add(1, Ordering::AcqRel) + 1;
        self.peak.fetch_max(holders, Ordering::Relaxed);
        assert!(
            holders <= self.ceiling,
            "{holders} holders at once, max_concurrent {}",
            self.ceiling
        );
    }

    pub(crate) fn leave(&self) {
        self.holders.fetch_sub(1, Ordering::AcqRel);
    }
}

/// What the listener heard, checked as it arrives.
#[derive(Default)]
struct Heard {
    admits: AtomicU64,
    usages: AtomicU64,
    releases: AtomicU64,
    rejects: AtomicU64,
    reconfigures: AtomicU64,
    books: Mutex<Books>,
}

#[derive(Default)]
struct Books {
    open: HashMap<AdmissionId, Open>,
    closed: HashMap<AdmissionId, Trace>,
    /// Inconsistencies seen (a panic in a listener would only be counted, not reported).
    errors: Vec<String>,
}

impl Books {
    fn error(&mut self, message: String) {
        if self.errors.len() < 20 {
            self.errors.push(message);
        }
    }
}

/// An admission between its admit and release events.
struct Open {
    revision: u64,
    reserved: u64,
    held: u64,
    sequence: u64,
    delta_sum: i128,
}

impl Heard {
    fn hear(&self, event: &Event<'_>) {
        match event {
            Event::Admit(e) => {
                self.admits.fetch_add(1, Ordering::Relaxed);
                let mut books = self.books.lock().unwrap();
                let open = Open {
                    revision: e.limit_revision,
                    reserved: e.reserved_tokens,
                    held: e.reserved_tokens,
                    sequence: 0,
                    delta_sum: 0,
                };
                let id = e.admission_id;
                if books.open.insert(id, open).is_some() || books.closed.contains_key(&id) {
                    books.error(format!("admission id {id} admitted twice"));
                }
            }
            Event::Usage(e) => {
                self.usages.fetch_add(1, Ordering::Relaxed);
                let mut books = self.books.lock().unwrap();
                let id = e.admission_id;
                let Some(open) = books.open.get_mut(&id) else {
                    books.error(format!("usage event of {id} outside its admission"));
                    return;
                };
                let expected = (
                    open.sequence + 1,
                    open.held,
                    i128::from(e.held_tokens) - i128::from(open.held),
                    open.reserved,
                    open.revision,
                );
                let seen = (
                    e.sequence,
                    e.previous_held_tokens,
                    e.delta_tokens,
                    e.reserved_tokens,
                    e.limit_revision,
                );
                open.sequence = e.sequence;
                open.held = e.held_tokens;
                open.delta_sum += e.delta_tokens;
                if seen != expected {
                    books.error(format!(
                        "usage event of {id}: (sequence, previous held, delta, reserved, revision) \
                         {seen:?}, expected {expected:?}"
                    ));
                }
            }
            Event::Release(e) => {
                self.releases.fetch_add(1, Ordering::Relaxed);
                let mut books = self.books.lock().unwrap();
                let id = e.admission_id;
                let Some(open) = books.open.remove(&id) else {
                    books.error(format!("release event of {id} outside its admission"));
                    return;
                };
                let expected = (open.held, open.sequence, open.reserved, open.revision);
                let seen = (
                    e.held_tokens,
                    e.usage_sequence,
                    e.reserved_tokens,
                    e.limit_revision,
                );
                if seen != expected {
                    books.error(format!(
                        "release event of {id}: (held, usage sequence, reserved, revision) \
                         {seen:?}, expected {expected:?}"
                    ));
                }
                if i128::from(open.reserved) + open.delta_sum != i128::from(e.held_tokens) {
                    books.error(format!(
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
                books.closed.insert(id, trace);
            }
            Event::Reject(_) => {
                self.rejects.fetch_add(1, Ordering::Relaxed);
            }
            Event::Reconfigure(_) => {
                self.reconfigures.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
    }
}

/// Everything the callers of one scenario share.
pub(crate) struct Shared {
    pub(crate) tally: Tally,
    pub(crate) ledger: Ledger,
    heard: Arc<Heard>,
    /// The first panic of a caller or of the control plane, re-raised once the others have
    /// stopped: a failed check ends the run instead of leaving the control plane waiting for
    /// callers that will never finish (or a runtime swallowing the panic).
    panic: Mutex<Option<Box<dyn Any + Send>>>,
}

impl Shared {
    /// The shared tallies and, if the setup listens, a listener subscribed to every event of
    /// `bulkhead`.
    pub(crate) fn new(bulkhead: &LlmBulkhead, setup: Setup) -> (Arc<Shared>, Option<Subscription>) {
        let heard = Arc::new(Heard::default());
        let listener = Arc::clone(&heard);
        let subscription = setup
            .listen
            .then(|| bulkhead.on(move |event| listener.hear(event)));
        let shared = Shared {
            tally: Tally::default(),
            ledger: Ledger::new(setup.ceiling()),
            heard,
            panic: Mutex::new(None),
        };
        (Arc::new(shared), subscription)
    }

    /// Runs `f`, keeping its panic (the first one) for [`rethrow`](Shared::rethrow).
    pub(crate) fn guard(&self, f: impl FnOnce()) {
        if let Err(panic) = catch_unwind(AssertUnwindSafe(f)) {
            self.keep(panic);
        }
    }

    pub(crate) fn keep(&self, panic: Box<dyn Any + Send>) {
        let mut kept = self.panic.lock().unwrap_or_else(PoisonError::into_inner);
        kept.get_or_insert(panic);
    }

    pub(crate) fn rethrow(&self) {
        let kept = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(panic) = kept {
            resume_unwind(panic);
        }
    }

    /// Whether the control plane keeps changing the limits: until enough calls are done, or
    /// something failed.
    pub(crate) fn plane_continues(&self, setup: Setup, callers: u64) -> bool {
        let failed = self
            .panic
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .is_some();
        !failed && self.tally.done.load(Ordering::Acquire) < setup.plane_stops_after(callers)
    }

    /// The end-of-run invariants, once every caller finished and nothing is in flight.
    pub(crate) fn verify(&self, bulkhead: &LlmBulkhead, callers: u64, setup: Setup) {
        let (tally, heard) = (&self.tally, &self.heard);
        let stats = bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        let load = |counter: &AtomicU64| counter.load(Ordering::Relaxed);

        // Everything is back.
        assert_eq!(
            (stats.in_flight, stats.pending, tokens.in_flight_tokens),
            (0, 0, 0),
            "{stats:?}"
        );
        assert_eq!(load(&self.ledger.holders), 0);
        assert!(load(&self.ledger.peak) <= self.ledger.ceiling);

        // Every caller decided exactly once; every admission settled exactly once.
        let admitted = load(&tally.admitted);
        assert_eq!(stats.admitted, admitted, "admissions the callers saw");
        assert_eq!(stats.released, stats.admitted);
        assert_eq!(stats.admitted + stats.rejected, callers);
        assert!(stats.rejected >= load(&tally.refused));
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(stats.closed, setup.closes);
        if !setup.closes {
            assert_eq!(stats.rejected_by_reason.shutdown, 0);
        }

        // The listener heard every admission, report and release, consistently.
        if setup.listen {
            let books = heard.books.lock().unwrap();
            assert!(books.errors.is_empty(), "{:#?}", books.errors);
            assert!(
                books.open.is_empty(),
                "{} admissions never released",
                books.open.len()
            );
            assert_eq!(load(&heard.admits), admitted, "admit events");
            assert_eq!(load(&heard.releases), admitted, "release events");
            assert_eq!(
                load(&heard.usages),
                load(&tally.effective_reports),
                "usage events == effective reports"
            );
            assert_eq!(load(&heard.rejects), stats.rejected, "reject events");
            let traces = tally.traces.lock().unwrap();
            assert_eq!(books.closed.len(), traces.len());
            for (id, expected) in traces.iter() {
                assert_eq!(
                    books.closed.get(id),
                    Some(expected),
                    "admission {id}: heard vs. modelled"
                );
            }
        }

        // The token books, against the callers' models...
        let unused = load(&tally.unused_reserved);
        assert_eq!(tokens.total_reserved, load(&tally.reserved), "reserved");
        assert_eq!(tokens.total_consumed, load(&tally.consumed), "consumed");
        assert_eq!(tokens.total_overrun, load(&tally.overrun), "overrun");
        assert_eq!(
            tokens.total_refunded,
            load(&tally.refunded),
            "refunded (gross)"
        );
        assert_eq!(tokens.total_reheld, load(&tally.reheld), "re-held");
        assert_eq!(
            tokens.total_returned_unreported, unused,
            "returned unreported == the reservations of admissions settled without usage"
        );
        // ...and the identity over every admission, settled with usage or not.
        if setup.always_usage {
            assert_eq!(unused, 0, "every admission settled with usage");
        }
        assert_eq!(
            tokens.total_reserved + tokens.total_overrun + tokens.total_reheld,
            tokens.total_consumed + tokens.total_refunded + tokens.total_returned_unreported,
            "reserved + overrun + reheld == consumed + refunded + returned: {tokens:?}"
        );

        // The run did what it was meant to (not a vacuous pass).
        assert!(admitted > 0 && load(&tally.effective_reports) > 0);
        assert!(tokens.total_overrun > 0 && tokens.total_refunded > 0);
        assert!(!setup.listen || load(&heard.reconfigures) > 0);
    }
}
