//! The ledger's errors and refusals: a bad configuration, Redis out of reach, and a call the
//! local bulkhead, the global ledger or the failure policy refused.

use std::fmt;
use std::time::Duration;

use async_bulkhead_llm::{AcquireError, RejectReason, stats::TokenBudgetStats};

/// Why a call to Redis failed.
#[derive(Debug)]
pub enum StoreError {
    /// Redis answered with an error, or the connection failed.
    Redis(redis::RedisError),
    /// No answer within the ledger's timeout.
    Timeout(Duration),
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Redis(e) => write!(f, "redis: {e}"),
            StoreError::Timeout(t) => write!(f, "redis: no answer within {t:?}"),
        }
    }
}

impl std::error::Error for StoreError {}

/// A configuration the ledger cannot run with; nothing was started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigError {
    /// The global budget is zero.
    ZeroBudget,
    /// The global budget exceeds [`MAX_BUDGET`](async_bulkhead_llm::limits::MAX_BUDGET).
    BudgetTooLarge {
        /// The refused value.
        value: u64,
        /// The largest accepted value.
        max: u64,
    },
    /// The namespace is empty.
    EmptyNamespace,
    /// The replica id is empty or contains whitespace or `|`.
    BadReplicaId(String),
    /// The lease must be at least three times the renewal period and at least 100 ms.
    LeaseTooShort {
        /// The lease.
        lease: Duration,
        /// The renewal (or rebalance) period.
        renew_every: Duration,
    },
    /// The Redis timeout is zero.
    ZeroTimeout,
    /// The local bulkhead has no token budget (the ledger shares tokens).
    NoTokenBudget,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::ZeroBudget => write!(f, "the global budget must be positive"),
            ConfigError::BudgetTooLarge { value, max } => {
                write!(f, "global budget {value} exceeds the largest, {max}")
            }
            ConfigError::EmptyNamespace => write!(f, "the namespace is empty"),
            ConfigError::BadReplicaId(id) => write!(
                f,
                "replica id {id:?} must be non-empty, without whitespace or '|'"
            ),
            ConfigError::LeaseTooShort { lease, renew_every } => write!(
                f,
                "lease {lease:?} must be at least 100 ms and three renewal periods ({renew_every:?})"
            ),
            ConfigError::ZeroTimeout => write!(f, "the Redis timeout must be positive"),
            ConfigError::NoTokenBudget => {
                write!(f, "the local bulkhead must be built with a token budget")
            }
        }
    }
}

impl std::error::Error for ConfigError {}

/// Why a ledger could not start or act.
#[derive(Debug)]
pub enum LedgerError {
    /// The configuration is invalid.
    Config(ConfigError),
    /// Redis could not be reached.
    Store(StoreError),
    /// The local bulkhead refused a budget change.
    Limits(async_bulkhead_llm::limits::LimitsError),
}

impl fmt::Display for LedgerError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerError::Config(e) => write!(f, "ledger configuration: {e}"),
            LedgerError::Store(e) => write!(f, "ledger store: {e}"),
            LedgerError::Limits(e) => write!(f, "local budget: {e}"),
        }
    }
}

impl std::error::Error for LedgerError {}

impl From<ConfigError> for LedgerError {
    fn from(e: ConfigError) -> LedgerError {
        LedgerError::Config(e)
    }
}

impl From<StoreError> for LedgerError {
    fn from(e: StoreError) -> LedgerError {
        LedgerError::Store(e)
    }
}

/// The global ledger refused: every replica's holds plus this request exceed the global
/// budget. The local bulkhead's admission was returned (its accounting stays exact).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalRejection {
    /// The tokens the call asked for (its local hold).
    pub requested: u64,
    /// The tokens every live replica held when the ledger judged the call.
    pub global_in_flight: u64,
    /// The global budget.
    pub global_budget: u64,
    /// The local bulkhead's token figures just after its admission was returned.
    pub local: Option<TokenBudgetStats>,
}

/// Redis was out of reach (or slower than the timeout) and the failure policy refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnavailableRejection {
    /// What went wrong, or that the ledger is waiting before it tries Redis again.
    pub cause: String,
    /// The tokens the call asked for.
    pub requested: u64,
    /// The local floor's tokens in flight and its size, under a `LocalFloor` policy.
    pub floor: Option<(u64, u64)>,
}

/// A call the ledger refused, typed like the local bulkhead's refusals.
#[derive(Debug)]
pub enum LedgerRefusal {
    /// The local bulkhead refused (or the request was invalid).
    Local(AcquireError),
    /// The global ledger refused.
    Global(GlobalRejection),
    /// Redis was unavailable and the failure policy refused.
    Unavailable(UnavailableRejection),
}

impl LedgerRefusal {
    /// The reason, in the local bulkhead's terms: a global refusal is a
    /// [`RejectReason::BudgetLimit`]; `None` for an invalid request or an unavailable ledger.
    pub fn reason(&self) -> Option<RejectReason> {
        match self {
            LedgerRefusal::Local(AcquireError::Rejected(r)) => Some(r.reason()),
            LedgerRefusal::Local(_) => None,
            LedgerRefusal::Global(_) => Some(RejectReason::BudgetLimit),
            LedgerRefusal::Unavailable(_) => None,
        }
    }

    /// The HTTP status a gateway answers with: 429 for capacity (local or global), 503 for a
    /// closed bulkhead or an unavailable ledger, 400 for an invalid request.
    pub fn http_status(&self) -> u16 {
        match self {
            LedgerRefusal::Local(AcquireError::Rejected(r)) => match r.reason() {
                RejectReason::Shutdown => 503,
                _ => 429,
            },
            LedgerRefusal::Local(_) => 400,
            LedgerRefusal::Global(_) => 429,
            LedgerRefusal::Unavailable(_) => 503,
        }
    }
}

impl fmt::Display for LedgerRefusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LedgerRefusal::Local(e) => write!(f, "refused locally: {e}"),
            LedgerRefusal::Global(g) => write!(
                f,
                "global budget: {} requested, {} of {} held by every replica",
                g.requested, g.global_in_flight, g.global_budget
            ),
            LedgerRefusal::Unavailable(u) => write!(f, "ledger unavailable: {}", u.cause),
        }
    }
}

impl std::error::Error for LedgerRefusal {}
