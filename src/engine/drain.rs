//! Waiting for quiescence: [`Drain`] and [`DrainTimeout`].
//!
//! # Protocol
//!
//! A drain *arms* the `DRAINING` flag of the admission word with a CAS that also reads whether
//! the bulkhead is idle (no slot held, nobody queued): if it is, the drain is done. Every
//! operation that can make the bulkhead idle (a release, a waiter leaving the queue by timeout,
//! cancellation or refusal, `close`) does so with an atomic operation on the same word, so it
//! sees the flag if the drain armed first, and then clears it, advances the idle generation and
//! notifies the drainers. A drain that armed, listened and re-checked therefore cannot miss the
//! idle moment; a woken drainer that finds new work already running still completes, because
//! the generation moved after it started waiting (an idle moment happened): the original's
//! semantics, with its quirk Q5 fixed (`docs/design.md` §D4: idle reached by a timeout or a
//! cancellation completes a drain too).

use core::fmt;
use core::future::Future;
use core::pin::Pin;
use core::task::{Context, Poll};
use std::time::{Duration, Instant};

use event_listener::EventListener;

use super::assembly::Engine;
use super::timer::Sleep;
use crate::support::sync::atomic::Ordering;
use crate::vocabulary::drain_report::DrainReport;

impl Engine {
    /// A future that resolves once the engine is idle (see
    /// [`LlmBulkhead::drain`](crate::LlmBulkhead::drain)).
    pub(crate) fn drain(&self) -> Drain<'_> {
        Drain {
            engine: self,
            generation: None,
            listener: None,
        }
    }
}

impl<'a> Drain<'a> {
    /// This drain, giving up at `timeout` from now.
    pub(crate) fn within(self, timeout: Duration) -> DrainTimeout<'a> {
        DrainTimeout {
            drain: self,
            sleep: Sleep::after(Instant::now(), timeout),
        }
    }
}

/// Future returned by [`LlmBulkhead::drain`](crate::LlmBulkhead::drain).
#[must_use = "futures do nothing unless polled"]
pub struct Drain<'a> {
    engine: &'a Engine,
    /// The idle generation when the drain started.
    generation: Option<u64>,
    listener: Option<EventListener>,
}

impl Future for Drain<'_> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let engine = self.engine;
        // Acquire: pairs with the Release increment in `Engine::notify_drained`.
        let started = *self
            .generation
            .get_or_insert_with(|| engine.idle_generation.load(Ordering::Acquire));
        loop {
            if engine.idle_generation.load(Ordering::Acquire) != started {
                return Poll::Ready(());
            }
            // Arm: set DRAINING unless idle, in one CAS that also reads whether it is idle.
            // While the classes' floors are reserved the word never reads idle: they are
            // released first (and not reserved again while DRAINING is set).
            let idle = engine
                .state
                .update(|s| {
                    if s.floors_reserved() {
                        Err(None)
                    } else if s.is_idle() {
                        Err(Some(true))
                    } else if s.is_draining() {
                        Err(Some(false))
                    } else {
                        Ok((s.with_draining(true), Some(false)))
                    }
                })
                .unwrap_or_else(|idle| idle);
            match idle {
                None => {
                    engine.release_floors();
                    continue;
                }
                Some(true) => return Poll::Ready(()),
                Some(false) => {}
            }
            match &mut self.listener {
                None => self.listener = Some(engine.drained.listen()),
                Some(listener) => {
                    if Pin::new(listener).poll(cx).is_ready() {
                        self.listener = None;
                    } else {
                        return Poll::Pending;
                    }
                }
            }
        }
    }
}

impl fmt::Debug for Drain<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Drain { .. }")
    }
}

/// Future returned by [`LlmBulkhead::drain_timeout`](crate::LlmBulkhead::drain_timeout).
#[must_use = "futures do nothing unless polled"]
pub struct DrainTimeout<'a> {
    drain: Drain<'a>,
    /// `None` when the timeout is beyond what the clock can represent (no deadline).
    sleep: Option<Sleep>,
}

impl Future for DrainTimeout<'_> {
    type Output = DrainReport;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<DrainReport> {
        // Completion wins over a deadline that passes at the same moment.
        if Pin::new(&mut self.drain).poll(cx).is_ready() {
            return Poll::Ready(DrainReport {
                drained: true,
                in_flight: 0,
                pending: 0,
            });
        }
        let expired = match &mut self.sleep {
            Some(sleep) => sleep.poll_elapsed(cx).is_ready(),
            None => false,
        };
        if !expired {
            return Poll::Pending;
        }
        let occupancy = self.drain.engine.occupancy();
        Poll::Ready(DrainReport {
            drained: false,
            in_flight: occupancy.active,
            pending: occupancy.queued,
        })
    }
}

impl fmt::Debug for DrainTimeout<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("DrainTimeout { .. }")
    }
}
