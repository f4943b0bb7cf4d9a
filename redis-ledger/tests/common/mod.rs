//! A real `redis-server` on a free loopback port (or a Redis Cluster of them), started and
//! stopped by the tests, and an observer that reads the ledger's keys straight from Redis (not
//! through the crate).

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Opens a ledger with `open`, again while its first commands time out (at most 20 tries): on
/// a loaded machine a redis-server just started can take longer than these tests' short
/// timeout to answer the opening (its scripts compiled), and the opening is not what they test.
pub async fn opened<L, F>(mut open: impl FnMut() -> F) -> L
where
    F: std::future::Future<Output = Result<L, async_bulkhead_llm_redis::LedgerError>>,
{
    for _ in 0..20 {
        match open().await {
            Err(async_bulkhead_llm_redis::LedgerError::Store(
                async_bulkhead_llm_redis::StoreError::Timeout(_),
            )) => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            opened => return opened.unwrap(),
        }
    }
    open().await.unwrap()
}

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

/// One node of a [`RedisCluster`]: a `redis-server --cluster-enabled yes` child process.
pub struct ClusterNode {
    child: Option<Child>,
    /// Its client port on 127.0.0.1 (its cluster bus has another free port).
    pub port: u16,
}

impl ClusterNode {
    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn is_alive(&self) -> bool {
        self.child.is_some()
    }

    fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().expect("a live node").id().to_string();
        let status = Command::new("kill")
            .args([signal, &pid])
            .status()
            .expect("kill(1)");
        assert!(status.success(), "kill {signal} {pid}");
    }
}

/// A line of `CLUSTER NODES`, as one node sees the cluster.
#[derive(Debug, Clone)]
pub struct NodeView {
    pub id: String,
    pub port: u16,
    pub master: bool,
    pub failed: bool,
    /// The id of its master (a replica), else `-`.
    pub master_id: String,
    /// The slot ranges it serves (a master), inclusive.
    pub slots: Vec<(u16, u16)>,
}

/// A master as one node sees it: its port, its slot ranges, its replicas' ports.
type Shard = (u16, Vec<(u16, u16)>, Vec<u16>);

/// A Redis Cluster on loopback: `masters` masters with one replica each, every node on free
/// ports (client and bus) in its own temporary directory, without persistence, a node timeout
/// of one second. Every process is killed on drop.
pub struct RedisCluster {
    pub nodes: Vec<ClusterNode>,
    dir: std::path::PathBuf,
}

/// `count` distinct free loopback ports (held together while they are picked).
fn free_ports(count: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..count)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("a free loopback port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("bound").port())
        .collect()
}

/// A connection to `port` whose every call gives up after a second.
fn node_connection(port: u16) -> redis::RedisResult<redis::Connection> {
    let c = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?
        .get_connection_with_timeout(Duration::from_secs(1))?;
    c.set_read_timeout(Some(Duration::from_secs(1)))?;
    c.set_write_timeout(Some(Duration::from_secs(1)))?;
    Ok(c)
}

impl RedisCluster {
    /// Starts and joins the cluster, retrying (on new ports) up to three times if the
    /// creation or the agreement that follows fails.
    pub fn start(masters: usize) -> RedisCluster {
        let mut failures = Vec::new();
        for _ in 0..3 {
            match RedisCluster::try_start(masters) {
                Ok(cluster) => return cluster,
                Err(why) => failures.push(why),
            }
        }
        panic!("no Redis Cluster after three attempts: {failures:?}");
    }

    fn try_start(masters: usize) -> Result<RedisCluster, String> {
        let ports = free_ports(masters * 4);
        let dir = std::env::temp_dir().join(format!(
            "ledger-cluster-{}-{}",
            std::process::id(),
            ports[0]
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{dir:?}: {e}"))?;
        let mut cluster = RedisCluster {
            nodes: Vec::new(),
            dir,
        };
        for pair in ports.chunks(2) {
            let (port, bus) = (pair[0], pair[1]);
            let config = cluster.dir.join(format!("nodes-{port}.conf"));
            let child = Command::new("redis-server")
                .args([
                    "--port",
                    &port.to_string(),
                    "--cluster-port",
                    &bus.to_string(),
                    "--cluster-enabled",
                    "yes",
                    "--cluster-config-file",
                    config.to_str().expect("a UTF-8 temporary path"),
                    "--cluster-node-timeout",
                    "1000",
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    cluster.dir.to_str().expect("a UTF-8 temporary path"),
                    // The first sync of a replica at once (not after the default 5 s).
                    "--repl-diskless-sync-delay",
                    "0",
                ])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect(
                    "redis-server (7.0 or newer: --cluster-port) must be installed for these tests",
                );
            cluster.nodes.push(ClusterNode {
                child: Some(child),
                port,
            });
        }
        for node in &cluster.nodes {
            wait_for(Duration::from_secs(10), || {
                node_connection(node.port)
                    .and_then(|mut c| redis::cmd("PING").query::<String>(&mut c))
                    .is_ok()
            })
            .map_err(|_| format!("node {} never answered", node.port))?;
        }
        let mut create = Command::new("redis-cli");
        create.args(["--cluster", "create"]);
        for node in &cluster.nodes {
            create.arg(format!("127.0.0.1:{}", node.port));
        }
        let mut create = create
            .args(["--cluster-replicas", "1", "--cluster-yes"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-cli must be installed for these tests (it comes with redis-server)");
        let created = wait_for(Duration::from_secs(15), || {
            matches!(create.try_wait(), Ok(Some(_)))
        });
        if created.is_err() {
            let _ = create.kill();
            let _ = create.wait();
            return Err("redis-cli --cluster create did not finish within 15 s".into());
        }
        let status = create.wait().map_err(|e| e.to_string())?;
        if !status.success() {
            return Err(format!("redis-cli --cluster create: {status}"));
        }
        wait_for(Duration::from_secs(15), || cluster.is_settled(masters))
            .map_err(|_| "the cluster did not settle within 15 s".to_string())?;
        Ok(cluster)
    }

    /// Every node answers `cluster_state:ok`, sees every node and the same masters each with
    /// one replica, and every replica's link to its master is up.
    fn is_settled(&self, masters: usize) -> bool {
        let mut layouts = Vec::new();
        for node in &self.nodes {
            let Ok(mut c) = node_connection(node.port) else {
                return false;
            };
            let Ok(info) = redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c) else {
                return false;
            };
            if !info.contains("cluster_state:ok")
                || !info.contains(&format!("cluster_known_nodes:{}", self.nodes.len()))
            {
                return false;
            }
            let Ok(views) = cluster_nodes(&mut c) else {
                return false;
            };
            let mut layout: Vec<Shard> = views
                .iter()
                .filter(|v| v.master && !v.failed)
                .map(|m| {
                    let replicas = views
                        .iter()
                        .filter(|r| !r.master && r.master_id == m.id && !r.failed)
                        .map(|r| r.port)
                        .collect();
                    (m.port, m.slots.clone(), replicas)
                })
                .collect();
            layout.sort();
            if layout.len() != masters || layout.iter().any(|(_, _, r)| r.len() != 1) {
                return false;
            }
            let Ok(replication) = redis::cmd("INFO")
                .arg("replication")
                .query::<String>(&mut c)
            else {
                return false;
            };
            if replication.contains("role:slave") && !replication.contains("master_link_status:up")
            {
                return false;
            }
            if replication.contains("role:master") && !replication.contains("state=online") {
                return false;
            }
            layouts.push(layout);
        }
        layouts.windows(2).all(|w| w[0] == w[1])
    }

    fn node(&self, port: u16) -> &ClusterNode {
        self.nodes
            .iter()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    fn node_mut(&mut self, port: u16) -> &mut ClusterNode {
        self.nodes
            .iter_mut()
            .find(|n| n.port == port)
            .expect("a node of this cluster")
    }

    /// The URLs of every node started (what a ledger is configured with).
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(ClusterNode::url).collect()
    }

    /// A connection to the node on `port`.
    pub fn connection(&self, port: u16) -> redis::Connection {
        node_connection(self.node(port).port).expect("a live node")
    }

    /// The slot of `key` (`CLUSTER KEYSLOT`, asked of a live node).
    pub fn slot(&self, key: &str) -> u16 {
        let node = self
            .nodes
            .iter()
            .find(|n| n.is_alive())
            .expect("a live node");
        redis::cmd("CLUSTER")
            .arg("KEYSLOT")
            .arg(key)
            .query(&mut self.connection(node.port))
            .unwrap()
    }

    /// `CLUSTER NODES` as the node on `port` sees it.
    pub fn view(&self, port: u16) -> Vec<NodeView> {
        cluster_nodes(&mut self.connection(port)).unwrap()
    }

    /// The port of the master serving `slot`, as the node on `from` sees it.
    pub fn master_of(&self, slot: u16, from: u16) -> Option<u16> {
        self.view(from)
            .into_iter()
            .find(|v| v.master && !v.failed && v.slots.iter().any(|&(a, b)| a <= slot && slot <= b))
            .map(|v| v.port)
    }

    /// The port of the replica of the master on `master`.
    pub fn replica_of(&self, master: u16) -> u16 {
        let views = self.view(master);
        let id = &views.iter().find(|v| v.port == master).unwrap().id;
        views
            .iter()
            .find(|v| !v.master && &v.master_id == id)
            .map(|v| v.port)
            .expect("every master has a replica")
    }

    /// The masters (ports) other nodes agree on.
    pub fn masters(&self) -> Vec<u16> {
        let from = self.nodes.iter().find(|n| n.is_alive()).unwrap().port;
        let mut ports: Vec<u16> = self
            .view(from)
            .into_iter()
            .filter(|v| v.master && !v.failed && !v.slots.is_empty())
            .map(|v| v.port)
            .collect();
        ports.sort();
        ports
    }

    /// Waits until the replica of the master on `master` has acknowledged everything the
    /// master was sent so far (replication offsets), within `limit`.
    pub fn wait_replicated(&self, master: u16, limit: Duration) {
        let info = |c: &mut redis::Connection| -> String {
            redis::cmd("INFO").arg("replication").query(c).unwrap()
        };
        let field = |text: &str, name: &str| -> Option<u64> {
            text.split(['\n', ','])
                .find_map(|f| f.trim().strip_prefix(name))
                .and_then(|v| v.parse().ok())
        };
        let mut c = self.connection(master);
        let target = field(&info(&mut c), "master_repl_offset:").unwrap();
        wait_for(limit, || {
            let text = info(&mut c);
            text.contains("state=online") && field(&text, "offset=").is_some_and(|o| o >= target)
        })
        .unwrap_or_else(|_| panic!("the replica of {master} did not reach offset {target}"));
    }

    /// Kills the node on `port` (`SIGKILL`: its data is gone).
    pub fn kill(&mut self, port: u16) {
        if let Some(mut child) = self.node_mut(port).child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// Stops the node on `port` (`SIGSTOP`): it neither answers nor reads until resumed.
    pub fn freeze(&self, port: u16) {
        self.node(port).signal("-STOP");
    }

    /// Resumes a frozen node (`SIGCONT`).
    pub fn thaw(&self, port: u16) {
        self.node(port).signal("-CONT");
    }

    /// Waits until every live node answers `cluster_state:ok` and agrees that `slot` is served
    /// by one master other than `old`, which answers as a master; that master's port.
    pub fn wait_served_elsewhere(&self, slot: u16, old: u16, limit: Duration) -> u16 {
        let mut found = None;
        wait_for(limit, || {
            let mut owners = Vec::new();
            for node in self.nodes.iter().filter(|n| n.is_alive()) {
                let Ok(mut c) = node_connection(node.port) else {
                    return false;
                };
                let Ok(info) = redis::cmd("CLUSTER").arg("INFO").query::<String>(&mut c) else {
                    return false;
                };
                if !info.contains("cluster_state:ok") {
                    return false;
                }
                let Ok(views) = cluster_nodes(&mut c) else {
                    return false;
                };
                owners.push(
                    views
                        .into_iter()
                        .find(|v| {
                            v.master
                                && !v.failed
                                && v.slots.iter().any(|&(a, b)| a <= slot && slot <= b)
                        })
                        .map(|v| v.port),
                );
            }
            let owner = owners[0];
            if owner.is_none() || owner == Some(old) || owners.iter().any(|o| *o != owner) {
                return false;
            }
            let port = owner.unwrap();
            let role = node_connection(port)
                .and_then(|mut c| redis::cmd("ROLE").query::<Vec<redis::Value>>(&mut c));
            let is_master = matches!(
                role.as_deref(),
                Ok([redis::Value::BulkString(r), ..]) if r == b"master"
            );
            if is_master {
                found = Some(port);
            }
            is_master
        })
        .unwrap_or_else(|_| panic!("slot {slot} not served by a new master within {limit:?}"));
        found.unwrap()
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            if let Some(mut child) = node.child.take() {
                // A frozen node dies of SIGKILL as well.
                let _ = child.kill();
                let _ = child.wait();
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Parses `CLUSTER NODES`.
fn cluster_nodes(c: &mut redis::Connection) -> redis::RedisResult<Vec<NodeView>> {
    let text: String = redis::cmd("CLUSTER").arg("NODES").query(c)?;
    Ok(text
        .lines()
        .filter(|line| !line.is_empty())
        .map(|line| {
            let fields: Vec<&str> = line.split(' ').collect();
            let address = fields[1].split('@').next().unwrap();
            let port = address.rsplit(':').next().unwrap().parse().unwrap();
            let flags: Vec<&str> = fields[2].split(',').collect();
            let slots = fields[8..]
                .iter()
                .filter(|s| !s.starts_with('['))
                .map(|s| match s.split_once('-') {
                    Some((a, b)) => (a.parse().unwrap(), b.parse().unwrap()),
                    None => (s.parse().unwrap(), s.parse().unwrap()),
                })
                .collect();
            NodeView {
                id: fields[0].to_owned(),
                port,
                master: flags.contains(&"master"),
                failed: flags.contains(&"fail") || flags.contains(&"fail?"),
                master_id: fields[3].to_owned(),
                slots,
            }
        })
        .collect())
}

/// Polls `done` every 20 ms until it holds (`Ok`) or `limit` passes (`Err`).
fn wait_for(limit: Duration, mut done: impl FnMut() -> bool) -> Result<(), ()> {
    let deadline = Instant::now() + limit;
    loop {
        if done() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
