//! The one place the crate takes atomics, locks, `Arc` and thread-locals from.
//!
//! Every protocol the crate's correctness depends on (the packed admission word, the published
//! limits, the close bit) is built from the items of this module, so that `--cfg loom` swaps them
//! all for loom's model-checked versions at once. Nothing else in the crate imports
//! `std::sync` or `core::sync::atomic` (`tests/house_rules.rs` checks it): what is modelled
//! comes from here, and what is deliberately not, from [`unmodeled`].
//!
//! Not modelled ([`unmodeled`], always std's or portable-atomic's): statistics shards
//! (single-writer counters whose values no decision ever reads) and the process-wide counter
//! that numbers threads for admission ids; state that loom cannot run or that no model reaches
//! (the timer's threads and their lock, which do not exist under loom; `tokio`'s clock
//! probe; the interned class handles; the listener list, an `arc_swap` list loom cannot see
//! into); a flag that only the task it belongs to reads (a `run` callback's abandonment); and
//! the `Arc`s of user objects a public signature names (`Arc<dyn Estimator>`). Keeping them out
//! of the model keeps loom's state space on the admission protocol itself; none of their
//! correctness depends on an interleaving a model would explore.
//!
//! On targets without native 64-bit atomics (32-bit PowerPC, MIPS, RISC-V), and everywhere
//! with the `portable-atomic` feature, every atomic integer here comes from `portable-atomic`
//! instead of `std` (the feature also turns on event-listener's and atomic-waker's, for targets
//! with no atomic compare-and-swap at all); `.ci/run` checks the crate for 32-bit PowerPC.

#[cfg(all(loom, not(feature = "loom")))]
compile_error!("building with `--cfg loom` requires the `loom` feature of async-bulkhead-llm");

#[cfg(not(loom))]
pub(crate) use std::sync::{Arc, Mutex, MutexGuard};

#[cfg(loom)]
pub(crate) use loom::sync::{Arc, Mutex, MutexGuard};

/// Declares a thread-local: std's, const-initialised, normally; loom's (one value per modelled
/// thread) under `--cfg loom`.
#[cfg(not(loom))]
macro_rules! thread_local_cell {
    ($name:ident: $t:ty = $init:expr) => {
        std::thread_local! { static $name: $t = const { $init }; }
    };
}

#[cfg(loom)]
macro_rules! thread_local_cell {
    ($name:ident: $t:ty = $init:expr) => {
        loom::thread_local! { static $name: $t = $init; }
    };
}

pub(crate) use thread_local_cell;

/// A waker slot for one task: atomic-waker's, or loom's model of it.
#[derive(Debug, Default)]
pub(crate) struct AtomicWaker {
    #[cfg(not(loom))]
    inner: atomic_waker::AtomicWaker,
    #[cfg(loom)]
    inner: loom::future::AtomicWaker,
}

impl AtomicWaker {
    /// Registers `waker` to be woken by the next [`wake`](AtomicWaker::wake).
    pub(crate) fn register(&self, waker: &core::task::Waker) {
        #[cfg(not(loom))]
        self.inner.register(waker);
        #[cfg(loom)]
        self.inner.register_by_ref(waker);
    }

    /// Wakes the registered waker, if any.
    pub(crate) fn wake(&self) {
        self.inner.wake();
    }

    /// Takes the registered waker out, if any, without waking it.
    #[cfg(not(loom))]
    pub(crate) fn take(&self) -> Option<core::task::Waker> {
        self.inner.take()
    }
}

/// Atomic integers and orderings.
pub(crate) mod atomic {
    #[cfg(all(not(loom), not(feature = "portable-atomic"), target_has_atomic = "64"))]
    pub(crate) use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};

    /// The same through `portable-atomic`: with the feature, and on every target without
    /// native 64-bit atomics.
    #[cfg(all(
        not(loom),
        any(feature = "portable-atomic", not(target_has_atomic = "64"))
    ))]
    pub(crate) use portable_atomic_crate::{AtomicU8, AtomicU64, Ordering};

    /// The wide admission word of a bulkhead with admission classes: `cmpxchg16b` on x86-64
    /// (detected at run time unless the target enables it), `casp` or `ldxp`/`stxp` on aarch64,
    /// a lock where the target has no 128-bit atomic.
    #[cfg(not(loom))]
    pub(crate) use portable_atomic_crate::AtomicU128;

    #[cfg(loom)]
    pub(crate) use loom::sync::atomic::{AtomicU8, AtomicU64, Ordering};

    #[cfg(loom)]
    pub(crate) use super::loom_u128::AtomicU128;

    /// Moves `word` to `next(current)` with a CAS loop (`AcqRel` on success, `Acquire` on a
    /// failure), as `fetch_update` does: the previous value, or `Err` with the value `next`
    /// refused (it returned `None`). The crate's own loop, because std deprecates
    /// `fetch_update` (renamed `try_update`, which the minimum supported Rust lacks).
    #[inline]
    pub(crate) fn update(
        word: &AtomicU64,
        mut next: impl FnMut(u64) -> Option<u64>,
    ) -> Result<u64, u64> {
        let mut current = word.load(Ordering::Acquire);
        while let Some(value) = next(current) {
            match word.compare_exchange_weak(current, value, Ordering::AcqRel, Ordering::Acquire) {
                Ok(previous) => return Ok(previous),
                Err(actual) => current = actual,
            }
        }
        Err(current)
    }
}

/// Loom has no 128-bit atomic: a loom-visible stand-in with the same operations, each one a
/// step of the model (a loom mutex around the value, so every access is a synchronisation point
/// loom schedules around, like the atomic it stands for).
#[cfg(loom)]
mod loom_u128 {
    use loom::sync::Mutex;

    use super::atomic::Ordering;

    #[derive(Debug)]
    pub(crate) struct AtomicU128(Mutex<u128>);

    impl AtomicU128 {
        pub(crate) fn new(value: u128) -> AtomicU128 {
            AtomicU128(Mutex::new(value))
        }

        pub(crate) fn load(&self, _order: Ordering) -> u128 {
            *self.0.lock().unwrap()
        }

        pub(crate) fn fetch_sub(&self, value: u128, _order: Ordering) -> u128 {
            let mut current = self.0.lock().unwrap();
            let before = *current;
            *current = before.wrapping_sub(value);
            before
        }

        pub(crate) fn compare_exchange_weak(
            &self,
            current: u128,
            new: u128,
            _success: Ordering,
            _failure: Ordering,
        ) -> Result<u128, u128> {
            let mut value = self.0.lock().unwrap();
            if *value == current {
                *value = new;
                Ok(current)
            } else {
                Err(*value)
            }
        }
    }
}

/// Items that are not part of any modelled protocol (see the module docs).
pub(crate) mod unmodeled {
    #[cfg(any(feature = "portable-atomic", not(target_has_atomic = "64")))]
    pub(crate) use portable_atomic_crate::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
    /// The timer's (no timer thread exists under loom).
    #[cfg(not(loom))]
    pub(crate) use std::sync::Condvar;
    #[cfg(all(not(feature = "portable-atomic"), target_has_atomic = "64"))]
    pub(crate) use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
    pub(crate) use std::sync::{Arc, Mutex, MutexGuard, Once, OnceLock, RwLock, Weak};

    /// Locks `mutex`, ignoring poisoning.
    ///
    /// No code of this crate panics while holding one of its locks (user code never runs under
    /// them, see `crate::support::contain`), so a poisoned lock can only come from an allocation failure
    /// or a similar abort-class event; the protected data is still consistent and refusing to
    /// continue would only turn one failure into many.
    pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
        mutex
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

/// Locks a modelled `mutex`, ignoring poisoning (see [`unmodeled::lock`]): without loom the
/// two are the same function.
#[cfg(not(loom))]
pub(crate) use unmodeled::lock;

/// Locks a modelled `mutex` (loom's), ignoring poisoning (see [`unmodeled::lock`]).
#[cfg(loom)]
pub(crate) fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Waits a little while spinning on a value another thread will change: exponential spinning,
/// then yielding the thread; under loom, a yield to the model (a spin loop must let loom run
/// the thread it waits for).
#[inline]
pub(crate) fn spin_wait(backoff: &crossbeam_utils::Backoff) {
    #[cfg(loom)]
    {
        let _ = backoff;
        loom::thread::yield_now();
    }
    #[cfg(not(loom))]
    backoff.snooze();
}
