//! Two classes hammered at a floor boundary: 4 plain threads on 2 slots `try_acquire`,
//! release, drop and abandon as fast as they can (about 200 000 operations), with floors 1/1
//! (no shared slot: nothing may ever borrow a slot) and 1/0 (one shared slot, which the class
//! without a floor always borrows), and token floors and ceilings under a budget.
//!
//! Live: a ledger of slots and tokens per class packed in one word (a thread counts an
//! admission after it got it, uncounts its slot before it gives it back and its tokens before
//! it settles, so every field is at most the truth at that moment) never exceeds a class
//! ceiling, `max_concurrent`, the budget or the shared pools; every admission borrows what its
//! floors and the thread's own holdings imply, and a borrowing admission fits in its shared
//! pool; `abandon_borrowed_concurrency` answers exactly whether the slot is borrowed and held;
//! sampled statistics stay within the ceilings and the shared pool. At the end, exact per-class
//! books (admissions, releases, refusals by reason, tokens, borrowing, abandonments) and the
//! classes summing to the globals. The kit's watchdog aborts a hang; `CHAOS_SEED` replays a
//! failure's random choices and `STRESS_SCALE` multiplies the operations.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Barrier};

use async_bulkhead_llm::{
    AcquireError, AcquireOptions, LlmBulkhead, LlmRequest, Permit, RejectReason, Reservation,
    TokenBudget, TokenUsage, classes::AdmissionClasses, classes::ClassLimits, classes::Resources,
};

use crate::kit::books::reason_index;
use crate::kit::runtimes::Guard;
use crate::kit::{fresh_seed, mix, scale};

const THREADS: u64 = 4;
/// Operations per thread and configuration (two configurations: 200 000 in all).
const OPS: u64 = 25_000;
const BUDGET: u64 = 1_000;

/// The limits of the two classes, `a` and `b`.
#[derive(Clone, Copy, Debug)]
struct Config {
    floors: [u64; 2],
    ceilings: [u64; 2],
    token_floors: [u64; 2],
    token_ceilings: [Option<u64>; 2],
}

impl Config {
    fn shared_slots(&self) -> u64 {
        2 - self.floors[0] - self.floors[1]
    }

    fn shared_tokens(&self) -> u64 {
        BUDGET - self.token_floors[0] - self.token_floors[1]
    }

    fn limits(&self, c: usize) -> ClassLimits {
        let limits = ClassLimits::new()
            .protected_concurrent(self.floors[c] as u32)
            .max_concurrent(self.ceilings[c] as u32)
            .protected_in_flight_tokens(self.token_floors[c]);
        match self.token_ceilings[c] {
            Some(max) => limits.max_in_flight_tokens(max),
            None => limits,
        }
    }
}

/// Slots (16 bits) and tokens (16 bits) of each class, in one word.
fn field(slot: bool, class: usize) -> u32 {
    32 * u32::from(!slot) + 16 * class as u32
}

fn unpack(word: u64) -> ([u64; 2], [u64; 2]) {
    let get = |slot, c| (word >> field(slot, c)) & 0xFFFF;
    ([get(true, 0), get(true, 1)], [get(false, 0), get(false, 1)])
}

/// One thread's sums for one class.
#[derive(Clone, Copy, Default, Debug)]
struct Books {
    admitted: u64,
    refused: [u64; RejectReason::ALL.len()],
    reserved: u64,
    consumed: u64,
    refunded: u64,
    overrun: u64,
    borrowed: u64,
    borrowed_tokens: u64,
    abandoned: u64,
}

struct Holding<'a> {
    permit: Permit<'a>,
    class: usize,
    reserved: u64,
    resources: Resources,
    abandoned: bool,
}

struct Bench {
    config: Config,
    bulkhead: LlmBulkhead,
    ledger: AtomicU64,
}

impl Bench {
    /// Checks a ledger reading: ceilings, `max_concurrent`, the budget and the shared pools.
    fn check(&self, word: u64) {
        let cfg = &self.config;
        let (slots, tokens) = unpack(word);
        let mut borrowed = (0, 0);
        for c in 0..2 {
            assert!(slots[c] <= cfg.ceilings[c], "class {c}: {slots:?} {cfg:?}");
            if let Some(max) = cfg.token_ceilings[c] {
                assert!(tokens[c] <= max, "class {c}: {tokens:?} {cfg:?}");
            }
            borrowed.0 += slots[c].saturating_sub(cfg.floors[c]);
            borrowed.1 += tokens[c].saturating_sub(cfg.token_floors[c]);
        }
        assert!(slots[0] + slots[1] <= 2, "{slots:?}");
        assert!(tokens[0] + tokens[1] <= BUDGET, "{tokens:?}");
        assert!(
            borrowed.0 <= cfg.shared_slots(),
            "shared slots: {slots:?} {cfg:?}"
        );
        assert!(
            borrowed.1 <= cfg.shared_tokens(),
            "shared tokens: {tokens:?} {cfg:?}"
        );
    }

    /// An admission of `class`, the thread holding `own` (slots, tokens) in it already.
    fn admitted<'a>(&self, permit: Permit<'a>, class: usize, own: (u64, u64)) -> Holding<'a> {
        let cfg = &self.config;
        let reserved = permit.reservation().unwrap().reserved();
        let resources = permit.resources();
        let at = || format!("{resources:?} of {reserved} in class {class}, own {own:?}, {cfg:?}");
        assert_eq!(permit.class().map(|c| usize::from(c.index())), Some(class));
        if own.0 >= cfg.floors[class] {
            assert!(resources.borrowed_concurrency, "{}", at());
        }
        if resources.borrowed_concurrency {
            assert!(
                cfg.shared_slots() >= 1,
                "borrowed from an empty pool: {}",
                at()
            );
        }
        let free_floor = cfg.token_floors[class].saturating_sub(own.1);
        assert!(resources.borrowed_tokens <= reserved, "{}", at());
        assert!(
            resources.borrowed_tokens >= reserved.saturating_sub(free_floor),
            "{}",
            at()
        );
        assert!(resources.borrowed_tokens <= cfg.shared_tokens(), "{}", at());
        let delta = (1 << field(true, class)) + (reserved << field(false, class));
        self.check(self.ledger.fetch_add(delta, Ordering::AcqRel) + delta);
        Holding {
            permit,
            class,
            reserved,
            resources,
            abandoned: false,
        }
    }

    /// Abandons `h`'s slot (uncounted first if it must go).
    fn abandon(&self, h: &mut Holding<'_>, books: &mut [Books; 2]) {
        let expected = h.resources.borrowed_concurrency && !h.abandoned;
        if expected {
            self.ledger
                .fetch_sub(1 << field(true, h.class), Ordering::AcqRel);
        }
        assert_eq!(
            h.permit.abandon_borrowed_concurrency(),
            expected,
            "{:?}",
            h.resources
        );
        if expected {
            h.abandoned = true;
            books[h.class].abandoned += 1;
        }
        assert_eq!(h.permit.holds_slot(), !h.abandoned);
    }

    /// Settles `h`: released with random explicit usage, without usage, or dropped.
    fn settle(&self, h: Holding<'_>, rng: &mut fastrand::Rng, books: &mut [Books; 2]) {
        let slot = u64::from(!h.abandoned) << field(true, h.class);
        self.ledger.fetch_sub(
            slot + (h.reserved << field(false, h.class)),
            Ordering::AcqRel,
        );
        let b = &mut books[h.class];
        b.reserved += h.reserved;
        match rng.u8(0..3) {
            0 => drop(h.permit),
            1 => {
                h.permit.release(None);
            }
            _ => {
                let used = TokenUsage::new(rng.u64(0..150), rng.u64(0..200)).unwrap();
                let report = h.permit.release(Some(used));
                let total = used.total();
                assert_eq!(report.refunded_tokens, h.reserved.saturating_sub(total));
                b.consumed += total;
                b.refunded += h.reserved.saturating_sub(total);
                b.overrun += total.saturating_sub(h.reserved);
            }
        }
    }

    /// One thread: random operations, never more than 2 permits held.
    fn hammer(&self, seed: u64) -> [Books; 2] {
        let mut rng = fastrand::Rng::with_seed(seed);
        let mut books = [Books::default(); 2];
        let mut held: Vec<Holding<'_>> = Vec::new();
        let classes = [
            self.bulkhead.class("a").unwrap(),
            self.bulkhead.class("b").unwrap(),
        ];
        let request = LlmRequest::new();
        for i in 0..OPS * scale() {
            match rng.u8(0..8) {
                0..=3 if held.len() < 2 => {
                    let class = rng.usize(0..2);
                    let own = held
                        .iter()
                        .filter(|h| h.class == class)
                        .fold((0, 0), |(s, t), h| {
                            (s + u64::from(!h.abandoned), t + h.reserved)
                        });
                    let reservation = Reservation::new(rng.u64(0..100), rng.u64(0..150)).unwrap();
                    let options = AcquireOptions::new()
                        .class(classes[class])
                        .reservation(reservation);
                    match self.bulkhead.try_acquire(&request, options) {
                        Ok(permit) => {
                            let h = self.admitted(permit, class, own);
                            books[class].admitted += 1;
                            books[class].borrowed += u64::from(h.resources.borrowed_concurrency);
                            books[class].borrowed_tokens += h.resources.borrowed_tokens;
                            held.push(h);
                        }
                        Err(AcquireError::Rejected(r)) => {
                            let reason = r.reason();
                            assert!(
                                matches!(
                                    reason,
                                    RejectReason::ConcurrencyLimit | RejectReason::BudgetLimit
                                ),
                                "{r:?}"
                            );
                            let detail = r.detail().admission_class().unwrap();
                            assert_eq!(detail.class, classes[class]);
                            books[class].refused[reason_index(reason)] += 1;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                0..=5 if !held.is_empty() => {
                    let h = held.swap_remove(rng.usize(0..held.len()));
                    self.settle(h, &mut rng, &mut books);
                }
                6 if !held.is_empty() => {
                    let at = rng.usize(0..held.len());
                    self.abandon(&mut held[at], &mut books);
                }
                _ => self.check(self.ledger.load(Ordering::Acquire)),
            }
            if i % 1_000 == 0 {
                self.sample();
            }
        }
        for h in held {
            self.settle(h, &mut rng, &mut books);
        }
        books
    }

    /// Statistics within the ceilings and the shared pools.
    fn sample(&self) {
        let cfg = &self.config;
        let stats = self.bulkhead.stats();
        assert!(stats.in_flight <= 2);
        let classes = stats.admission_classes.unwrap();
        assert!(
            classes.shared.in_flight <= cfg.shared_slots(),
            "{:?}",
            classes.shared
        );
        for (c, s) in classes.classes.iter().enumerate() {
            assert!(s.in_flight <= cfg.ceilings[c], "{s:?}");
            if let Some(max) = cfg.token_ceilings[c] {
                assert!(s.in_flight_tokens <= max, "{s:?}");
            }
        }
    }
}

fn run(config: Config) {
    let seed = fresh_seed();
    let bulkhead = LlmBulkhead::builder("m", 2)
        .token_budget(TokenBudget::new(BUDGET))
        .admission_classes(
            AdmissionClasses::new("a")
                .class("a", config.limits(0))
                .class("b", config.limits(1)),
        )
        .build()
        .unwrap();
    let _guard = Guard::new(
        format!("classes contention: seed {seed} {config:?}"),
        bulkhead.clone(),
    );
    let bench = Arc::new(Bench {
        config,
        bulkhead: bulkhead.clone(),
        ledger: AtomicU64::new(0),
    });
    let started = std::time::Instant::now();
    let start = Arc::new(Barrier::new(THREADS as usize));
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let (bench, start) = (Arc::clone(&bench), Arc::clone(&start));
            std::thread::spawn(move || {
                start.wait();
                bench.hammer(mix(seed, t))
            })
        })
        .collect();
    let mut books = [Books::default(); 2];
    let mut failure = None;
    for thread in threads {
        match thread.join() {
            Ok(sums) => {
                for c in 0..2 {
                    let (b, s) = (&mut books[c], sums[c]);
                    b.admitted += s.admitted;
                    for r in 0..6 {
                        b.refused[r] += s.refused[r];
                    }
                    b.reserved += s.reserved;
                    b.consumed += s.consumed;
                    b.refunded += s.refunded;
                    b.overrun += s.overrun;
                    b.borrowed += s.borrowed;
                    b.borrowed_tokens += s.borrowed_tokens;
                    b.abandoned += s.abandoned;
                }
            }
            Err(panic) => failure = Some(panic),
        }
    }
    if let Some(panic) = failure {
        std::panic::resume_unwind(panic);
    }

    let stats = bulkhead.stats();
    let classes = stats.admission_classes.clone().unwrap();
    assert_eq!(bench.ledger.load(Ordering::Acquire), 0);
    assert_eq!((stats.in_flight, stats.abandoned_in_flight), (0, 0));
    assert_eq!(stats.token_budget.as_ref().unwrap().in_flight_tokens, 0);
    assert_eq!(classes.shared.in_flight, 0);
    for (c, s) in classes.classes.iter().enumerate() {
        let b = &books[c];
        let by = s.rejected_by_reason;
        let abandoned = s.borrowed_concurrency_abandoned_by_cause;
        assert_eq!(
            (s.in_flight, s.in_flight_tokens, s.admitted, s.released),
            (0, 0, b.admitted, b.admitted),
            "class {c}: {s:#?}"
        );
        let refused: Vec<u64> = RejectReason::ALL.iter().map(|&r| by.get(r)).collect();
        assert_eq!(refused, b.refused.to_vec(), "class {c}: refusals by reason");
        assert_eq!(
            (
                s.total_reserved,
                s.total_consumed,
                s.total_refunded,
                s.total_overrun
            ),
            (b.reserved, b.consumed, b.refunded, b.overrun),
            "class {c}: tokens"
        );
        assert_eq!(
            (
                s.total_borrowed_admissions,
                s.total_borrowed_tokens_reserved,
                abandoned.manual,
                abandoned.deadline
            ),
            (b.borrowed, b.borrowed_tokens, b.abandoned, 0),
            "class {c}: borrowing and abandonments"
        );
    }
    let sum = |f: fn(&async_bulkhead_llm::stats::ClassStats) -> u64| {
        classes.classes.iter().map(f).sum::<u64>()
    };
    let tokens = stats.token_budget.unwrap();
    assert_eq!(
        [
            sum(|s| s.admitted),
            sum(|s| s.released),
            sum(|s| s.rejected),
            sum(|s| s.total_reserved),
            sum(|s| s.total_consumed),
            sum(|s| s.total_refunded),
            sum(|s| s.total_overrun),
            sum(|s| s.borrowed_concurrency_abandoned),
        ],
        [
            stats.admitted,
            stats.released,
            stats.rejected,
            tokens.total_reserved,
            tokens.total_consumed,
            tokens.total_refunded,
            tokens.total_overrun,
            stats.borrowed_concurrency_abandoned,
        ],
        "the classes sum to the globals"
    );
    // Not a vacuous pass: both classes admitted many times, and the floor boundary refused
    // many calls. (Which class the refusals fall on depends on the scheduler: on a loaded
    // machine one class's threads may seldom run beside the other's, and a class whose
    // floor covers its calls alone is then never refused; counted per class, this check failed
    // there with no fault in the crate.)
    let refused: u64 = books.iter().map(|b| b.refused.iter().sum::<u64>()).sum();
    assert!(
        books.iter().all(|b| b.admitted > 1_000) && refused > 1_000,
        "{books:?}"
    );
    println!(
        "contention seed {seed} {config:?}: {:?}, admitted {}, refused {:?}, borrowed {:?}, \
         abandoned {}",
        started.elapsed(),
        stats.admitted,
        stats.rejected_by_reason,
        books.map(|b| b.borrowed),
        stats.borrowed_concurrency_abandoned,
    );
}

/// Floors 1/1 on 2 slots: no shared slot, so no admission ever borrows its slot (and no
/// abandonment ever succeeds); each class holds at most one slot.
#[test]
fn floors_one_and_one_on_two_slots() {
    run(Config {
        floors: [1, 1],
        ceilings: [2, 2],
        token_floors: [300, 300],
        token_ceilings: [Some(700), None],
    });
}

/// Floors 1/0 on 2 slots: one shared slot; `b` always borrows it, `a` beyond its first call.
#[test]
fn floors_one_and_zero_on_two_slots() {
    run(Config {
        floors: [1, 0],
        ceilings: [2, 1],
        token_floors: [400, 0],
        token_ceilings: [Some(800), Some(500)],
    });
}
