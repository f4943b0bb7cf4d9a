//! The reference model's operations, one per public operation of the crate.

use std::task::Poll;

use async_bulkhead_llm::{LimitsError, MAX_BUDGET, MAX_CONCURRENT, MAX_REVISION, UsageError};

use super::state::Model;
use super::values::{
    Ask, Booking, Detail, LimitsOutcome, ModelLimits, ModelPermit, ModelStats, ModelVerdict,
    ModelWaiter, Observed, Reason, Refusal, Refused, Settled, Started, TokenStats, UsageSnapshot,
    WaiterState, book, saturate,
};

impl Model {
    /// `try_acquire`: admits now or refuses now, never waits.
    pub(crate) fn try_acquire(&mut self, ask: Ask) -> Result<ModelPermit, Refused> {
        match self.judge_newcomer(ask) {
            Ok(()) => {
                self.take(ask.reserved());
                Ok(self.admit(ask, self.limits.revision))
            }
            Err(refusal) => {
                let refused = self.refuse(Model::reason_of(refusal, Reason::ConcurrencyLimit), ask);
                self.announce_reject(refused);
                self.note_refusal(refused.reason);
                Err(refused)
            }
        }
    }

    /// An `acquire` at its first poll (design §U3.2 with Q1 and Q7, §U2.1).
    pub(crate) fn acquire(&mut self, ask: Ask, zero_timeout: bool) -> Started {
        let reason = match self.judge_newcomer(ask) {
            Ok(()) => {
                self.take(ask.reserved());
                return Started::Admitted(self.admit(ask, self.limits.revision));
            }
            Err(Refusal::NoSlot) => match self.queue_verdict() {
                Ok(()) => {
                    let key = self.next_key;
                    self.next_key += 1;
                    self.queue.push_back(key);
                    self.note("queued");
                    if !zero_timeout {
                        self.waiters.push(ModelWaiter {
                            key,
                            ask,
                            state: WaiterState::Queued,
                        });
                        return Started::Queued(key);
                    }
                    // A zero timeout gives up at the first check (crate options.rs `timeout`):
                    // nothing can have been handed to it in between.
                    self.leave_queue(key);
                    self.note("timed out");
                    Reason::Timeout
                }
                Err(reason) => reason,
            },
            Err(refusal) => Model::reason_of(refusal, Reason::ConcurrencyLimit),
        };
        let refused = self.refuse(reason, ask);
        self.announce_reject(refused);
        self.note_refusal(reason);
        Started::Refused(refused)
    }

    fn note_refusal(&mut self, reason: Reason) {
        self.note(match reason {
            Reason::Shutdown => "refused: shutdown",
            Reason::ConcurrencyLimit => "refused: concurrency_limit",
            Reason::BudgetLimit => "refused: budget_limit",
            Reason::QueueLimit => "refused: queue_limit",
            Reason::Timeout => "refused: timeout",
            Reason::Aborted => "refused: aborted",
        });
    }

    fn waiter_mut(&mut self, key: u64) -> &mut ModelWaiter {
        self.waiters
            .iter_mut()
            .find(|w| w.key == key)
            .expect("a live waiter")
    }

    fn remove_waiter(&mut self, key: u64) -> ModelWaiter {
        let at = self
            .waiters
            .iter()
            .position(|w| w.key == key)
            .expect("a live waiter");
        self.waiters.remove(at)
    }

    /// Hands free capacity to the queue head, in order (design §U2.3, with Q7: the head's
    /// slot and tokens are taken together). The head keeps its place until a slot frees,
    /// whatever its tokens; when one is free, tokens that do not fit refuse it `budget_limit`
    /// and the turn passes on (design §U3.2; crate policy.rs `Turn::Head`).
    pub(crate) fn pump(&mut self) {
        while let Some(&key) = self.queue.front() {
            let ask = self.waiter_mut(key).ask;
            let reason = if self.closed {
                // Unreachable: `close` empties the queue. The crate's policy says shutdown.
                Reason::Shutdown
            } else if !self.slot_free() {
                break;
            } else if self.tokens_fit(ask) {
                // Slot and tokens first, then out of the queue: one step in the crate.
                self.take(ask.reserved());
                self.leave_queue(key);
                let revision = self.limits.revision;
                self.waiter_mut(key).state = WaiterState::Handed { revision };
                self.note("handed a slot");
                if ask.reserved() > 0 {
                    self.note("handed a slot and tokens");
                }
                continue;
            } else {
                self.note("queue head refused for its tokens");
                Reason::BudgetLimit
            };
            self.leave_queue(key);
            let refused = self.refuse(reason, ask);
            self.waiter_mut(key).state = WaiterState::Refused(refused);
        }
    }

    /// Polls a waiter's future: a decided outcome is picked up (for a hand-off, the counting
    /// of design §U3.2 happens now: the admission is counted and its permit built).
    pub(crate) fn poll_waiter(&mut self, key: u64) -> Poll<Result<ModelPermit, Refused>> {
        let waiter = *self.waiter_mut(key);
        match waiter.state {
            WaiterState::Queued => Poll::Pending,
            WaiterState::Handed { revision } => {
                self.remove_waiter(key);
                if self.closed {
                    self.note("hand-off picked up after close");
                }
                Poll::Ready(Ok(self.admit(waiter.ask, revision)))
            }
            WaiterState::Refused(refused) => {
                self.remove_waiter(key);
                self.announce_reject(refused);
                self.note_refusal(refused.reason);
                Poll::Ready(Err(refused))
            }
        }
    }

    /// Drops a waiter's future (design §D3: a dropped waiter counts as `aborted`; §D2: a
    /// hand-off it received passes on, so no waiter is stranded).
    pub(crate) fn cancel_waiter(&mut self, key: u64) {
        let waiter = self.remove_waiter(key);
        let refused = match waiter.state {
            WaiterState::Queued => {
                self.leave_queue(key);
                self.note("cancelled while queued");
                self.refuse(Reason::Aborted, waiter.ask)
            }
            WaiterState::Handed { .. } => {
                // Counted with the slot still held, then the slot and tokens go back as a
                // release returns them (to the next waiter, if any).
                let refused = self.refuse(Reason::Aborted, waiter.ask);
                self.release_capacity(waiter.ask.reserved());
                self.note("cancelled after a hand-off");
                refused
            }
            WaiterState::Refused(refused) => {
                self.note("cancelled after a refusal");
                refused
            }
        };
        self.announce_reject(refused);
    }

    /// `report_usage` / `report_usage_progressive` (design §U4.3; Q4 booking). Checks
    /// everything before changing anything.
    pub(crate) fn report(
        &mut self,
        permit: &mut ModelPermit,
        usage: (u64, u64),
        progressive: Option<(u64, u64)>,
    ) -> Result<UsageSnapshot, UsageError> {
        // Step 2: the remaining output may not exceed the reserved output cap (only checked
        // when there is a reservation).
        if let (Some((remaining, _)), Some((_, cap))) = (progressive, permit.reservation)
            && remaining > cap
        {
            self.note("usage error: remaining exceeds cap");
            return Err(UsageError::RemainingExceedsCap { remaining, cap });
        }
        // Step 3: cumulative, per field; the clamped total must fit in 64 bits.
        let reported = match permit.reported {
            None => usage,
            Some((input, output)) => (input.max(usage.0), output.max(usage.1)),
        };
        if reported.0.checked_add(reported.1).is_none() {
            self.note("usage error: clamped total overflows");
            return Err(UsageError::TotalOverflow {
                input: reported.0,
                output: reported.1,
            });
        }
        // Step 4: the new hold.
        let hold = match permit.reservation {
            None => Some(0),
            Some((_, max_output)) => match progressive {
                // Legacy: actual input plus the whole output reservation, expanded by output
                // beyond it.
                None => reported.0.checked_add(max_output.max(reported.1)),
                // Progressive: what may still come, plus the margin, plus output beyond the
                // reservation.
                Some((remaining, margin)) => remaining
                    .checked_add(margin)
                    .and_then(|h| h.checked_add(reported.1.saturating_sub(max_output))),
            },
        };
        // The hold, and the tokens in flight with it, must fit what the crate counts
        // (`MAX_BUDGET`, crate limits.rs).
        let tokens = hold.and_then(|hold| {
            (u128::from(self.tokens) - u128::from(permit.held) + u128::from(hold)
                <= u128::from(MAX_BUDGET))
            .then(|| self.tokens - permit.held + hold)
        });
        let (Some(hold), Some(tokens)) = (hold, tokens) else {
            self.note("usage error: hold overflows");
            return Err(UsageError::HoldOverflow);
        };
        let previous_hold = permit.held;
        let moved = hold != previous_hold;
        if moved {
            self.tokens = tokens;
            self.record(book(permit.reserved(), previous_hold, hold));
        }
        let usage_changed = permit.reported != Some(reported);
        permit.held = hold;
        permit.reported = Some(reported);
        // Step 5: only an effective report counts and is announced.
        if usage_changed || moved {
            permit.sequence += 1;
            if self.listening {
                self.events.push(Observed::Usage {
                    revision: permit.revision,
                    sequence: permit.sequence,
                    reserved: permit.reserved(),
                    previous_held: previous_hold,
                    held: hold,
                    usage: reported,
                });
            }
        } else {
            self.note("stale usage report");
        }
        if permit.reservation.is_some() && hold == 0 {
            self.note("hold driven to zero");
        }
        // Step 6: the snapshot.
        let consumed = reported.0 + reported.1;
        let output_cap = permit.reservation.map(|(_, cap)| cap);
        Ok(UsageSnapshot {
            limit_revision: permit.revision,
            sequence: permit.sequence,
            reserved: permit.reserved(),
            held: hold,
            consumed,
            output_cap,
            output_remaining: output_cap.map(|cap| cap.saturating_sub(reported.1)),
            over_reservation: permit.reservation.is_some() && consumed > permit.reserved(),
        })
    }

    fn record(&mut self, booking: Booking) {
        self.overrun += u128::from(booking.overrun);
        self.refunded += u128::from(booking.refunded);
        self.reheld += u128::from(booking.reheld);
        if booking.overrun > 0 {
            self.note("overrun booked");
        }
        if booking.reheld > 0 {
            self.note("tokens re-held");
        }
    }

    /// Settles an admission: `release(usage)`, or a drop (`usage` none) (design §U4.4 with
    /// Q3: the usage given, else the last reported one, always reaches `total_consumed`; the
    /// hold moves to that usage before it is returned, booked like any move, crate usage.rs).
    pub(crate) fn settle(&mut self, permit: ModelPermit, usage: Option<(u64, u64)>) -> Settled {
        let usage = usage.or(permit.reported);
        let mut booking = book(0, 0, 0);
        match usage {
            Some((input, output)) => {
                let total = input + output;
                self.consumed += u128::from(total);
                if permit.reservation.is_some() {
                    booking = book(permit.reserved(), permit.held, total);
                    self.record(booking);
                    if permit.held == 0 {
                        self.note("settled a hold of zero with usage");
                    }
                }
            }
            None => {
                if permit.reservation.is_some() {
                    self.all_settled_with_usage = false;
                }
            }
        }
        self.released += 1;
        self.release_capacity(permit.held);
        if self.listening {
            self.events.push(Observed::Release {
                revision: permit.revision,
                reserved: permit.reserved(),
                held: permit.held,
                refunded: booking.refunded,
                sequence: permit.sequence,
                usage,
            });
        }
        Settled {
            held_tokens: permit.held,
            refunded_tokens: booking.refunded,
            overrun_tokens: booking.overrun,
            usage,
        }
    }

    /// Installs new limits (design §U8.2): shrink by attrition, raised limits serve
    /// the queue at once.
    fn install(&mut self, next: ModelLimits) -> ModelLimits {
        let previous = self.limits;
        self.limits = next;
        if !self.queue.is_empty() {
            self.note("limits changed while calls wait");
            self.pump();
        }
        if self.listening {
            self.events.push(Observed::Reconfigure {
                previous,
                current: next,
            });
        }
        previous
    }

    /// `apply_limits` (design §U8.2): the revision bound first, then staleness without
    /// examining the rest, then the rest (crate limits.rs `validate`: the word's bounds, and
    /// the budget's presence fixed at construction).
    pub(crate) fn apply_limits(&mut self, next: ModelLimits) -> Result<LimitsOutcome, LimitsError> {
        if next.revision > MAX_REVISION {
            self.note("limits refused");
            return Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        if next.revision <= self.limits.revision {
            self.note("stale limits");
            return Ok(LimitsOutcome::Stale {
                current: self.limits,
            });
        }
        let invalid = if next.max_concurrent > MAX_CONCURRENT {
            Some(LimitsError::MaxConcurrentTooLarge {
                value: next.max_concurrent,
                max: MAX_CONCURRENT,
            })
        } else {
            match (self.has_budget, next.budget) {
                (true, None) => Some(LimitsError::TokenBudgetRequired),
                (false, Some(_)) => Some(LimitsError::TokenBudgetNotConfigured),
                (true, Some((budget, _))) if budget > MAX_BUDGET => {
                    Some(LimitsError::BudgetTooLarge {
                        value: budget,
                        max: MAX_BUDGET,
                    })
                }
                _ => None,
            }
        };
        if let Some(error) = invalid {
            self.note("limits refused");
            return Err(error);
        }
        self.note("limits applied");
        let previous = self.install(next);
        Ok(LimitsOutcome::Applied {
            previous,
            current: next,
        })
    }

    /// `set_budget` (design §U8.4): the budget only, at the next revision, keeping the
    /// reserve.
    pub(crate) fn set_budget(&mut self, tokens: u64) -> Result<ModelLimits, LimitsError> {
        let Some((_, reserve)) = self.limits.budget else {
            return Err(LimitsError::TokenBudgetNotConfigured);
        };
        if self.limits.revision >= MAX_REVISION {
            self.note("limits refused");
            return Err(LimitsError::RevisionExhausted {
                current: self.limits.revision,
            });
        }
        if tokens > MAX_BUDGET {
            self.note("limits refused");
            return Err(LimitsError::BudgetTooLarge {
                value: tokens,
                max: MAX_BUDGET,
            });
        }
        let next = ModelLimits {
            revision: self.limits.revision + 1,
            budget: Some((tokens, reserve)),
            ..self.limits
        };
        self.note("budget set");
        self.install(next);
        Ok(next)
    }

    /// `close` (design §U15.1, Q1/Q2): idempotent; every queued waiter is refused
    /// `shutdown`, in order (a waiter already handed a slot keeps it).
    pub(crate) fn close(&mut self) -> bool {
        if self.closed {
            return false;
        }
        self.closed = true;
        // Design §U15.1: every waiter is refused, and each refusal's detail is the state after
        // the close emptied the queue (`pending: 0` for all of them).
        let refused: Vec<u64> = self.queue.iter().copied().collect();
        for &key in &refused {
            self.leave_queue(key);
        }
        for key in refused {
            let ask = self.waiter_mut(key).ask;
            let refused = self.refuse(Reason::Shutdown, ask);
            self.waiter_mut(key).state = WaiterState::Refused(refused);
            self.note("waiter refused by close");
        }
        true
    }

    /// `would_admit` (design §U3.6 with Q1): reserves and counts nothing.
    pub(crate) fn would_admit(&self, ask: Ask) -> (ModelVerdict, Detail) {
        let verdict = match self.judge_newcomer(ask) {
            Ok(()) => ModelVerdict::Admit,
            Err(Refusal::NoSlot) => match self.queue_verdict() {
                Ok(()) => ModelVerdict::Queue,
                Err(reason) => ModelVerdict::Reject(reason),
            },
            Err(refusal) => {
                ModelVerdict::Reject(Model::reason_of(refusal, Reason::ConcurrencyLimit))
            }
        };
        (verdict, self.detail(ask))
    }

    /// `drain_timeout(0)` (design §U15.3: an idle bulkhead wins over the zero timer).
    pub(crate) fn drain_now(&self) -> (bool, u64, u64) {
        if self.is_idle() {
            (true, 0, 0)
        } else {
            (false, self.slots, self.pending())
        }
    }

    /// Whether a drain that started at `epoch` is done (Q5: idle now, or idle at some moment
    /// since).
    pub(crate) fn drain_done(&self, epoch: u64) -> bool {
        self.is_idle() || self.idle_epoch != epoch
    }

    pub(crate) fn stats(&self) -> ModelStats {
        ModelStats {
            limits: self.limits,
            closed: self.closed,
            in_flight: self.slots,
            pending: self.pending(),
            admitted: self.admitted,
            released: self.released,
            rejected: self.rejected.iter().sum(),
            rejected_by_reason: self.rejected,
            tokens: self.limits.budget.map(|(budget, reserve)| TokenStats {
                budget,
                high_priority_reserve: reserve,
                in_flight_tokens: self.tokens,
                // Not adjusted for priority (design §U4.5, Q11).
                available: budget.saturating_sub(self.tokens),
                total_reserved: saturate(self.reserved),
                total_consumed: saturate(self.consumed),
                total_refunded: saturate(self.refunded - self.reheld),
                total_overrun: saturate(self.overrun),
            }),
            listener_panics: 0,
        }
    }
}
