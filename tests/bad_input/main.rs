//! Bad input never panics and never changes state.
//!
//! A systematic sweep over every public entry point of `async-bulkhead-llm` that takes input,
//! with edge values (0, 1, `u64::MAX`, `u64::MAX - 1`, `MAX_BUDGET(+1)`, `MAX_CONCURRENT(+1)`,
//! `MAX_REVISION(+1)`), sums that overflow, inconsistent reservations, stale/equal/huge
//! revisions, empty and whitespace-only model names, non-finite and non-positive estimator
//! options, invalid JSON bodies, zero and huge timeouts, and usage reports whose totals or holds
//! cannot be represented.
//!
//! For each case the test asserts
//!
//! - the exact typed error (variant and fields) and, where the spec or the crate's docs give
//!   one, its `Display` text;
//! - that nothing panicked (a panic fails the test);
//! - that nothing changed: the bulkhead is compared with a *control twin* built the same way
//!   and given the same valid operations but not the bad one (stats, limits, closed flag, the
//!   events emitted, a permit's hold and its next report sequence), and a subsequent valid
//!   operation sequence (the "probe") behaves exactly as on the control.
//!
//! Valid edge values are checked too: they are accepted and behave as documented.
//!
//! References: design §U1.4, §U3.1, §U4.3, §U4.4, §U8, §U16 and design §D4 (Q9/Q10: every
//! option is validated before any capacity decision; Q17: override ratios must be finite and
//! > 0).
//!
//! The regression tests of what the fuzz targets in `fuzz/` found are here too
//! (`fuzz_regressions`).
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod support;

mod apply_limits;
mod builder;
mod constructors;
mod estimators;
mod fuzz_regressions;
#[cfg(feature = "serde")]
mod json;
mod oversized_reservations;
mod releases;
mod reports;
mod requests;
mod set_budget;
mod shutdown;
mod timeouts;
