//! The token books balance whatever path the reports take (Q4).

use std::thread;

use async_bulkhead_llm::{
    LlmBulkhead, OwnedPermit, Permit, TokenUsage, usage::Progressive, usage::ReleaseReport,
    usage::UsageReport,
};

use crate::common::usage_fixtures::{
    ReportFigures, assert_identity, budgeted, figures, fixed, opts, progressive, reheld_returned,
    req, settled, tokens, totals, usage,
};

/// A reference model of one admission's hold and of the books, straight from §U4.3 and Q4.
#[derive(Clone, Copy, Debug)]
struct Model {
    input: u64,
    max_output: u64,
    held: u64,
    reported: Option<(u64, u64)>,
    sequence: u64,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
struct Books {
    reserved: u64,
    consumed: u64,
    overrun: u64,
    refunded_gross: u64,
    reheld: u64,
}

impl Books {
    /// Books the move of a hold from `old` to `new` for a reservation of `r`.
    fn book(&mut self, r: u64, old: u64, new: u64) {
        if new < old {
            self.refunded_gross += old - new;
        } else if new > old {
            // The part of [old, new) above r is overrun; the part below r is re-held.
            if new > r {
                self.overrun += new - old.max(r);
            }
            if old < r {
                self.reheld += new.min(r) - old;
            }
        }
    }

    fn add(&mut self, other: Books) {
        self.reserved += other.reserved;
        self.consumed += other.consumed;
        self.overrun += other.overrun;
        self.refunded_gross += other.refunded_gross;
        self.reheld += other.reheld;
    }

    /// `(total_reserved, total_consumed, total_refunded, total_overrun)` as stats show them
    /// (refunds gross).
    fn totals(&self) -> (u64, u64, u64, u64) {
        (
            self.reserved,
            self.consumed,
            self.refunded_gross,
            self.overrun,
        )
    }
}

impl Model {
    fn new(input: u64, max_output: u64) -> Model {
        Model {
            input,
            max_output,
            held: input + max_output,
            reported: None,
            sequence: 0,
        }
    }

    fn r(&self) -> u64 {
        self.input + self.max_output
    }

    /// Applies a report; returns what the `UsageReport` must say.
    fn report(&mut self, books: &mut Books, u: (u64, u64), p: Option<(u64, u64)>) -> ReportFigures {
        let reported = match self.reported {
            None => u,
            Some((i, o)) => (i.max(u.0), o.max(u.1)),
        };
        let hold = match p {
            None => reported.0 + self.max_output.max(reported.1),
            Some((remaining, margin)) => {
                remaining + margin + reported.1.saturating_sub(self.max_output)
            }
        };
        if Some(reported) != self.reported || hold != self.held {
            self.sequence += 1;
        }
        books.book(self.r(), self.held, hold);
        self.held = hold;
        self.reported = Some(reported);
        let consumed = reported.0 + reported.1;
        (
            self.sequence,
            self.r(),
            hold,
            consumed,
            Some(self.max_output),
            Some(self.max_output.saturating_sub(reported.1)),
            consumed > self.r(),
        )
    }

    /// Settles; returns what the `ReleaseReport` must say.
    fn settle(
        &self,
        books: &mut Books,
        explicit: Option<(u64, u64)>,
    ) -> (u64, u64, u64, Option<TokenUsage>) {
        let effective = explicit.or(self.reported).expect("settled with usage");
        let consumed = effective.0 + effective.1;
        let before = *books;
        books.consumed += consumed;
        books.book(self.r(), self.held, consumed);
        (
            self.held,
            books.refunded_gross - before.refunded_gross,
            books.overrun - before.overrun,
            Some(usage(effective.0, effective.1)),
        )
    }
}

/// A permit of either flavour.
enum Live<'a> {
    Borrowed(Permit<'a>),
    Owned(OwnedPermit),
}

impl Live<'_> {
    fn report(&mut self, u: TokenUsage, p: Option<Progressive>) -> UsageReport {
        match (self, p) {
            (Live::Borrowed(permit), None) => permit.report_usage(u),
            (Live::Borrowed(permit), Some(p)) => permit.report_usage_progressive(u, p),
            (Live::Owned(permit), None) => permit.report_usage(u),
            (Live::Owned(permit), Some(p)) => permit.report_usage_progressive(u, p),
        }
        .expect("a valid report")
    }

    fn held(&self) -> u64 {
        match self {
            Live::Borrowed(permit) => permit.held_tokens(),
            Live::Owned(permit) => permit.held_tokens(),
        }
    }

    fn release(self, u: Option<TokenUsage>) -> ReleaseReport {
        match self {
            Live::Borrowed(permit) => permit.release(u),
            Live::Owned(permit) => permit.release(u),
        }
    }
}

/// Runs `steps` random operations (admit, report plain or progressive with rising or falling
/// usage, settle by release with or without usage or by drop) on `bulkhead`, checking every
/// report and settlement against the model; settles everything at the end, always with some
/// usage known. Returns the books of this run. With `check_live`, also checks the tokens in
/// flight after every step (only valid while no other thread uses the bulkhead).
fn random_walk(bulkhead: &LlmBulkhead, seed: u64, steps: usize, check_live: bool) -> Books {
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut books = Books::default();
    let mut open: Vec<(Live<'_>, Model)> = Vec::new();

    let settle =
        |books: &mut Books, rng: &mut fastrand::Rng, (permit, model): (Live<'_>, Model)| {
            let explicit = if model.reported.is_none() || rng.u8(..3) == 0 {
                Some((rng.u64(..600), rng.u64(..2500)))
            } else {
                None
            };
            let expected = model.settle(books, explicit);
            let report = if explicit.is_none() && rng.bool() {
                // Dropped: settles with the last reported usage, no report to check.
                drop(permit);
                return;
            } else {
                permit.release(explicit.map(|(i, o)| usage(i, o)))
            };
            assert_eq!(settled(&report), expected, "seed {seed}: {model:?}");
        };

    for _ in 0..steps {
        match rng.u8(..10) {
            0..=2 if open.len() < 8 => {
                let (input, max_output) = (rng.u64(..500), rng.u64(..2000));
                let permit = if rng.bool() {
                    Live::Borrowed(
                        bulkhead
                            .try_acquire(&req(), opts(input, max_output))
                            .unwrap(),
                    )
                } else {
                    Live::Owned(
                        bulkhead
                            .try_acquire_owned(&req(), opts(input, max_output))
                            .unwrap(),
                    )
                };
                books.reserved += input + max_output;
                open.push((permit, Model::new(input, max_output)));
            }
            3..=7 if !open.is_empty() => {
                let i = rng.usize(..open.len());
                let (permit, model) = &mut open[i];
                let (pi, po) = model.reported.unwrap_or((0, 0));
                // Mostly rising, sometimes falling (clamped), sometimes identical (stale).
                let u = match rng.u8(..4) {
                    0 => (rng.u64(..=pi), rng.u64(..=po)),
                    1 => (pi, po),
                    _ => (pi + rng.u64(..200), po + rng.u64(..700)),
                };
                let p = rng
                    .bool()
                    .then(|| (rng.u64(..=model.max_output), rng.u64(..300)));
                let expected = model.report(&mut books, u, p);
                let report = permit.report(usage(u.0, u.1), p.map(|(r, m)| progressive(r, m)));
                assert_eq!(figures(&report), expected, "seed {seed}: {u:?} {p:?}");
                assert_eq!(permit.held(), model.held);
            }
            8..=9 if !open.is_empty() => {
                let i = rng.usize(..open.len());
                settle(&mut books, &mut rng, open.swap_remove(i));
            }
            _ => {}
        }
        if check_live {
            let t = tokens(bulkhead);
            let held: u64 = open.iter().map(|(_, m)| m.held).sum();
            assert_eq!(t.in_flight_tokens, held, "seed {seed}");
            let (reserved, consumed, refunded, overrun) = books.totals();
            assert_eq!(
                totals(&t),
                (reserved, consumed, refunded, overrun),
                "seed {seed}"
            );
            assert_eq!(t.total_reheld, books.reheld, "seed {seed}");
            // Nothing is released without usage here (a drop settles with the last report).
            assert_identity(&t);
        }
    }
    while let Some(entry) = open.pop() {
        settle(&mut books, &mut rng, entry);
    }
    books
}

#[test]
fn the_books_balance_after_random_report_paths_on_one_thread() {
    for seed in 0..40 {
        let bulkhead = budgeted(64, 1_000_000_000);
        let books = random_walk(&bulkhead, seed, 300, true);
        let t = tokens(&bulkhead);
        assert_eq!(totals(&t), books.totals(), "seed {seed}");
        assert_eq!(t.total_reheld, books.reheld, "seed {seed}");
        assert_eq!(t.in_flight_tokens, 0, "seed {seed}");
        assert_identity(&t);
        let stats = bulkhead.stats();
        assert_eq!(stats.admitted, stats.released);
        assert_eq!(stats.in_flight, 0);
    }
}

#[test]
fn the_books_balance_after_random_report_paths_on_several_threads() {
    let bulkhead = budgeted(256, 1_000_000_000);
    let all = thread::scope(|scope| {
        let workers: Vec<_> = (0..4u64)
            .map(|n| {
                let bulkhead = &bulkhead;
                scope.spawn(move || random_walk(bulkhead, 1000 + n, 400, false))
            })
            .collect();
        let mut all = Books::default();
        for worker in workers {
            all.add(worker.join().unwrap());
        }
        all
    });
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), all.totals());
    assert_eq!(t.total_reheld, all.reheld);
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
}

#[test]
fn the_books_balance_for_scripted_paths_of_every_kind() {
    let bulkhead = budgeted(16, 100_000);
    // Plain, falling then rising above r, released without usage:
    // 1100 -> 1010 (refund 90) -> 1510 (re-hold 90, overrun 410) -> settled at 1510.
    // Refunds are gross: the re-hold is booked apart, the 90 stay refunded.
    let mut p = bulkhead.try_acquire(&req(), fixed()).unwrap();
    p.report_usage(usage(10, 0)).unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 90, 0));
    p.report_usage(usage(10, 1500)).unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 0, 90, 410));
    assert_eq!(reheld_returned(&tokens(&bulkhead)), (90, 0));
    assert_identity(&tokens(&bulkhead));
    assert_eq!(
        settled(&p.release(None)),
        (1510, 0, 0, Some(usage(10, 1500)))
    );
    assert_eq!(totals(&tokens(&bulkhead)), (1100, 1510, 90, 410));

    // Progressive, falling, rising above r, falling, released with larger explicit usage:
    // 1100 -> 1000 (refund 100) -> 1200 (re-hold 100, overrun 100) -> 100 (refund 1100)
    // -> settled at 2100 (re-hold 1000, overrun 1000). Tokens once held above r stay booked
    // as overrun even when a later report gives them back (then they are refunds too).
    let mut p = bulkhead.try_acquire_owned(&req(), fixed()).unwrap();
    p.report_usage_progressive(usage(100, 0), progressive(1000, 0))
        .unwrap();
    p.report_usage_progressive(usage(100, 100), progressive(900, 300))
        .unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 1510, 190, 510));
    assert_eq!(reheld_returned(&tokens(&bulkhead)), (190, 0));
    p.report_usage_progressive(usage(100, 900), progressive(100, 0))
        .unwrap();
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 1510, 1290, 510));
    assert_identity(&tokens(&bulkhead));
    let report = p.release(Some(usage(100, 2000)));
    assert_eq!(settled(&report), (100, 0, 1000, Some(usage(100, 2000))));
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 3610, 1290, 1510));
    assert_eq!(reheld_returned(&tokens(&bulkhead)), (1190, 0));

    // A zero reservation, mixed reports, dropped: 0 -> 7 (overrun 7) -> 4 (refund 3)
    // -> settled at 7 (overrun 3).
    let mut p = bulkhead.try_acquire(&req(), opts(0, 0)).unwrap();
    p.report_usage(usage(3, 4)).unwrap();
    p.report_usage_progressive(usage(3, 4), progressive(0, 0))
        .unwrap();
    assert_eq!(p.held_tokens(), 4);
    assert_identity(&tokens(&bulkhead));
    drop(p);
    assert_eq!(totals(&tokens(&bulkhead)), (2200, 3617, 1293, 1520));

    // No reports, explicit usage equal to the reservation.
    bulkhead
        .try_acquire(&req(), fixed())
        .unwrap()
        .release(Some(usage(100, 1000)));
    let t = tokens(&bulkhead);
    assert_eq!(totals(&t), (3300, 4717, 1293, 1520));
    assert_eq!(reheld_returned(&t), (1190, 0));
    assert_eq!(t.in_flight_tokens, 0);
    assert_identity(&t);
}
