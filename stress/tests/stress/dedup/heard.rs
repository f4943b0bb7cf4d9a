//! Who acted when the bulkhead spoke: each creation, poll and drop of a caller's future runs
//! with the caller named in a thread-local, and the listener notes every event with the
//! caller (and its action) on whose thread it was emitted. A caller's role is the dedup event
//! emitted while `run_shared` registered it (its action 0).

use std::cell::Cell;
use std::sync::Mutex;

use async_bulkhead_llm::{RejectReason, admission::AdmissionId, events::Event, observe::ShadowId};

thread_local! {
    static ACTING: Cell<Option<Acting>> = const { Cell::new(None) };
    /// `DedupEvent::followers` of the call this thread is making, if it joined one.
    static JOINED: Cell<Option<u64>> = const { Cell::new(None) };
}

/// A caller acting: its action 0 is the `run_shared` call itself, then one per poll or drop.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Acting {
    /// Which scenario (several run at once on shared executors).
    pub(crate) scenario: u64,
    pub(crate) caller: u32,
    pub(crate) action: u32,
}

/// Runs `f` as `who` (the previous actor is restored after, even if `f` panics).
pub(crate) fn acting<R>(who: Acting, f: impl FnOnce() -> R) -> R {
    struct Restore(Option<Acting>);
    impl Drop for Restore {
        fn drop(&mut self) {
            ACTING.set(self.0);
        }
    }
    let _restore = Restore(ACTING.replace(Some(who)));
    f()
}

/// Who acts on this thread now.
pub(crate) fn current() -> Option<Acting> {
    ACTING.get()
}

/// Forgets the last join noted on this thread.
pub(crate) fn clear_joined() {
    JOINED.set(None);
}

/// The `followers` of the dedup event emitted while this thread's last `run_shared` call
/// registered, if it joined a call in flight.
pub(crate) fn take_joined() -> Option<u64> {
    JOINED.take()
}

/// What an event said (the kinds the checks use).
#[derive(Clone, Copy, Debug)]
pub(crate) enum What {
    /// A refusal; `untimed`: both durations zero (a follower's own wait, a bypass refused by
    /// a hard check, which no decision timed, or in observe mode a refusal the call bypasses
    /// as a race); `undecided`: its snapshot asks for no tokens, as a refusal no decision made
    /// (a follower's own wait) does, while every call here reserves some (the estimator sizes
    /// a prompt and an output cap).
    Reject {
        reason: RejectReason,
        untimed: bool,
        undecided: bool,
    },
    Dedup {
        followers: u64,
        classless: bool,
    },
    Admit(AdmissionId),
    Release(AdmissionId),
    Bypass {
        shadow: ShadowId,
        reason: RejectReason,
        raced: bool,
        detail: bool,
    },
    BypassUsage(ShadowId),
    BypassRelease(ShadowId),
}

/// One event, and who acted when it was emitted (`None`: nobody of this scenario).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Note {
    pub(crate) by: Option<(u32, u32)>,
    pub(crate) what: What,
}

/// Every event of one scenario's bulkhead, in the order they were emitted (per thread).
pub(crate) struct Heard {
    scenario: u64,
    pub(crate) notes: Mutex<Vec<Note>>,
}

impl Heard {
    pub(crate) fn new(scenario: u64) -> Heard {
        Heard {
            scenario,
            notes: Mutex::new(Vec::new()),
        }
    }

    pub(crate) fn hear(&self, event: &Event<'_>) {
        let what = match event {
            Event::Reject(e) => What::Reject {
                reason: e.reason,
                untimed: e.decision_duration.is_zero() && e.queue_wait.is_zero(),
                undecided: e.detail.token_budget.is_some_and(|t| t.requested == 0),
            },
            Event::Dedup(e) => What::Dedup {
                followers: e.followers,
                classless: e.class.is_none(),
            },
            Event::Admit(e) => What::Admit(e.admission_id),
            Event::Release(e) => What::Release(e.admission_id),
            Event::Bypass(e) => What::Bypass {
                shadow: e.shadow_id,
                reason: e.reason,
                raced: e.raced,
                detail: e.detail.is_some(),
            },
            Event::BypassUsage(e) => What::BypassUsage(e.shadow_id),
            Event::BypassRelease(e) => What::BypassRelease(e.shadow_id),
            _ => return,
        };
        let by = current()
            .filter(|who| who.scenario == self.scenario)
            .map(|who| (who.caller, who.action));
        if let (What::Dedup { followers, .. }, Some((_, 0))) = (what, by) {
            JOINED.set(Some(followers));
        }
        self.notes.lock().unwrap().push(Note { by, what });
    }
}
