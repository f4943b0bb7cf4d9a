//! Admission classes: configuration and its validation, the class decision (ceilings, floors,
//! the shared pool) with its detail, resources, abandoning a borrowed slot, the run deadline,
//! limits, stats, events and drain with classes.

// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

mod abandon;
mod config;
mod deadline;
mod decision;
mod limits;
mod queue;
mod reserved;
mod support;
