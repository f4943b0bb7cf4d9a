//! The reference model of in-flight deduplication (crate dedup.rs and run_shared.rs): which
//! `run_shared` calls lead and which follow, the shared call itself (a `run` any of its waiters
//! drives), what each caller gets, and the registry's figures.
//!
//! A *flight* is one call running a callback: a leader's (registered under its key, so that
//! identical calls join it), a call on its own (no deduplication for it: not registered), or a
//! follower's own bypass after its timeout (crate run_shared.rs `timed_out`). It is named by the
//! serial of the caller whose callback it runs. Its waiters are the callers still waiting for
//! its outcome; polling any of them polls the call (crate dedup.rs "Drive"); when it finishes,
//! every other waiter gets a copy of the outcome, picked up at its next poll; when its last
//! waiter leaves, the call is dropped (leaving the queue, or settling its admission or bypass).

use std::collections::BTreeMap;
use std::task::Poll;

use async_bulkhead_llm::{request::RequestError, usage::UsageError};

use super::bypass::Entered;
use super::harness::{Call, MAX_CHARS};
use super::state::{Model, Named};
use super::values::{Ask, Cause, ModelBypass, ModelPermit, Reason, Refused, Shadow, UsageSnapshot};

/// How the bulkhead deduplicates (see [`Config::dedup`](super::harness::Config::dedup)).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DedupKind {
    /// `Deduplication::new()`: by the whole request.
    ByRequest,
    /// `Deduplication::by_key`: by the request's model name (none: an empty key, the call opts
    /// out; [`PANICKING_MODEL`]: the key function panics, the call opts out and is counted).
    ByModel,
}

/// The model name whose key the `by_key` function refuses by panicking.
pub(crate) const PANICKING_MODEL: &str = "GPT-4o-mini";

/// A deduplication key: the partition (scope, class) and the raw key.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct FlightKey {
    scope: u8,
    class: Option<usize>,
    raw: RawKey,
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum RawKey {
    /// The request's fields (model, characters, `max_tokens`, extra input tokens).
    Request(u8, u32, Option<u64>, Option<u64>),
    /// The key function's answer.
    Key(&'static str),
}

/// What a `run_shared` caller gets: the callback's value (the serial of the flight that made
/// it, and its usage), the callback's error (the flight's serial), a refusal, or invalid input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Value {
        flight: u64,
        usage: Option<(u64, u64)>,
    },
    Failed(u64),
    Rejected(Refused),
    Invalid(RequestError),
}

/// What a shared callback does first when it is called (report this usage, then finish at once,
/// `Ok` with no usage of its own), and how its value settles.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct SharedScript {
    pub(crate) report_first: Option<(u64, u64)>,
    pub(crate) finish_first: bool,
    /// Settles a successful call with the usage in its value (`run_shared_with` and
    /// `Sharing::usage`), else with the last reported one (`run_shared`).
    pub(crate) extract: bool,
}

/// A `run_shared` call as it is made.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SharedSpec {
    /// 0: the unnamed scope; else a named one.
    pub(crate) scope: u8,
    pub(crate) no_dedup: bool,
    /// An explicit queue timeout: none, zero, or long (never passes here).
    pub(crate) timeout: Option<bool>,
    pub(crate) observe: Option<Shadow>,
    pub(crate) script: SharedScript,
}

/// A flight's call.
#[derive(Clone, Copy, Debug)]
pub(crate) enum CallState {
    /// Not polled yet.
    Unstarted {
        ask: Result<Ask, RequestError>,
        zero_timeout: bool,
    },
    Queued {
        ask: Ask,
        key: u64,
        advisory: bool,
    },
    Admitted(ModelPermit),
    Bypassed(ModelBypass),
}

#[derive(Clone, Debug)]
pub(crate) struct Flight {
    /// Its key, while it is registered (joinable).
    key: Option<FlightKey>,
    /// Joins so far.
    followers: u64,
    observe: Option<Shadow>,
    script: SharedScript,
    /// `None` once it finished.
    pub(crate) call: Option<CallState>,
    /// Callers waiting for its outcome, in creation order.
    waiters: Vec<u64>,
    leader: Option<u64>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Leader,
    Follower,
    /// Runs on its own (or its own bypass).
    Solo,
}

#[derive(Clone, Copy, Debug)]
pub(crate) struct Caller {
    /// Its flight; none for a call refused before anything started.
    flight: Option<u64>,
    role: Role,
    /// A follower with a zero timeout gives up at its first poll that finds no outcome.
    zero_timeout: bool,
    /// What a follower runs as a bypass when its own timeout passes.
    own: Option<(Result<Ask, RequestError>, SharedScript)>,
    high: bool,
    class: Option<usize>,
    /// Its outcome, once the flight finished and until it is picked up.
    delivered: Option<Outcome>,
}

/// A callback called during a poll: the flight it runs, and the answer to its first report.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Began {
    pub(crate) flight: u64,
    /// The bypass's number, for a bypassed call.
    pub(crate) bypass: Option<u128>,
    pub(crate) report: Option<Result<UsageSnapshot, UsageError>>,
}

/// The deduplication state of the model.
#[derive(Debug, Default)]
pub(crate) struct Flights {
    pub(crate) kind: Option<DedupKind>,
    pub(crate) flights: BTreeMap<u64, Flight>,
    pub(crate) callers: BTreeMap<u64, Caller>,
    pub(crate) hits: u64,
    pub(crate) key_panics: u64,
}

impl Flights {
    /// Registered flights (`active`).
    pub(crate) fn active(&self) -> u64 {
        self.flights.values().filter(|f| f.key.is_some()).count() as u64
    }

    /// Flights whose callback runs, in creation order.
    pub(crate) fn running(&self) -> Vec<u64> {
        self.flights
            .iter()
            .filter(|(_, f)| {
                matches!(
                    f.call,
                    Some(CallState::Admitted(_) | CallState::Bypassed(_))
                )
            })
            .map(|(&id, _)| id)
            .collect()
    }

    /// The callers waiting for `flight`.
    pub(crate) fn waiters(&self, flight: u64) -> Vec<u64> {
        self.flights[&flight].waiters.clone()
    }
}

impl Model {
    /// The class a call names (design §U6.2; crate core.rs `class_of`), before anything else.
    pub(crate) fn class_of(&self, named: Named) -> Result<Option<usize>, RequestError> {
        match (self.default_class, named) {
            (None, Named::Default) => Ok(None),
            (None, Named::Foreign(class)) => Err(RequestError::ClassesNotConfigured { class }),
            (None, Named::Own(_)) => unreachable!("no own handle without classes"),
            (Some(_), Named::Foreign(class)) => Err(RequestError::ForeignClass { class }),
            (Some(default), Named::Default) => Ok(Some(default)),
            (Some(_), Named::Own(class)) => Ok(Some(class)),
        }
    }

    /// The key of a call (crate dedup.rs `Dedup::key`), or none when it opts out.
    fn key_of(&mut self, call: &Call, scope: u8, class: Option<usize>) -> Option<FlightKey> {
        let raw = match self.flights.kind? {
            DedupKind::ByRequest => RawKey::Request(
                call.model % 4,
                call.chars % MAX_CHARS,
                call.has_max_tokens.then_some(call.max_tokens),
                call.has_extra_input.then_some(call.extra_input),
            ),
            DedupKind::ByModel => match call.model % 4 {
                0 => {
                    self.note("shared: empty key");
                    return None;
                }
                1 => RawKey::Key("gpt-4o"),
                2 => RawKey::Key("claude-sonnet-4"),
                _ => {
                    self.flights.key_panics += 1;
                    self.note("shared: key function panicked");
                    return None;
                }
            },
        };
        Some(FlightKey { scope, class, raw })
    }

    /// `run_shared` is called (crate run_shared.rs `plan`): invalid options end it at once;
    /// otherwise it follows a registered flight of its key, or leads a new one, or (no
    /// deduplication for it: none configured, `no_dedup`, an opted-out key, a closed
    /// bulkhead) runs on its own. Nothing is polled yet.
    pub(crate) fn shared_start(
        &mut self,
        serial: u64,
        call: &Call,
        named: Named,
        spec: SharedSpec,
    ) {
        let class = match self.class_of(named) {
            Ok(class) => class,
            Err(error) => {
                self.note("shared: invalid class");
                self.flights.callers.insert(
                    serial,
                    Caller {
                        flight: None,
                        role: Role::Solo,
                        zero_timeout: false,
                        own: None,
                        high: call.high,
                        class: None,
                        delivered: Some(Outcome::Invalid(error)),
                    },
                );
                return;
            }
        };
        let key = if self.flights.kind.is_none() {
            self.note("shared: no deduplication configured");
            None
        } else if spec.no_dedup {
            self.note("shared: no_dedup");
            None
        } else if self.closed {
            self.note("shared: alone after close");
            None
        } else {
            self.key_of(call, spec.scope, class)
        };
        let mut caller = Caller {
            flight: Some(serial),
            role: Role::Solo,
            zero_timeout: false,
            own: None,
            high: call.high,
            class,
            delivered: None,
        };
        let joined = key.as_ref().and_then(|key| {
            self.flights
                .flights
                .iter()
                .find(|(_, f)| f.key.as_ref() == Some(key))
                .map(|(&id, _)| id)
        });
        if let Some(id) = joined {
            let flight = self.flights.flights.get_mut(&id).expect("registered");
            flight.followers += 1;
            flight.waiters.push(serial);
            let followers = flight.followers;
            let queued = matches!(flight.call, Some(CallState::Queued { .. }));
            let bypassed = matches!(flight.call, Some(CallState::Bypassed(_)));
            self.flights.hits += 1;
            self.note("shared: followed");
            if queued {
                self.note("shared: followed a queued call");
            }
            if bypassed {
                self.note("shared: followed a bypassed call");
            }
            if followers > 1 {
                self.note("shared: several followers");
            }
            if self.listening {
                self.events
                    .push(super::values::Observed::Dedup { class, followers });
            }
            caller.flight = Some(id);
            caller.role = Role::Follower;
            caller.zero_timeout = spec.timeout == Some(true);
            caller.own = spec
                .observe
                .filter(|set| spec.timeout.is_some() && set.contains(Reason::Timeout))
                .map(|_| (self.resolve(call, named), spec.script));
            self.flights.callers.insert(serial, caller);
            return;
        }
        if let Some(key) = &key {
            let apart = self
                .flights
                .flights
                .values()
                .filter_map(|f| f.key.as_ref())
                .filter(|k| k.raw == key.raw)
                .map(|k| (k.scope != key.scope, k.class != key.class))
                .collect::<Vec<_>>();
            if apart.iter().any(|&(scope, _)| scope) {
                self.note("shared: the same request led apart by its scope");
            }
            if apart.iter().any(|&(scope, class)| !scope && class) {
                self.note("shared: the same request led apart by its class");
            }
            caller.role = Role::Leader;
            self.note("shared: led");
        }
        let flight = Flight {
            key,
            followers: 0,
            observe: spec.observe,
            script: spec.script,
            call: Some(CallState::Unstarted {
                ask: self.resolve(call, named),
                zero_timeout: spec.timeout == Some(true),
            }),
            waiters: vec![serial],
            leader: (caller.role == Role::Leader).then_some(serial),
        };
        self.flights.flights.insert(serial, flight);
        self.flights.callers.insert(serial, caller);
    }

    /// Polls caller `serial`'s future: its outcome if one arrived; else it drives its flight's
    /// call once (which may finish it: every other waiter gets a copy); else a follower whose
    /// own zero timeout passed leaves (counted as `timeout`), and in observe mode runs its own
    /// callback as a bypass.
    pub(crate) fn shared_poll(&mut self, serial: u64, began: &mut Vec<Began>) -> Poll<Outcome> {
        let caller = self.flights.callers[&serial];
        if let Some(outcome) = caller.delivered {
            self.flights.callers.remove(&serial);
            return Poll::Ready(outcome);
        }
        let id = caller
            .flight
            .expect("a caller without an outcome waits for a flight");
        if let Some(outcome) = self.drive(id, began) {
            if caller.role == Role::Follower {
                self.note("shared: call finished by a follower's poll");
            }
            let mine = self.finish_flight(id, outcome, serial);
            return Poll::Ready(mine);
        }
        if !(caller.role == Role::Follower && caller.zero_timeout) {
            return Poll::Pending;
        }
        // Its own timeout passed: it leaves (its call goes on for the others), then the
        // refusal is counted and announced, untimed.
        self.leave(serial, id, false);
        let refused = self.refuse_undecided(Reason::Timeout, caller.high, caller.class);
        self.note("shared: follower timed out");
        let Some((ask, script)) = caller.own else {
            self.flights.callers.remove(&serial);
            return Poll::Ready(Outcome::Rejected(refused));
        };
        let ask = match ask {
            Ok(ask) => ask,
            Err(error) => {
                self.flights.callers.remove(&serial);
                return Poll::Ready(Outcome::Invalid(error));
            }
        };
        match self.begin_bypass(ask, Reason::Timeout, None, false) {
            Err(refused) => {
                self.flights.callers.remove(&serial);
                Poll::Ready(Outcome::Rejected(refused))
            }
            Ok(bypass) => {
                self.note("shared: follower timed out into a bypass");
                let flight = Flight {
                    key: None,
                    followers: 0,
                    observe: None,
                    script,
                    call: None,
                    waiters: vec![serial],
                    leader: None,
                };
                self.flights.flights.insert(serial, flight);
                let caller = self.flights.callers.get_mut(&serial).expect("a caller");
                caller.flight = Some(serial);
                caller.role = Role::Solo;
                caller.zero_timeout = false;
                match self.begin_bypassed(serial, bypass, script, began) {
                    Ok(state) => {
                        self.flights
                            .flights
                            .get_mut(&serial)
                            .expect("a flight")
                            .call = Some(state);
                        Poll::Pending
                    }
                    Err(outcome) => Poll::Ready(self.finish_flight(serial, outcome, serial)),
                }
            }
        }
    }

    /// Polls flight `id`'s call once; its outcome if it finished.
    fn drive(&mut self, id: u64, began: &mut Vec<Began>) -> Option<Outcome> {
        let flight = &self.flights.flights[&id];
        let (observe, script) = (flight.observe, flight.script);
        let call = flight.call.expect("a flight waited for runs its call");
        let next = match call {
            CallState::Unstarted { ask, zero_timeout } => match ask {
                Err(error) => Err(Outcome::Invalid(error)),
                Ok(ask) => match self.enter(ask, zero_timeout, observe) {
                    Entered::Admitted(permit) => self.begin_admitted(id, permit, script, began),
                    Entered::Bypassed(bypass) => self.begin_bypassed(id, bypass, script, began),
                    Entered::Refused(refused) => Err(Outcome::Rejected(refused)),
                    Entered::Queued { key, advisory } => {
                        Ok(CallState::Queued { ask, key, advisory })
                    }
                },
            },
            CallState::Queued { ask, key, advisory } => match self.poll_waiter(key) {
                Poll::Pending => Ok(call),
                Poll::Ready(Ok(permit)) => self.begin_admitted(id, permit, script, began),
                Poll::Ready(Err(refused)) => {
                    match self.after_refusal(ask, refused, observe, advisory) {
                        Ok(bypass) => self.begin_bypassed(id, bypass, script, began),
                        Err(refused) => Err(Outcome::Rejected(refused)),
                    }
                }
            },
            // The callback waits for the worker: polling it changes nothing.
            CallState::Admitted(_) | CallState::Bypassed(_) => Ok(call),
        };
        match next {
            Ok(call) => {
                self.flights.flights.get_mut(&id).expect("a flight").call = Some(call);
                None
            }
            Err(outcome) => Some(outcome),
        }
    }

    /// An admitted call's callback is called: its first steps.
    fn begin_admitted(
        &mut self,
        id: u64,
        mut permit: ModelPermit,
        script: SharedScript,
        began: &mut Vec<Began>,
    ) -> Result<CallState, Outcome> {
        self.note("shared: call admitted");
        let report = script
            .report_first
            .map(|usage| self.report(&mut permit, usage, None));
        began.push(Began {
            flight: id,
            bypass: None,
            report,
        });
        if script.finish_first {
            self.settle(permit, None);
            return Err(Outcome::Value {
                flight: id,
                usage: None,
            });
        }
        Ok(CallState::Admitted(permit))
    }

    /// A bypassed call's callback is called: its first steps.
    fn begin_bypassed(
        &mut self,
        id: u64,
        mut bypass: ModelBypass,
        script: SharedScript,
        began: &mut Vec<Began>,
    ) -> Result<CallState, Outcome> {
        self.note("shared: call bypassed");
        let report = script
            .report_first
            .map(|usage| self.report_bypass(&mut bypass, usage, None));
        began.push(Began {
            flight: id,
            bypass: Some(bypass.shadow),
            report,
        });
        if script.finish_first {
            self.finish_bypass(bypass, None);
            return Err(Outcome::Value {
                flight: id,
                usage: None,
            });
        }
        Ok(CallState::Bypassed(bypass))
    }

    /// Flight `id` finished with `outcome` while `driver` polled it: no one joins it any more,
    /// every other waiter gets a copy; answers the driver's.
    fn finish_flight(&mut self, id: u64, outcome: Outcome, driver: u64) -> Outcome {
        let flight = self.flights.flights.remove(&id).expect("a flight");
        let others: Vec<u64> = flight
            .waiters
            .iter()
            .copied()
            .filter(|&w| w != driver)
            .collect();
        if !others.is_empty() {
            self.note(match outcome {
                Outcome::Value { .. } => "shared: value shared with followers",
                Outcome::Failed(_) => "shared: failure shared with followers",
                Outcome::Rejected(_) => "shared: refusal shared with followers",
                Outcome::Invalid(_) => "shared: invalid input shared with followers",
            });
        }
        if flight.leader.is_none() && flight.followers > 0 {
            self.note("shared: call finished after its leader left");
        }
        for other in others {
            self.flights
                .callers
                .get_mut(&other)
                .expect("a waiter")
                .delivered = Some(outcome);
        }
        self.flights.callers.remove(&driver);
        outcome
    }

    /// Caller `serial` leaves flight `id` before its outcome; the last waiter drops the call
    /// (crate dedup.rs "Leave").
    fn leave(&mut self, serial: u64, id: u64, dropped: bool) {
        let flight = self.flights.flights.get_mut(&id).expect("a flight");
        flight.waiters.retain(|&w| w != serial);
        let was_leader = flight.leader == Some(serial);
        if was_leader {
            flight.leader = None;
        }
        if !flight.waiters.is_empty() {
            if was_leader {
                self.note("shared: leader left while followers wait");
            }
            return;
        }
        let flight = self.flights.flights.remove(&id).expect("a flight");
        let shared = flight.followers > 0;
        match flight.call.expect("an unfinished flight") {
            CallState::Unstarted { .. } => {}
            CallState::Queued { key, .. } => {
                self.note(if shared {
                    "shared: last waiter left a queued call"
                } else {
                    "shared: queued call dropped"
                });
                self.cancel_waiter(key);
            }
            CallState::Admitted(permit) => {
                self.note(if shared {
                    "shared: last waiter left a running call"
                } else {
                    "shared: running call dropped"
                });
                self.settle(permit, None);
            }
            CallState::Bypassed(bypass) => {
                self.note("observe: bypass dropped");
                self.finish_bypass(bypass, None);
            }
        }
        if dropped && shared && !was_leader {
            self.note("shared: last waiter was a follower");
        }
    }

    /// Drops caller `serial`'s future (crate run_shared.rs "Cancel safety"): an outcome that
    /// arrived is dropped with it; otherwise it leaves its flight, and a follower that waited is
    /// counted as `aborted` (after leaving), announced untimed.
    pub(crate) fn shared_drop(&mut self, serial: u64) {
        let caller = self.flights.callers.remove(&serial).expect("a caller");
        if caller.delivered.is_some() {
            if caller.flight.is_some() {
                self.note("shared: outcome dropped unread");
            }
            return;
        }
        let id = caller
            .flight
            .expect("a caller without an outcome waits for a flight");
        self.leave(serial, id, true);
        if caller.role == Role::Follower {
            self.note("shared: follower cancelled");
            self.refuse_undecided(Reason::Aborted, caller.high, caller.class);
        }
    }

    /// The callback of running flight `id` reports usage.
    pub(crate) fn shared_report(
        &mut self,
        id: u64,
        usage: (u64, u64),
        progressive: Option<(u64, u64)>,
    ) -> Result<UsageSnapshot, UsageError> {
        let mut call = self.flights.flights[&id].call.expect("a running flight");
        let result = match &mut call {
            CallState::Admitted(permit) => self.report(permit, usage, progressive),
            CallState::Bypassed(bypass) => self.report_bypass(bypass, usage, progressive),
            _ => unreachable!("a running flight"),
        };
        self.flights.flights.get_mut(&id).expect("a flight").call = Some(call);
        result
    }

    /// The callback of running flight `id` gives its borrowed slot back (a bypass holds none).
    pub(crate) fn shared_abandon(&mut self, id: u64) -> bool {
        let mut call = self.flights.flights[&id].call.expect("a running flight");
        let done = match &mut call {
            CallState::Admitted(permit) => self.abandon(permit, Cause::Manual),
            CallState::Bypassed(_) => {
                self.note("observe: bypass holds no slot to abandon");
                false
            }
            _ => unreachable!("a running flight"),
        };
        self.flights.flights.get_mut(&id).expect("a flight").call = Some(call);
        done
    }

    /// The callback of running flight `id` returns: `Ok(usage)` settles with that usage (when
    /// the flight's script extracts it; else with the last reported one), an
    /// error with the last reported usage. The flight's outcome is then set for every waiter
    /// (the one that polls it picks it up at once).
    pub(crate) fn shared_finish(&mut self, id: u64, ok: bool, usage: Option<(u64, u64)>) {
        let flight = &self.flights.flights[&id];
        let call = flight.call.expect("a running flight");
        let settle_with = if ok && flight.script.extract {
            usage
        } else {
            None
        };
        match call {
            CallState::Admitted(permit) => {
                self.settle(permit, settle_with);
            }
            CallState::Bypassed(bypass) => self.finish_bypass(bypass, settle_with),
            _ => unreachable!("a running flight"),
        }
        let outcome = if ok {
            Outcome::Value { flight: id, usage }
        } else {
            self.note("shared: callback failed");
            Outcome::Failed(id)
        };
        let flight = self.flights.flights.get_mut(&id).expect("a flight");
        flight.call = None;
        for waiter in flight.waiters.clone() {
            self.flights
                .callers
                .get_mut(&waiter)
                .expect("a waiter")
                .delivered = Some(outcome);
        }
        let flight = self.flights.flights.remove(&id).expect("a flight");
        if flight.waiters.len() > 1 {
            self.note(if ok {
                "shared: value shared with followers"
            } else {
                "shared: failure shared with followers"
            });
        }
        if flight.leader.is_none() && flight.followers > 0 {
            self.note("shared: call finished after its leader left");
        }
    }
}
