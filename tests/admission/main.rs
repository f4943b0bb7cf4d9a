//! Behavioural tests of the public API of `async-bulkhead-llm`: builder validation, the order of
//! admission checks, reservation resolution, permits and token accounting, versioned limits,
//! advisory checks, close, statistics and display texts.
//!
//! Figures come from the original's behaviour (design §U1.4, §U1.6, §U3, §U4, §U5, §U8,
//! §U15.1) as adapted by design §D3–§D4 (shutdown is always checked first; reported usage
//! always reaches `total_consumed`).
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

mod support;

mod auto_traits;
mod builder;
mod check_order;
mod close;
mod display;
mod limits;
mod permits;
mod reservations;
mod stats;
mod would_admit;
