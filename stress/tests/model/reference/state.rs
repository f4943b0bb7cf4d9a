//! The reference model's state: resolution, derived figures and state changes.

use std::collections::{BTreeMap, VecDeque};

use async_bulkhead_llm::request::RequestError;

use async_bulkhead_llm::{classes::AdmissionClass, limits::LimitsError};

use super::flights::{DedupKind, Flights};
use super::harness::{Call, MAX_CHARS};
use super::rate::{CLOCK_START_NS, Windows};
use super::values::{
    Ask, Borrowed, ClassCaps, ClassDetail, ClassTokenDetail, Constraint, DEFAULT_OUTPUT_CAP,
    Detail, ModelLimits, ModelPermit, ModelWaiter, ObserveFigures, Observed, Pool, Reason, Refusal,
    Refused, TokenDetail,
};

/// What a call names as its class (design §U6.2).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Named {
    /// Nothing: the default class.
    Default,
    /// One of this bulkhead's classes, by position.
    Own(usize),
    /// A handle of another bulkhead.
    Foreign(AdmissionClass),
}

/// One class's live figures and counters (design §U6.3).
#[derive(Clone, Debug, Default)]
pub(crate) struct ClassState {
    /// Slots its admissions hold (abandoned ones hold none, design §U7.2).
    pub(crate) slots: u64,
    /// Tokens its admissions hold (abandoned ones included until they settle).
    pub(crate) tokens: u64,
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    /// By cause, in `Cause` order.
    pub(crate) abandoned: [u64; 2],
    pub(crate) rejected: [u64; 7],
    pub(crate) reserved: u128,
    pub(crate) consumed: u128,
    pub(crate) refunded: u128,
    pub(crate) reheld: u128,
    pub(crate) overrun: u128,
    pub(crate) returned_unreported: u128,
    pub(crate) borrowed_admissions: u64,
    pub(crate) borrowed_tokens: u128,
}

pub(crate) struct Model {
    /// Whether the bulkhead has a token budget (fixed at construction, design §U1.4).
    pub(crate) has_budget: bool,
    pub(crate) limits: ModelLimits,
    pub(crate) closed: bool,
    /// Slots held: by permits, and by waiters handed a slot that have not picked it up.
    pub(crate) slots: u64,
    /// Admissions that gave their borrowed slot back and have not settled (design §U7.2).
    pub(crate) abandoned: u64,
    /// Abandonments so far, by cause (design §U12).
    pub(crate) abandoned_by: [u64; 2],
    /// With classes: the default class's position, and each class's figures in order.
    pub(crate) default_class: Option<usize>,
    pub(crate) classes: Vec<ClassState>,
    /// Tokens in flight `T` (design §U4).
    pub(crate) tokens: u64,
    /// Keys of the queued waiters, in arrival order (design §U2: strictly FIFO).
    pub(crate) queue: VecDeque<u64>,
    /// Every waiter whose future has not finished, in creation order.
    pub(crate) waiters: Vec<ModelWaiter>,
    pub(crate) next_key: u64,
    pub(crate) admitted: u64,
    pub(crate) released: u64,
    pub(crate) rejected: [u64; 7],
    // Exact cumulative token totals; `stats()` saturates them like the crate.
    pub(crate) reserved: u128,
    pub(crate) consumed: u128,
    pub(crate) refunded: u128,
    pub(crate) reheld: u128,
    pub(crate) overrun: u128,
    /// Holds returned by settlements that knew no usage.
    pub(crate) returned_unreported: u128,
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
    /// The last refusal announced to a caller, with the call's class (for scenarios).
    pub(crate) last_refused: Option<(Option<usize>, Refused)>,
    /// The last error of `apply_limits` or `set_budget` (for scenarios).
    pub(crate) last_limits_error: Option<LimitsError>,
    /// Deduplication: the flights of `run_shared` calls and their callers.
    pub(crate) flights: Flights,
    /// Observe mode's figures (`stats().observe` once `bypassed > 0`).
    pub(crate) observe: ObserveFigures,
    /// The number the next bypass gets.
    pub(crate) next_shadow: u128,
    /// The bulkhead's pair of rate windows, iff it keeps windows: built with rate limits of
    /// its own or of a class (crate assembly.rs: "Windows iff rate limits are configured
    /// anywhere"); a pair that counts nothing without rate limits of its own.
    pub(crate) windows: Option<Windows>,
    /// Each class's pair, in class order, iff the bulkhead keeps windows and has classes.
    pub(crate) class_windows: Vec<Windows>,
    /// The manual clock's time, nanoseconds (moved by `Op::Advance` with the harness's clock).
    pub(crate) now_ns: u64,
}

/// Whether a bulkhead built with `limits` keeps rate windows (crate assembly.rs).
fn keeps_windows(limits: &ModelLimits) -> bool {
    limits.rate.is_some()
        || limits
            .classes
            .is_some_and(|table| table.iter().any(|(_, caps)| caps.rate.is_some()))
}

impl Model {
    pub(crate) fn new(
        limits: ModelLimits,
        default_class: Option<usize>,
        dedup: Option<DedupKind>,
    ) -> Model {
        Model {
            has_budget: limits.budget.is_some(),
            limits,
            closed: false,
            slots: 0,
            abandoned: 0,
            abandoned_by: [0; 2],
            default_class: default_class.filter(|_| limits.classes.is_some()),
            classes: vec![ClassState::default(); limits.classes.map_or(0, |t| t.len)],
            tokens: 0,
            queue: VecDeque::new(),
            waiters: Vec::new(),
            next_key: 0,
            admitted: 0,
            released: 0,
            rejected: [0; 7],
            reserved: 0,
            consumed: 0,
            refunded: 0,
            reheld: 0,
            overrun: 0,
            returned_unreported: 0,
            all_settled_with_usage: true,
            idle_epoch: 0,
            listening: false,
            events: Vec::new(),
            tally: BTreeMap::new(),
            last_refused: None,
            last_limits_error: None,
            flights: Flights {
                kind: dedup,
                ..Flights::default()
            },
            observe: ObserveFigures::default(),
            next_shadow: 0,
            windows: keeps_windows(&limits).then(|| Windows::of(limits.rate)),
            class_windows: match (keeps_windows(&limits), limits.classes) {
                (true, Some(table)) => table
                    .iter()
                    .map(|(_, caps)| Windows::of(caps.rate))
                    .collect(),
                _ => Vec::new(),
            },
            now_ns: CLOCK_START_NS,
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

    /// Resolves a call (design §U3.1): the class first (design §U6.2: none is the default
    /// class; a class on a bulkhead without classes, or another bulkhead's, is refused before
    /// anything is counted); without a budget nothing is estimated and an override is
    /// ignored; an override replaces the estimator; else the estimator. An explicit
    /// reservation was checked when it was built.
    pub(crate) fn resolve(&self, call: &Call, named: Named) -> Result<Ask, RequestError> {
        let class = self.class_of(named)?;
        let reservation = if !self.has_budget {
            None
        } else if call.explicit {
            Some((call.input, call.max_output))
        } else {
            Some(Model::estimate(call)?)
        };
        Ok(Ask {
            class,
            high: call.high,
            reservation,
        })
    }

    // ----- derived figures -----

    pub(crate) fn pending(&self) -> u64 {
        self.queue.len() as u64
    }

    /// No slot held, no abandoned admission unsettled and nobody queued (design §U15.2,
    /// §U7.4).
    pub(crate) fn is_idle(&self) -> bool {
        self.slots == 0 && self.abandoned == 0 && self.queue.is_empty()
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

    /// The capacity snapshot for `ask`, now (design §U1.6, and the detail example of §U5;
    /// with classes §U6.5, the constraint only with classes).
    pub(crate) fn detail(&self, ask: Ask, constraint: Option<Constraint>) -> Detail {
        Detail {
            constraint: constraint.filter(|_| self.limits.classes.is_some()),
            shared: ask.class.map(|class| self.shared_detail(class, ask)),
            class: ask.class.map(|class| self.class_detail(class, ask)),
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

    // ----- classes (design §U6.4) -----

    pub(crate) fn caps(&self, class: usize) -> ClassCaps {
        self.limits.classes.expect("classes").caps(class)
    }

    /// `(Σ floors, Σ token floors)` of the limits in force.
    pub(crate) fn floor_sums(&self) -> (u64, u64) {
        self.limits.classes.map_or((0, 0), |table| {
            table.iter().fold((0, 0), |(slots, tokens), (_, caps)| {
                (slots + caps.floor(), tokens + caps.token_floor())
            })
        })
    }

    /// The shared pool's use: `Σ_c max(0, in_flight_c − floor_c)` slots, and the same for
    /// tokens (design §D2, §U6.4).
    pub(crate) fn shared_in_use(&self) -> (u64, u64) {
        self.classes
            .iter()
            .enumerate()
            .fold((0, 0), |(slots, tokens), (c, state)| {
                let caps = self.caps(c);
                (
                    slots + state.slots.saturating_sub(caps.floor()),
                    tokens + state.tokens.saturating_sub(caps.token_floor()),
                )
            })
    }

    /// What `ask` would borrow now: its slot iff its class's `in_flight ≥ floor`, and
    /// `max(0, r − max(0, token_floor − in_flight_tokens))` tokens (design §U6.4, §U7.1).
    pub(crate) fn borrowing(&self, ask: Ask) -> Borrowed {
        match ask.class {
            None => Borrowed::default(),
            Some(class) => {
                let (caps, state) = (self.caps(class), &self.classes[class]);
                let free_floor = caps.token_floor().saturating_sub(state.tokens);
                Borrowed {
                    slot: state.slots >= caps.floor(),
                    tokens: ask.reserved().saturating_sub(free_floor),
                }
            }
        }
    }

    /// The shared pools for `ask` (design §U6.5): slots `max(0, max_concurrent − Σ floors)`,
    /// tokens `max(0, E(p) − Σ token floors)`.
    fn shared_detail(&self, class: usize, ask: Ask) -> (Pool, Option<Pool>) {
        debug_assert!(class < self.classes.len());
        let (floors, token_floors) = self.floor_sums();
        let (slots_in_use, tokens_in_use) = self.shared_in_use();
        let borrowing = self.borrowing(ask);
        let pool = |capacity: u64, in_use: u64, requested_borrowed| Pool {
            capacity,
            in_use,
            available: capacity.saturating_sub(in_use),
            requested_borrowed,
        };
        (
            pool(
                u64::from(self.limits.max_concurrent).saturating_sub(floors),
                slots_in_use,
                u64::from(borrowing.slot),
            ),
            self.effective_budget(ask.high).map(|effective| {
                pool(
                    effective.saturating_sub(token_floors),
                    tokens_in_use,
                    borrowing.tokens,
                )
            }),
        )
    }

    /// The call's class at a decision (design §U6.5).
    fn class_detail(&self, class: usize, ask: Ask) -> ClassDetail {
        let (caps, state) = (self.caps(class), &self.classes[class]);
        let floor = caps.floor();
        let max = caps.max_concurrent.map(u64::from);
        ClassDetail {
            class,
            in_flight: state.slots,
            protected_concurrent: floor,
            protected_concurrent_in_use: state.slots.min(floor),
            borrowed_concurrent: state.slots.saturating_sub(floor),
            available_protected_concurrent: floor.saturating_sub(state.slots),
            max_concurrent: max,
            available_concurrent: max.map(|max| max.saturating_sub(state.slots)),
            tokens: self.has_budget.then(|| {
                let floor = caps.token_floor();
                ClassTokenDetail {
                    in_flight_tokens: state.tokens,
                    protected_tokens: floor,
                    protected_tokens_in_use: state.tokens.min(floor),
                    borrowed_tokens: state.tokens.saturating_sub(floor),
                    available_protected_tokens: floor.saturating_sub(state.tokens),
                    max_tokens: caps.max_tokens,
                    available: caps.max_tokens.map(|max| max.saturating_sub(state.tokens)),
                    requested: ask.reserved(),
                }
            }),
        }
    }

    /// Design §U6.4 after the global budget: the class token ceiling, the class concurrency
    /// ceiling, concurrency protection (only when the call borrows its slot and some class
    /// has a floor), token protection (only when it borrows tokens and some class has a token
    /// floor). Sums in 128 bits: nothing overflows.
    fn judge_class(&self, ask: Ask) -> Result<(), Refusal> {
        let Some(class) = ask.class else {
            return Ok(());
        };
        let (caps, state) = (self.caps(class), &self.classes[class]);
        let r = u128::from(ask.reserved());
        if let Some(max) = caps.max_tokens
            && self.has_budget
            && u128::from(state.tokens) + r > u128::from(max)
        {
            return Err(Refusal::ClassTokenCeiling);
        }
        if let Some(max) = caps.max_concurrent
            && state.slots >= u64::from(max)
        {
            return Err(Refusal::ClassSlotCeiling);
        }
        let (floors, token_floors) = self.floor_sums();
        let (slots_in_use, tokens_in_use) = self.shared_in_use();
        let borrowing = self.borrowing(ask);
        let shared_slots = u64::from(self.limits.max_concurrent).saturating_sub(floors);
        if borrowing.slot && floors > 0 && slots_in_use + 1 > shared_slots {
            return Err(Refusal::SlotProtection);
        }
        if let Some(effective) = self.effective_budget(ask.high)
            && borrowing.tokens > 0
            && token_floors > 0
            && u128::from(tokens_in_use) + u128::from(borrowing.tokens)
                > u128::from(effective.saturating_sub(token_floors))
        {
            return Err(Refusal::TokenProtection);
        }
        Ok(())
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

    /// Everything but shutdown and the slot, in the judging order (design §D4): the
    /// priority-adjusted budget, then the class checks. None of them ever queues (Q7).
    pub(crate) fn judge_capacity(&self, ask: Ask) -> Result<(), Refusal> {
        if !self.tokens_fit(ask) {
            Err(Refusal::Budget)
        } else {
            self.judge_class(ask)
        }
    }

    /// A newcomer, in the order Q1 and design §D4 fix: shutdown first, then the capacity
    /// checks, then a slot. Newcomers never pass a waiter (design §D2: "newcomers never barge
    /// past waiters").
    pub(crate) fn judge_newcomer(&self, ask: Ask) -> Result<(), Refusal> {
        if self.closed {
            Err(Refusal::Shutdown)
        } else {
            self.judge_capacity(ask)?;
            if !self.slot_free() || !self.queue.is_empty() {
                Err(Refusal::NoSlot)
            } else {
                Ok(())
            }
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

    /// Commits `ask`: its slot and its tokens in one step (Q7), and with classes its class's
    /// (design §U6.3: `in_flight` rises at commit). Answers what it borrowed, fixed now
    /// (design §U7.1).
    pub(crate) fn take(&mut self, ask: Ask) -> Borrowed {
        let borrowed = self.borrowing(ask);
        self.slots += 1;
        self.tokens += ask.reserved();
        if let Some(class) = ask.class {
            self.classes[class].slots += 1;
            self.classes[class].tokens += ask.reserved();
        }
        borrowed
    }

    /// Returns `held` tokens and, if `slot`, a slot, of `class` (design §U4.4: the whole hold
    /// returns), then serves the queue (design §U2.4: release pumps).
    pub(crate) fn release_capacity(&mut self, class: Option<usize>, slot: bool, held: u64) {
        let was_idle = self.is_idle();
        if slot {
            self.slots -= 1;
        } else {
            self.abandoned -= 1;
        }
        self.tokens -= held;
        if let Some(class) = class {
            self.classes[class].slots -= u64::from(slot);
            self.classes[class].tokens -= held;
        }
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
    /// and by reason, design §U12; with classes against the call's class too, §U6.3).
    pub(crate) fn refuse(
        &mut self,
        reason: Reason,
        constraint: Option<Constraint>,
        ask: Ask,
    ) -> Refused {
        self.rejected[reason as usize] += 1;
        if let Some(class) = ask.class {
            self.classes[class].rejected[reason as usize] += 1;
        }
        Refused {
            reason,
            detail: self.detail(ask, constraint),
            rate: None,
        }
    }

    /// Emits a reject event if someone listens now (design §D4: every outcome reaches the
    /// listeners registered when it is announced, including an outcome of a call that waited
    /// in the queue since before they subscribed). With classes it carries the call's class
    /// (design §U11.2).
    pub(crate) fn announce_reject(&mut self, class: Option<usize>, refused: Refused) {
        self.last_refused = Some((class, refused));
        if self.listening {
            // A reject event carries no window nor retry-after of its own.
            let refused = Refused {
                rate: None,
                ..refused
            };
            self.events.push(Observed::Reject { class, refused });
        }
    }

    /// Counts an admission (design §U3.2: count; §U4.1: `total_reserved += r`; §U6.3 and
    /// §U7.1: in its class too, with what it borrowed) and builds its permit: it holds its
    /// reservation (design §U4.1). What it borrowed was fixed at commit, but like every
    /// counter it is counted with the admission: for a waiter when it picks its hand-off up,
    /// so a hand-off dropped before that counts as `aborted` only.
    pub(crate) fn admit(&mut self, ask: Ask, revision: u64, borrowed: Borrowed) -> ModelPermit {
        self.admitted += 1;
        self.reserved += u128::from(ask.reserved());
        if let Some(class) = ask.class {
            let state = &mut self.classes[class];
            state.admitted += 1;
            state.reserved += u128::from(ask.reserved());
            state.borrowed_admissions += u64::from(borrowed.slot);
            state.borrowed_tokens += u128::from(borrowed.tokens);
        }
        if self.listening {
            self.events.push(Observed::Admit {
                revision,
                class: ask.class,
                borrowed,
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
            class: ask.class,
            borrowed,
            holds_slot: true,
            high: ask.high,
            reservation: ask.reservation,
            held: ask.reserved(),
            reported: None,
            sequence: 0,
            refunded: 0,
        }
    }
}
