//! How a call that finds no free slot waits ([`Wait`]) and what an admission that may wait
//! decided ([`Decision`]): the values the engine's doors answer with. A leaf: it imports only
//! the values it carries.

use super::grant::Grant;
use super::pool::WaiterHandle;
use crate::vocabulary::rejection::Rejection;

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

/// What [`Engine::admit`](super::Engine::admit) decided.
#[derive(Debug)]
pub(crate) enum Decision {
    /// Admitted now (counted, with its id).
    Admitted(Grant),
    /// Refused now (counted).
    Refused(Rejection),
    /// Waiting in the queue: its outcome comes through the waiter.
    Queued(WaiterHandle),
}
