//! In-flight deduplication (`run_shared`): keys (canonical request, custom key functions,
//! scopes, classes, result types), the leader/follower lifecycle (registration before
//! admission, followers' own timeouts and cancellation, the leader leaving, the last waiter
//! leaving), outcomes (clones, share hooks, errors, panics), stats and events.

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod keys;
mod lifecycle;
mod outcomes;
mod support;
