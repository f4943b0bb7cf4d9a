//! Behavioural tests of typed lifecycle events: payloads, order, subscription handling and
//! what dropping a subscription guarantees, re-entrancy, panicking listeners, admission timing,
//! and listeners subscribed while a call waits.
//!
//! Figures come from the original's behaviour (design §U11, §U12) as adapted by design §D4.
//! Unless said otherwise an admission reserves the fixed override input 100 / max output 1000,
//! so `r = 1100`, on a bulkhead whose limits start at revision `REV` (the fixtures of
//! `common::usage_fixtures`, shared with the `usage` tests).
//!
//! Some tests are regression tests for defects found by adversarial probing (user code that
//! panics or blocks, re-entrant wakers and listeners) and by comparing the crate with the
//! JavaScript original; each failed before its fix.
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

#[path = "../common/mod.rs"]
mod common;

mod admission_timing;
mod payloads;
mod reentrancy_and_panics;
mod sampling;
mod subscribed_while_waiting;
mod subscriptions;
