//! Helpers of the deduplication tests: a gate that holds a callback until the test opens it,
//! a counter of callbacks run, and an event recorder.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use async_bulkhead_llm::{
    LlmBulkhead, LlmBulkheadBuilder, LlmRequest, RunContext, dedup::Deduplication, events::Event,
    events::EventKind,
};
use futures::FutureExt;
use futures::channel::oneshot;
use futures::future::Shared;

/// A bulkhead with `max_concurrent` slots that deduplicates by the whole request.
pub(crate) fn dedup(max_concurrent: usize) -> LlmBulkhead {
    builder(max_concurrent).build().unwrap()
}

pub(crate) fn builder(max_concurrent: usize) -> LlmBulkheadBuilder {
    LlmBulkhead::builder("m", max_concurrent).deduplication(Deduplication::new())
}

pub(crate) fn prompt(text: &str) -> LlmRequest {
    LlmRequest::new().user(text).max_tokens(100)
}

/// Holds callbacks until opened. Clones share the gate.
#[derive(Clone)]
pub(crate) struct Gate {
    open: Arc<Mutex<Option<oneshot::Sender<()>>>>,
    wait: Shared<oneshot::Receiver<()>>,
}

impl Gate {
    pub(crate) fn new() -> Gate {
        let (tx, rx) = oneshot::channel();
        Gate {
            open: Arc::new(Mutex::new(Some(tx))),
            wait: rx.shared(),
        }
    }

    /// A gate already open.
    pub(crate) fn open_now() -> Gate {
        let gate = Gate::new();
        gate.open();
        gate
    }

    pub(crate) fn open(&self) {
        if let Some(tx) = self.open.lock().unwrap().take() {
            let _ = tx.send(());
        }
    }

    /// Resolves once the gate is opened.
    pub(crate) fn passed(&self) -> impl Future<Output = ()> + Send + 'static {
        let wait = self.wait.clone();
        async move {
            let _ = wait.await;
        }
    }
}

/// Counts the callbacks that ran, and those whose future was dropped before finishing.
#[derive(Clone, Default)]
pub(crate) struct Runs {
    pub(crate) started: Arc<AtomicU64>,
    pub(crate) dropped: Arc<AtomicU64>,
}

impl Runs {
    pub(crate) fn started(&self) -> u64 {
        self.started.load(Ordering::SeqCst)
    }

    pub(crate) fn dropped(&self) -> u64 {
        self.dropped.load(Ordering::SeqCst)
    }

    /// A callback that counts its start, waits for `gate`, and returns `value`; its drop
    /// before finishing is counted.
    pub(crate) fn call<T: Send + 'static>(
        &self,
        gate: &Gate,
        value: T,
    ) -> impl FnOnce(RunContext<'static>) -> Pin<Box<dyn Future<Output = Result<T, String>> + Send>>
    + Send
    + 'static {
        let runs = self.clone();
        let passed = gate.passed();
        move |_ctx| {
            runs.started.fetch_add(1, Ordering::SeqCst);
            let guard = DropCount(Some(runs.dropped.clone()));
            Box::pin(async move {
                passed.await;
                guard.disarm();
                Ok(value)
            })
        }
    }
}

struct DropCount(Option<Arc<AtomicU64>>);

impl DropCount {
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for DropCount {
    fn drop(&mut self) {
        if let Some(count) = self.0.take() {
            count.fetch_add(1, Ordering::SeqCst);
        }
    }
}

/// Polls `future` once with a no-op waker.
pub(crate) fn poll_once<F: Future + Unpin>(future: &mut F) -> Poll<F::Output> {
    Pin::new(future).poll(&mut Context::from_waker(std::task::Waker::noop()))
}

/// Records the kinds of events (and dedup followers counts) it hears.
#[derive(Clone, Default)]
pub(crate) struct Heard(Arc<Mutex<Vec<HeardEvent>>>);

/// An event's kind, and for a dedup event its follower count.
type HeardEvent = (EventKind, Option<u64>);

impl Heard {
    pub(crate) fn on(bulkhead: &LlmBulkhead) -> (Heard, async_bulkhead_llm::events::Subscription) {
        let heard = Heard::default();
        let log = heard.clone();
        let subscription = bulkhead.on(move |event: &Event<'_>| {
            let followers = match event {
                Event::Dedup(e) => Some(e.followers),
                _ => None,
            };
            log.0.lock().unwrap().push((event.kind(), followers));
        });
        (heard, subscription)
    }

    pub(crate) fn kinds(&self) -> Vec<EventKind> {
        self.0.lock().unwrap().iter().map(|(k, _)| *k).collect()
    }

    pub(crate) fn followers(&self) -> Vec<u64> {
        self.0
            .lock()
            .unwrap()
            .iter()
            .filter_map(|(_, f)| *f)
            .collect()
    }
}
