//! What one replica needs to join a shared ledger: where Redis is (one server or a Redis
//! Cluster), the namespace and global budget every replica shares, its own id, the lease, the
//! timeout and the failure policy.

use std::time::Duration;

use async_bulkhead_llm::limits::MAX_BUDGET;
use async_bulkhead_llm::rate::RateLimits;

use crate::error::ConfigError;

/// What a replica does while Redis is unreachable or slower than the timeout.
///
/// Recovery is automatic either way: the ledger tries Redis again every
/// [`retry_every`](LedgerConfig::retry_every) (and at every lease renewal), and resumes
/// global admission at the first answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailurePolicy {
    /// Refuse every call that needs the ledger (a 503), so the global budget can never be
    /// exceeded, at the cost of availability.
    FailClosed,
    /// Admit locally within a fixed floor of tokens in flight per replica (never the
    /// replica's full local budget): an outage can exceed the global budget by at most
    /// `replicas x tokens`. In leased mode the replica first keeps the slice it leased until
    /// that lease expires, then drops to the floor. Calls admitted on the floor charge no
    /// global rate window (Redis is out of reach): only the floor and the local bulkhead's
    /// own windows, if any, bound them (see the crate's "Rate windows across replicas").
    LocalFloor {
        /// The tokens this replica may hold in flight without the ledger.
        tokens: u64,
    },
}

/// Configuration of a replica's ledger. Every replica of one deployment uses the same
/// `namespace` and `global_budget`, and its own `replica_id`.
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm_redis::{FailurePolicy, LedgerConfig};
///
/// let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000)
///     .replica_id("gateway-a")
///     .lease(Duration::from_secs(6))
///     .timeout(Duration::from_millis(100))
///     .failure(FailurePolicy::LocalFloor { tokens: 8_000 });
/// assert!(config.validate().is_ok());
/// assert_eq!(config.renew_every_value(), Duration::from_secs(2));
/// ```
#[derive(Debug, Clone)]
pub struct LedgerConfig {
    pub(crate) endpoint: Endpoint,
    pub(crate) namespace: String,
    pub(crate) global_budget: u64,
    pub(crate) replica_id: String,
    pub(crate) lease: Duration,
    pub(crate) renew_every: Option<Duration>,
    pub(crate) timeout: Duration,
    pub(crate) retry_every: Duration,
    pub(crate) failure: FailurePolicy,
    pub(crate) rate: Option<RateLimits>,
}

/// Where the ledger's Redis is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Endpoint {
    /// One server (or a proxy in front of several): its URL.
    Single(String),
    /// A Redis Cluster: the URLs of some of its nodes (the others are discovered).
    Cluster(Vec<String>),
}

/// The shortest and the longest rate window (the core crate's bounds).
const MIN_RATE_WINDOW: Duration = Duration::from_millis(1);
const MAX_RATE_WINDOW: Duration = Duration::from_secs(86_400);

/// The largest `window_us * limit` the scripts count exactly (Lua numbers are doubles).
const MAX_WINDOW_UNITS: u128 = 1 << 53;

/// Rate limits as the scripts take them: the window in microseconds, each limit (0: none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RateSpec {
    pub(crate) window_us: u64,
    pub(crate) requests: u64,
    pub(crate) tokens: u64,
}

impl RateSpec {
    pub(crate) fn of(rate: &RateLimits) -> RateSpec {
        RateSpec {
            window_us: u64::try_from(rate.window.as_micros()).unwrap_or(u64::MAX),
            requests: rate.requests.unwrap_or(0),
            tokens: rate.tokens.unwrap_or(0),
        }
    }

    /// The limits these figures stand for (`None` for `0 0 0`: no limits).
    pub(crate) fn limits(self) -> Option<RateLimits> {
        if self.window_us == 0 {
            return None;
        }
        let mut rate = RateLimits::new(Duration::from_micros(self.window_us));
        if self.requests > 0 {
            rate = rate.requests(self.requests);
        }
        if self.tokens > 0 {
            rate = rate.tokens(self.tokens);
        }
        Some(rate)
    }
}

/// The largest limit a ledger's window of `window` can count: `2^53 / window_us` (the
/// scripts multiply microseconds below one window by the limit in Lua doubles).
///
/// # Examples
///
/// ```
/// use std::time::Duration;
/// use async_bulkhead_llm_redis::max_rate_limit;
///
/// assert_eq!(max_rate_limit(Duration::from_secs(60)), 150_119_987); // tokens per minute
/// assert_eq!(max_rate_limit(Duration::from_secs(1)), 9_007_199_254);
/// ```
pub fn max_rate_limit(window: Duration) -> u64 {
    let window_us = window.as_micros().max(1);
    u64::try_from(MAX_WINDOW_UNITS / window_us).unwrap_or(u64::MAX)
}

impl LedgerConfig {
    /// Redis at `url` (`redis://host:port/db`), keys under `namespace` (use a hash tag such as
    /// `{gpt-4o}`, so that the same namespace also works on a Redis Cluster: see
    /// [`cluster`](Self::cluster)), `global_budget` tokens shared by every replica. Defaults: a
    /// random replica id, a 10 s lease renewed every third of it, a 250 ms timeout, a retry every
    /// 500 ms while Redis is down, [`FailurePolicy::FailClosed`].
    pub fn new(url: impl Into<String>, namespace: impl Into<String>, global_budget: u64) -> Self {
        LedgerConfig::with_endpoint(Endpoint::Single(url.into()), namespace, global_budget)
    }

    /// A ledger on a Redis Cluster: `nodes` are the URLs of some of its nodes
    /// (`redis://host:port`; the rest of the cluster is discovered from them), the rest as
    /// [`new`](Self::new).
    ///
    /// Every key of one ledger must live in one hash slot, since each script reads and writes
    /// them atomically: the namespace must carry a non-empty hash tag (`{gpt-4o}`, or
    /// `{gpt-4o}:eu`), else [`validate`](Self::validate) refuses it with
    /// [`ConfigError::NamespaceWithoutHashTag`]. One ledger's load therefore goes to one master
    /// (spread several ledgers over the cluster with different tags); the ledger's timeout
    /// bounds each connection attempt and each answer, as on one server. Scripts run on the
    /// master of that slot; a `PING` ([`ExactLedger::ping`](crate::ExactLedger::ping)) goes there
    /// too.
    ///
    /// **Failover.** When that master fails, the cluster promotes its replica: at once for a
    /// manual `CLUSTER FAILOVER`, else after `cluster-node-timeout` and an election (about two
    /// to three node timeouts: 2.2 to 2.7 s with a 1 s node timeout, in this crate's tests).
    /// Meanwhile every call to the ledger fails within the timeout and the [`FailurePolicy`]
    /// applies, as in any outage. The ledger finds the new master by itself: a call the cluster
    /// refuses unrun because the slot moved (`MOVED`, `TRYAGAIN`, `READONLY`) is sent again,
    /// to the new master, within the timeout; a call whose connection failed is never sent
    /// again (it may have run: a reservation would be taken twice), it fails as any call to an
    /// unreachable Redis does. In the tests, global admission resumed within 50 ms of the
    /// promotion (with a 50 ms [`retry_every`](Self::retry_every)). The time the master was
    /// unreachable lapses no lease (the scripts move lease deadlines by the gap: the `ns:clock`
    /// key in [`scripts`](crate::scripts)).
    ///
    /// **Resharding.** While the namespace's slot is being migrated to another master, the
    /// old master runs a script whose keys are all still there; one whose keys have moved it
    /// refuses unrun with `ASK`, which is followed at once (`ASKING`, then the script, in one
    /// pipeline to the importing master); a refusal with `TRYAGAIN` (the script's keys split
    /// between the two, or some of them not created yet) is sent again within the timeout,
    /// and the slot's handover ends with the `MOVED` above. So a migration whose keys move
    /// and whose slot is handed over within the timeout fails no call (tested with a 100 ms
    /// window and a 1 s timeout); calls that meet a longer window fail as in an outage,
    /// and the failure policy applies.
    ///
    /// A manual failover loses nothing (the replica catches up first) and, in the tests, fails
    /// no call (the old master's `MOVED` is followed). A crash can lose writes: Redis
    /// replicates asynchronously, so the promoted replica can miss the master's last writes
    /// (whole scripts, never a part of one). What each loss does:
    ///
    /// - **a lost lease** (a replica that joined, or re-registered, just before the crash): its
    ///   next renewal (or reservation) is told Redis does not know it, and it puts back every
    ///   live hold ([`scripts::REGISTER`](crate::scripts::REGISTER)), so its holds are counted
    ///   exactly again within one renewal period of the promotion
    ///   ([`LedgerStats::reregistrations`](crate::LedgerStats::reregistrations)); until then
    ///   reservations are judged without them;
    /// - **a lost reservation** of a replica whose lease survived: the replica's next renewal
    ///   puts it back (every renewal sends the replica's live holds, [`scripts::RENEW`](crate::scripts::RENEW)),
    ///   so the global total is below what is in flight for at most one renewal period of the
    ///   promotion ([`LedgerStats::missing_tokens_put_back`](crate::LedgerStats::missing_tokens_put_back));
    /// - **a lost release**: the hold, no longer listed by its replica, is released at the
    ///   second renewal that finds it (two renewal periods: the total is above what is in
    ///   flight meanwhile; [`LedgerStats::stray_tokens_released`](crate::LedgerStats::stray_tokens_released));
    /// - **a lost usage update**: the next renewal moves the hold to the replica's newer usage
    ///   (or the call's next report does, by sequence number);
    /// - **a lost charge of a rate window** ([`rate_limits`](Self::rate_limits)): forgotten, so
    ///   the window lets that much more through.
    ///
    /// Redis's own `min-replicas-to-write` and `min-replicas-max-lag` narrow what a crash can
    /// lose (a master whose replica lags more refuses writes: the failure policy applies).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm_redis::{ConfigError, LedgerConfig};
    ///
    /// let nodes = ["redis://10.0.0.1:6379", "redis://10.0.0.2:6379", "redis://10.0.0.3:6379"];
    /// let config = LedgerConfig::cluster(nodes, "{gpt-4o}", 200_000)
    ///     .replica_id("gateway-a")
    ///     .timeout(Duration::from_millis(100));
    /// assert!(config.validate().is_ok());
    /// assert!(config.is_cluster());
    ///
    /// // Without a hash tag the keys would spread over the cluster's slots.
    /// let untagged = LedgerConfig::cluster(nodes, "gpt-4o", 200_000);
    /// assert_eq!(
    ///     untagged.validate(),
    ///     Err(ConfigError::NamespaceWithoutHashTag("gpt-4o".into()))
    /// );
    /// assert_eq!(
    ///     LedgerConfig::cluster(Vec::<String>::new(), "{gpt-4o}", 200_000).validate(),
    ///     Err(ConfigError::NoClusterNodes)
    /// );
    /// ```
    pub fn cluster(
        nodes: impl IntoIterator<Item = impl Into<String>>,
        namespace: impl Into<String>,
        global_budget: u64,
    ) -> Self {
        let nodes = nodes.into_iter().map(Into::into).collect();
        LedgerConfig::with_endpoint(Endpoint::Cluster(nodes), namespace, global_budget)
    }

    /// Whether the ledger is on a Redis Cluster ([`cluster`](Self::cluster)).
    pub fn is_cluster(&self) -> bool {
        matches!(self.endpoint, Endpoint::Cluster(_))
    }

    fn with_endpoint(
        endpoint: Endpoint,
        namespace: impl Into<String>,
        global_budget: u64,
    ) -> LedgerConfig {
        LedgerConfig {
            endpoint,
            namespace: namespace.into(),
            global_budget,
            replica_id: default_replica_id(),
            lease: Duration::from_secs(10),
            renew_every: None,
            timeout: Duration::from_millis(250),
            retry_every: Duration::from_millis(500),
            failure: FailurePolicy::FailClosed,
            rate: None,
        }
    }

    /// Requests and tokens per window shared by every replica (exact mode only): each
    /// admission is also charged to the global windows, in the reservation's script, on
    /// Redis's clock (see the crate's "Rate windows across replicas"). Every replica of the
    /// deployment must use the same limits: the first replica to connect stores them in Redis
    /// (`ns:rate:limits`) and a replica whose limits differ (or that has none while some are
    /// stored) is refused at [`ExactLedger::connect`](crate::ExactLedger::connect) with
    /// [`ConfigError::RateLimitsMismatch`]. The window is counted in whole microseconds.
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm::rate::RateLimits;
    /// use async_bulkhead_llm_redis::{ConfigError, LedgerConfig};
    ///
    /// let rpm = RateLimits::per_minute().requests(500).tokens(200_000);
    /// let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000).rate_limits(rpm);
    /// assert!(config.validate().is_ok());
    /// assert_eq!(config.rate_limits_value(), Some(rpm));
    ///
    /// let empty = RateLimits::new(Duration::from_secs(1));
    /// let config = config.rate_limits(empty);
    /// assert_eq!(config.validate(), Err(ConfigError::RateLimitsEmpty));
    /// ```
    pub fn rate_limits(mut self, rate: RateLimits) -> Self {
        self.rate = Some(rate);
        self
    }

    /// The rate limits in use, if any.
    pub fn rate_limits_value(&self) -> Option<RateLimits> {
        self.rate
    }

    /// This replica's id, unique in the deployment (no whitespace, no `|`).
    pub fn replica_id(mut self, id: impl Into<String>) -> Self {
        self.replica_id = id.into();
        self
    }

    /// How long the replica's holds (or slice) outlive its last renewal: a crashed or hung
    /// replica's tokens return to the others this long after its last word.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.lease = lease;
        self
    }

    /// How often the lease is renewed (exact mode) or the slice rebalanced (leased mode);
    /// a third of the lease unless set. Every replica of a namespace should use the same.
    ///
    /// A stall of Redis itself (a `DEBUG SLEEP`, a slow fork, a paused process) does not lapse
    /// a live replica's lease, however long it lasts, while the lease is at least twice this
    /// period plus 100 ms (the default, three periods, is): the scripts move every lease
    /// deadline by the part of a gap between their runs beyond this period plus 100 ms (see
    /// the `ns:clock` key in [`scripts`](crate::scripts)).
    pub fn renew_every(mut self, period: Duration) -> Self {
        self.renew_every = Some(period);
        self
    }

    /// The longest the ledger waits for Redis before it applies the failure policy.
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// While Redis is down, how long calls go straight to the failure policy before one
    /// tries Redis again.
    pub fn retry_every(mut self, period: Duration) -> Self {
        self.retry_every = period;
        self
    }

    /// What to do while Redis is unavailable.
    pub fn failure(mut self, policy: FailurePolicy) -> Self {
        self.failure = policy;
        self
    }

    /// The replica id in use.
    pub fn replica_id_value(&self) -> &str {
        &self.replica_id
    }

    /// The renewal period in use.
    pub fn renew_every_value(&self) -> Duration {
        self.renew_every.unwrap_or(self.lease / 3)
    }

    /// The recovery period: how long a ledger that Redis lost (a restart without persistence,
    /// an emptied database) admits nothing new once a replica finds out, so that every live
    /// replica can renew and put back what it holds first. A live replica contacts Redis at
    /// least once per renewal period and retries a failed contact after the retry period, each
    /// attempt bounded by the timeout, and re-registers in one more call: so the renewal
    /// period, plus the retry period, plus two timeouts, plus 100 ms. Replicas of one ledger
    /// should share these settings (the replica that opens the recovery sets its length).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::time::Duration;
    /// use async_bulkhead_llm_redis::LedgerConfig;
    ///
    /// let config = LedgerConfig::new("redis://127.0.0.1:6379/", "{gpt-4o}", 200_000)
    ///     .lease(Duration::from_secs(3))
    ///     .timeout(Duration::from_millis(250))
    ///     .retry_every(Duration::from_millis(500));
    /// // 1 s + 500 ms + 2 x 250 ms + 100 ms
    /// assert_eq!(config.recovery_value(), Duration::from_millis(2_100));
    /// ```
    pub fn recovery_value(&self) -> Duration {
        self.renew_every_value() + self.retry_every + self.timeout * 2 + Duration::from_millis(100)
    }

    /// Checks the configuration, in this order: budget, namespace (on a cluster: at least one
    /// node, and a non-empty hash tag in the namespace), replica id, timeout, lease, rate limits
    /// (a window of 1 ms to 1 day, at least one limit, each at least 1 and at most
    /// [`max_rate_limit`] of the window).
    ///
    /// # Errors
    ///
    /// The first [`ConfigError`] found.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.global_budget == 0 {
            return Err(ConfigError::ZeroBudget);
        }
        if self.global_budget > MAX_BUDGET {
            return Err(ConfigError::BudgetTooLarge {
                value: self.global_budget,
                max: MAX_BUDGET,
            });
        }
        if self.namespace.is_empty() {
            return Err(ConfigError::EmptyNamespace);
        }
        if let Endpoint::Cluster(nodes) = &self.endpoint {
            if nodes.is_empty() {
                return Err(ConfigError::NoClusterNodes);
            }
            if hash_tag(&self.namespace).is_none() {
                return Err(ConfigError::NamespaceWithoutHashTag(self.namespace.clone()));
            }
        }
        let id = &self.replica_id;
        if id.is_empty() || id.contains('|') || id.chars().any(char::is_whitespace) {
            return Err(ConfigError::BadReplicaId(id.clone()));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::ZeroTimeout);
        }
        let renew_every = self.renew_every_value();
        if self.lease < Duration::from_millis(100)
            || renew_every.is_zero()
            || self.lease < renew_every * 3
        {
            return Err(ConfigError::LeaseTooShort {
                lease: self.lease,
                renew_every,
            });
        }
        if let Some(rate) = &self.rate {
            validate_rate(rate)?;
        }
        Ok(())
    }
}

/// The hash tag of a key starting with `namespace`, found in `namespace` itself, as Redis
/// Cluster finds it: what lies between the first `{` and the first `}` after it, if not empty
/// (a tag left open in the namespace would close in the key's suffix, which differs per key).
fn hash_tag(namespace: &str) -> Option<&str> {
    let open = namespace.find('{')?;
    let rest = &namespace[open + 1..];
    let close = rest.find('}')?;
    Some(&rest[..close]).filter(|tag| !tag.is_empty())
}

fn validate_rate(rate: &RateLimits) -> Result<(), ConfigError> {
    if rate.window < MIN_RATE_WINDOW || rate.window > MAX_RATE_WINDOW {
        return Err(ConfigError::RateWindowOutOfRange {
            window: rate.window,
        });
    }
    if rate.requests.is_none() && rate.tokens.is_none()
        || rate.requests == Some(0)
        || rate.tokens == Some(0)
    {
        return Err(ConfigError::RateLimitsEmpty);
    }
    let max = max_rate_limit(rate.window);
    for limit in [rate.requests, rate.tokens].into_iter().flatten() {
        if limit > max {
            return Err(ConfigError::RateLimitTooHigh {
                limit,
                window: rate.window,
                max,
            });
        }
    }
    Ok(())
}

/// `<host>-<pid>-<random>`: unique across processes and restarts.
fn default_replica_id() -> String {
    use std::hash::{BuildHasher, Hasher};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos()),
    );
    let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "replica".into());
    let host: String = host
        .chars()
        .filter(|c| !c.is_whitespace() && *c != '|')
        .collect();
    format!(
        "{host}-{}-{:08x}",
        std::process::id(),
        hasher.finish() as u32
    )
}
