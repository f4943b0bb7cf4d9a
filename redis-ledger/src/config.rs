//! What one replica needs to join a shared ledger: where Redis is, the namespace and global
//! budget every replica shares, its own id, the lease, the timeout and the failure policy.

use std::time::Duration;

use async_bulkhead_llm::limits::MAX_BUDGET;

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
    /// that lease expires, then drops to the floor.
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
    pub(crate) url: String,
    pub(crate) namespace: String,
    pub(crate) global_budget: u64,
    pub(crate) replica_id: String,
    pub(crate) lease: Duration,
    pub(crate) renew_every: Option<Duration>,
    pub(crate) timeout: Duration,
    pub(crate) retry_every: Duration,
    pub(crate) failure: FailurePolicy,
}

impl LedgerConfig {
    /// Redis at `url` (`redis://host:port/db`), keys under `namespace` (use a hash tag such as
    /// `{gpt-4o}` so that a Redis cluster keeps them together), `global_budget` tokens shared by
    /// every replica. Defaults: a random replica id, a 10 s lease renewed every third of it, a
    /// 250 ms timeout, a retry every 500 ms while Redis is down, [`FailurePolicy::FailClosed`].
    pub fn new(url: impl Into<String>, namespace: impl Into<String>, global_budget: u64) -> Self {
        LedgerConfig {
            url: url.into(),
            namespace: namespace.into(),
            global_budget,
            replica_id: default_replica_id(),
            lease: Duration::from_secs(10),
            renew_every: None,
            timeout: Duration::from_millis(250),
            retry_every: Duration::from_millis(500),
            failure: FailurePolicy::FailClosed,
        }
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
    /// a third of the lease unless set.
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

    /// Checks the configuration, in this order: budget, namespace, replica id, timeout, lease.
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
        Ok(())
    }
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
