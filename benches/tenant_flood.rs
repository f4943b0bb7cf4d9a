//! A tenant family under a flood of unknown keys (plain loops, no criterion): what a known
//! tenant's `get` costs alone, and what its latency and throughput become while another thread
//! floods the family with keys it has never seen.
//!
//! The setup: `max_tenants` places, 100 *known* tenants served by one thread (a `get` of the
//! next known key, then a 50 us sleep: a gateway thread between requests), the other places
//! taken by filler tenants. Phases, each `SECS` seconds (default 2):
//!
//! - `no flood`: the known thread alone;
//! - `control flood`: a second thread floods *another* family (the same CPU load, no shared
//!   lock): what the machine's contention alone costs;
//! - `flood, family full`: every filler holds a call, so no place can be freed: each unknown
//!   key is refused `Full` (and builds nothing);
//! - `flood, evicting`: the fillers are idle past `idle_after`: each unknown key evicts one
//!   (and the flood's own tenants, once idle, in turn).
//!
//! ```text
//! cargo bench -p async-bulkhead-llm-benches --bench tenant_flood            # 2 s per phase
//! TENANT_FLOOD_SECS=5 cargo bench -p async-bulkhead-llm-benches --bench tenant_flood
//! ```

use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, tenants::Tenants};

/// Known tenants served by the measured thread.
const KNOWN: usize = 100;
/// The known thread's pause between two requests.
const PAUSE: Duration = Duration::from_micros(50);
/// How long a filler must be idle before it may be evicted.
const IDLE_AFTER: Duration = Duration::from_millis(200);

fn family(max_tenants: usize) -> Tenants<String> {
    Tenants::builder(|_: &String| LlmBulkhead::builder("gpt-4o", 4))
        .max_tenants(max_tenants)
        .idle_after(IDLE_AFTER)
        .build()
        .expect("valid configuration")
}

/// The host's raw compare-and-swap acquire + release, in ns (printed beside every ratio).
fn raw_cas_ns() -> f64 {
    let word = AtomicU64::new(0);
    let n = 5_000_000u64;
    let started = Instant::now();
    for _ in 0..n {
        let _ = black_box(word.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed));
        black_box(word.fetch_sub(1, Ordering::Release));
    }
    started.elapsed().as_nanos() as f64 / n as f64
}

/// ns per `get` of a known key, one thread, median of 5 runs of 1,000,000.
fn lookup_ns(max_tenants: usize) -> f64 {
    let tenants = family(max_tenants);
    let keys: Vec<String> = (0..KNOWN).map(|i| format!("known-{i}")).collect();
    for key in &keys {
        tenants.get(key.as_str()).expect("room");
    }
    let mut runs: Vec<f64> = (0..5)
        .map(|_| {
            let n = 1_000_000;
            let started = Instant::now();
            for i in 0..n {
                black_box(tenants.get(keys[i % KNOWN].as_str()).expect("known"));
            }
            started.elapsed().as_nanos() as f64 / n as f64
        })
        .collect();
    runs.sort_by(f64::total_cmp);
    runs[2]
}

/// A flood: runs until the flag says stop, then stores how many keys it sent.
type Flood = Box<dyn FnOnce(&AtomicBool, &AtomicU64) + Send>;

/// One phase's figures for the known thread.
struct Figures {
    p50_us: f64,
    p99_us: f64,
    max_us: f64,
    gets: usize,
    flood_keys: u64,
}

/// Serves the known tenants for `secs`, with `flood` running on another thread meanwhile
/// (if any); the known gets' latencies.
fn serve(tenants: &Tenants<String>, secs: f64, flood: Option<Flood>) -> Figures {
    let keys: Vec<String> = (0..KNOWN).map(|i| format!("known-{i}")).collect();
    let stop = Arc::new(AtomicBool::new(false));
    let flooded = Arc::new(AtomicU64::new(0));
    let flooder = flood.map(|flood| {
        let (stop, flooded) = (stop.clone(), flooded.clone());
        thread::spawn(move || flood(&stop, &flooded))
    });
    // Let the flood start before measuring.
    thread::sleep(Duration::from_millis(50));
    let mut latencies = Vec::new();
    let until = Instant::now() + Duration::from_secs_f64(secs);
    let mut i = 0;
    while Instant::now() < until {
        let started = Instant::now();
        black_box(
            tenants
                .get(keys[i % KNOWN].as_str())
                .expect("a known tenant is never refused"),
        );
        latencies.push(started.elapsed());
        i += 1;
        thread::sleep(PAUSE);
    }
    stop.store(true, Ordering::Relaxed);
    if let Some(flooder) = flooder {
        flooder.join().expect("the flood thread");
    }
    latencies.sort();
    let at =
        |q: f64| latencies[((latencies.len() - 1) as f64 * q) as usize].as_nanos() as f64 / 1e3;
    Figures {
        p50_us: at(0.50),
        p99_us: at(0.99),
        max_us: at(1.0),
        gets: latencies.len(),
        flood_keys: flooded.load(Ordering::Relaxed),
    }
}

/// Floods `tenants` with keys never seen before until told to stop.
fn flood(tenants: Tenants<String>) -> Flood {
    Box::new(move |stop, flooded| {
        let mut i = 0u64;
        while !stop.load(Ordering::Relaxed) {
            let _ = black_box(tenants.get(format!("unknown-{i}").as_str()));
            i += 1;
        }
        flooded.store(i, Ordering::Relaxed);
    })
}

fn main() {
    let secs: f64 = std::env::var("TENANT_FLOOD_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2.0);
    if std::env::args().any(|a| a == "--list") {
        println!("tenant_flood: bench");
        return;
    }
    let cas = raw_cas_ns();
    println!("raw CAS acquire + release: {cas:.2} ns");
    for max_tenants in [1_000, 10_000] {
        println!(
            "known-tenant get, {max_tenants} places: {:.1} ns (raw CAS {cas:.2} ns)",
            lookup_ns(max_tenants)
        );
    }
    println!();
    println!(
        "| max_tenants | phase | known p50 | known p99 | known max | known throughput | flood keys/s |"
    );
    println!("|---|---|---|---|---|---|---|");
    let request = LlmRequest::new().user("hi").max_tokens(16);
    for max_tenants in [1_000, 10_000] {
        let tenants = family(max_tenants);
        for i in 0..KNOWN {
            tenants.get(format!("known-{i}").as_str()).expect("room");
        }
        // The fillers, each holding a call: nothing can be evicted.
        let held: Vec<_> = (0..max_tenants - KNOWN)
            .map(|i| {
                tenants
                    .get(format!("filler-{i}").as_str())
                    .expect("room")
                    .try_acquire_owned(&request, AcquireOptions::new())
                    .expect("a free slot")
            })
            .collect();
        let base = serve(&tenants, secs, None);
        let control = serve(&tenants, secs, Some(flood(family(max_tenants))));
        let full = serve(&tenants, secs, Some(flood(tenants.clone())));
        drop(held);
        // The fillers become idle past `idle_after`; the known tenants stay active (served
        // every few ms meanwhile).
        serve(
            &tenants,
            (IDLE_AFTER + Duration::from_millis(100)).as_secs_f64(),
            None,
        );
        let evicting = serve(&tenants, secs, Some(flood(tenants.clone())));
        for (phase, figures) in [
            ("no flood", &base),
            ("control flood (another family)", &control),
            ("flood, family full", &full),
            ("flood, evicting", &evicting),
        ] {
            println!(
                "| {max_tenants} | {phase} | {:.2} us | {:.1} us | {:.0} us | {:.0}% | {:.0} |",
                figures.p50_us,
                figures.p99_us,
                figures.max_us,
                100.0 * figures.gets as f64 / base.gets as f64,
                figures.flood_keys as f64 / secs,
            );
        }
    }
}
