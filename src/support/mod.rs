//! The crate's footing, below the vocabulary: where atomics, locks and `Arc` come from
//! (`sync`, swapped for loom's under `--cfg loom`), and how every call into user code catches
//! its panic (`contain`). It imports nothing else of the crate.

pub(crate) mod contain;
pub(crate) mod sync;
