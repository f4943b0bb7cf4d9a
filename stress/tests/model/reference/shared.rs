//! `run_shared` in the harness: each call's callback is driven through a mailbox (report
//! usage, abandon its slot, finish, fail), so everything a shared call does happens at a known
//! step, whichever of its waiters polls it. The futures are owned (`'static`), so they live
//! next to the borrowed ones on the worker. A follower's own wait ends deterministically: a
//! zero timeout gives up at its first poll that finds no outcome, a long one never passes.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use async_bulkhead_llm::{
    RunContext, RunError, RunOptions, TokenUsage, admission::AdmissionId, classes::AdmissionClass,
    dedup::DedupScope, dedup::Sharing, usage::Progressive, usage::UsageError, usage::UsageReport,
};

use super::convert::{Seen, bypass_view, refused_of, seen_of_context, shadow_reasons, usage_of};
use super::driver::{Driver, model_view};
use super::flights::{Began, CallState, Outcome, SharedScript, SharedSpec};
use super::harness::{Call, Step};
use super::values::{Shadow, UsageSnapshot};

/// A shared callback's value: the serial of the caller whose callback made it, and its usage.
type Value = (u64, Option<TokenUsage>);
type Output = Result<Value, RunError<u64>>;
type SharedFuture = Pin<Box<dyn Future<Output = Output> + Send>>;

/// What the worker asks of a running shared callback.
enum Command {
    Report(TokenUsage, Option<Progressive>),
    Abandon,
    /// Return `Ok(usage)` or an error.
    Finish(Result<Option<TokenUsage>, ()>),
}

enum Reply {
    Report(Result<UsageReport, UsageError>),
    Abandon(bool),
}

/// Between the worker and one caller's callback (which runs only if that caller's call runs:
/// a leader's or a lone call's, or a follower's own bypass).
#[derive(Default)]
pub(crate) struct Mailbox {
    /// The callback was called.
    started: bool,
    commands: VecDeque<Command>,
    replies: VecDeque<Reply>,
    /// The call as the context showed it when the callback last ran.
    seen: Option<Seen>,
}

fn open(mailbox: &Mutex<Mailbox>) -> MutexGuard<'_, Mailbox> {
    mailbox.lock().expect("a mailbox")
}

/// A `run_shared` caller whose future has not finished.
pub(crate) struct SharedCaller {
    serial: u64,
    future: SharedFuture,
}

/// The `run_shared` side of the driver.
#[derive(Default)]
pub(crate) struct SharedCalls {
    /// In creation order.
    callers: Vec<SharedCaller>,
    /// Every caller's mailbox, by serial (a flight's is its owner's).
    mailboxes: std::collections::BTreeMap<u64, Arc<Mutex<Mailbox>>>,
    /// The admission id of each admitted flight.
    ids: std::collections::BTreeMap<u64, AdmissionId>,
    /// The callers whose callback the model says was called.
    called: std::collections::BTreeSet<u64>,
    next: u64,
}

impl SharedCalls {
    pub(crate) fn is_empty(&self) -> bool {
        self.callers.is_empty()
    }
}

/// The callback of caller `serial`: records its context, then obeys its mailbox.
fn callback(
    serial: u64,
    inbox: Arc<Mutex<Mailbox>>,
    handles: Vec<AdmissionClass>,
) -> impl FnOnce(RunContext<'static>) -> Pin<Box<dyn Future<Output = Result<Value, u64>> + Send>>
+ Send
+ 'static {
    move |mut ctx: RunContext<'static>| {
        Box::pin(async move {
            open(&inbox).started = true;
            loop {
                open(&inbox).seen = Some(seen_of_context(&ctx, &handles));
                let command = std::future::poll_fn(|_| match open(&inbox).commands.pop_front() {
                    Some(command) => Poll::Ready(command),
                    None => Poll::Pending,
                })
                .await;
                let reply = match command {
                    Command::Report(usage, None) => Reply::Report(ctx.report_usage(usage)),
                    Command::Report(usage, Some(progressive)) => {
                        Reply::Report(ctx.report_usage_progressive(usage, progressive))
                    }
                    Command::Abandon => Reply::Abandon(ctx.abandon_borrowed_concurrency()),
                    Command::Finish(result) => {
                        open(&inbox).seen = Some(seen_of_context(&ctx, &handles));
                        return result.map(|usage| (serial, usage)).map_err(|()| serial);
                    }
                };
                open(&inbox).replies.push_back(reply);
            }
        })
    }
}

fn describe(output: &Poll<Output>) -> String {
    format!("{output:?}")
}

impl Driver<'_> {
    /// `Op::Shared`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn shared(
        &mut self,
        call: &Call,
        scope: u8,
        no_dedup: bool,
        timeout: u8,
        observe: u8,
        script: SharedScript,
    ) {
        let Some((request, mut options, _)) = self.resolve(call) else {
            return;
        };
        let timeout = match timeout % 4 {
            1 => Some(true),
            2 => Some(false),
            _ => None,
        };
        match timeout {
            Some(true) => options = options.timeout(Duration::ZERO),
            Some(false) => options = options.timeout(Duration::from_secs(3600)),
            None => {}
        }
        let mut run_options = RunOptions::new(options);
        let observe = Shadow::pick(observe);
        if let Some(set) = observe {
            run_options = run_options.observe(shadow_reasons(set));
        }
        let scope = scope % 3;
        if scope > 0 {
            run_options = run_options.dedup_scope(DedupScope::new(format!("tenant {scope}")));
        }
        if no_dedup {
            run_options = run_options.no_dedup();
        }
        let serial = self.shared.next;
        self.shared.next += 1;
        let mailbox = Arc::new(Mutex::new(Mailbox::default()));
        {
            let mut mailbox = open(&mailbox);
            if let Some((input, output)) = script.report_first {
                let usage = TokenUsage::new(input, output).expect("a small usage");
                mailbox.commands.push_back(Command::Report(usage, None));
            }
            if script.finish_first {
                mailbox.commands.push_back(Command::Finish(Ok(None)));
            }
        }
        self.shared.mailboxes.insert(serial, Arc::clone(&mailbox));
        let f = callback(serial, mailbox, self.handles.clone());
        let future: SharedFuture = if script.extract {
            let sharing = Sharing::cloned().usage(|value: &Value| value.1);
            Box::pin(
                self.bulkhead
                    .run_shared_with(&request, run_options, sharing, f),
            )
        } else {
            Box::pin(self.bulkhead.run_shared(&request, run_options, f))
        };
        let (named, _) = self.named(call);
        let spec = SharedSpec {
            scope,
            no_dedup,
            timeout,
            observe,
            script,
        };
        self.model.shared_start(serial, call, named, spec);
        self.shared.callers.push(SharedCaller { serial, future });
        self.poll_shared(self.shared.callers.len() - 1);
    }

    /// Polls caller `at` and checks it against the model: its outcome, and every callback
    /// called meanwhile.
    fn poll_shared(&mut self, at: usize) {
        let serial = self.shared.callers[at].serial;
        let real = self.shared.callers[at]
            .future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()));
        let mut began = Vec::new();
        let model = self.model.shared_poll(serial, &mut began);
        for began in began {
            self.check_began(began);
        }
        match (real, model) {
            (Poll::Pending, Poll::Pending) => {}
            (Poll::Ready(real), Poll::Ready(expected)) => {
                self.shared.callers.remove(at);
                let real = match real {
                    Ok((flight, usage)) => Ok(Outcome::Value {
                        flight,
                        usage: usage_of(usage),
                    }),
                    Err(RunError::Failed(flight)) => Ok(Outcome::Failed(flight)),
                    Err(RunError::Rejected(rejection)) => {
                        Ok(Outcome::Rejected(refused_of(&rejection, &self.handles)))
                    }
                    Err(RunError::Invalid(error)) => {
                        self.note_invalid(&error);
                        Ok(Outcome::Invalid(error))
                    }
                    Err(other) => Err(format!("{other:?}")),
                };
                self.agree("a run_shared outcome", real, Ok(expected));
            }
            (real, model) => self.agree("a run_shared poll", describe(&real), format!("{model:?}")),
        }
    }

    /// A callback the model says was called during a poll: it was, its context shows its
    /// admission (with a new id) or its bypass (with a new shadow id), and its first report
    /// was answered as the model answers it.
    fn check_began(&mut self, began: Began) {
        let mailbox = Arc::clone(&self.shared.mailboxes[&began.flight]);
        let (started, seen, reply) = {
            let mut mailbox = open(&mailbox);
            (mailbox.started, mailbox.seen, mailbox.replies.pop_front())
        };
        self.agree("a shared callback was called", started, true);
        self.shared.called.insert(began.flight);
        match (seen, began.bypass) {
            (Some(Seen::Admitted(view)), None) => {
                let new = self.ids.insert(view.id);
                self.agree("whether the admission id is new", new, true);
                self.shared.ids.insert(began.flight, view.id);
                if let Some(model) = began.report {
                    match reply {
                        Some(Reply::Report(real)) => self.agree_report(real, view.id, model),
                        _ => {
                            self.agree("the shared callback's first report", "no reply", "a reply")
                        }
                    }
                }
            }
            (Some(Seen::Bypassed(view)), Some(number)) => {
                self.new_shadow(view.shadow, number);
                if let Some(model) = began.report {
                    match reply {
                        Some(Reply::Report(real)) => {
                            self.agree_bypass_report(real, view.shadow, model)
                        }
                        _ => {
                            self.agree("the shared callback's first report", "no reply", "a reply")
                        }
                    }
                }
            }
            (seen, bypass) => self.agree(
                "what a shared callback saw when it was called",
                format!("{seen:?}"),
                format!("bypass number {bypass:?}"),
            ),
        }
    }

    /// Records the shadow id of bypass number `number` (bypasses are numbered in the order
    /// they began); it is new and never an admission's.
    pub(super) fn new_shadow(&mut self, shadow: u128, number: u128) {
        self.agree(
            "the number of a new bypass",
            self.shadows.len() as u128,
            number,
        );
        self.agree(
            "whether the shadow id is new",
            self.shadows.contains(&shadow) || self.ids.iter().any(|id| id.as_u128() == shadow),
            false,
        );
        self.shadows.push(shadow);
    }

    /// Checks a bypassed call's usage report: its ids are the bypass's shadow id.
    pub(super) fn agree_bypass_report(
        &self,
        real: Result<UsageReport, UsageError>,
        shadow: u128,
        model: Result<UsageSnapshot, UsageError>,
    ) {
        let real = real.map(|r| {
            self.agree(
                "a bypass usage report's ids",
                (
                    r.admission_id.as_u128(),
                    r.shadow_id.map(super::convert::shadow_raw),
                ),
                (shadow, Some(shadow)),
            );
            UsageSnapshot {
                limit_revision: r.limit_revision,
                sequence: r.sequence,
                reserved: r.reserved,
                held: r.held,
                consumed: r.consumed,
                output_cap: r.output_cap,
                output_remaining: r.output_remaining,
                over_reservation: r.over_reservation,
            }
        });
        self.agree("a bypass usage report", real, model);
    }

    /// `Op::SharedStep`.
    pub(super) fn shared_step(&mut self, flight: u32, via: u32, step: Step) {
        let running = self.model.flights.running();
        if running.is_empty() {
            return;
        }
        let id = running[flight as usize % running.len()];
        let waiters = self.model.flights.waiters(id);
        let via = waiters[via as usize % waiters.len()];
        if via != id {
            self.model.note("shared: call driven by a follower");
        }
        let command = match step {
            Step::Report {
                input,
                output,
                progressive,
            } => {
                let Ok(usage) = TokenUsage::new(input, output) else {
                    return;
                };
                let progress = progressive
                    .map(|(remaining, margin)| Progressive::new(remaining).safety_margin(margin));
                Command::Report(usage, progress)
            }
            Step::Abandon => Command::Abandon,
            Step::Finish { ok, usage } => {
                let usage = match usage.map(|(input, output)| TokenUsage::new(input, output)) {
                    None => None,
                    Some(Ok(usage)) => Some(usage),
                    Some(Err(_)) => return,
                };
                Command::Finish(if ok { Ok(usage) } else { Err(()) })
            }
        };
        let mailbox = Arc::clone(&self.shared.mailboxes[&id]);
        open(&mailbox).commands.push_back(command);
        let bypass = match self.model.flights.flights[&id].call {
            Some(CallState::Bypassed(bypass)) => Some(self.shadows[bypass.shadow as usize]),
            _ => None,
        };
        enum Expect {
            Report(Result<UsageSnapshot, UsageError>),
            Abandon(bool),
            Nothing,
        }
        let expected = match step {
            Step::Report {
                input,
                output,
                progressive,
            } => Expect::Report(self.model.shared_report(id, (input, output), progressive)),
            Step::Abandon => Expect::Abandon(self.model.shared_abandon(id)),
            Step::Finish { ok, usage } => {
                self.model.shared_finish(id, ok, usage);
                Expect::Nothing
            }
        };
        let at = self
            .shared
            .callers
            .iter()
            .position(|c| c.serial == via)
            .expect("a waiter's future");
        self.poll_shared(at);
        let reply = open(&mailbox).replies.pop_front();
        match (expected, reply) {
            (Expect::Nothing, None) => {}
            (Expect::Report(model), Some(Reply::Report(real))) => match bypass {
                Some(shadow) => self.agree_bypass_report(real, shadow, model),
                None => self.agree_report(real, self.shared.ids[&id], model),
            },
            (Expect::Abandon(model), Some(Reply::Abandon(real))) => {
                self.agree("a shared callback's abandonment", real, model);
            }
            (_, reply) => self.agree(
                "a shared callback's reply",
                reply.is_some(),
                !matches!(step, Step::Finish { .. }),
            ),
        }
    }

    /// `Op::DropShared`.
    pub(super) fn drop_shared(&mut self, caller: u32) {
        if self.shared.callers.is_empty() {
            return;
        }
        let at = caller as usize % self.shared.callers.len();
        let SharedCaller { serial, future } = self.shared.callers.remove(at);
        drop(future);
        self.model.shared_drop(serial);
    }

    /// `Op::PollShared`.
    pub(super) fn poll_one_shared(&mut self, caller: u32) {
        if !self.shared.callers.is_empty() {
            self.poll_shared(caller as usize % self.shared.callers.len());
        }
    }

    /// Polls every `run_shared` caller, in creation order.
    pub(super) fn poll_all_shared(&mut self) {
        let serials: Vec<u64> = self.shared.callers.iter().map(|c| c.serial).collect();
        for serial in serials {
            if let Some(at) = self.shared.callers.iter().position(|c| c.serial == serial) {
                self.poll_shared(at);
            }
        }
    }

    /// Every running shared callback's context, as it last saw it; no other callback was
    /// called.
    pub(super) fn check_shared(&self) {
        for (serial, mailbox) in &self.shared.mailboxes {
            if open(mailbox).started && !self.shared.called.contains(serial) {
                self.agree("a callback the model did not call", Some(*serial), None);
            }
        }
        for id in self.model.flights.running() {
            let expected = match self.model.flights.flights[&id].call {
                Some(CallState::Admitted(permit)) => {
                    Seen::Admitted(model_view(self.shared.ids[&id], &permit))
                }
                Some(CallState::Bypassed(bypass)) => {
                    Seen::Bypassed(bypass_view(self.shadows[bypass.shadow as usize], &bypass))
                }
                _ => unreachable!("a running flight"),
            };
            self.agree(
                "a running shared call's context",
                open(&self.shared.mailboxes[&id]).seen,
                Some(expected),
            );
        }
    }

    /// Drops the oldest `run_shared` caller (for `finish`).
    pub(super) fn drop_oldest_shared(&mut self) {
        self.drop_shared(0);
    }
}
