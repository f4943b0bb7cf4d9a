//! Shared books: the callers' tallies, their ledger of holders, and what the listener heard.

use std::collections::HashSet;
use std::future::Future;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireError, LlmBulkhead, RejectReason, admission::AdmissionId, events::Event,
};

use super::runtime::{Rt, Setup, Task, Tasks};
use crate::caller_model::{Model, Settled};

fn reason_index(reason: RejectReason) -> usize {
    RejectReason::ALL.iter().position(|&r| r == reason).unwrap()
}

/// `reserved + overrun + reheld - refunded - consumed - returned_unreported`: the tokens in
/// flight at every quiet point (crate `TokenBudgetStats`), `None` once a total saturated.
pub(crate) fn token_balance(t: &async_bulkhead_llm::stats::TokenBudgetStats) -> Option<i128> {
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

/// The callers' own sums, compared with the bulkhead's statistics at the end.
#[derive(Default)]
pub(crate) struct Tally {
    /// Calls the bulkhead decided: returned a result, or were polled and then cancelled.
    pub(crate) decided: AtomicU64,
    pub(crate) admitted: AtomicU64,
    /// Refusals the callers saw, by reason.
    seen: [AtomicU64; 6],
    /// Calls polled (so decided) and cancelled before their result: each counted as a refusal
    /// (aborted, or whatever refused it before the caller gave up).
    vanished: AtomicU64,
    /// Acquire futures dropped before their first poll (decided nothing).
    unpolled: AtomicU64,
    /// Calls refused for invalid input (decided nothing).
    pub(crate) invalid: AtomicU64,
    /// Refusals (all `shutdown`) of calls that started after `close()` returned.
    post_close_refused: AtomicU64,
    pub(crate) effective_reports: AtomicU64,
    reserved: AtomicU64,
    /// Reservations of admissions settled without any usage (booked as returned unreported).
    unused_reserved: AtomicU64,
    consumed: AtomicU64,
    overrun: AtomicU64,
    refunded: AtomicU64,
    reheld: AtomicU64,
    /// Limit changes applied (each is a reconfigure event).
    pub(crate) limit_changes: AtomicU64,
    pub(crate) drains_started: AtomicU64,
    pub(crate) drains_resolved: AtomicU64,
    /// Quiet points at which the token identity was checked (at least the end of the control
    /// plane).
    pub(crate) quiet_checks: AtomicU64,
}

impl Tally {
    pub(crate) fn bump(counter: &AtomicU64) {
        counter.fetch_add(1, Ordering::Relaxed);
    }

    fn load(counter: &AtomicU64) -> u64 {
        counter.load(Ordering::Relaxed)
    }

    fn seen(&self, reason: RejectReason) -> u64 {
        Tally::load(&self.seen[reason_index(reason)])
    }

    /// Books a settled admission (the model already includes the settlement's move).
    pub(crate) fn settled(&self, model: &Model, settled: &Settled) {
        self.reserved.fetch_add(model.reserved(), Ordering::Relaxed);
        match settled.usage {
            Some(u) => self.consumed.fetch_add(u.total(), Ordering::Relaxed),
            None => self
                .unused_reserved
                .fetch_add(model.reserved(), Ordering::Relaxed),
        };
        self.overrun.fetch_add(model.overrun, Ordering::Relaxed);
        self.refunded.fetch_add(model.refunded, Ordering::Relaxed);
        self.reheld.fetch_add(model.reheld, Ordering::Relaxed);
    }
}

/// Holders counted by the callers themselves: a caller counts itself right after it got its
/// permit and uncounts itself before it settles, so the ledger never exceeds what the
/// bulkhead really holds.
#[derive(Default)]
pub(crate) struct Ledger {
    holders: AtomicU64,
    peak: AtomicU64,
}

/// What the listener heard.
#[derive(Default)]
pub(crate) struct Heard {
    admits: AtomicU64,
    releases: AtomicU64,
    usages: AtomicU64,
    reconfigures: AtomicU64,
    rejects: [AtomicU64; 6],
    reserved: AtomicU64,
    /// Admissions between their admit and release events, and inconsistencies seen.
    open: Mutex<(HashSet<AdmissionId>, Vec<String>)>,
}

impl Heard {
    pub(crate) fn hear(&self, event: &Event<'_>) {
        match event {
            Event::Admit(e) => {
                Tally::bump(&self.admits);
                self.reserved
                    .fetch_add(e.reserved_tokens, Ordering::Relaxed);
                let mut open = self.open.lock().unwrap();
                if !open.0.insert(e.admission_id) {
                    open.1
                        .push(format!("admission {} admitted twice", e.admission_id));
                }
            }
            Event::Release(e) => {
                Tally::bump(&self.releases);
                let mut open = self.open.lock().unwrap();
                if !open.0.remove(&e.admission_id) {
                    open.1.push(format!(
                        "release of {} outside its admission",
                        e.admission_id
                    ));
                }
            }
            Event::Usage(e) => {
                Tally::bump(&self.usages);
                let mut open = self.open.lock().unwrap();
                if !open.0.contains(&e.admission_id) {
                    open.1
                        .push(format!("usage of {} outside its admission", e.admission_id));
                }
            }
            Event::Reject(e) => Tally::bump(&self.rejects[reason_index(e.reason)]),
            Event::Reconfigure(_) => Tally::bump(&self.reconfigures),
            _ => {}
        }
    }
}

/// Everything the tasks of one scenario share.
pub(crate) struct Shared {
    pub(crate) setup: Setup,
    pub(crate) bulkhead: LlmBulkhead,
    pub(crate) rt: Rt,
    pub(crate) tally: Tally,
    pub(crate) ledger: Ledger,
    pub(crate) heard: Arc<Heard>,
    /// Set (Release) once `close()` returned: a call that sees it must be refused.
    pub(crate) closed: AtomicBool,
    /// The largest `max_queue` ever applied (raised before it is applied).
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

    pub(crate) fn enter(&self) {
        let holders = self.ledger.holders.fetch_add(1, Ordering::AcqRel) + 1;
        self.ledger.peak.fetch_max(holders, Ordering::Relaxed);
        assert!(
            holders <= self.setup.ceiling(),
            "{holders} holders at once, max_concurrent at most {}",
            self.setup.ceiling()
        );
    }

    pub(crate) fn leave(&self) {
        self.ledger.holders.fetch_sub(1, Ordering::AcqRel);
    }

    /// A refusal the caller saw.
    pub(crate) fn refused(&self, reason: RejectReason, closed_before: bool) {
        assert_ne!(
            reason,
            RejectReason::Aborted,
            "only a dropped call is aborted"
        );
        Tally::bump(&self.tally.seen[reason_index(reason)]);
        if closed_before {
            assert_eq!(reason, RejectReason::Shutdown, "refused after close()");
            Tally::bump(&self.tally.post_close_refused);
        }
    }

    /// Books a decided call's result; returns the permit (counted in the ledger) if admitted.
    pub(crate) fn decided<P>(
        &self,
        result: Result<P, AcquireError>,
        closed_before: bool,
    ) -> Option<P> {
        Tally::bump(&self.tally.decided);
        match result {
            Ok(permit) => {
                assert!(!closed_before, "admitted after close() returned");
                Tally::bump(&self.tally.admitted);
                self.enter();
                Some(permit)
            }
            Err(AcquireError::Rejected(rejection)) => {
                self.refused(rejection.reason(), closed_before);
                None
            }
            Err(AcquireError::Invalid(error)) => panic!("valid input refused: {error}"),
            Err(other) => panic!("an error this test does not know: {other}"),
        }
    }

    /// A call cancelled before its result.
    pub(crate) fn vanished(&self, polled: bool) {
        if polled {
            Tally::bump(&self.tally.decided);
            Tally::bump(&self.tally.vanished);
        } else {
            Tally::bump(&self.tally.unpolled);
        }
    }

    /// The end-of-run invariants, once every task finished.
    pub(crate) fn verify(&self) {
        let (tally, setup) = (&self.tally, self.setup);
        let load = Tally::load;
        let stats = self.bulkhead.stats();
        let tokens = stats.token_budget.unwrap();

        // Everything is back.
        assert!(stats.closed);
        assert_eq!(
            (stats.in_flight, stats.pending, tokens.in_flight_tokens),
            (0, 0, 0),
            "{stats:?}"
        );
        assert_eq!(load(&self.ledger.holders), 0);
        assert!(load(&self.ledger.peak) <= setup.ceiling());

        // Every decided call counted exactly once, every admission settled exactly once.
        assert_eq!(
            stats.admitted,
            load(&tally.admitted),
            "admissions the callers saw"
        );
        assert_eq!(stats.released, stats.admitted, "every admission released");
        assert_eq!(
            stats.admitted + stats.rejected,
            load(&tally.decided),
            "admitted + rejected == decided calls"
        );
        let by = stats.rejected_by_reason;
        let seen: u64 = RejectReason::ALL.iter().map(|&r| tally.seen(r)).sum();
        assert_eq!(
            stats.rejected,
            seen + load(&tally.vanished),
            "refusals: seen + cancelled after their first poll ({by:?})"
        );
        for &reason in RejectReason::ALL {
            assert!(
                by.get(reason) >= tally.seen(reason),
                "{reason}: {} counted, {} seen",
                by.get(reason),
                tally.seen(reason)
            );
        }
        assert!(by.aborted <= load(&tally.vanished));
        assert!(by.shutdown >= load(&tally.post_close_refused));
        assert_eq!(stats.listener_panics, 0);

        // The token books.
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
        // An admission settled without usage never moved its hold: its reservation went back.
        assert_eq!(
            tokens.total_returned_unreported, unused,
            "returned unreported == the reservations of admissions settled without usage"
        );
        if setup.always_usage {
            assert_eq!(unused, 0, "every admission settled with usage");
        }
        assert_eq!(
            tokens.total_reserved + tokens.total_overrun + tokens.total_reheld,
            tokens.total_consumed + tokens.total_refunded + tokens.total_returned_unreported,
            "reserved + overrun + reheld == consumed + refunded + returned: {tokens:?}"
        );

        // Every drain resolved.
        assert_eq!(load(&tally.drains_started), load(&tally.drains_resolved));
        assert!(
            load(&tally.quiet_checks) > 0,
            "the token identity was checked at a quiet point"
        );

        // The listener heard everything, consistently.
        if setup.listen {
            let heard = &self.heard;
            let open = heard.open.lock().unwrap();
            assert!(open.1.is_empty(), "{:#?}", open.1);
            assert!(
                open.0.is_empty(),
                "{} admissions never released",
                open.0.len()
            );
            assert_eq!(load(&heard.admits), stats.admitted, "admit events");
            assert_eq!(load(&heard.releases), stats.admitted, "release events");
            assert_eq!(load(&heard.reserved), tokens.total_reserved);
            assert_eq!(
                load(&heard.usages),
                load(&tally.effective_reports),
                "usage events"
            );
            assert_eq!(
                load(&heard.reconfigures),
                load(&tally.limit_changes),
                "reconfigure events"
            );
            for &reason in RejectReason::ALL {
                assert_eq!(
                    load(&heard.rejects[reason_index(reason)]),
                    by.get(reason),
                    "{reason} events"
                );
            }
        }

        // Not a vacuous pass.
        assert!(stats.admitted > 0);
        assert!(load(&tally.post_close_refused) > 0, "calls after the close");
        println!(
            "chaos seed {} {:?}: decided {}, admitted {}, refused {by:?}, cancelled {}, \
             unpolled {}, invalid {}, effective reports {}, limit changes {}, peak holders {}, \
             tokens {tokens:?}",
            setup.seed,
            setup.plane,
            load(&tally.decided),
            stats.admitted,
            load(&tally.vanished),
            load(&tally.unpolled),
            load(&tally.invalid),
            load(&tally.effective_reports),
            load(&tally.limit_changes),
            load(&self.ledger.peak),
        );
    }
}
