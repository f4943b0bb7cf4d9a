//! The reference model of observe mode (crate options.rs `RunOptions::observe`, run.rs
//! `enter`, bypass.rs, observe.rs): the advisory check, the admission, the bypass of a refusal
//! in the call's set, its usage reports and its end; and the untimed refusals of deduplication
//! followers (crate engine `refuse_undecided`).

use async_bulkhead_llm::usage::UsageError;

use super::state::Model;
use super::values::{
    Ask, Detail, ModelBypass, ModelPermit, ModelVerdict, Observed, Reason, Refused, Shadow,
    Started, UsageSnapshot,
};

/// How a `run` (or the call of a `run_shared`) got past its first poll.
#[derive(Debug)]
pub(crate) enum Entered {
    Admitted(ModelPermit),
    Bypassed(ModelBypass),
    /// Refused (counted and announced, or a bypass refused `shutdown`).
    Refused(Refused),
    /// Waiting in the queue as this waiter; `advisory` is whether the advisory check said it
    /// would get in (admit or queue), for a bypass after the wait.
    Queued {
        key: u64,
        advisory: bool,
    },
}

impl Model {
    /// The first poll of a `run` (crate run.rs `enter`): without observe mode, the admission
    /// as `acquire`. In observe mode the advisory check first: a predicted refusal whose reason
    /// is in the set is bypassed at once (neither counted nor announced as a rejection);
    /// otherwise the admission, whose refusal in the set is counted and announced, then
    /// bypassed as a race (`raced`: the advisory said admit or queue).
    pub(crate) fn enter(
        &mut self,
        ask: Ask,
        zero_timeout: bool,
        observe: Option<Shadow>,
    ) -> Entered {
        let advisory = match observe {
            None => true,
            Some(set) => {
                let (verdict, detail) = self.would_admit(ask);
                match verdict {
                    ModelVerdict::Reject(reason) if set.contains(reason) => {
                        self.note("observe: advisory bypass");
                        return match self.begin_bypass(ask, reason, Some(detail), false) {
                            Ok(bypass) => Entered::Bypassed(bypass),
                            Err(refused) => Entered::Refused(refused),
                        };
                    }
                    ModelVerdict::Reject(_) => false,
                    ModelVerdict::Admit | ModelVerdict::Queue => true,
                }
            }
        };
        match self.acquire(ask, zero_timeout) {
            Started::Admitted(permit) => Entered::Admitted(permit),
            Started::Queued(key) => Entered::Queued { key, advisory },
            Started::Refused(refused) => {
                match self.after_refusal(ask, refused, observe, advisory) {
                    Ok(bypass) => Entered::Bypassed(bypass),
                    Err(refused) => Entered::Refused(refused),
                }
            }
        }
    }

    /// An admission refused (already counted and announced): bypassed if its reason is in the
    /// observe set (crate run.rs `enter`), else the refusal stands.
    pub(crate) fn after_refusal(
        &mut self,
        ask: Ask,
        refused: Refused,
        observe: Option<Shadow>,
        advisory: bool,
    ) -> Result<ModelBypass, Refused> {
        match observe {
            Some(set) if set.contains(refused.reason) => {
                self.note(if refused.reason == Reason::Timeout {
                    "observe: bypass after a queue timeout"
                } else {
                    "observe: bypass after a refusal"
                });
                self.begin_bypass(ask, refused.reason, Some(refused.detail), advisory)
            }
            Some(_) => {
                self.note(if refused.reason == Reason::Shutdown {
                    "observe: shutdown not bypassed"
                } else {
                    "observe: refusal outside the set"
                });
                Err(refused)
            }
            None => Err(refused),
        }
    }

    /// Starts a bypass (crate bypass.rs `begin_bypass`): a closed bulkhead refuses it with
    /// `shutdown` (counted, announced without timing); otherwise it is counted and announced.
    /// Its revision is its refusal's (the current one without a detail).
    pub(crate) fn begin_bypass(
        &mut self,
        ask: Ask,
        reason: Reason,
        detail: Option<Detail>,
        raced: bool,
    ) -> Result<ModelBypass, Refused> {
        if self.closed {
            self.note("observe: bypass refused by close");
            return Err(self.refuse_undecided(Reason::Shutdown, ask.high, ask.class));
        }
        let bypass = ModelBypass {
            shadow: self.next_shadow,
            reason,
            detail,
            raced,
            reservation: ask.reservation,
            revision: detail.map_or(self.limits.revision, |d| d.limit_revision),
            high: ask.high,
            class: ask.class,
            reported: None,
            sequence: 0,
        };
        self.next_shadow += 1;
        let figures = &mut self.observe;
        figures.bypassed += 1;
        figures.by_reason[reason as usize] += 1;
        if raced {
            figures.race_bypassed += 1;
            self.note("observe: race bypass");
        }
        if self.listening {
            self.events.push(Observed::Bypass {
                shadow: bypass.shadow,
                revision: bypass.revision,
                high: bypass.high,
                class: bypass.class,
                reason,
                detail,
                reservation: bypass.reservation,
                raced,
            });
        }
        self.note("observe: bypassed");
        Ok(bypass)
    }

    /// A bypassed call's usage report (crate bypass.rs `report_bypass`): validated and clamped
    /// as an admitted call's, holding nothing; only a change of the usage is effective.
    pub(crate) fn report_bypass(
        &mut self,
        bypass: &mut ModelBypass,
        usage: (u64, u64),
        progressive: Option<(u64, u64)>,
    ) -> Result<UsageSnapshot, UsageError> {
        if let (Some((remaining, _)), Some((_, cap))) = (progressive, bypass.reservation)
            && remaining > cap
        {
            self.note("observe: bypass usage error");
            return Err(UsageError::RemainingExceedsCap { remaining, cap });
        }
        let reported = match bypass.reported {
            None => usage,
            Some((input, output)) => (input.max(usage.0), output.max(usage.1)),
        };
        let Some(consumed) = reported.0.checked_add(reported.1) else {
            self.note("observe: bypass usage error");
            return Err(UsageError::TotalOverflow {
                input: reported.0,
                output: reported.1,
            });
        };
        let effective = bypass.reported != Some(reported);
        bypass.reported = Some(reported);
        let reserved = bypass.reserved();
        let output_cap = bypass.reservation.map(|(_, cap)| cap);
        let output_remaining = output_cap.map(|cap| cap.saturating_sub(reported.1));
        let over_reservation = bypass.reservation.is_some() && consumed > reserved;
        if effective {
            bypass.sequence += 1;
            self.note("observe: bypass usage reported");
            if self.listening {
                self.events.push(Observed::BypassUsage {
                    shadow: bypass.shadow,
                    revision: bypass.revision,
                    high: bypass.high,
                    class: bypass.class,
                    reason: bypass.reason,
                    sequence: bypass.sequence,
                    reservation: bypass.reservation,
                    usage: reported,
                    output_cap,
                    output_remaining,
                    over_reservation,
                    progressive,
                });
            }
        } else {
            self.note("observe: stale bypass usage report");
        }
        Ok(UsageSnapshot {
            limit_revision: bypass.revision,
            sequence: bypass.sequence,
            reserved,
            held: 0,
            consumed,
            output_cap,
            output_remaining,
            over_reservation,
        })
    }

    /// Ends a bypassed call with `usage`, else its last reported usage (crate bypass.rs
    /// `finish_bypass`): a usage is counted, the end announced.
    pub(crate) fn finish_bypass(&mut self, bypass: ModelBypass, usage: Option<(u64, u64)>) {
        let usage = usage.or(bypass.reported);
        if let Some((input, output)) = usage {
            let figures = &mut self.observe;
            figures.usage_reported += 1;
            figures.input_tokens += input;
            figures.output_tokens += output;
            self.note("observe: bypass ended with usage");
        }
        if self.listening {
            self.events.push(Observed::BypassRelease {
                shadow: bypass.shadow,
                revision: bypass.revision,
                high: bypass.high,
                class: bypass.class,
                reason: bypass.reason,
                reservation: bypass.reservation,
                sequence: bypass.sequence,
                usage,
            });
        }
    }

    /// A refusal no decision made (crate engine `refuse_undecided`: a deduplication
    /// follower's own wait ended, or a bypass found the bulkhead closed): counted for the
    /// caller's class, its detail the global figures now (no class part, nothing requested),
    /// announced with the caller's class.
    pub(crate) fn refuse_undecided(
        &mut self,
        reason: Reason,
        high: bool,
        class: Option<usize>,
    ) -> Refused {
        self.rejected[reason as usize] += 1;
        if let Some(class) = class {
            self.classes[class].rejected[reason as usize] += 1;
        }
        let global = Ask {
            class: None,
            high,
            reservation: None,
        };
        let refused = Refused {
            reason,
            detail: self.detail(global, None),
            rate: None,
        };
        self.announce_reject(class, refused);
        refused
    }
}
