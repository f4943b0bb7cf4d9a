//! What the tasks of one chaos scenario share (the kit's scene, books, ledger and listener),
//! how a decided call is booked, and the end-of-run invariants.

use std::ops::Deref;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use async_bulkhead_llm::{AcquireError, RejectReason};

use super::Plane;
use crate::kit::books::{Book, Figures, Heard, Ledger, load};
use crate::kit::scene::{Scene, Setup};

/// Everything the tasks of one scenario share.
pub(crate) struct Shared {
    pub(crate) setup: Setup<Plane>,
    pub(crate) scene: Scene,
    /// The callers' sums (tracing every admission when a listener hears them).
    pub(crate) book: Book,
    /// Holders counted by the callers themselves, never above `max_concurrent` while it is
    /// fixed (`Setup::ceiling`).
    pub(crate) ledger: Ledger,
    pub(crate) heard: Arc<Heard>,
    /// Quiet points at which the token identity was checked (at least the end of the control
    /// plane).
    pub(crate) quiet_checks: AtomicU64,
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

    /// Books a decided call's result; returns the permit (counted in the ledger) if admitted.
    pub(crate) fn decided<P>(
        &self,
        result: Result<P, AcquireError>,
        closed_before: bool,
    ) -> Option<P> {
        match result {
            Ok(permit) => {
                self.book.admitted(closed_before);
                self.enter();
                Some(permit)
            }
            Err(AcquireError::Rejected(rejection)) => {
                self.book.refused(rejection.reason(), closed_before);
                None
            }
            Err(AcquireError::Invalid(error)) => panic!("valid input refused: {error}"),
            Err(other) => panic!("an error this test does not know: {other}"),
        }
    }

    /// The end-of-run invariants, once every task finished.
    pub(crate) fn check_end(&self) {
        let (book, setup) = (&self.book, self.setup);
        let stats = self.bulkhead.stats();
        let tokens = stats.token_budget.unwrap();

        // Everything is back.
        assert!(stats.closed);
        assert_eq!(
            (stats.in_flight, stats.pending, tokens.in_flight_tokens),
            (0, 0, 0),
            "{stats:?}"
        );
        self.ledger.check_empty(setup.ceiling());
        assert_eq!(stats.listener_panics, 0);

        // Every decided call counted exactly once, every admission settled exactly once, the
        // token books equal to the callers' models.
        book.check(&Figures::of(&stats), setup.always_usage, |what| {
            format!("{what}: {tokens:?}")
        });
        assert!(
            load(&self.quiet_checks) > 0,
            "the token identity was checked at a quiet point"
        );

        // The listener heard everything, consistently.
        let by = stats.rejected_by_reason;
        if setup.listen {
            let heard = &self.heard;
            heard.check_consistent();
            let h = heard.scope(0);
            assert_eq!(load(&h.admits), stats.admitted, "admit events");
            assert_eq!(load(&h.releases), stats.admitted, "release events");
            assert_eq!(load(&h.reserved), tokens.total_reserved);
            assert_eq!(
                load(&h.usages),
                load(&book.effective_reports),
                "usage events"
            );
            assert_eq!(
                load(&heard.reconfigures),
                load(&self.counts.limit_changes),
                "reconfigure events"
            );
            for &reason in RejectReason::ALL {
                assert_eq!(h.rejects(reason), by.get(reason), "{reason} events");
            }
            heard.check_traces([book]);
        }

        // Not a vacuous pass.
        assert!(stats.admitted > 0);
        assert!(load(&book.post_close_refused) > 0, "calls after the close");
        println!(
            "chaos seed {} {:?}: decided {}, admitted {}, refused {by:?}, cancelled {}, \
             unpolled {}, invalid {}, effective reports {}, limit changes {}, peak holders {}, \
             tokens {tokens:?}",
            setup.seed,
            setup.plane,
            load(&book.decided),
            stats.admitted,
            load(&book.vanished),
            load(&book.unpolled),
            load(&self.counts.invalid),
            load(&book.effective_reports),
            load(&self.counts.limit_changes),
            self.ledger.peak(0),
        );
    }
}
