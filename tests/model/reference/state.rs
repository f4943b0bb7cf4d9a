//! The reference model's state: resolution, derived figures and state changes.

use std::collections::{BTreeMap, VecDeque};

use async_bulkhead_llm::RequestError;

use super::harness::{Call, MAX_CHARS};
use super::values::{
    Ask, DEFAULT_OUTPUT_CAP, Detail, ModelLimits, ModelPermit, ModelWaiter, Observed, Reason,
    Refusal, Refused, TokenDetail,
};

pub(crate) struct Model {
    /// Whether the bulkhead has a token budget (fixed at construction, design §U1.4).
    pub(crate) has_budget: bool,
    pub(crate) limits: ModelLimits,
    pub(crate) closed: bool,
    /// Slots held: by permits, and by waiters handed a slot that have not picked it up.
    pub(crate) slots: u64,
    /// Tokens in flight `T` (design §U4).
    pub(crate) tokens: u64,
    /// Keys of the queued waiters, in arrival order (design §U2: strictly FIFO).
    pub(crate) queue: VecDeque<u64>,
    /// Every waiter whose future has not finished, in creation order.
    pub(crate) waiters: Vec<ModelWaiter>,
    pub(crate) next_key: u64,
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    pub(crate) rejected: [u64; 6],
    // Exact cumulative token totals; `stats()` saturates them like the crate.
    pub(crate) reserved: u128,
    pub(crate) consumed: u128,
    pub(crate) refunded: u128,
    pub(crate) reheld: u128,
    pub(crate) overrun: u128,
    /// Whether every settled admission with a reservation knew its usage (design §U4.5).
    pub(crate) all_settled_with_usage: bool,
    /// Counts the moments the bulkhead became idle (design §U15.2, Q5).
    pub(crate) idle_epoch: u64,
    /// Whether an event listener is subscribed.
    pub(crate) listening: bool,
    /// Events emitted and not yet compared.
    pub(crate) events: Vec<Observed>,
    /// Notable situations reached, for coverage checks.
    pub(crate) tally: BTreeMap<&'static str, u64>,
}

impl Model {
    pub(crate) fn new(limits: ModelLimits) -> Model {
        Model {
            has_budget: limits.budget.is_some(),
            limits,
            closed: false,
            slots: 0,
            tokens: 0,
            queue: VecDeque::new(),
            waiters: Vec::new(),
            next_key: 0,
            admitted: 0,
            released: 0,
            rejected: [0; 6],
            reserved: 0,
            consumed: 0,
            refunded: 0,
            reheld: 0,
            overrun: 0,
            all_settled_with_usage: true,
            idle_epoch: 0,
            listening: false,
            events: Vec::new(),
            tally: BTreeMap::new(),
        }
    }

    pub(crate) fn note(&mut self, what: &'static str) {
        *self.tally.entry(what).or_insert(0) += 1;
    }

    // ----- resolution (design §U3.1, §U3.7, §U13.3) -----

    /// The estimate of the call's request by the default model-aware estimator (design
    /// §U13.3): input `ceil(chars / ratio) + extra_input_tokens`, maximum output `max_tokens`
    /// or the output cap; a sum that does not fit in 64 bits is an error naming its parts.
    pub(crate) fn estimate(call: &Call) -> Result<(u64, u64), RequestError> {
        let ratio = match call.model % 4 {
            0 => 4.0, // the bulkhead's own model, unknown to the table: the fallback
            1 | 3 => 3.7,
            _ => 3.9,
        };
        let text_tokens = (f64::from(call.chars % MAX_CHARS) / ratio).ceil() as u64;
        let extra = if call.has_extra_input {
            call.extra_input
        } else {
            0
        };
        let input = text_tokens
            .checked_add(extra)
            .ok_or(RequestError::InputOverflow {
                text_tokens,
                opaque_tokens: 0,
                extra_input_tokens: extra,
            })?;
        let max_output = if call.has_max_tokens {
            call.max_tokens
        } else {
            DEFAULT_OUTPUT_CAP
        };
        match input.checked_add(max_output) {
            Some(_) => Ok((input, max_output)),
            None => Err(RequestError::ReservationOverflow { input, max_output }),
        }
    }

    /// Resolves a call (design §U3.1): without a budget nothing is estimated and an override
    /// is ignored; an override replaces the estimator; else the estimator. An explicit
    /// reservation was checked when it was built.
    pub(crate) fn resolve(&self, call: &Call) -> Result<Ask, RequestError> {
        let reservation = if !self.has_budget {
            None
        } else if call.explicit {
            Some((call.input, call.max_output))
        } else {
            Some(Model::estimate(call)?)
        };
        Ok(Ask {
            high: call.high,
            reservation,
        })
    }

    // ----- derived figures -----

    pub(crate) fn pending(&self) -> u64 {
        self.queue.len() as u64
    }

    /// No slot held and nobody queued (design §U15.2).
    pub(crate) fn is_idle(&self) -> bool {
        self.slots == 0 && self.queue.is_empty()
    }

    /// `E(priority)` (design §U3.5, §U5): the whole budget for high priority, the budget
    /// minus the reserve, at least 0, for normal priority.
    fn effective_budget(&self, high: bool) -> Option<u64> {
        self.limits.budget.map(|(budget, reserve)| {
            if high {
                budget
            } else {
                budget.saturating_sub(reserve)
            }
        })
    }

    /// The capacity snapshot for `ask`, now (design §U1.6, and the detail example of §U5).
    pub(crate) fn detail(&self, ask: Ask) -> Detail {
        Detail {
            limit_revision: self.limits.revision,
            in_flight: self.slots,
            max_concurrent: self.limits.max_concurrent,
            pending: self.pending(),
            max_queue: self.limits.max_queue,
            tokens: self.limits.budget.map(|(budget, _)| {
                let effective_budget = self.effective_budget(ask.high).expect("a budget");
                TokenDetail {
                    budget,
                    in_flight_tokens: self.tokens,
                    effective_budget,
                    available: effective_budget.saturating_sub(self.tokens),
                    requested: ask.reserved(),
                }
            }),
        }
    }

    /// Design §U3.4 step 1: refused iff `T + r > E(priority)` (strict: an exact fit
    /// admits; computed without overflow).
    pub(crate) fn tokens_fit(&self, ask: Ask) -> bool {
        match self.effective_budget(ask.high) {
            None => true,
            Some(effective) => {
                u128::from(self.tokens) + u128::from(ask.reserved()) <= u128::from(effective)
            }
        }
    }

    pub(crate) fn slot_free(&self) -> bool {
        self.slots < u64::from(self.limits.max_concurrent)
    }

    /// A newcomer, in the order Q1 fixes: shutdown first, then the priority-adjusted budget
    /// (which never queues, Q7), then a slot. Newcomers never pass a waiter (design §D2:
    /// "newcomers never barge past waiters").
    pub(crate) fn judge_newcomer(&self, ask: Ask) -> Result<(), Refusal> {
        if self.closed {
            Err(Refusal::Shutdown)
        } else if !self.tokens_fit(ask) {
            Err(Refusal::Budget)
        } else if !self.slot_free() || !self.queue.is_empty() {
            Err(Refusal::NoSlot)
        } else {
            Ok(())
        }
    }

    /// A newcomer without a slot (design §U2.1, §U3.8): zero concurrency or a zero
    /// queue never queues (`concurrency_limit`); a full queue is `queue_limit`.
    pub(crate) fn queue_verdict(&self) -> Result<(), Reason> {
        if self.limits.max_concurrent == 0 || self.limits.max_queue == 0 {
            Err(Reason::ConcurrencyLimit)
        } else if self.pending() >= u64::from(self.limits.max_queue) {
            Err(Reason::QueueLimit)
        } else {
            Ok(())
        }
    }

    // ----- state changes -----

    /// Takes a slot and `reserved` tokens in one step (Q7).
    pub(crate) fn take(&mut self, reserved: u64) {
        self.slots += 1;
        self.tokens += reserved;
    }

    /// Returns a slot and `held` tokens (design §U4.4: the whole hold returns), then
    /// serves the queue (design §U2.4: release pumps).
    pub(crate) fn release_capacity(&mut self, held: u64) {
        let was_idle = self.is_idle();
        self.slots -= 1;
        self.tokens -= held;
        self.became_idle(was_idle);
        if !self.queue.is_empty() {
            self.pump();
        }
    }

    /// Takes `key` out of the queue.
    pub(crate) fn leave_queue(&mut self, key: u64) {
        let was_idle = self.is_idle();
        let at = self
            .queue
            .iter()
            .position(|&k| k == key)
            .expect("the waiter is queued");
        self.queue.remove(at);
        self.became_idle(was_idle);
    }

    /// Q5: becoming idle for any reason completes the drains waiting for it.
    fn became_idle(&mut self, was_idle: bool) {
        if !was_idle && self.is_idle() {
            self.idle_epoch += 1;
        }
    }

    /// Counts a refusal and snapshots the capacity now (every refusal counts in `rejected`
    /// and by reason, design §U12).
    pub(crate) fn refuse(&mut self, reason: Reason, ask: Ask) -> Refused {
        self.rejected[reason as usize] += 1;
        Refused {
            reason,
            detail: self.detail(ask),
        }
    }

    /// Emits a reject event if someone listens now (design §D4: every outcome reaches the
    /// listeners registered when it is announced, including an outcome of a call that waited
    /// in the queue since before they subscribed).
    pub(crate) fn announce_reject(&mut self, refused: Refused) {
        if self.listening {
            self.events.push(Observed::Reject(refused));
        }
    }

    /// Counts an admission (design §U3.2: count; §U4.1: `total_reserved += r`) and
    /// builds its permit: it holds its reservation (design §U4.1).
    pub(crate) fn admit(&mut self, ask: Ask, revision: u64) -> ModelPermit {
        self.admitted += 1;
        self.reserved += u128::from(ask.reserved());
        if self.listening {
            self.events.push(Observed::Admit {
                revision,
                reserved: ask.reserved(),
                high: ask.high,
            });
        }
        if ask.high
            && self
                .effective_budget(false)
                .is_some_and(|e| u128::from(self.tokens) > u128::from(e))
        {
            self.note("admitted into the high-priority reserve");
        }
        ModelPermit {
            revision,
            high: ask.high,
            reservation: ask.reservation,
            held: ask.reserved(),
            reported: None,
            sequence: 0,
        }
    }

    pub(crate) fn reason_of(refusal: Refusal, no_slot: Reason) -> Reason {
        match refusal {
            Refusal::Shutdown => Reason::Shutdown,
            Refusal::Budget => Reason::BudgetLimit,
            Refusal::NoSlot => no_slot,
        }
    }
}
