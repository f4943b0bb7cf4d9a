//! One gateway replica as a real process, for the multi-process fault suite
//! (`redis-ledger/faults/run.py`): it joins a ledger (exact or leased mode), runs T tasks that
//! admit calls of random size and duration through it, and logs every call's real time in
//! flight to a file. The suite kills it, stalls or restarts its Redis, or cuts its link, and
//! reads the logs of every replica to find the tokens really in flight at each instant.
//!
//! ```sh
//! cargo build --release -p async-bulkhead-llm-redis --example fault_replica
//! target/release/examples/fault_replica --redis redis://127.0.0.1:6379/ --ns '{faults}' \
//!     --id a --mode exact --policy closed --budget 20000 --tasks 8 --log /tmp/a.log
//! ```
//!
//! The log, one event a line (unix microseconds from the system clock, comparable across the
//! processes of one host):
//!
//! - `ready <us> <mode> <id>`: the ledger is joined; the tasks start.
//! - `start <us> <tokens> <id>`: written right after the admission returned (the tokens are
//!   held from before it, so the log never places a call in flight when it was not).
//! - `end <us> <tokens> <id>`: written right before the release (held until after it).
//! - Refusals are not logged one by one; their counts close the log:
//!   `stats <us> key=value ...` (the ledger's counters and the refusals by kind), then `exit <us>`.
//!
//! Each line is written with one `write(2)` as soon as it is made (through a buffer of its
//! own, flushed per line): the page cache keeps it through a SIGKILL, so a killed replica's
//! log lacks nothing it did. (Buffered for 50 ms, a killed replica's lost `end` lines made
//! calls it had already released look in flight until its death: 546 tokens over the budget
//! that were never in flight, in a first run.) A `start` without an `end` is a call really in
//! flight when the process died.
//!
//! The replica stops when its standard input closes (or after `--run-ms`): no new admissions,
//! the calls in flight end, the log is flushed and the ledger is left with `close`. Each line
//! `c` it reads on standard input before that is answered on standard output with
//! `clock <unix_us>`, its own wall clock: the suite maps the log of a replica whose clock it
//! slowed (libfaketime) back to the real clock from these answers.

use std::io::{BufWriter, Write};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, Reservation, TokenBudget};
use async_bulkhead_llm_redis::{
    ExactLedger, FailurePolicy, LeasedLedger, LedgerConfig, LedgerRefusal,
};

const USAGE: &str = "fault_replica --redis URL --ns NS --id ID [--mode exact|leased] \
[--policy closed|floor:N] [--budget TOKENS] [--lease-ms MS] [--renew-ms MS] [--timeout-ms MS] \
[--retry-ms MS] [--tasks T] [--min-tokens N] [--max-tokens N] [--max-call-ms MS] \
[--pause-ms MS] [--seed S] [--run-ms MS] --log PATH";

/// The command line, parsed by hand (no dependency).
#[derive(Debug, Clone)]
struct Args {
    redis: String,
    ns: String,
    id: String,
    leased: bool,
    policy: FailurePolicy,
    budget: u64,
    lease: Duration,
    renew: Option<Duration>,
    timeout: Duration,
    retry: Duration,
    tasks: u64,
    min_tokens: u64,
    max_tokens: u64,
    max_call: Duration,
    pause: Duration,
    seed: u64,
    run: Option<Duration>,
    log: String,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        redis: String::new(),
        ns: String::new(),
        id: String::new(),
        leased: false,
        policy: FailurePolicy::FailClosed,
        budget: 20_000,
        lease: Duration::from_secs(3),
        renew: None,
        timeout: Duration::from_millis(100),
        retry: Duration::from_millis(100),
        tasks: 8,
        min_tokens: 500,
        max_tokens: 3_000,
        max_call: Duration::from_millis(200),
        pause: Duration::from_millis(10),
        seed: 1,
        run: None,
        log: String::new(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|e| format!("{flag} {value}: {e}"))
        };
        let ms = || number().map(Duration::from_millis);
        match flag.as_str() {
            "--redis" => args.redis = value.clone(),
            "--ns" => args.ns = value.clone(),
            "--id" => args.id = value.clone(),
            "--mode" => {
                args.leased = match value.as_str() {
                    "exact" => false,
                    "leased" => true,
                    _ => return Err(format!("--mode {value}: exact or leased")),
                }
            }
            "--policy" => {
                args.policy = match value.strip_prefix("floor:") {
                    _ if value == "closed" => FailurePolicy::FailClosed,
                    Some(n) => FailurePolicy::LocalFloor {
                        tokens: n.parse().map_err(|e| format!("--policy {value}: {e}"))?,
                    },
                    None => return Err(format!("--policy {value}: closed or floor:N")),
                }
            }
            "--budget" => args.budget = number()?,
            "--lease-ms" => args.lease = ms()?,
            "--renew-ms" => args.renew = Some(ms()?),
            "--timeout-ms" => args.timeout = ms()?,
            "--retry-ms" => args.retry = ms()?,
            "--tasks" => args.tasks = number()?,
            "--min-tokens" => args.min_tokens = number()?,
            "--max-tokens" => args.max_tokens = number()?,
            "--max-call-ms" => args.max_call = ms()?,
            "--pause-ms" => args.pause = ms()?,
            "--seed" => args.seed = number()?,
            "--run-ms" => args.run = Some(ms()?),
            "--log" => args.log = value.clone(),
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.redis.is_empty() || args.ns.is_empty() || args.id.is_empty() || args.log.is_empty() {
        return Err("--redis, --ns, --id and --log are required".into());
    }
    if args.min_tokens < 2 || args.min_tokens > args.max_tokens || args.tasks == 0 {
        return Err("need 2 <= --min-tokens <= --max-tokens and --tasks >= 1".into());
    }
    if args.max_call < Duration::from_millis(20) {
        return Err("--max-call-ms must be at least 20".into());
    }
    Ok(args)
}

/// xorshift64*: a small seeded generator (no dependency), one per task.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        // splitmix64 of the seed, so that neighbouring seeds start far apart (never 0).
        let mut z = seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        Rng((z ^ (z >> 31)) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// Uniform in `lo..=hi` (the modulo bias is negligible here).
    fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }
}

fn unix_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// The log file: every line is formatted into the buffer and written at once, under one short
/// lock (one `write(2)` per line).
#[derive(Clone)]
struct Log(Arc<Mutex<BufWriter<std::fs::File>>>);

impl Log {
    fn line(&self, text: std::fmt::Arguments<'_>) {
        let mut out = self.0.lock().unwrap_or_else(|p| p.into_inner());
        // A write error (a full disk) is not the replica's business: the suite sees a short log.
        let _ = out.write_fmt(text);
        let _ = out.write_all(b"\n");
        let _ = out.flush();
    }
}

/// Refusals by kind, for the closing `stats` line.
#[derive(Default)]
struct Refusals {
    local: AtomicU64,
    global: AtomicU64,
    unavailable: AtomicU64,
    other: AtomicU64,
}

/// Either mode's handle: exact admissions go through the ledger, leased ones through the
/// local bulkhead whose budget the ledger keeps at the leased slice.
#[derive(Clone)]
enum Ledger {
    Exact(ExactLedger),
    Leased(LeasedLedger, LlmBulkhead),
}

/// One admitted call, released when it ends.
enum Call {
    Exact(async_bulkhead_llm_redis::GlobalPermit),
    Leased(async_bulkhead_llm::OwnedPermit),
}

impl Ledger {
    async fn admit(&self, options: AcquireOptions, refusals: &Refusals) -> Option<Call> {
        let request = LlmRequest::new();
        match self {
            Ledger::Exact(ledger) => match ledger.try_acquire(&request, options).await {
                Ok(permit) => Some(Call::Exact(permit)),
                Err(refusal) => {
                    let kind = match refusal {
                        LedgerRefusal::Local(_) => &refusals.local,
                        LedgerRefusal::Global(_) => &refusals.global,
                        LedgerRefusal::Unavailable(_) => &refusals.unavailable,
                        _ => &refusals.other,
                    };
                    kind.fetch_add(1, Ordering::Relaxed);
                    None
                }
            },
            Ledger::Leased(_, bulkhead) => match bulkhead.try_acquire_owned(&request, options) {
                Ok(permit) => Some(Call::Leased(permit)),
                Err(_) => {
                    refusals.local.fetch_add(1, Ordering::Relaxed);
                    None
                }
            },
        }
    }

    fn stats(&self) -> async_bulkhead_llm_redis::LedgerStats {
        match self {
            Ledger::Exact(ledger) => ledger.stats(),
            Ledger::Leased(ledger, _) => ledger.stats(),
        }
    }

    async fn close(&self) {
        let _ = match self {
            Ledger::Exact(ledger) => {
                ledger.settled(Duration::from_secs(2)).await;
                ledger.close().await
            }
            Ledger::Leased(ledger, _) => ledger.close().await,
        };
    }
}

impl Call {
    fn tokens(&self) -> u64 {
        match self {
            Call::Exact(permit) => permit.permit().held_tokens(),
            Call::Leased(permit) => permit.held_tokens(),
        }
    }

    fn release(self) {
        match self {
            Call::Exact(permit) => drop(permit.release(None)),
            Call::Leased(permit) => drop(permit.release(None)),
        }
    }
}

/// One task's loop: a call of random size and length, admitted, held, released; a refusal
/// waits `pause` and tries another call.
async fn task(
    index: u64,
    args: Arc<Args>,
    ledger: Ledger,
    log: Log,
    stop: Arc<AtomicBool>,
    refusals: Arc<Refusals>,
) {
    let mut rng = Rng::new(args.seed.wrapping_mul(1_000_003).wrapping_add(index));
    let max_call = u64::try_from(args.max_call.as_millis()).unwrap_or(u64::MAX);
    let mut n = 0u64;
    while !stop.load(Ordering::Acquire) {
        let tokens = rng.between(args.min_tokens, args.max_tokens);
        let millis = rng.between(20, max_call);
        let input = tokens / 2;
        let options = AcquireOptions::new().reservation(
            Reservation::new(input, tokens - input).expect("a reservation within the bounds"),
        );
        let Some(call) = ledger.admit(options, &refusals).await else {
            tokio::time::sleep(args.pause).await;
            continue;
        };
        let id = format!("{}.{index}.{n}", args.id);
        n += 1;
        let held = call.tokens();
        log.line(format_args!("start {} {held} {id}", unix_us()));
        tokio::time::sleep(Duration::from_millis(millis)).await;
        log.line(format_args!("end {} {held} {id}", unix_us()));
        call.release();
    }
}

async fn run(args: Args) -> Result<(), Box<dyn std::error::Error>> {
    let file = std::fs::File::create(&args.log)?;
    let log = Log(Arc::new(Mutex::new(BufWriter::new(file))));
    let mut config = LedgerConfig::new(args.redis.clone(), args.ns.clone(), args.budget)
        .replica_id(args.id.clone())
        .lease(args.lease)
        .timeout(args.timeout)
        .retry_every(args.retry)
        .failure(args.policy);
    if let Some(renew) = args.renew {
        config = config.renew_every(renew);
    }
    // The local bulkhead never binds on its own: a slot per task and the whole global budget
    // (in leased mode that budget is the most the replica asks for; the slice replaces it).
    let slots = usize::try_from(args.tasks)?;
    let bulkhead = LlmBulkhead::builder("fault-replica", slots)
        .token_budget(TokenBudget::new(args.budget))
        .build()?;
    let ledger = match args.leased {
        false => Ledger::Exact(ExactLedger::connect(bulkhead, config).await?),
        true => Ledger::Leased(
            LeasedLedger::start(bulkhead.clone(), config).await?,
            bulkhead,
        ),
    };
    let mode = if args.leased { "leased" } else { "exact" };
    log.line(format_args!("ready {} {mode} {}", unix_us(), args.id));

    let stop = Arc::new(AtomicBool::new(false));
    // Standard input closed (the driver's signal to stop), or the run's length passed.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<()>(1);
    std::thread::spawn(move || {
        let mut line = String::new();
        while matches!(std::io::stdin().read_line(&mut line), Ok(n) if n > 0) {
            if line.trim() == "c" {
                let mut out = std::io::stdout().lock();
                let _ = writeln!(out, "clock {}", unix_us());
                let _ = out.flush();
            }
            line.clear();
        }
        let _ = tx.blocking_send(());
    });
    let args = Arc::new(args);
    let refusals = Arc::new(Refusals::default());
    let tasks: Vec<_> = (0..args.tasks)
        .map(|i| {
            tokio::spawn(task(
                i,
                args.clone(),
                ledger.clone(),
                log.clone(),
                stop.clone(),
                refusals.clone(),
            ))
        })
        .collect();
    match args.run {
        Some(run) => {
            let _ = tokio::time::timeout(run, rx.recv()).await;
        }
        None => {
            let _ = rx.recv().await;
        }
    }
    stop.store(true, Ordering::Release);
    for t in tasks {
        t.await?;
    }
    let s = ledger.stats();
    log.line(format_args!(
        "stats {} reserved={} refused_global={} admitted_on_floor={} refused_unavailable={} \
         store_errors={} leases_lost={} reregistrations={} reregistered_tokens={} \
         rebalances={} refusals_local={} refusals_global={} refusals_unavailable={} \
         refusals_other={}",
        unix_us(),
        s.reserved,
        s.refused_global,
        s.admitted_on_floor,
        s.refused_unavailable,
        s.store_errors,
        s.leases_lost,
        s.reregistrations,
        s.reregistered_tokens,
        s.rebalances,
        refusals.local.load(Ordering::Relaxed),
        refusals.global.load(Ordering::Relaxed),
        refusals.unavailable.load(Ordering::Relaxed),
        refusals.other.load(Ordering::Relaxed),
    ));
    ledger.close().await;
    log.line(format_args!("exit {}", unix_us()));
    Ok(())
}

fn main() {
    let args = match parse_args() {
        Ok(args) => args,
        Err(why) => {
            eprintln!("{why}\nusage: {USAGE}");
            std::process::exit(2);
        }
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    if let Err(error) = runtime.block_on(run(args)) {
        eprintln!("fault_replica: {error}");
        std::process::exit(1);
    }
}
