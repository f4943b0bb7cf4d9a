//! Observe (shadow) mode: the advisory bypass (a predicted refusal runs anyway, uncounted),
//! the race bypass (a refusal made by the admission itself: counted, then bypassed), hard
//! refusals that are never bypassed, what a bypassed call holds (nothing) and reports (usage,
//! validated and clamped), its events and `stats().observe`, and bypasses under deduplication.

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod bypass;
mod shared;
