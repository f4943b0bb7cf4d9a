//! The checks of a refusal's detail, and the end-of-run invariants.

use async_bulkhead_llm::{RejectReason, Rejection};

use super::books::{Call, MAX_CLASSES, Own, Shared};
use crate::kit::books::{Figures, load};

impl Shared {
    /// A refusal's detail against the limits of its revision, the snapshot's own figures and,
    /// for `solo`, the book.
    pub(crate) fn check_detail(&self, rejection: &Rejection, call: Call) {
        let (reason, d) = (rejection.reason(), rejection.detail());
        let c = call.class;
        let caps = self.revisions.get(d.limit_revision);
        let context = || format!("{reason} for class {c} ({call:?}): {d:#?} under {caps:?}");
        let tb = d.token_budget.expect("a budget");
        assert_eq!(d.max_concurrent, caps.max_concurrent, "{}", context());
        assert_eq!(tb.budget, caps.budget, "{}", context());
        match reason {
            RejectReason::Shutdown => assert_eq!(d.constraint, None, "{}", context()),
            _ => assert!(d.constraint.is_some(), "{}", context()),
        }
        let Some(cd) = d.admission_class() else {
            assert!(
                matches!(reason, RejectReason::Shutdown | RejectReason::Timeout),
                "a capacity refusal carries its class: {}",
                context()
            );
            return;
        };
        let ct = cd.token_budget.expect("a budget");
        let sc = d.shared_capacity().expect("classes: the shared pool");
        let st = sc.token_budget.expect("a budget");
        assert_eq!(cd.class, self.handles[c], "{}", context());
        assert_eq!(
            (cd.protected_concurrent, cd.max_concurrent),
            (caps.floor(c), caps.ceiling(c)),
            "{}",
            context()
        );
        assert_eq!(
            (ct.protected_in_flight_tokens, ct.max_in_flight_tokens),
            (caps.token_floor(c), caps.token_ceiling(c)),
            "{}",
            context()
        );
        assert_eq!(ct.requested, tb.requested, "{}", context());
        assert_eq!(
            sc.concurrency.capacity,
            caps.shared_slots(),
            "{}",
            context()
        );
        assert_eq!(
            st.capacity,
            caps.shared_tokens(call.priority),
            "{}",
            context()
        );
        let requested = tb.requested;
        let borrows_slot = cd.in_flight >= caps.floor(c);
        let borrows_tokens =
            requested.saturating_sub(caps.token_floor(c).saturating_sub(ct.in_flight_tokens));
        assert_eq!(
            (sc.concurrency.requested_borrowed, st.requested_borrowed),
            (u64::from(borrows_slot), borrows_tokens),
            "what the call borrows: {}",
            context()
        );
        if c == self.solo {
            let book = *self.solo_book.lock().unwrap();
            assert_eq!(
                Own {
                    slots: cd.in_flight,
                    tokens: ct.in_flight_tokens
                },
                book,
                "the solo book: {}",
                context()
            );
        }
        let tokens_fit = ct
            .max_in_flight_tokens
            .is_none_or(|max| ct.in_flight_tokens + requested <= max);
        let slots_fit = cd.max_concurrent.is_none_or(|max| cd.in_flight < max);
        let shared_slot_short = borrows_slot
            && caps.floors() > 0
            && sc.concurrency.in_use + 1 > sc.concurrency.capacity;
        let shared_tokens_short = borrows_tokens > 0
            && caps.token_floors() > 0
            && st.in_use + borrows_tokens > st.capacity;
        let budget_short = tb.in_flight_tokens + requested > tb.effective_budget;
        use RejectReason::{BudgetLimit, ConcurrencyLimit, QueueLimit};
        use async_bulkhead_llm::rejection::Constraint::{
            AdmissionClass, AdmissionClassProtection, Global,
        };
        let consistent = match (reason, d.constraint) {
            (BudgetLimit, Some(Global)) => budget_short,
            (BudgetLimit, Some(AdmissionClass)) => !tokens_fit,
            (ConcurrencyLimit, Some(AdmissionClass)) => tokens_fit && !slots_fit,
            (ConcurrencyLimit, Some(AdmissionClassProtection)) => {
                tokens_fit && slots_fit && shared_slot_short
            }
            (BudgetLimit, Some(AdmissionClassProtection)) => {
                tokens_fit && slots_fit && !shared_slot_short && shared_tokens_short
            }
            (ConcurrencyLimit | QueueLimit, Some(Global)) => {
                !budget_short
                    && tokens_fit
                    && slots_fit
                    && !shared_slot_short
                    && !shared_tokens_short
            }
            (ConcurrencyLimit | BudgetLimit | QueueLimit, constraint) => {
                panic!("{reason} bound by {constraint:?}: {}", context())
            }
            _ => true,
        };
        assert!(
            consistent,
            "a detail at odds with its constraint: {}",
            context()
        );
    }

    /// The end-of-run invariants, once every task finished.
    pub(crate) fn check_end(&self) {
        let setup = self.setup;
        let stats = self.bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        let classes = stats.admission_classes.clone().unwrap();
        let shared = classes.shared;

        // Everything is back.
        assert!(stats.closed);
        assert_eq!(
            (
                stats.in_flight,
                stats.abandoned_in_flight,
                stats.pending,
                tokens.in_flight_tokens
            ),
            (0, 0, 0, 0),
            "{stats:?}"
        );
        assert_eq!(
            (
                shared.in_flight,
                shared.token_budget.unwrap().in_flight_tokens
            ),
            (0, 0),
            "the shared pool: {shared:?}"
        );
        assert_eq!(self.ledger.read(), [0; MAX_CLASSES], "the ledger");
        assert_eq!(
            *self.solo_book.lock().unwrap(),
            Own::default(),
            "the solo book"
        );
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(classes.classes.len(), self.handles.len());
        assert_eq!(classes.default_class, self.handles[self.default]);

        // Each class against its callers' books, and the classes against the globals.
        let mut sums = [0u64; 12];
        let mut rejected_sum = [0u64; RejectReason::ALL.len()];
        for (c, s) in classes.classes.iter().enumerate() {
            let book = self.book(c);
            let at = |what: &str| format!("class {c} ({}): {what}: {s:#?}", s.class);
            assert_eq!(s.class, self.handles[c]);
            assert_eq!(
                (s.in_flight, s.in_flight_tokens),
                (0, 0),
                "{}",
                at("in flight")
            );
            book.check(&Figures::of_class(s), setup.always_usage, at);
            let by = s.rejected_by_reason;
            assert_eq!(
                (
                    s.total_borrowed_admissions,
                    s.total_borrowed_tokens_reserved
                ),
                (load(&book.borrowed_admissions), load(&book.borrowed_tokens)),
                "{}",
                at("borrowed admissions and tokens")
            );
            let abandoned = s.borrowed_concurrency_abandoned_by_cause;
            assert_eq!(
                (abandoned.manual, abandoned.deadline),
                (load(&book.abandoned_manual), load(&book.abandoned_deadline)),
                "{}",
                at("abandonments by cause")
            );
            assert_eq!(s.borrowed_concurrency_abandoned, abandoned.total());
            assert!(s.total_borrowed_admissions <= s.admitted);
            assert!(s.borrowed_concurrency_abandoned <= s.total_borrowed_admissions);
            for (sum, v) in sums.iter_mut().zip([
                s.admitted,
                s.released,
                s.rejected,
                s.total_reserved,
                s.total_consumed,
                s.total_refunded,
                s.total_overrun,
                s.total_reheld,
                s.total_returned_unreported,
                abandoned.manual,
                abandoned.deadline,
                s.borrowed_concurrency_abandoned,
            ]) {
                *sum += v;
            }
            for (sum, &reason) in rejected_sum.iter_mut().zip(RejectReason::ALL) {
                *sum += by.get(reason);
            }
        }
        let by_cause = stats.borrowed_concurrency_abandoned_by_cause;
        assert_eq!(
            sums,
            [
                stats.admitted,
                stats.released,
                stats.rejected,
                tokens.total_reserved,
                tokens.total_consumed,
                tokens.total_refunded,
                tokens.total_overrun,
                tokens.total_reheld,
                tokens.total_returned_unreported,
                by_cause.manual,
                by_cause.deadline,
                stats.borrowed_concurrency_abandoned,
            ],
            "the classes sum to the globals: {stats:#?}"
        );
        let by = stats.rejected_by_reason;
        let global_by: Vec<u64> = RejectReason::ALL.iter().map(|&r| by.get(r)).collect();
        assert_eq!(rejected_sum.to_vec(), global_by, "refusals by reason");

        // The listener heard everything, class by class.
        if setup.listen {
            let heard = &self.heard;
            heard.check_consistent();
            for (c, s) in classes.classes.iter().enumerate() {
                let h = heard.scope(c);
                let by = s.rejected_by_reason;
                let abandoned = s.borrowed_concurrency_abandoned_by_cause;
                assert_eq!(
                    [
                        load(&h.admits),
                        load(&h.releases),
                        load(&h.usages),
                        load(&h.reserved),
                        load(&h.borrowed_admissions),
                        load(&h.borrowed_tokens),
                        load(&h.abandons[0]),
                        load(&h.abandons[1]),
                    ],
                    [
                        s.admitted,
                        s.released,
                        load(&self.book(c).effective_reports),
                        s.total_reserved,
                        s.total_borrowed_admissions,
                        s.total_borrowed_tokens_reserved,
                        abandoned.manual,
                        abandoned.deadline,
                    ],
                    "class {c}: events (admit, release, usage, reserved, borrowed admissions, \
                     borrowed tokens, manual and deadline abandons)"
                );
                for &reason in RejectReason::ALL {
                    assert_eq!(
                        h.rejects(reason),
                        by.get(reason),
                        "class {c}: {reason} events"
                    );
                }
            }
            assert_eq!(
                load(&heard.reconfigures),
                load(&self.counts.limit_changes),
                "reconfigure events"
            );
            heard.check_traces(self.classes.iter().map(|b| &b.calls));
        }

        let kept: u64 = self.classes.iter().map(|b| load(&b.deadline_kept)).sum();
        let per_class: Vec<_> = classes
            .classes
            .iter()
            .map(|s| {
                let a = s.borrowed_concurrency_abandoned_by_cause;
                format!(
                    "{} {:?}: admitted {} (borrowed {}), refused {}, abandoned {}+{}",
                    s.class,
                    s.limits,
                    s.admitted,
                    s.total_borrowed_admissions,
                    s.rejected,
                    a.manual,
                    a.deadline
                )
            })
            .collect();
        println!(
            "classes seed {} {:?}: default {}, {per_class:#?}, refused {by:?}, deadline runs \
             kept {kept}, unpolled {}, invalid {}, limit changes {} (refused {}), ledger peaks \
             {:?} / {}, tokens {tokens:?}",
            setup.seed,
            setup.plane,
            self.handles[self.default],
            self.classes.iter().map(|b| load(&b.unpolled)).sum::<u64>(),
            load(&self.counts.invalid),
            load(&self.counts.limit_changes),
            load(&self.refused_snapshots),
            (0..self.handles.len())
                .map(|c| self.ledger.peak(c))
                .collect::<Vec<_>>(),
            self.ledger.peak_total(),
        );
        // Not a vacuous pass.
        assert!(stats.admitted > 0);
        let post_close: u64 = self
            .classes
            .iter()
            .map(|b| load(&b.post_close_refused))
            .sum();
        assert!(post_close > 0, "calls after the close");
    }
}
