//! The end-of-run invariants: flights rebuilt from the callers' records, every outcome traced
//! to the callback that produced it, and every refusal, admission and bypass accounted for.

use std::collections::HashMap;

use async_bulkhead_llm::RejectReason;

use super::books::{CallerRecord, Cancel, Got, Role, RunRecord, Shared};
use super::heard::What;
use crate::kit::books::{load, reason_index};

/// One flight (or solo call) as its callers saw it.
#[derive(Default)]
struct Flight {
    /// Its leader (or the solo caller).
    leader: Option<u32>,
    /// `(followers, caller)` of each follower.
    followers: Vec<(u64, u32)>,
}

/// The refusals counted in one caller's hands, split into its own (a follower's own timeout,
/// its cancellation, the `shutdown` of its own bypass after that timeout) and its flight's.
#[derive(Default)]
struct Refusals {
    own: Vec<RejectReason>,
    flight: Vec<RejectReason>,
}

impl Shared {
    /// The end-of-run invariants, once every task finished.
    pub(crate) fn check_end(&self) {
        let stats = self.bulkhead.stats();
        let tokens = stats.token_budget.unwrap();
        let dedup = stats.deduplication.unwrap();
        let observe = stats.observe.unwrap_or_default();
        let mut callers = std::mem::take(&mut *self.callers.lock().unwrap());
        callers.sort_unstable_by_key(|c| c.id);
        let runs = self.runs.lock().unwrap().clone();
        let notes = self.heard.notes.lock().unwrap().clone();
        assert_eq!(
            callers.len(),
            self.next_caller.load(std::sync::atomic::Ordering::Relaxed) as usize,
            "every call was driven and recorded"
        );
        assert!(callers.iter().enumerate().all(|(i, c)| c.id as usize == i));
        let caller = |id: u32| &callers[id as usize];

        // Nothing left behind.
        assert!(stats.closed);
        assert_eq!(
            (
                stats.in_flight,
                stats.abandoned_in_flight,
                stats.pending,
                tokens.in_flight_tokens,
                dedup.active
            ),
            (0, 0, 0, 0, 0),
            "in flight, abandoned, pending, tokens in flight, shared calls: {stats:#?}"
        );
        assert_eq!(stats.listener_panics, 0);
        assert_eq!(dedup.key_panics, 0);

        // Every caller: one outcome unless cancelled.
        for c in &callers {
            match c.cancel {
                Cancel::Never => assert!(c.got.is_some(), "no outcome: {c:?}"),
                Cancel::Unpolled => assert!(c.polls == 0 && c.got.is_none(), "{c:?}"),
                Cancel::AfterPolls(_) | Cancel::After(_) => {}
            }
            if c.closed_before {
                assert!(
                    !matches!(c.role, Role::Follower { .. }),
                    "joined after close: {c:?}"
                );
            }
        }

        // The flights, rebuilt from the roles; each has one leader and followers 1, 2, ...
        let mut flights: HashMap<u32, Flight> = HashMap::new();
        for c in &callers {
            let flight = flights.entry(c.flight).or_default();
            match c.role {
                Role::Solo | Role::Leader => {
                    assert!(
                        flight.leader.is_none(),
                        "two leaders of flight {}",
                        c.flight
                    );
                    flight.leader = Some(c.id);
                }
                Role::Follower { followers } => flight.followers.push((followers, c.id)),
            }
        }
        let mut hits = 0;
        for (id, flight) in &mut flights {
            let leader = caller(flight.leader.expect("a followed flight has a leader"));
            flight.followers.sort_unstable();
            for (n, &(followers, f)) in flight.followers.iter().enumerate() {
                let f = caller(f);
                assert_eq!(
                    followers,
                    n as u64 + 1,
                    "joins of flight {id}: {:?}",
                    flight.followers
                );
                assert_eq!(leader.role, Role::Leader, "{leader:?} followed by {f:?}");
                assert!(f.dedup && !f.closed_before, "{f:?}");
                assert_eq!(
                    (f.identity, f.scope),
                    (leader.identity, leader.scope),
                    "a follower of another request or scope: {f:?} of {leader:?}"
                );
                hits += 1;
            }
        }

        // Events: all in some caller's hands (any waiter drives a shared call, nothing runs it
        // in the background); the dedup events are the followers'.
        let mut by_caller: Vec<Vec<(u32, What)>> = vec![Vec::new(); callers.len()];
        let mut heard_dedup = 0;
        for note in &notes {
            let (who, action) = note
                .by
                .unwrap_or_else(|| panic!("emitted outside every caller's poll or drop: {note:?}"));
            by_caller[who as usize].push((action, note.what));
            if let What::Dedup {
                followers,
                classless,
            } = note.what
            {
                heard_dedup += 1;
                assert!(classless && followers > 0, "{note:?}");
            }
        }
        for c in &callers {
            let joins: Vec<u64> = by_caller[c.id as usize]
                .iter()
                .filter_map(|&(action, what)| match what {
                    What::Dedup { followers, .. } => {
                        assert_eq!(action, 0, "a join outside the call: {c:?}");
                        Some(followers)
                    }
                    _ => None,
                })
                .collect();
            let expected: Vec<u64> = match c.role {
                Role::Follower { followers } => vec![followers],
                Role::Solo | Role::Leader => Vec::new(),
            };
            assert_eq!(joins, expected, "dedup events of {c:?}");
        }
        assert_eq!((dedup.hits, heard_dedup), (hits, hits), "hits");

        // Runs: one per callback at most, started in the hands of one of its flight's waiters.
        let mut owned: HashMap<u32, usize> = HashMap::new();
        for (run, r) in runs.iter().enumerate() {
            assert!(
                owned.insert(r.owner, run).is_none(),
                "two runs of one callback: {r:?}"
            );
            let owner = caller(r.owner);
            assert_eq!((r.identity, r.scope), (owner.identity, owner.scope));
            let driver = r.driver.expect("a callback runs in a caller's poll");
            match owner.role {
                Role::Follower { .. } => {
                    // Only its own bypass after its own timeout.
                    let b = r
                        .bypass
                        .unwrap_or_else(|| panic!("a follower admitted: {r:?}"));
                    assert_eq!(
                        (b.reason, b.detail, b.raced),
                        (RejectReason::Timeout, None, false),
                        "{r:?} of {owner:?}"
                    );
                    assert!(
                        owner.observe.is_some() && owner.timeout.is_some(),
                        "{owner:?}"
                    );
                    assert_eq!(driver, owner.id, "its own bypass runs in its own poll");
                }
                Role::Solo | Role::Leader => {
                    let flight = &flights[&owner.flight];
                    assert!(
                        driver == owner.id || flight.followers.iter().any(|&(_, f)| f == driver),
                        "{r:?} driven by caller {driver}, not a waiter of its flight"
                    );
                    if let Some(b) = r.bypass {
                        assert!(owner.observe.is_some(), "{owner:?}");
                        assert!(b.detail.is_some(), "{r:?}");
                    }
                }
            }
        }

        // Admissions: the admitted runs, their events, and the token books.
        let admitted: Vec<&RunRecord> = runs.iter().filter(|r| r.admission.is_some()).collect();
        let bypassed: Vec<&RunRecord> = runs.iter().filter(|r| r.bypass.is_some()).collect();
        assert_eq!(
            runs.len() as u64,
            stats.admitted + observe.bypassed,
            "callbacks run == admitted + bypassed"
        );
        assert_eq!(
            (admitted.len() as u64, stats.released),
            (stats.admitted, stats.admitted),
            "admitted runs, released"
        );
        let mut run_ids: Vec<_> = admitted.iter().map(|r| r.admission.unwrap().0).collect();
        run_ids.sort_unstable();
        for kind in ["admit", "release"] {
            let mut ids: Vec<_> = notes
                .iter()
                .filter_map(|n| match (kind, n.what) {
                    ("admit", What::Admit(id)) | ("release", What::Release(id)) => Some(id),
                    _ => None,
                })
                .collect();
            ids.sort_unstable();
            assert_eq!(ids, run_ids, "{kind} events against the admitted runs");
        }
        let reserved: u64 = admitted.iter().map(|r| r.admission.unwrap().1).sum();
        let consumed: u64 = admitted
            .iter()
            .filter_map(|r| r.usage)
            .map(|u| u.total())
            .sum();
        assert_eq!(
            (tokens.total_reserved, tokens.total_consumed),
            (reserved, consumed),
            "token books against the admitted runs"
        );

        // Bypasses: the bypassed runs, their events, and the observe figures.
        let mut by_reason = [0u64; RejectReason::ALL.len()];
        for r in &bypassed {
            by_reason[reason_index(r.bypass.unwrap().reason)] += 1;
        }
        let figures: Vec<u64> = RejectReason::ALL
            .iter()
            .map(|&r| observe.bypassed_by_reason.get(r))
            .collect();
        assert_eq!(figures, by_reason.to_vec(), "bypasses by reason");
        let raced = bypassed.iter().filter(|r| r.bypass.unwrap().raced).count() as u64;
        assert_eq!(observe.race_bypassed, raced);
        let mut shadows: Vec<_> = bypassed
            .iter()
            .map(|r| {
                let b = r.bypass.unwrap();
                (b.shadow_id, b.reason, b.raced, b.detail.is_some())
            })
            .collect();
        shadows.sort_unstable_by_key(|s| s.0);
        let mut heard: Vec<_> = notes
            .iter()
            .filter_map(|n| match n.what {
                What::Bypass {
                    shadow,
                    reason,
                    raced,
                    detail,
                } => Some((shadow, reason, raced, detail)),
                _ => None,
            })
            .collect();
        heard.sort_unstable_by_key(|s| s.0);
        assert_eq!(heard, shadows, "bypass events against the bypassed runs");
        let mut released: Vec<_> = notes
            .iter()
            .filter_map(|n| match n.what {
                What::BypassRelease(shadow) => Some(shadow),
                _ => None,
            })
            .collect();
        released.sort_unstable();
        let ids: Vec<_> = shadows.iter().map(|s| s.0).collect();
        assert_eq!(released, ids, "bypass release events");
        let mut usage_events: HashMap<_, u64> = HashMap::new();
        for note in &notes {
            if let What::BypassUsage(shadow) = note.what {
                *usage_events.entry(shadow).or_default() += 1;
            }
        }
        let reports: HashMap<_, u64> = bypassed
            .iter()
            .filter(|r| r.reports > 0)
            .map(|r| (r.bypass.unwrap().shadow_id, r.reports))
            .collect();
        assert_eq!(usage_events, reports, "bypass usage events per bypass");
        let usages: Vec<_> = bypassed.iter().filter_map(|r| r.usage).collect();
        assert_eq!(
            (
                observe.usage_reported,
                observe.total_input_tokens,
                observe.total_output_tokens
            ),
            (
                usages.len() as u64,
                usages.iter().map(|u| u.input()).sum(),
                usages.iter().map(|u| u.output()).sum()
            ),
            "observe usage figures against the bypassed runs' reports"
        );

        // Refusals, in whose hands they were counted.
        let refusals: Vec<Refusals> = callers
            .iter()
            .map(|c| split(c, &by_caller[c.id as usize]))
            .collect();
        let mut counted = [0u64; RejectReason::ALL.len()];
        for r in &refusals {
            for &reason in r.own.iter().chain(&r.flight) {
                counted[reason_index(reason)] += 1;
            }
        }
        let figures: Vec<u64> = RejectReason::ALL
            .iter()
            .map(|&r| stats.rejected_by_reason.get(r))
            .collect();
        assert_eq!(
            figures,
            counted.to_vec(),
            "refusals by reason against the events"
        );
        assert_eq!(stats.rejected, counted.iter().sum::<u64>());

        // Each caller's own refusals.
        let mut own_timeouts = 0;
        let mut own_doubles = 0;
        let mut aborts = 0;
        for c in &callers {
            let own = &refusals[c.id as usize].own;
            let count = |reason| own.iter().filter(|&&r| r == reason).count();
            let (timeouts, aborted, shutdowns) = (
                count(RejectReason::Timeout),
                count(RejectReason::Aborted),
                count(RejectReason::Shutdown),
            );
            own_timeouts += timeouts;
            aborts += aborted;
            own_doubles += shutdowns;
            if !matches!(c.role, Role::Follower { .. }) {
                continue;
            }
            assert!(
                timeouts + aborted <= 1 && shutdowns <= timeouts,
                "own refusals {own:?} of {c:?}"
            );
            if aborted == 1 {
                assert!(c.got.is_none(), "counted as cancelled: {c:?}");
            }
            if timeouts == 1 {
                let timeout = c.timeout.expect("an own timeout needs one");
                if let Some(waited) = c.waited {
                    assert!(waited >= timeout, "timed out early: {waited:?} {c:?}");
                }
                let run = owned.get(&c.id).copied();
                match (c.observe, shutdowns, run) {
                    (None, _, _) => assert!(
                        matches!(c.got, Some(Got::Rejected(r)) if r.reason() == RejectReason::Timeout),
                        "{c:?}"
                    ),
                    (Some(_), 1, None) => assert!(
                        c.got.is_none()
                            || matches!(c.got, Some(Got::Rejected(r)) if r.reason() == RejectReason::Shutdown),
                        "{c:?}"
                    ),
                    (Some(_), 0, Some(run)) => {
                        if let Some(Got::Value(reply) | Got::Failed(reply)) = c.got {
                            assert_eq!(reply.run, run, "{c:?}");
                        } else {
                            assert!(c.got.is_none(), "{c:?}");
                        }
                    }
                    _ => panic!("own timeout of {c:?}: {own:?}, run {run:?}"),
                }
            } else {
                assert!(
                    !owned.contains_key(&c.id),
                    "a follower ran without its own timeout: {c:?}"
                );
            }
        }

        // Each flight: its outcome, shared by its waiters, and its refusals.
        let mut doubles = 0;
        let mut shared_refusals = 0;
        for (id, flight) in &flights {
            let leader = caller(flight.leader.unwrap());
            let waiters: Vec<&CallerRecord> = std::iter::once(leader)
                .chain(flight.followers.iter().map(|&(_, f)| caller(f)))
                .collect();
            let events: Vec<RejectReason> = waiters
                .iter()
                .flat_map(|w| refusals[w.id as usize].flight.iter().copied())
                .collect();
            let polled = waiters.iter().any(|w| w.polls > 0);
            // The waiters that got the flight's outcome (not their own timeout's).
            let receivers: Vec<&CallerRecord> = waiters
                .iter()
                .copied()
                .filter(|w| w.got.is_some() && refusals[w.id as usize].own.is_empty())
                .collect();
            let context = || format!("flight {id}: waiters {waiters:#?}, refusals {events:?}");
            match owned.get(&leader.id).map(|&run| (run, runs[run])) {
                Some((run, r)) => {
                    let failed =
                        matches!(receivers.first().and_then(|w| w.got), Some(Got::Failed(_)));
                    for w in &receivers {
                        let (Some(Got::Value(reply)) | Some(Got::Failed(reply))) = w.got else {
                            panic!("caller {} got no value of run {run}: {}", w.id, context());
                        };
                        assert_eq!(
                            (
                                reply.run,
                                reply.owner,
                                matches!(w.got, Some(Got::Failed(_)))
                            ),
                            (run, leader.id, failed),
                            "caller {}: {}",
                            w.id,
                            context()
                        );
                    }
                    let expected: Vec<RejectReason> = match r.bypass {
                        Some(b) if b.raced || b.reason == RejectReason::Timeout => vec![b.reason],
                        _ => Vec::new(),
                    };
                    assert_eq!(events, expected, "{r:?}: {}", context());
                }
                None => {
                    let rejection = receivers.first().map(|w| match w.got {
                        Some(Got::Rejected(rejection)) => rejection,
                        _ => panic!("a value without a run: {}", context()),
                    });
                    for w in &receivers {
                        assert_eq!(
                            w.got,
                            Some(Got::Rejected(rejection.unwrap())),
                            "{}",
                            context()
                        );
                    }
                    match rejection.map(|r| r.reason()) {
                        Some(reason) => {
                            shared_refusals += receivers.len() as u64 - 1;
                            if let Some(observe) = leader.observe {
                                assert!(
                                    !observe.reasons().contains(reason),
                                    "an observe-mode call refused {reason}: {}",
                                    context()
                                );
                            }
                            // A bypass refused at the close was counted for its first refusal
                            // too (the double refusal of observe mode, Q6).
                            let double = leader.observe.is_some()
                                && reason == RejectReason::Shutdown
                                && events.len() == 2
                                && events[1] == RejectReason::Shutdown
                                && leader.observe.unwrap().reasons().contains(events[0]);
                            if double {
                                doubles += 1;
                            } else {
                                assert_eq!(events, [reason], "{}", context());
                            }
                        }
                        // Nobody got its outcome: dropped with its last waiter, counted once
                        // if it was queued (it was polled and did not finish).
                        None => assert_eq!(events.len(), usize::from(polled), "{}", context()),
                    }
                }
            }
        }

        // Not a vacuous pass.
        let followers = callers
            .iter()
            .filter(|c| matches!(c.role, Role::Follower { .. }))
            .count();
        let after_close = callers.iter().filter(|c| c.closed_before).count();
        assert!(stats.admitted > 0 && hits > 0 && after_close > 0);
        let cancelled = callers.iter().filter(|c| c.got.is_none()).count();
        let forms = callers
            .iter()
            .filter(|c| matches!(c.role, Role::Follower { .. }))
            .filter(|c| c.form != caller(flights[&c.flight].leader.unwrap()).form)
            .count();
        println!(
            "dedup seed {} {:?}: {} calls, {} flights, {followers} followers ({forms} of another \
             form), admitted {}, bypassed {} (raced {}), refused {:?} (shared by {shared_refusals} \
             more callers, {doubles} doubled at the close), own timeouts {own_timeouts} \
             ({own_doubles} doubled at the close), \
             counted cancellations {aborts}, cancelled {cancelled}, after the close \
             {after_close}, limit changes {}",
            self.setup.seed,
            self.setup.plane,
            callers.len(),
            flights.len(),
            stats.admitted,
            observe.bypassed,
            observe.race_bypassed,
            stats.rejected_by_reason,
            load(&self.counts.limit_changes),
        );
    }
}

/// Splits the refusals counted in `c`'s hands into its own and its flight's. Only a follower
/// has refusals of its own, each announced untimed (zero durations):
/// - a `timeout` without timing and without tokens asked is its own wait's (a queue timeout
///   waited at least its timeout by the clock that decided it, so its `queue_wait` is not
///   zero, unless the flight's call bypasses it as a race in observe mode, which announces it
///   untimed; the flight's call asks for its reservation, never 0 here);
/// - the last `aborted` of the action that dropped its future is its cancellation (counted
///   after the drop of the shared call it was the last waiter of, whose queued admission
///   counts a refusal of its own), if it was polled: a follower dropped before its first
///   poll is not counted (see `found`);
/// - a `shutdown` after its own timeout in the same action is its own bypass refused at the
///   close (the double refusal of observe mode, Q6).
///
/// Everything else was counted for the flight it drove or dropped.
fn split(c: &CallerRecord, notes: &[(u32, What)]) -> Refusals {
    let mut refusals = Refusals::default();
    let follower = matches!(c.role, Role::Follower { .. });
    let last_abort = notes.iter().rposition(|&(action, what)| {
        action == c.drop_action
            && matches!(
                what,
                What::Reject {
                    reason: RejectReason::Aborted,
                    ..
                }
            )
    });
    let mut own_timeout_in = None;
    for (i, &(action, what)) in notes.iter().enumerate() {
        let What::Reject {
            reason,
            untimed,
            undecided,
        } = what
        else {
            continue;
        };
        assert!(
            follower || !(untimed && undecided && reason == RejectReason::Timeout),
            "an undecided timeout in the hands of {c:?}"
        );
        let own = follower
            && match reason {
                RejectReason::Timeout if untimed && undecided => {
                    own_timeout_in = Some(action);
                    true
                }
                RejectReason::Aborted => last_abort == Some(i),
                RejectReason::Shutdown => own_timeout_in == Some(action),
                _ => false,
            };
        if own {
            assert!(untimed, "{reason} of {c:?}: its own refusals are untimed");
            refusals.own.push(reason);
        } else {
            refusals.flight.push(reason);
        }
    }
    refusals
}
