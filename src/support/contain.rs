//! Running user code (wakers, listeners, estimators) so that its panic cannot unwind into the
//! crate's bookkeeping.
//!
//! The crate calls user code only where its own state is consistent and no lock of its own is
//! held, and always through [`contain`]: a panic is caught there, so a release or a hand-off
//! that called a panicking waker or estimator still completes, a permit dropped while its
//! thread is already unwinding does not abort the process, and a timer thread keeps running.

use core::panic::AssertUnwindSafe;
use std::panic::catch_unwind;

/// Runs `f`, catching a panic; returns whether it panicked.
///
/// The panic's payload is dropped under a second guard (a payload whose own `drop` panics is
/// leaked instead), so nothing escapes.
#[inline]
pub(crate) fn contain(f: impl FnOnce()) -> bool {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(()) => false,
        Err(payload) => {
            if let Err(nested) = catch_unwind(AssertUnwindSafe(move || drop(payload))) {
                core::mem::forget(nested);
            }
            true
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::contain;

    struct PanicsOnDrop;

    impl Drop for PanicsOnDrop {
        fn drop(&mut self) {
            panic!("payload drop");
        }
    }

    #[test]
    fn catches_panics_and_panicking_payloads() {
        assert!(!contain(|| {}));
        assert!(contain(|| panic!("boom")));
        assert!(contain(|| std::panic::panic_any(PanicsOnDrop)));
    }
}
