//! A real `redis-server` on a free loopback port, started and stopped by the tests, and an
//! observer that reads the ledger's keys straight from Redis (not through the crate).

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A bulkhead of 64 slots and `budget` tokens.
pub fn bulkhead(budget: u64) -> async_bulkhead_llm::LlmBulkhead {
    async_bulkhead_llm::LlmBulkhead::builder("m", 64)
        .token_budget(async_bulkhead_llm::TokenBudget::new(budget))
        .build()
        .unwrap()
}

/// Options reserving `input` + `output` tokens.
pub fn reserve(input: u64, output: u64) -> async_bulkhead_llm::AcquireOptions {
    async_bulkhead_llm::AcquireOptions::new()
        .reservation(async_bulkhead_llm::Reservation::new(input, output).unwrap())
}

/// A `redis-server` child process on 127.0.0.1, without persistence.
pub struct RedisServer {
    child: Option<Child>,
    pub port: u16,
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

impl RedisServer {
    pub fn start() -> RedisServer {
        let mut server = RedisServer {
            child: None,
            port: free_port(),
        };
        server.launch();
        server
    }

    fn launch(&mut self) {
        let child = Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--enable-debug-command",
                "yes",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect(
                "redis-server must be installed for these tests (apt-get install -y redis-server; \
                 .ci/run installs it)",
            );
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(mut c) = self.connection()
                && redis::cmd("PING").query::<String>(&mut c).is_ok()
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("redis-server did not answer on port {}", self.port);
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    pub fn connection(&self) -> redis::RedisResult<redis::Connection> {
        redis::Client::open(self.url())?.get_connection_with_timeout(Duration::from_secs(1))
    }

    /// Kills the server (its data is gone: no persistence).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Kills the server and starts an empty one on the same port.
    pub fn restart(&mut self) {
        self.kill();
        self.launch();
    }

    /// Makes the server unresponsive for `d` (`DEBUG SLEEP`, from a thread).
    pub fn pause(&self, d: Duration) -> std::thread::JoinHandle<()> {
        let url = self.url();
        let seconds = format!("{:.3}", d.as_secs_f64());
        let thread = std::thread::spawn(move || {
            let mut c = redis::Client::open(url).unwrap().get_connection().unwrap();
            let _: () = redis::cmd("DEBUG")
                .arg("SLEEP")
                .arg(seconds)
                .query(&mut c)
                .unwrap();
        });
        std::thread::sleep(Duration::from_millis(30));
        thread
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The ledger as Redis holds it, read key by key (not through the crate's scripts).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Observed {
    /// `ns:total`.
    pub total: u64,
    /// The sum of every replica's exact holds.
    pub holds: u64,
    /// The number of exact holds.
    pub hold_count: u64,
    /// The sum of the leased slices.
    pub slices: u64,
    /// The replicas with a lease.
    pub replicas: u64,
}

/// Read in one `EVAL` of the test's own script, so the figures are one instant's (the
/// ledger's scripts are not used).
pub fn observe(c: &mut redis::Connection, ns: &str) -> Observed {
    const READ: &str = r#"
local ns = ARGV[1]
local total = tonumber(redis.call('GET', ns .. ':total') or '0')
local holds, count = 0, 0
for _, key in ipairs(redis.call('KEYS', ns .. ':holds:*')) do
  for _, v in ipairs(redis.call('HVALS', key)) do
    holds = holds + tonumber(string.match(v, '^(%d+)|'))
    count = count + 1
  end
end
local slices = 0
for _, v in ipairs(redis.call('HVALS', ns .. ':slices')) do
  slices = slices + tonumber(v)
end
return {total, holds, count, slices, redis.call('ZCARD', ns .. ':leases')}
"#;
    let v: Vec<u64> = redis::cmd("EVAL")
        .arg(READ)
        .arg(0)
        .arg(ns)
        .query(c)
        .unwrap();
    Observed {
        total: v[0],
        holds: v[1],
        hold_count: v[2],
        slices: v[3],
        replicas: v[4],
    }
}

/// Watches the ledger from its own thread every millisecond until stopped; panics if the
/// total ever exceeds `budget` or differs from the holds and slices it is made of.
pub struct Observer {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<(u64, u64)>>,
}

impl Observer {
    pub fn start(server: &RedisServer, ns: &str, budget: u64) -> Observer {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut c = server.connection().unwrap();
        let ns = ns.to_owned();
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let (mut reads, mut peak) = (0, 0);
            while !flag.load(std::sync::atomic::Ordering::Acquire) {
                // One MULTI-free read is not atomic across keys; a script-free snapshot is
                // taken with the ledger quiet only at the end. Here: the total alone, read
                // atomically, against the budget.
                let total: Option<u64> = redis::cmd("GET")
                    .arg(format!("{ns}:total"))
                    .query(&mut c)
                    .unwrap();
                let total = total.unwrap_or(0);
                assert!(
                    total <= budget,
                    "global total {total} above the budget {budget}"
                );
                peak = peak.max(total);
                reads += 1;
                std::thread::sleep(Duration::from_micros(500));
            }
            (reads, peak)
        });
        Observer {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops watching: the number of reads and the highest total seen.
    pub fn finish(mut self) -> (u64, u64) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.thread
            .take()
            .unwrap()
            .join()
            .expect("the observer saw the budget exceeded")
    }
}
