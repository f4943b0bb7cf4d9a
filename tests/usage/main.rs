//! Behavioural tests of streaming usage reconciliation (reports, progressive reports,
//! settlement with the last reported usage), of the token books they keep, and of what a
//! panicking `Estimator::observe` leaves behind.
//!
//! Figures come from the original's behaviour (design §U4.3, §U4.4, §U4.5, §U12) as adapted by
//! design §D4:
//!
//! - Q3: reported usage always reaches `total_consumed`, even when the hold is 0;
//! - Q4: every move of a hold, and the settlement (which moves the hold to the final usage), is
//!   split at the reservation `r`: tokens added above `r` are *overrun*, tokens removed are
//!   *refunded*, tokens added back below `r` are *re-held* (all gross: every total only grows).
//!   So for every admission settled with usage, `reserved + overrun + reheld == consumed +
//!   refunded`; one released without usage books its hold as *returned unreported*; and after
//!   every step `in_flight_tokens == reserved + overrun + reheld - refunded - consumed -
//!   returned_unreported`;
//! - Q15: reporting after release cannot compile (covered by a `compile_fail` doctest).
//!
//! Unless said otherwise an admission reserves the fixed override input 100 / max output 1000,
//! so `r = 1100`, on a bulkhead whose limits start at revision `REV` (the fixtures of
//! `common::usage_fixtures`, shared with the `events` tests).
//!
//! Some tests are regression tests for defects found by adversarial probing (user code that
//! panics or blocks, re-entrant wakers and listeners) and by comparing the crate with the
//! JavaScript original; each failed before its fix.
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

#[path = "../common/mod.rs"]
mod common;

mod books;
mod cumulative_clamp;
mod errors_change_nothing;
mod estimator_feedback;
mod monotonic_totals;
mod panicking_estimator;
mod refunds_and_overruns;
mod settlement;
#[cfg(feature = "serde")]
mod stats_serde;
mod without_budget;
mod worked_examples;
