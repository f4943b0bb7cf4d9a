//! Model-based tests: random configurations and operation sequences are applied to the real
//! bulkhead and to the sequential reference model of `reference/`, which must agree on every
//! decision and every counter (design §D6), deduplication (`run_shared`) and observe mode
//! included. Deterministic scenarios pin the tricky cases, and coverage tests make sure the
//! random sequences reach them too.
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod reference;

mod class_limits;
mod class_scenarios;
mod proptests;
mod rate_scenarios;
mod scenarios;
mod shared_proptests;
mod shared_scenarios;
