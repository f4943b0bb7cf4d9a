//! Helpers shared by several test binaries, included by each with
//! `#[path = "../common/mod.rs"] mod common;`. Each binary uses a different part, hence the
//! `dead_code` allowance.
#![allow(dead_code)]

pub mod child_process;
pub mod usage_fixtures;
pub mod waiters;
