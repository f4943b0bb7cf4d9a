//! What an admission that may wait decided ([`Decision`]): admitted with its grant, refused,
//! or queued with its waiter.

use super::grant::Grant;
use super::pool::WaiterHandle;
use crate::vocabulary::rejection::Rejection;

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
