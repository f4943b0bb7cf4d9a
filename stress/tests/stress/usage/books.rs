//! What the callers of one usage scenario share (the kit's scene, callers' book, ledger and
//! listener), how a refusal is booked, and the end-of-run invariants.

use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use async_bulkhead_llm::{AcquireError, RejectReason};

use super::Plane;
use crate::kit::books::{Book, Figures, Heard, Ledger, load};
use crate::kit::scene::{Scene, Setup};

/// Everything the callers of one scenario share.
pub(crate) struct Shared {
    pub(crate) setup: Setup<Plane>,
    pub(crate) scene: Scene,
    /// The callers' sums (tracing every admission when a listener hears them).
    pub(crate) book: Book,
    /// Admitted callers holding their permit, never above `Setup::ceiling`.
    pub(crate) ledger: Ledger,
    pub(crate) heard: Arc<Heard>,
    /// Calls made (each decided exactly once).
    pub(crate) calls: AtomicU64,
}

impl Deref for Shared {
    type Target = Scene;

    fn deref(&self) -> &Scene {
        &self.scene
    }
}

impl Shared {
    /// Counts a holder (right after its admission).
    pub(crate) fn enter(&self) {
        self.ledger.enter_within(self.setup.ceiling());
    }

    /// Uncounts a holder (before it settles).
    pub(crate) fn leave(&self) {
        self.ledger.leave(0);
    }

    /// A call the bulkhead refused (a capacity refusal, never for invalid input).
    pub(crate) fn refused(&self, error: AcquireError, closed_before: bool) {
        match error {
            AcquireError::Rejected(rejection) => {
                self.book.refused(rejection.reason(), closed_before);
            }
            AcquireError::Invalid(error) => panic!("valid input refused: {error}"),
            other => panic!("an error this test does not know: {other}"),
        }
    }

    /// The end-of-run invariants, once every caller finished and nothing is in flight.
    pub(crate) fn check_end(&self) {
        let (book, heard, setup) = (&self.book, &self.heard, self.setup);
        let stats = self.bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        let closes = setup.plane == Plane::Closes;

        // Everything is back.
        assert_eq!(
            (stats.in_flight, stats.pending, tokens.in_flight_tokens),
            (0, 0, 0),
            "{stats:?}"
        );
        self.ledger.check_empty(setup.ceiling());

        // Every call decided exactly once; every admission settled exactly once; the token
        // books against the callers' models, and the identity over every admission, settled
        // with usage or not.
        let calls = load(&self.calls);
        assert_eq!(
            stats.admitted + stats.rejected,
            calls,
            "every call decided once"
        );
        assert_eq!(load(&book.unpolled), 0, "every call was polled");
        book.check(&Figures::of(&stats), setup.always_usage, |what| {
            format!("{what}: {tokens:?}")
        });
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(stats.closed, closes);
        if !closes {
            assert_eq!(stats.rejected_by_reason.shutdown, 0);
        }

        // The listener heard every admission, report, refusal, limit change and release,
        // consistently.
        if setup.listen {
            heard.check_consistent();
            let h = heard.scope(0);
            let admitted = load(&book.admitted);
            assert_eq!(load(&h.admits), admitted, "admit events");
            assert_eq!(load(&h.releases), admitted, "release events");
            assert_eq!(
                load(&h.usages),
                load(&book.effective_reports),
                "usage events == effective reports"
            );
            let rejects: u64 = RejectReason::ALL.iter().map(|&r| h.rejects(r)).sum();
            assert_eq!(rejects, stats.rejected, "reject events");
            for &reason in RejectReason::ALL {
                assert_eq!(
                    h.rejects(reason),
                    stats.rejected_by_reason.get(reason),
                    "{reason} events"
                );
            }
            assert_eq!(
                load(&heard.reconfigures),
                load(&self.counts.limit_changes),
                "reconfigure events"
            );
            heard.check_traces([book]);
        }

        // The run did what it was meant to (not a vacuous pass).
        assert!(
            stats.admitted > 0 && load(&book.effective_reports) > 0,
            "admissions and reports: {stats:?}"
        );
        assert!(
            tokens.total_overrun > 0 && tokens.total_refunded > 0,
            "overruns and refunds: {tokens:?}"
        );
        assert!(
            !setup.listen || load(&heard.reconfigures) > 0,
            "limit changes heard"
        );
        if closes {
            assert!(load(&book.post_close_refused) > 0, "calls after the close");
        }
        println!(
            "usage seed {} {:?}: calls {calls}, admitted {}, refused {:?}, cancelled {}, \
             effective reports {}, limit changes {}, peak holders {}, tokens {tokens:?}",
            setup.seed,
            setup.plane,
            stats.admitted,
            stats.rejected_by_reason,
            load(&book.vanished),
            load(&book.effective_reports),
            load(&self.counts.limit_changes),
            self.ledger.peak(0),
        );
    }
}
