//! The reference model's operations, one per public operation of the crate.

use std::task::Poll;

use async_bulkhead_llm::{limits::MAX_BUDGET, usage::UsageError};

use super::state::Model;
use super::values::{
    Ask, Booking, Cause, ClassStats, ClassesStats, Constraint, Detail, ModelLimits, ModelPermit,
    ModelStats, ModelVerdict, ModelWaiter, Observed, Reason, Refusal, Refused, Settled, Started,
    TokenStats, UsageSnapshot, WaiterState, book, saturate,
};

impl Model {
    /// `try_acquire`: admits now or refuses now, never waits.
    pub(crate) fn try_acquire(&mut self, ask: Ask) -> Result<ModelPermit, Refused> {
        // The rate windows first (crate rate.rs), their charge given back on a refusal.
        let charged = self.charge_windows(ask)?;
        match self.judge_newcomer(ask) {
            Ok(()) => {
                let borrowed = self.take(ask);
                Ok(self.admit(ask, self.limits.revision, borrowed))
            }
            Err(refusal) => {
                if charged {
                    self.refund_windows(ask, "rate charge given back: refused now");
                }
                let (reason, constraint) = refusal.reason(Reason::ConcurrencyLimit);
                self.note_refusal(reason, constraint, Some(ask));
                let refused = self.refuse(reason, constraint, ask);
                self.announce_reject(ask.class, refused);
                Err(refused)
            }
        }
    }

    /// An `acquire` at its first poll (design §U3.2 with Q1 and Q7, §U2.1).
    pub(crate) fn acquire(&mut self, ask: Ask, zero_timeout: bool) -> Started {
        // The rate windows first (crate rate.rs): a queued call keeps its charge while it
        // waits; any refusal gives it back.
        let charged = match self.charge_windows(ask) {
            Ok(charged) => charged,
            Err(refused) => return Started::Refused(refused),
        };
        let (reason, constraint) = match self.judge_newcomer(ask) {
            Ok(()) => {
                let borrowed = self.take(ask);
                return Started::Admitted(self.admit(ask, self.limits.revision, borrowed));
            }
            Err(Refusal::NoSlot) => match self.queue_verdict() {
                Ok(()) => {
                    let key = self.next_key;
                    self.next_key += 1;
                    self.queue.push_back(key);
                    self.note("queued");
                    if charged {
                        self.note("queued with a rate charge");
                    }
                    if ask.class.is_some_and(|c| self.caps(c).floor() > 0)
                        && !self.borrowing(ask).slot
                    {
                        self.note("queued within a floor");
                    }
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
                    (Reason::Timeout, Some(Constraint::Global))
                }
                Err(reason) => (reason, Some(Constraint::Global)),
            },
            Err(refusal) => refusal.reason(Reason::ConcurrencyLimit),
        };
        if charged {
            self.refund_windows(ask, "rate charge given back: refused now");
        }
        self.note_refusal(reason, constraint, Some(ask));
        let refused = self.refuse(reason, constraint, ask);
        self.announce_reject(ask.class, refused);
        Started::Refused(refused)
    }

    /// Notes a refusal announced to its caller; `now` is the call refused at this moment
    /// (before it is counted), none for an outcome decided earlier.
    fn note_refusal(&mut self, reason: Reason, constraint: Option<Constraint>, now: Option<Ask>) {
        self.note(match reason {
            Reason::Shutdown => "refused: shutdown",
            Reason::ConcurrencyLimit => "refused: concurrency_limit",
            Reason::BudgetLimit => "refused: budget_limit",
            Reason::QueueLimit => "refused: queue_limit",
            Reason::Timeout => "refused: timeout",
            Reason::Aborted => "refused: aborted",
            Reason::RateLimit => "refused: rate_limit",
        });
        match (reason, constraint) {
            (Reason::BudgetLimit, Some(Constraint::AdmissionClass)) => {
                self.note("refused: class token ceiling")
            }
            (Reason::ConcurrencyLimit, Some(Constraint::AdmissionClass)) => {
                self.note("refused: class concurrency ceiling")
            }
            (Reason::ConcurrencyLimit, Some(Constraint::AdmissionClassProtection)) => {
                self.note("refused: concurrency protection")
            }
            (Reason::BudgetLimit, Some(Constraint::AdmissionClassProtection)) => {
                self.note("refused: token protection")
            }
            (Reason::ConcurrencyLimit | Reason::QueueLimit, Some(Constraint::Global))
                if now.is_some_and(|ask| {
                    ask.class.is_some_and(|c| self.caps(c).floor() > 0) && !self.borrowing(ask).slot
                }) =>
            {
                self.note("refused: global concurrency within a floor")
            }
            _ => {}
        }
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
    /// whatever its tokens; when one is free, it is judged again on the budget and its class
    /// (design §D4, §U6.4): what does not fit refuses it with that reason and the turn passes
    /// on (design §U3.2; crate policy.rs `Turn::Head`).
    pub(crate) fn pump(&mut self) {
        while let Some(&key) = self.queue.front() {
            let ask = self.waiter_mut(key).ask;
            let (reason, constraint) = if self.closed {
                // Unreachable: `close` empties the queue. The crate's policy says shutdown.
                (Reason::Shutdown, None)
            } else if !self.slot_free() {
                break;
            } else {
                match self.judge_capacity(ask) {
                    Ok(()) => {
                        // Slot and tokens first, then out of the queue: one step in the crate.
                        let borrowed = self.take(ask);
                        self.leave_queue(key);
                        let revision = self.limits.revision;
                        self.waiter_mut(key).state = WaiterState::Handed { revision, borrowed };
                        self.note("handed a slot");
                        if ask.reserved() > 0 {
                            self.note("handed a slot and tokens");
                        }
                        continue;
                    }
                    Err(refusal) => {
                        self.note(if refusal == Refusal::Budget {
                            "queue head refused for its tokens"
                        } else {
                            "queue head refused by its class"
                        });
                        refusal.reason(Reason::ConcurrencyLimit)
                    }
                }
            };
            self.leave_queue(key);
            let refused = self.refuse(reason, constraint, ask);
            self.waiter_mut(key).state = WaiterState::Refused(refused);
        }
    }

    /// Polls a waiter's future: a decided outcome is picked up (for a hand-off, the counting
    /// of design §U3.2 happens now: the admission is counted and its permit built).
    pub(crate) fn poll_waiter(&mut self, key: u64) -> Poll<Result<ModelPermit, Refused>> {
        let waiter = *self.waiter_mut(key);
        match waiter.state {
            WaiterState::Queued => Poll::Pending,
            WaiterState::Handed { revision, borrowed } => {
                self.remove_waiter(key);
                if self.closed {
                    self.note("hand-off picked up after close");
                }
                Poll::Ready(Ok(self.admit(waiter.ask, revision, borrowed)))
            }
            WaiterState::Refused(refused) => {
                self.remove_waiter(key);
                // Its wait ended refused: its rate charge goes back (crate waiting.rs
                // `pick_up`, rate.rs).
                self.refund_windows(waiter.ask, "rate charge given back: wait ended refused");
                self.announce_reject(waiter.ask.class, refused);
                self.note_refusal(refused.reason, refused.detail.constraint, None);
                Poll::Ready(Err(refused))
            }
        }
    }

    /// Drops a waiter's future (design §D3: a dropped waiter counts as `aborted`; §D2: a
    /// hand-off it received passes on, so no waiter is stranded).
    pub(crate) fn cancel_waiter(&mut self, key: u64) {
        let waiter = self.remove_waiter(key);
        let ask = waiter.ask;
        // Cancelled in any state, the wait ended refused (`aborted`): its rate charge goes
        // back, a hand-off's too (crate waiting.rs `cancel`, rate.rs).
        self.refund_windows(ask, "rate charge given back: wait cancelled");
        let refused = match waiter.state {
            WaiterState::Queued => {
                self.leave_queue(key);
                self.note("cancelled while queued");
                self.refuse(Reason::Aborted, None, ask)
            }
            WaiterState::Handed { .. } => {
                // Counted with the slot still held, then the slot and tokens go back as a
                // release returns them (to the next waiter, if any).
                let refused = self.refuse(Reason::Aborted, None, ask);
                self.release_capacity(ask.class, true, ask.reserved());
                self.note("cancelled after a hand-off");
                refused
            }
            WaiterState::Refused(refused) => {
                self.note("cancelled after a refusal");
                refused
            }
        };
        self.announce_reject(ask.class, refused);
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
            // The class's tokens move with the hold (design §U6.3: they fall only at
            // settlement, and otherwise follow the hold like `T`).
            if let Some(class) = permit.class {
                let state = &mut self.classes[class];
                state.tokens = state.tokens - previous_hold + hold;
            }
            let booking = book(permit.reserved(), previous_hold, hold);
            permit.refunded += booking.refunded;
            self.record(permit.class, booking);
        }
        // Usage beyond the reservation is charged to the tokens window as it is reported
        // (crate rate.rs "a report beyond its reservation is charged when it arrives", usage.rs).
        let reserved = permit.reserved();
        let before = permit
            .reported
            .map_or(0, |(input, output)| input + output)
            .max(reserved);
        self.correct_windows(
            permit.class,
            before,
            (reported.0 + reported.1).max(reserved).max(before),
        );
        let usage_changed = permit.reported != Some(reported);
        permit.held = hold;
        permit.reported = Some(reported);
        // Step 5: only an effective report counts and is announced.
        if usage_changed || moved {
            permit.sequence += 1;
            if self.listening {
                self.events.push(Observed::Usage {
                    revision: permit.revision,
                    class: permit.class,
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

    /// Books a move of a hold, globally and for the class (design §U6.3).
    fn record(&mut self, class: Option<usize>, booking: Booking) {
        self.overrun += u128::from(booking.overrun);
        self.refunded += u128::from(booking.refunded);
        self.reheld += u128::from(booking.reheld);
        if let Some(class) = class {
            let state = &mut self.classes[class];
            state.overrun += u128::from(booking.overrun);
            state.refunded += u128::from(booking.refunded);
            state.reheld += u128::from(booking.reheld);
        }
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
    /// An admission that gave its slot back settles its tokens only (design §U7.2).
    pub(crate) fn settle(&mut self, permit: ModelPermit, usage: Option<(u64, u64)>) -> Settled {
        let usage = usage.or(permit.reported);
        let mut booking = book(0, 0, 0);
        if let Some(class) = permit.class {
            self.classes[class].released += 1;
        }
        if !permit.holds_slot {
            self.note("released an abandoned admission");
        }
        match usage {
            Some((input, output)) => {
                let total = input + output;
                // The tokens charge moves from what was charged (the reservation, or more
                // reported beyond it) to the usage (crate rate.rs "A settled call's tokens
                // charge is corrected to its reported usage", usage.rs `settle`).
                let charged = permit
                    .reported
                    .map_or(0, |(input, output)| input + output)
                    .max(permit.reserved());
                self.correct_windows(permit.class, charged, total);
                self.consumed += u128::from(total);
                if let Some(class) = permit.class {
                    self.classes[class].consumed += u128::from(total);
                }
                if permit.reservation.is_some() {
                    booking = book(permit.reserved(), permit.held, total);
                    self.record(permit.class, booking);
                    if permit.held == 0 {
                        self.note("settled a hold of zero with usage");
                    }
                }
            }
            None => {
                if permit.reservation.is_some() {
                    self.all_settled_with_usage = false;
                }
                // Nobody said what it cost: the hold goes back as returned unreported.
                self.returned_unreported += u128::from(permit.held);
                if let Some(class) = permit.class {
                    self.classes[class].returned_unreported += u128::from(permit.held);
                }
                if permit.held > 0 {
                    self.note("returned a hold unreported");
                }
            }
        }
        self.released += 1;
        self.release_capacity(permit.class, permit.holds_slot, permit.held);
        if self.listening {
            self.events.push(Observed::Release {
                revision: permit.revision,
                class: permit.class,
                borrowed: permit.borrowed,
                reserved: permit.reserved(),
                held: permit.held,
                refunded: booking.refunded,
                returned: permit.held,
                returned_total: permit.refunded + permit.held,
                sequence: permit.sequence,
                usage,
            });
        }
        Settled {
            held_tokens: permit.held,
            refunded_tokens: booking.refunded,
            overrun_tokens: booking.overrun,
            returned_tokens: permit.held,
            returned_total_tokens: permit.refunded + permit.held,
            usage,
        }
    }

    /// `abandon_borrowed_concurrency` (design §U7.2), or a `run` deadline (§U7.3): only an
    /// admission that borrowed its slot and still holds it gives it back; the slot serves the
    /// queue at once, the tokens stay held, the abandonment is counted and announced.
    pub(crate) fn abandon(&mut self, permit: &mut ModelPermit, cause: Cause) -> bool {
        if !permit.borrowed.slot || !permit.holds_slot {
            self.note(if permit.holds_slot {
                "abandon refused: slot not borrowed"
            } else {
                "abandon refused: already abandoned"
            });
            return false;
        }
        permit.holds_slot = false;
        self.slots -= 1;
        self.abandoned += 1;
        self.abandoned_by[cause as usize] += 1;
        let class = permit.class.expect("only a class admission borrows");
        self.classes[class].slots -= 1;
        self.classes[class].abandoned[cause as usize] += 1;
        if self.listening {
            self.events.push(Observed::Abandon {
                revision: permit.revision,
                high: permit.high,
                class: permit.class,
                borrowed: permit.borrowed,
                cause,
                held: permit.held,
            });
        }
        self.note(match cause {
            Cause::Manual => "abandoned: manual",
            Cause::Deadline => "abandoned: deadline",
        });
        if !self.queue.is_empty() {
            self.note("abandoned slot served the queue");
            self.pump();
        }
        true
    }

    /// Installs new limits (design §U8.2): shrink by attrition, raised limits serve
    /// the queue at once.
    pub(crate) fn install(&mut self, next: ModelLimits) -> ModelLimits {
        // The windows move to the new limits' ticks (crate rate.rs `Words::rescale`).
        self.rescale_windows(&next);
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
            let refused = self.refuse(Reason::Shutdown, None, ask);
            self.waiter_mut(key).state = WaiterState::Refused(refused);
            self.note("waiter refused by close");
        }
        true
    }

    /// `would_admit` (design §U3.6 with Q1): reserves and counts nothing. The detail is the
    /// snapshot a refusal would carry; a verdict that refuses nothing (admit, or queue) names
    /// no constraint.
    pub(crate) fn would_admit(&self, ask: Ask) -> (ModelVerdict, Detail) {
        if !self.closed && !self.windows_would_fit(ask) {
            return (
                ModelVerdict::Reject(Reason::RateLimit),
                self.detail(ask, None),
            );
        }
        let (verdict, constraint) = match self.judge_newcomer(ask) {
            Ok(()) => (ModelVerdict::Admit, None),
            Err(Refusal::NoSlot) => match self.queue_verdict() {
                Ok(()) => (ModelVerdict::Queue, None),
                Err(reason) => (ModelVerdict::Reject(reason), Some(Constraint::Global)),
            },
            Err(refusal) => {
                let (reason, constraint) = refusal.reason(Reason::ConcurrencyLimit);
                (ModelVerdict::Reject(reason), constraint)
            }
        };
        (verdict, self.detail(ask, constraint))
    }

    /// `drain_timeout(0)` (design §U15.3: an idle bulkhead wins over the zero timer; its
    /// `in_flight` counts abandoned admissions not settled, §U7.4).
    pub(crate) fn drain_now(&self) -> (bool, u64, u64) {
        if self.is_idle() {
            (true, 0, 0)
        } else {
            (false, self.slots + self.abandoned, self.pending())
        }
    }

    /// Whether a drain that started at `epoch` is done (Q5: idle now, or idle at some moment
    /// since).
    pub(crate) fn drain_done(&self, epoch: u64) -> bool {
        self.is_idle() || self.idle_epoch != epoch
    }

    pub(crate) fn stats(&self) -> ModelStats {
        let [manual, deadline] = self.abandoned_by;
        ModelStats {
            limits: self.limits,
            closed: self.closed,
            in_flight: self.slots,
            abandoned_in_flight: self.abandoned,
            abandoned: (manual + deadline, manual, deadline),
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
                total_refunded: saturate(self.refunded),
                total_overrun: saturate(self.overrun),
                total_reheld: saturate(self.reheld),
                total_returned_unreported: saturate(self.returned_unreported),
            }),
            listener_panics: 0,
            classes: self
                .default_class
                .map(|default_class| self.classes_stats(default_class)),
            dedup: self.flights.kind.map(|_| {
                (
                    self.flights.active(),
                    self.flights.hits,
                    self.flights.key_panics,
                )
            }),
            observe: (self.observe.bypassed > 0).then_some(self.observe),
        }
    }

    /// The class part of `stats()` (design §U12, §U6.3, §U6.4): the shared pools (tokens
    /// against the raw budget), each class in order.
    fn classes_stats(&self, default_class: usize) -> ClassesStats {
        let (floors, token_floors) = self.floor_sums();
        let (slots_in_use, tokens_in_use) = self.shared_in_use();
        let pool = |capacity: u64, in_use: u64| (capacity, in_use, capacity.saturating_sub(in_use));
        ClassesStats {
            default_class,
            shared: pool(
                u64::from(self.limits.max_concurrent).saturating_sub(floors),
                slots_in_use,
            ),
            shared_tokens: self
                .limits
                .budget
                .map(|(budget, _)| pool(budget.saturating_sub(token_floors), tokens_in_use)),
            classes: self
                .classes
                .iter()
                .enumerate()
                .map(|(class, state)| {
                    let caps = self.caps(class);
                    let split =
                        |held: u64, floor: u64| (held, held.min(floor), held.saturating_sub(floor));
                    let [manual, deadline] = state.abandoned;
                    ClassStats {
                        class,
                        limits: caps,
                        slots: split(state.slots, caps.floor()),
                        tokens: split(state.tokens, caps.token_floor()),
                        admitted: state.admitted,
                        released: state.released,
                        abandoned: (manual + deadline, manual, deadline),
                        rejected: state.rejected.iter().sum(),
                        rejected_by_reason: state.rejected,
                        total_reserved: saturate(state.reserved),
                        total_consumed: saturate(state.consumed),
                        total_refunded: saturate(state.refunded),
                        total_overrun: saturate(state.overrun),
                        total_reheld: saturate(state.reheld),
                        total_returned_unreported: saturate(state.returned_unreported),
                        total_borrowed_admissions: state.borrowed_admissions,
                        total_borrowed_tokens_reserved: saturate(state.borrowed_tokens),
                    }
                })
                .collect(),
        }
    }
}
