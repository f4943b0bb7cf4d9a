//! The callers: random `run_shared` calls (alone, or in bursts of one key made before any is
//! polled), each made under its key's lock and then driven to its outcome or cancelled, with
//! every creation, poll and drop done as that caller (see `heard`).

use std::future::{Future, poll_fn};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{
    AcquireOptions, RejectReason, RunContext, RunError, RunOptions, TokenUsage, dedup::DedupScope,
};
use futures::future::join_all;

use super::books::{CallerRecord, Cancel, Got, Observe, Reply, Role, Shared};
use super::heard::{Acting, acting, clear_joined, take_joined};
use super::requests::{SCOPES, pick_scope};

type Call = Pin<Box<dyn Future<Output = Result<Reply, RunError<Reply>>> + Send>>;
type Callback = Pin<Box<dyn Future<Output = Result<Reply, Reply>> + Send>>;

/// What one caller asks.
#[derive(Clone, Copy, Debug)]
struct Ask {
    identity: usize,
    form: usize,
    scope: usize,
    dedup: bool,
    observe: Option<Observe>,
    timeout: Option<Duration>,
    cancel: Cancel,
    /// Its callback fails (returns its reply as the error).
    fails: bool,
    /// Its callback's random choices.
    seed: u64,
}

/// A random call, of `key` (an identity and a scope) if given.
fn ask(shared: &Shared, rng: &mut fastrand::Rng, key: Option<(usize, usize)>) -> Ask {
    let (identity, scope) = key.unwrap_or_else(|| (shared.table.pick(rng).0, pick_scope(rng)));
    let observe = match rng.u8(0..20) {
        0..=4 => Some(Observe::All),
        5 | 6 => Some(Observe::TimeoutOnly),
        _ => None,
    };
    let timeout = match rng.u8(0..10) {
        0..=3 => Some(Duration::from_micros(rng.u64(200..3_000))),
        4 => Some(Duration::from_micros(rng.u64(5_000..20_000))),
        _ => None,
    };
    let cancel = match rng.u8(0..25) {
        0..=14 => Cancel::Never,
        15 | 16 => Cancel::Unpolled,
        17..=20 => Cancel::AfterPolls(rng.u32(1..4)),
        _ => Cancel::After(Duration::from_micros(rng.u64(0..3_000))),
    };
    Ask {
        identity,
        form: rng.usize(0..shared.table.forms(identity)),
        scope,
        dedup: rng.u8(0..10) != 0,
        observe,
        timeout,
        cancel,
        fails: rng.u8(0..7) == 0,
        seed: rng.u64(..),
    }
}

/// `owner`'s callback: records its run, sleeps a little between growing usage reports, and
/// returns (or fails with) a reply naming the run.
fn callback(
    shared: Arc<Shared>,
    owner: u32,
    ask: Ask,
) -> impl FnOnce(RunContext<'static>) -> Callback + Send + 'static {
    move |mut ctx| {
        // Before any await: the run is recorded even if its future is dropped at once.
        let run = shared.start_run(owner, ask.identity, ask.scope, &ctx);
        let reply = Reply {
            run,
            owner,
            identity: ask.identity,
            scope: ask.scope,
        };
        Box::pin(async move {
            let mut rng = fastrand::Rng::with_seed(ask.seed);
            let (mut input, mut output) = (0, 0);
            for _ in 0..rng.usize(0..3) {
                shared.rt.pause(&mut rng).await;
                if rng.bool() {
                    input += rng.u64(1..40);
                    output += rng.u64(1..40);
                    let usage = TokenUsage::new(input, output).unwrap();
                    ctx.report_usage(usage).expect("a growing report is valid");
                    shared.reported(run, usage);
                }
            }
            shared.rt.pause(&mut rng).await;
            if ask.fails { Err(reply) } else { Ok(reply) }
        })
    }
}

/// Makes the call (its key's lock held, so that its role and flight are known exactly) and
/// returns it unpolled with its record so far.
fn make(shared: &Arc<Shared>, ask: Ask, closed_before: bool) -> (Call, CallerRecord, Instant) {
    let id = shared.next_caller.fetch_add(1, Ordering::Relaxed);
    let mut acquire = AcquireOptions::new();
    if let Some(timeout) = ask.timeout {
        acquire = acquire.timeout(timeout);
    }
    let mut options = RunOptions::from(acquire);
    if !ask.dedup {
        options = options.no_dedup();
    }
    if let Some(scope) = SCOPES[ask.scope] {
        options = options.dedup_scope(DedupScope::new(scope));
    }
    if let Some(observe) = ask.observe {
        options = options.observe(observe.reasons());
    }
    let request = shared.table.request(ask.identity, ask.form);
    let f = callback(Arc::clone(shared), id, ask);
    let who = Acting {
        scenario: shared.scenario,
        caller: id,
        action: 0,
    };
    let key = shared.table.key(ask.identity, ask.scope);
    let (call, role, flight, started): (Call, _, _, _) = {
        let mut current = ask.dedup.then(|| shared.keys[key].lock().unwrap());
        clear_joined();
        let started = Instant::now();
        let call = acting(who, || shared.bulkhead.run_shared(request, options, f));
        let role = match (ask.dedup, take_joined()) {
            (false, None) => Role::Solo,
            (true, None) => Role::Leader,
            (true, Some(followers)) => Role::Follower { followers },
            (false, Some(n)) => panic!("a no_dedup call joined a flight ({n} followers)"),
        };
        let flight = match (role, current.as_deref_mut()) {
            (Role::Follower { .. }, Some(current)) => *current,
            (_, current) => {
                let flight = shared.next_flight.fetch_add(1, Ordering::Relaxed);
                if let Some(current) = current {
                    *current = flight;
                }
                flight
            }
        };
        (Box::pin(call), role, flight, started)
    };
    if closed_before {
        assert!(
            !matches!(role, Role::Follower { .. }),
            "caller {id} joined a flight after close() returned"
        );
    }
    let record = CallerRecord {
        id,
        identity: ask.identity,
        form: ask.form,
        scope: ask.scope,
        dedup: ask.dedup,
        observe: ask.observe,
        timeout: ask.timeout,
        cancel: ask.cancel,
        closed_before,
        role,
        flight,
        polls: 0,
        drop_action: 0,
        got: None,
        waited: None,
    };
    (call, record, started)
}

/// Drives a call to its outcome, or cancels it as its caller planned; every poll and drop
/// is done as the caller. Records what it got.
async fn drive(shared: &Shared, mut record: CallerRecord, call: Call, started: Instant) {
    let mut call = Some(call);
    let mut action = 0;
    let mut who = || {
        action += 1;
        Acting {
            scenario: shared.scenario,
            caller: record.id,
            action,
        }
    };
    let mut timer = match record.cancel {
        Cancel::After(delay) => Some(shared.rt.timer(delay)),
        _ => None,
    };
    let mut polls = 0;
    let output = if record.cancel == Cancel::Unpolled {
        None
    } else {
        poll_fn(|cx| {
            let polled = acting(who(), || call.as_mut().unwrap().as_mut().poll(cx));
            polls += 1;
            if let Poll::Ready(output) = polled {
                return Poll::Ready(Some(output));
            }
            let cancel = match record.cancel {
                Cancel::AfterPolls(n) => polls >= n,
                Cancel::After(_) => timer.as_mut().unwrap().as_mut().poll(cx).is_ready(),
                Cancel::Never | Cancel::Unpolled => false,
            };
            if cancel {
                Poll::Ready(None)
            } else {
                Poll::Pending
            }
        })
        .await
    };
    let waited = started.elapsed();
    // Dropped as the caller: a cancellation (or nothing, once finished).
    let dropping = who();
    acting(dropping, || drop(call.take()));
    record.polls = polls;
    record.drop_action = dropping.action;
    record.got = output.map(|output| match output {
        Ok(reply) => Got::Value(reply),
        Err(RunError::Failed(reply)) => Got::Failed(reply),
        Err(RunError::Rejected(rejection)) => Got::Rejected(rejection),
        Err(other) => panic!("caller {}: {other:?}", record.id),
    });
    if record.got.is_some() {
        record.waited = Some(waited);
    }
    if let Some(Got::Value(reply) | Got::Failed(reply)) = record.got {
        assert_eq!(
            (reply.identity, reply.scope),
            (record.identity, record.scope),
            "caller {} got another request's or scope's reply: {record:?}",
            record.id
        );
    }
    if record.closed_before && polls > 0 {
        match record.got {
            Some(Got::Rejected(r)) if r.reason() == RejectReason::Shutdown => {}
            got => panic!("a call made after close() got {got:?}: {record:?}"),
        }
    }
    shared.callers.lock().unwrap().push(record);
}

/// One operation: a call, or a burst of 2 to 5 calls of one key made before any is polled
/// (each with its own options and form), driven together.
pub(crate) async fn op(shared: &Arc<Shared>, rng: &mut fastrand::Rng) {
    // Read before the calls are made: if set, `close()` returned before them.
    let closed_before = shared.closed();
    if rng.u8(0..3) == 0 {
        let key = (shared.table.pick(rng).0, pick_scope(rng));
        let calls: Vec<_> = (0..rng.usize(2..=5))
            .map(|_| make(shared, ask(shared, rng, Some(key)), closed_before))
            .collect();
        join_all(
            calls
                .into_iter()
                .map(|(call, record, started)| drive(shared, record, call, started)),
        )
        .await;
    } else {
        let (call, record, started) = make(shared, ask(shared, rng, None), closed_before);
        drive(shared, record, call, started).await;
    }
}
