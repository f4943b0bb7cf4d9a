//! How a call that finds no free slot waits ([`Wait`]): the value the engine's doors that may
//! queue take. A leaf: it imports nothing of the crate.

/// How a call that finds no free slot waits for one (a call that may not wait goes through
/// [`Engine::try_admit`](super::Engine::try_admit) instead).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Wait<'w> {
    /// In the queue, woken through this waker (the polling task's): it is registered in the
    /// waiter before the waiter is queued, so every hand-off after the arrival wakes it and
    /// the arriving poll may return `Pending` without registering and checking again.
    Async(&'w core::task::Waker),
    /// In the queue, as a parked thread.
    Blocking,
}
