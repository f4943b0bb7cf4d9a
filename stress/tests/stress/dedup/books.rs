//! What a scenario varies, what its tasks share (the kit's scene, and the dedup records), and
//! the records the checks read: one per caller (what it asked, its role and flight, what it
//! got) and one per callback run.

use std::ops::Deref;
use std::sync::atomic::AtomicU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_bulkhead_llm::{
    RejectReason, Rejection, RunContext, TokenUsage, admission::AdmissionId, observe::Bypass,
    observe::ShadowReasons,
};

use super::heard::Heard;
use super::requests::Table;
use crate::kit::scene::{Scene, Setup};

/// What the control plane changes before it closes the bulkhead.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Plane {
    /// Nothing: the limits stay as built.
    Fixed,
    /// `max_concurrent` (1 to 3), `max_queue` (0 to 3) and the budget, at random.
    Varying,
}

/// Which refusals an observe-mode call bypasses. Both sets make a bypass's refusal counted
/// exactly when the admission itself made it (`raced`, or a queue timeout, which the advisory
/// check never predicts): with every reason, the advisory check refuses only `shutdown`
/// outside the set, which the admission refuses too; with `timeout` alone, only a queue
/// timeout is bypassed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Observe {
    All,
    TimeoutOnly,
}

impl Observe {
    pub(crate) fn reasons(self) -> ShadowReasons {
        match self {
            Observe::All => ShadowReasons::ALL,
            Observe::TimeoutOnly => ShadowReasons::new([RejectReason::Timeout]).unwrap(),
        }
    }
}

/// How a caller ends its call early, if at all.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Cancel {
    Never,
    /// Dropped before its first poll.
    Unpolled,
    /// Dropped after this many polls that returned `Pending`.
    AfterPolls(u32),
    /// Dropped when this delay passes (if it has not finished).
    After(Duration),
}

/// What every callback returns, as its value or as its error: which run produced it, whose
/// callback it was, and the request's identity and scope.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Reply {
    pub(crate) run: usize,
    pub(crate) owner: u32,
    pub(crate) identity: usize,
    pub(crate) scope: usize,
}

/// A caller's role, as the dedup event of its registration said.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Role {
    /// `no_dedup`: neither joins nor leads.
    Solo,
    /// Led a flight (after the close: ran on its own, which no caller can tell apart).
    Leader,
    /// Joined a flight in flight, as its `followers`-th follower.
    Follower { followers: u64 },
}

/// What a caller got.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Got {
    Value(Reply),
    Failed(Reply),
    Rejected(Rejection),
}

/// One caller: what it asked, how it went, what it got.
#[derive(Clone, Debug)]
pub(crate) struct CallerRecord {
    pub(crate) id: u32,
    pub(crate) identity: usize,
    pub(crate) form: usize,
    pub(crate) scope: usize,
    pub(crate) dedup: bool,
    pub(crate) observe: Option<Observe>,
    pub(crate) timeout: Option<Duration>,
    pub(crate) cancel: Cancel,
    /// `close()` had returned before the call was made.
    pub(crate) closed_before: bool,
    pub(crate) role: Role,
    /// Its flight: the leader's for a follower; its own otherwise.
    pub(crate) flight: u32,
    pub(crate) polls: u32,
    /// The action that dropped its future (see `heard`): its cancellation, if it had no
    /// outcome by then.
    pub(crate) drop_action: u32,
    /// `None`: cancelled before an outcome.
    pub(crate) got: Option<Got>,
    /// From the call to its outcome.
    pub(crate) waited: Option<Duration>,
}

/// One callback run.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RunRecord {
    pub(crate) owner: u32,
    pub(crate) identity: usize,
    pub(crate) scope: usize,
    /// The caller whose poll started it.
    pub(crate) driver: Option<u32>,
    /// Its admission id and reserved tokens, if admitted.
    pub(crate) admission: Option<(AdmissionId, u64)>,
    pub(crate) bypass: Option<Bypass>,
    /// The last usage it reported (every report grows both fields).
    pub(crate) usage: Option<TokenUsage>,
    pub(crate) reports: u64,
}

/// Everything the tasks of one scenario share.
pub(crate) struct Shared {
    pub(crate) setup: Setup<Plane>,
    pub(crate) scene: Scene,
    /// The scenario's tag for the thread-local actor (see `heard`).
    pub(crate) scenario: u64,
    pub(crate) table: Table,
    /// Per (identity, scope) key: the flight its last leader registered. Calls with
    /// deduplication are made under their key's lock, so a follower's flight is this one.
    pub(crate) keys: Vec<Mutex<u32>>,
    pub(crate) next_caller: AtomicU32,
    pub(crate) next_flight: AtomicU32,
    pub(crate) callers: Mutex<Vec<CallerRecord>>,
    pub(crate) runs: Mutex<Vec<RunRecord>>,
    pub(crate) heard: Arc<Heard>,
}

impl Deref for Shared {
    type Target = Scene;

    fn deref(&self) -> &Scene {
        &self.scene
    }
}

impl Shared {
    /// Records the start of a callback run of `owner`'s callback, checking its context.
    pub(crate) fn start_run(
        &self,
        owner: u32,
        identity: usize,
        scope: usize,
        ctx: &RunContext<'static>,
    ) -> usize {
        let driver = super::heard::current()
            .filter(|who| who.scenario == self.scenario)
            .map(|who| who.caller);
        let bypass = ctx.bypass();
        let admission = ctx.admission_id().map(|id| {
            let reserved = ctx
                .reservation()
                .expect("a budget: admissions reserve")
                .reserved();
            assert_eq!(
                ctx.held_tokens(),
                reserved,
                "a fresh admission holds its reservation"
            );
            assert!(ctx.holds_slot());
            (id, reserved)
        });
        match bypass {
            Some(b) => {
                assert!(admission.is_none(), "admitted and bypassed: {ctx:?}");
                assert_eq!((ctx.held_tokens(), ctx.holds_slot()), (0, false), "{ctx:?}");
                assert_eq!(ctx.reservation(), b.reservation);
            }
            None => assert!(
                admission.is_some(),
                "neither admitted nor bypassed: {ctx:?}"
            ),
        }
        let mut runs = self.runs.lock().unwrap();
        runs.push(RunRecord {
            owner,
            identity,
            scope,
            driver,
            admission,
            bypass,
            usage: None,
            reports: 0,
        });
        runs.len() - 1
    }

    /// Run `run` reported `usage` (an effective report: it grew).
    pub(crate) fn reported(&self, run: usize, usage: TokenUsage) {
        let mut runs = self.runs.lock().unwrap();
        runs[run].usage = Some(usage);
        runs[run].reports += 1;
    }
}
