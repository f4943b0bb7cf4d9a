//! `run` in the harness: the callback is driven by the worker through a mailbox, so a run can
//! wait in the queue, run, report usage, abandon its slot, finish, fail or be dropped, one
//! operation at a time. Its borrowed-slot deadline (design §U7.3, Q16) is deterministic: a
//! short one is only ever set on a run whose callback then waits for the worker, who blocks
//! on the run until the crate's timer cuts it; a long one never passes during a test.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};
use std::thread::{self, Thread};
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    RunContext, RunError, RunOptions, TokenUsage, admission::AdmissionId, classes::AdmissionClass,
    request::RequestError, usage::Progressive, usage::UsageError, usage::UsageReport,
};

use super::bypass::Entered;
use super::convert::{Seen, borrowed_of, bypass_view, refused_of, seen_of_context, shadow_reasons};
use super::driver::{Driver, model_view};
use super::harness::Call;
use super::values::{Ask, Cause, ModelBypass, ModelPermit, Shadow};

/// The short deadline: the worker blocks until it passes.
pub(super) const SHORT_DEADLINE: Duration = Duration::from_millis(1);

type RunOutput = Result<Option<TokenUsage>, RunError<()>>;
type RunFuture<'b> = Pin<Box<dyn Future<Output = RunOutput> + 'b>>;

/// What the worker asks of a running callback.
enum Command {
    Report(TokenUsage, Option<Progressive>),
    Abandon,
    /// Return this: `Ok(usage)` settles with it (none: the last reported usage), an error
    /// with the last reported usage.
    Finish(Result<Option<TokenUsage>, ()>),
}

enum Reply {
    Report(Result<UsageReport, UsageError>),
    Abandon(bool),
}

/// Between the worker and a callback, on the worker's thread.
#[derive(Default)]
struct Mailbox {
    /// The callback was called (the run was admitted).
    started: bool,
    commands: VecDeque<Command>,
    replies: VecDeque<Reply>,
    /// The call as the run context showed it when the callback last ran.
    view: Option<Seen>,
}

/// The model's side of a run: waiting (the model's waiter key, and what a bypass after the
/// wait needs: the call, whether the advisory check said it gets in), running (its
/// admission), or running as a bypass.
enum RunState {
    Waiting { key: u64, ask: Ask, advisory: bool },
    Running { model: ModelPermit, id: AdmissionId },
    Bypassed(ModelBypass),
}

/// The first things a callback does when it is called (see `Op::Run`).
pub(super) type Script = (Option<(u64, u64)>, bool, bool);

/// A run the worker keeps: its future, the mailbox to its callback, its deadline, first
/// steps and observe set, and the model's side; `serial` tells runs apart in creation order.
pub(crate) struct LiveRun<'b> {
    future: RunFuture<'b>,
    mailbox: Rc<RefCell<Mailbox>>,
    deadline: Option<Duration>,
    script: Script,
    observe: Option<Shadow>,
    state: RunState,
    serial: u64,
}

impl LiveRun<'_> {
    fn poll(&mut self) -> Poll<RunOutput> {
        self.future
            .as_mut()
            .poll(&mut Context::from_waker(Waker::noop()))
    }

    fn started(&self) -> bool {
        self.mailbox.borrow().started
    }

    fn send(&mut self, command: Command) -> Poll<RunOutput> {
        self.mailbox.borrow_mut().commands.push_back(command);
        self.poll()
    }

    fn reply(&mut self) -> Option<Reply> {
        self.mailbox.borrow_mut().replies.pop_front()
    }

    /// Polls until the run ends, waking on the crate's timer; gives up after ten seconds.
    fn drive(&mut self) -> RunOutput {
        struct Unpark(Thread);
        impl Wake for Unpark {
            fn wake(self: Arc<Self>) {
                self.0.unpark();
            }
        }
        let waker = Waker::from(Arc::new(Unpark(thread::current())));
        let mut cx = Context::from_waker(&waker);
        let give_up = Instant::now() + Duration::from_secs(10);
        loop {
            if let Poll::Ready(output) = self.future.as_mut().poll(&mut cx) {
                return output;
            }
            let now = Instant::now();
            assert!(now < give_up, "the borrowed-slot deadline never passed");
            thread::park_timeout(give_up - now);
        }
    }
}

fn describe(output: &Poll<RunOutput>) -> String {
    format!("{output:?}")
}

impl<'b> Driver<'b> {
    /// `Op::Run`.
    pub(super) fn run(
        &mut self,
        call: &Call,
        timeout: u8,
        deadline: u8,
        script: Script,
        observe: u8,
    ) {
        let Some((request, mut options, ask)) = self.resolve(call) else {
            return;
        };
        let zero_timeout = timeout % 4 == 1;
        if zero_timeout {
            options = options.timeout(Duration::ZERO);
        } else if timeout % 4 == 2 {
            options = options.timeout(Duration::from_secs(3600));
        }
        let deadline = match deadline % 5 {
            0 => None,
            1 => Some(Duration::ZERO),
            2 => Some(SHORT_DEADLINE),
            3 => Some(Duration::from_secs(3600)),
            _ => Some(Duration::MAX),
        };
        let mut run_options = RunOptions::new(options);
        if let Some(deadline) = deadline {
            run_options = run_options.borrowed_concurrency_deadline(deadline);
        }
        let observe = Shadow::pick(observe);
        if let Some(set) = observe {
            run_options = run_options.observe(shadow_reasons(set));
        }
        let mailbox = Rc::new(RefCell::new(Mailbox::default()));
        {
            let mut mailbox = mailbox.borrow_mut();
            let (report, abandon, finish) = script;
            if let Some((input, output)) = report {
                let usage = TokenUsage::new(input, output).expect("a small usage");
                mailbox.commands.push_back(Command::Report(usage, None));
            }
            if abandon {
                mailbox.commands.push_back(Command::Abandon);
            }
            if finish {
                mailbox.commands.push_back(Command::Finish(Ok(None)));
            }
        }
        let inbox = Rc::clone(&mailbox);
        let handles: Vec<AdmissionClass> = self.handles.clone();
        let future = self.bulkhead.run_with_usage(
            &request,
            run_options,
            |value: &Option<TokenUsage>| *value,
            async move |mut ctx: RunContext<'_>| {
                inbox.borrow_mut().started = true;
                loop {
                    inbox.borrow_mut().view = Some(seen_of_context(&ctx, &handles));
                    let command =
                        std::future::poll_fn(|_| match inbox.borrow_mut().commands.pop_front() {
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
                            inbox.borrow_mut().view = Some(seen_of_context(&ctx, &handles));
                            return result;
                        }
                    };
                    inbox.borrow_mut().replies.push_back(reply);
                }
            },
        );
        // Unique among the live runs (a run admitted after waiting moves to the end).
        let serial = self.runs.iter().map(|r| r.serial + 1).max().unwrap_or(0);
        let mut run = LiveRun {
            future: Box::pin(future),
            mailbox,
            deadline,
            script,
            observe,
            state: RunState::Waiting {
                key: u64::MAX,
                ask: Ask {
                    class: None,
                    high: false,
                    reservation: None,
                },
                advisory: true,
            },
            serial,
        };
        let real = run.poll();
        if deadline == Some(Duration::ZERO) {
            // Validated when `run` starts, before anything else; changes nothing (design
            // §U7.3).
            self.model.note("run: zero deadline refused");
            self.agree(
                "a run with a zero deadline",
                describe(&real),
                describe(&Poll::Ready(Err(RunError::Invalid(
                    RequestError::ZeroBorrowedConcurrencyDeadline,
                )))),
            );
            return;
        }
        let model = ask.map(|ask| (ask, self.model.enter(ask, zero_timeout, observe)));
        match (real, model) {
            (Poll::Pending, Ok((ask, Entered::Queued { key, advisory }))) if !run.started() => {
                run.state = RunState::Waiting { key, ask, advisory };
                self.runs.push(run);
            }
            (real, Ok((_, Entered::Admitted(permit)))) if run.started() => {
                self.start_run(run, real, permit);
            }
            (real, Ok((_, Entered::Bypassed(bypass)))) if run.started() => {
                self.start_bypassed_run(run, real, bypass);
            }
            (
                Poll::Ready(Err(RunError::Rejected(rejection))),
                Ok((_, Entered::Refused(refused))),
            ) => {
                self.agree("run", refused_of(&rejection, &self.handles), refused);
            }
            (Poll::Ready(Err(RunError::Invalid(error))), Err(expected)) => {
                self.note_invalid(&error);
                self.agree("run", error, expected);
            }
            (real, model) => {
                let model = model.map(|(_, entered)| format!("{entered:?}"));
                self.agree(
                    "run",
                    format!("{} (callback called: {})", describe(&real), run.started()),
                    format!("{model:?}"),
                );
            }
        }
    }

    /// A run just admitted (its callback called, `real` the poll that called it): the
    /// callback's first steps, then the deadline if it applies, else it keeps running.
    fn start_run(&mut self, mut run: LiveRun<'b>, real: Poll<RunOutput>, mut permit: ModelPermit) {
        self.model.note("run admitted");
        let view = match run.mailbox.borrow().view {
            Some(Seen::Admitted(view)) => view,
            seen => panic!("an admitted run's callback saw {seen:?}"),
        };
        let new = self.ids.insert(view.id);
        self.agree("whether the admission id is new", new, true);
        let (report, abandon, finish) = run.script;
        if let Some(usage) = report {
            let model = self.model.report(&mut permit, usage, None);
            match run.reply() {
                Some(Reply::Report(real)) => self.agree_report(real, view.id, model),
                _ => self.agree("the callback's first report", "no reply", "a reply"),
            }
        }
        if abandon {
            let model = self.model.abandon(&mut permit, Cause::Manual);
            match run.reply() {
                Some(Reply::Abandon(real)) => {
                    self.agree("the callback's abandonment", real, model);
                }
                _ => self.agree("the callback's abandonment", "no reply", "a reply"),
            }
        }
        let seen = run.mailbox.borrow().view;
        self.agree(
            "a run's context",
            seen,
            Some(Seen::Admitted(model_view(view.id, &permit))),
        );
        // Design §U7.3: only a borrowed slot still held, from admission on.
        let cut = run.deadline == Some(SHORT_DEADLINE) && permit.borrowed.slot && permit.holds_slot;
        if finish {
            // The callback finished before its first poll returned: never cut.
            if cut {
                self.model.note("run finished first under a deadline");
            }
            self.agree(
                "a run finished at once",
                describe(&real),
                describe(&Poll::Ready(Ok(None))),
            );
            self.model.settle(permit, None);
            return;
        }
        if cut {
            let output = match real {
                Poll::Ready(output) => output,
                Poll::Pending => run.drive(),
            };
            // The error names the deadline, the admission, what it borrowed and its class.
            let expected = (
                SHORT_DEADLINE,
                view.id,
                permit.borrowed,
                permit.class.map(|c| self.handles[c]),
            );
            match output {
                Err(RunError::BorrowedConcurrencyDeadline(error)) => self.agree(
                    "the deadline error",
                    (
                        error.deadline,
                        error.admission_id,
                        borrowed_of(error.resources),
                        error.class,
                    ),
                    expected,
                ),
                other => self.agree(
                    "a run past its deadline",
                    format!("{other:?}"),
                    format!("the deadline error {expected:?}"),
                ),
            }
            // The slot goes back at once (cause `deadline`), then the tokens settle with the
            // last usage reported (design §U7.3, Q16).
            let cut = self.model.abandon(&mut permit, Cause::Deadline);
            assert!(cut, "the model abandons a borrowed slot still held");
            self.model.settle(permit, None);
            self.model.note("deadline passed");
            return;
        }
        if run.deadline == Some(SHORT_DEADLINE) {
            self.model
                .note(if permit.class.is_some() && !permit.borrowed.slot {
                    "run deadline not applied: slot within the floor"
                } else {
                    "run deadline not applied"
                });
        }
        self.agree("a running run", describe(&real), describe(&Poll::Pending));
        run.state = RunState::Running {
            model: permit,
            id: view.id,
        };
        self.runs.push(run);
    }

    /// A run just bypassed (its callback called with the bypass's context, `real` the poll
    /// that called it): the callback's first steps (a bypass has no slot to abandon, and no
    /// deadline applies to it), then it keeps running.
    fn start_bypassed_run(
        &mut self,
        mut run: LiveRun<'b>,
        real: Poll<RunOutput>,
        mut bypass: ModelBypass,
    ) {
        self.model.note("run bypassed");
        let shadow = match run.mailbox.borrow().view {
            Some(Seen::Bypassed(view)) => view.shadow,
            seen => panic!("a bypassed run's callback saw {seen:?}"),
        };
        self.new_shadow(shadow, bypass.shadow);
        let (report, abandon, finish) = run.script;
        if let Some(usage) = report {
            let model = self.model.report_bypass(&mut bypass, usage, None);
            match run.reply() {
                Some(Reply::Report(real)) => self.agree_bypass_report(real, shadow, model),
                _ => self.agree("the callback's first report", "no reply", "a reply"),
            }
        }
        if abandon {
            self.model.note("observe: bypass holds no slot to abandon");
            match run.reply() {
                Some(Reply::Abandon(real)) => {
                    self.agree("a bypass's abandonment", real, false);
                }
                _ => self.agree("a bypass's abandonment", "no reply", "a reply"),
            }
        }
        let seen = run.mailbox.borrow().view;
        self.agree(
            "a bypassed run's context",
            seen,
            Some(Seen::Bypassed(bypass_view(shadow, &bypass))),
        );
        if finish {
            self.agree(
                "a bypassed run finished at once",
                describe(&real),
                describe(&Poll::Ready(Ok(None))),
            );
            self.model.finish_bypass(bypass, None);
            return;
        }
        self.agree(
            "a running bypass",
            describe(&real),
            describe(&Poll::Pending),
        );
        run.state = RunState::Bypassed(bypass);
        self.runs.push(run);
    }

    /// Polls every waiting run, in creation order.
    pub(super) fn poll_runs(&mut self) {
        let waiting: Vec<u64> = self
            .runs
            .iter()
            .filter(|r| matches!(r.state, RunState::Waiting { .. }))
            .map(|r| r.serial)
            .collect();
        for serial in waiting {
            let at = self
                .runs
                .iter()
                .position(|r| r.serial == serial)
                .expect("still there");
            let RunState::Waiting { key, ask, advisory } = self.runs[at].state else {
                unreachable!("a waiting run")
            };
            let real = self.runs[at].poll();
            let started = self.runs[at].started();
            // A refusal after the wait may be bypassed (observe mode).
            let model = match self.model.poll_waiter(key) {
                Poll::Ready(Err(refused)) => {
                    let observe = self.runs[at].observe;
                    match self.model.after_refusal(ask, refused, observe, advisory) {
                        Ok(bypass) => Poll::Ready(Ok(Entered::Bypassed(bypass))),
                        Err(refused) => Poll::Ready(Err(refused)),
                    }
                }
                Poll::Ready(Ok(permit)) => Poll::Ready(Ok(Entered::Admitted(permit))),
                Poll::Pending => Poll::Pending,
            };
            match (real, model) {
                (Poll::Pending, Poll::Pending) if !started => {}
                (real, Poll::Ready(Ok(Entered::Admitted(permit)))) if started => {
                    let run = self.runs.remove(at);
                    self.start_run(run, real, permit);
                }
                (real, Poll::Ready(Ok(Entered::Bypassed(bypass)))) if started => {
                    let run = self.runs.remove(at);
                    self.start_bypassed_run(run, real, bypass);
                }
                (Poll::Ready(Err(RunError::Rejected(rejection))), Poll::Ready(Err(refused))) => {
                    self.runs.remove(at);
                    self.agree(
                        "a waiting run's poll",
                        refused_of(&rejection, &self.handles),
                        refused,
                    );
                }
                (real, model) => self.agree(
                    "a waiting run's poll",
                    format!("{} (callback called: {started})", describe(&real)),
                    format!("{model:?}"),
                ),
            }
        }
    }

    /// The position of running run `run` (modulo the number running, bypassed ones included),
    /// if any.
    fn running(&self, run: u32) -> Option<usize> {
        let running: Vec<usize> = (0..self.runs.len())
            .filter(|&i| !matches!(self.runs[i].state, RunState::Waiting { .. }))
            .collect();
        (!running.is_empty()).then(|| running[run as usize % running.len()])
    }

    /// `Op::RunReport`.
    pub(super) fn run_report(
        &mut self,
        run: u32,
        usage: (u64, u64),
        progressive: Option<(u64, u64)>,
    ) {
        let Some(at) = self.running(run) else {
            return;
        };
        let Ok(token_usage) = TokenUsage::new(usage.0, usage.1) else {
            return;
        };
        let progress = progressive
            .map(|(remaining, margin)| Progressive::new(remaining).safety_margin(margin));
        let live = &mut self.runs[at];
        let polled = live.send(Command::Report(token_usage, progress));
        let reply = live.reply();
        self.agree(
            "a run reporting",
            describe(&polled),
            describe(&Poll::Pending),
        );
        let Some(Reply::Report(real)) = reply else {
            return self.agree("a run's report", "no reply", "a reply");
        };
        match &mut self.runs[at].state {
            RunState::Running { model, id } => {
                let (mut permit, id) = (*model, *id);
                let expected = self.model.report(&mut permit, usage, progressive);
                self.runs[at].state = RunState::Running { model: permit, id };
                self.agree_report(real, id, expected);
            }
            RunState::Bypassed(bypass) => {
                let mut bypass = *bypass;
                let expected = self.model.report_bypass(&mut bypass, usage, progressive);
                self.runs[at].state = RunState::Bypassed(bypass);
                let shadow = self.shadows[bypass.shadow as usize];
                self.agree_bypass_report(real, shadow, expected);
            }
            RunState::Waiting { .. } => unreachable!("a running run"),
        }
    }

    /// `Op::RunAbandon` (design §U7.2; after it the deadline no longer applies, §U7.3). A
    /// bypass holds no slot.
    pub(super) fn run_abandon(&mut self, run: u32) {
        let Some(at) = self.running(run) else {
            return;
        };
        let live = &mut self.runs[at];
        let polled = live.send(Command::Abandon);
        let reply = live.reply();
        self.agree(
            "a run abandoning",
            describe(&polled),
            describe(&Poll::Pending),
        );
        let expected = match &self.runs[at].state {
            RunState::Running { model, id } => {
                let (mut permit, id) = (*model, *id);
                let done = self.model.abandon(&mut permit, Cause::Manual);
                self.runs[at].state = RunState::Running { model: permit, id };
                done
            }
            _ => {
                self.model.note("observe: bypass holds no slot to abandon");
                false
            }
        };
        match reply {
            Some(Reply::Abandon(real)) => self.agree("a run's abandonment", real, expected),
            _ => self.agree("a run's abandonment", "no reply", "a reply"),
        }
    }

    /// `Op::RunFinish`: `run` settles when the callback returns (crate run.rs), a bypass ends.
    pub(super) fn run_finish(&mut self, run: u32, ok: bool, usage: Option<(u64, u64)>) {
        let Some(at) = self.running(run) else {
            return;
        };
        let token_usage = match usage.map(|(input, output)| TokenUsage::new(input, output)) {
            None => None,
            Some(Ok(usage)) => Some(usage),
            Some(Err(_)) => return,
        };
        let mut live = self.runs.remove(at);
        let result = if ok { Ok(token_usage) } else { Err(()) };
        let polled = live.send(Command::Finish(result));
        let expected: Poll<RunOutput> = Poll::Ready(if ok {
            Ok(token_usage)
        } else {
            Err(RunError::Failed(()))
        });
        self.agree("a finished run", describe(&polled), describe(&expected));
        self.model
            .note(if ok { "run finished" } else { "run failed" });
        match live.state {
            RunState::Running { model, .. } => {
                self.model.settle(model, if ok { usage } else { None });
            }
            RunState::Bypassed(bypass) => {
                self.model
                    .finish_bypass(bypass, if ok { usage } else { None });
            }
            RunState::Waiting { .. } => unreachable!("a running run"),
        }
    }

    /// `Op::DropRun`: a waiting run leaves the queue as a dropped acquire does (design §D3),
    /// a running one settles with the last reported usage (crate run.rs, cancel safety), a
    /// bypass ends with it.
    pub(super) fn drop_run(&mut self, run: u32) {
        if self.runs.is_empty() {
            return;
        }
        let at = run as usize % self.runs.len();
        let live = self.runs.remove(at);
        let state = live.state;
        drop(live.future);
        match state {
            RunState::Waiting { key, .. } => {
                self.model.note("run dropped while waiting");
                self.model.cancel_waiter(key);
            }
            RunState::Running { model, .. } => {
                self.model.note("run dropped while running");
                self.model.settle(model, None);
            }
            RunState::Bypassed(bypass) => {
                self.model.note("observe: bypass dropped");
                self.model.finish_bypass(bypass, None);
            }
        }
    }

    /// Every running run's context, as its callback last saw it.
    pub(super) fn check_runs(&self) {
        for run in &self.runs {
            let expected = match &run.state {
                RunState::Running { model, id } => Seen::Admitted(model_view(*id, model)),
                RunState::Bypassed(bypass) => {
                    Seen::Bypassed(bypass_view(self.shadows[bypass.shadow as usize], bypass))
                }
                RunState::Waiting { .. } => continue,
            };
            self.agree(
                "a running run's context",
                run.mailbox.borrow().view,
                Some(expected),
            );
        }
    }
}
