//! Model-based tests: random configurations and operation sequences are applied to the real
//! bulkhead and to the sequential reference model of `reference/`, which must agree on every
//! decision and every counter (design §D6). Deterministic scenarios pin the tricky cases, and a
//! coverage test makes sure the random sequences reach them too.
//!
//! `§U..`, `§D..` and `Qn` refer to sections and quirks of `docs/design.md`.

mod reference;

mod proptests;
mod scenarios;
