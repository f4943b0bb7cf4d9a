//! The ledger's errors and refusals: a bad configuration, Redis out of reach, and a call the
//! local bulkhead, the global ledger or the failure policy refused.

use std::fmt;
use std::time::Duration;

use async_bulkhead_llm::http::HttpRefusal;
use async_bulkhead_llm::rate::{RateLimits, RateWindow};
use async_bulkhead_llm::rejection::{CapacityDetail, Rejection, Scope, TokenBudgetDetail};
use async_bulkhead_llm::{AcquireError, RejectReason, stats::TokenBudgetStats};

/// Why a call to Redis failed.
#[derive(Debug)]
pub enum StoreError {
    /// Redis answered with an error, or the connection failed.
    Redis(redis::RedisError),
    /// No answer within the ledger's timeout.
    Timeout(Duration),
    /// The rate limits stored in Redis differ from this replica's (another replica stored
    /// others after Redis lost them): the reservation changed nothing.
    RateLimitsMismatch,
}

impl fmt::Display for StoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreError::Redis(e) => write!(f, "redis: {e}"),
            StoreError::Timeout(t) => write!(f, "redis: no answer within {t:?}"),
            StoreError::RateLimitsMismatch => {
                write!(f, "redis: the namespace's stored rate limits differ")
            }
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
    /// A cluster configuration ([`LedgerConfig::cluster`](crate::LedgerConfig::cluster)) names
    /// no node.
    NoClusterNodes,
    /// On a Redis Cluster the namespace must carry a non-empty hash tag (`{gpt-4o}`), so that
    /// every key of the ledger lives in one slot, as its scripts need: this one has none.
    NamespaceWithoutHashTag(String),
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
    /// A rate window must be 1 ms to 1 day long.
    RateWindowOutOfRange {
        /// The refused window.
        window: Duration,
    },
    /// Rate limits must limit requests or tokens (or both), each by at least 1.
    RateLimitsEmpty,
    /// A limit above what the ledger's scripts count exactly in its window
    /// ([`max_rate_limit`](crate::max_rate_limit): `window_us * limit` at most 2^53).
    RateLimitTooHigh {
        /// The refused limit.
        limit: u64,
        /// Its window.
        window: Duration,
        /// The largest limit of that window.
        max: u64,
    },
    /// The namespace's rate limits stored in Redis (by the first replica that connected)
    /// differ from this replica's: every replica of a deployment must enforce the same windows.
    /// Nothing was changed. To change the limits, stop every replica and delete
    /// `ns:rate:limits` and `ns:rate`.
    RateLimitsMismatch {
        /// The limits stored in Redis (`None`: none stored).
        stored: Option<RateLimits>,
        /// This replica's (`None`: it has none).
        configured: Option<RateLimits>,
    },
    /// Leased mode enforces global rate windows through the local bulkhead's own windows (each
    /// replica's share of the global limits, installed with its slice): a
    /// [`LeasedLedger`](crate::LeasedLedger) with rate limits needs a bulkhead built with rate
    /// windows (any limits: they are replaced).
    LocalRateWindowsMissing,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ConfigError::ZeroBudget => write!(f, "the global budget must be positive"),
            ConfigError::BudgetTooLarge { value, max } => {
                write!(f, "global budget {value} exceeds the largest, {max}")
            }
            ConfigError::EmptyNamespace => write!(f, "the namespace is empty"),
            ConfigError::NoClusterNodes => write!(f, "the cluster configuration names no node"),
            ConfigError::NamespaceWithoutHashTag(namespace) => write!(
                f,
                "namespace {namespace:?} has no hash tag: on a Redis Cluster it must contain a \
                 non-empty {{tag}} (such as \"{{gpt-4o}}\") so that every key of the ledger \
                 lives in one slot"
            ),
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
            ConfigError::RateWindowOutOfRange { window } => {
                write!(f, "rate window {window:?} must be from 1 ms to 1 day")
            }
            ConfigError::RateLimitsEmpty => write!(
                f,
                "rate limits must limit requests or tokens, each by at least 1"
            ),
            ConfigError::RateLimitTooHigh { limit, window, max } => write!(
                f,
                "rate limit {limit} per {window:?} exceeds the largest the ledger counts, {max}"
            ),
            ConfigError::RateLimitsMismatch { stored, configured } => write!(
                f,
                "rate limits {configured:?} differ from those the namespace enforces, {stored:?}"
            ),
            ConfigError::LocalRateWindowsMissing => write!(
                f,
                "leased mode installs each replica's share of the global rate windows as the \
                 local bulkhead's windows: build the bulkhead with rate windows"
            ),
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
    /// The local bulkhead's capacity snapshot just after its admission was returned (its
    /// slots, queue and revision: what [`rejection`](Self::rejection) shows beside the global
    /// figures).
    pub local_capacity: CapacityDetail,
}

impl GlobalRejection {
    /// This refusal as the core crate's [`Rejection`]: `budget_limit`, scoped `global`, its
    /// token figures the ledger's (the global budget, every replica's holds, the call's
    /// request), the rest the local bulkhead's; answered as a local refusal is (429, or 413
    /// for a request larger than the whole global budget).
    pub fn rejection(&self) -> Rejection {
        let c = self.local_capacity;
        let tokens = TokenBudgetDetail::compute(
            self.global_budget,
            0,
            false,
            self.global_in_flight,
            self.requested,
        );
        let detail = CapacityDetail::new(
            c.limit_revision,
            c.in_flight,
            c.max_concurrent,
            c.pending,
            c.max_queue,
            Some(tokens),
        );
        Rejection::budget_limit(detail).scoped(Scope::Global)
    }
}

/// A global rate window (shared by every replica) had no room for the call: it took nothing
/// (no hold, no charge). The local bulkhead's admission was returned.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GlobalRateRejection {
    /// The window that refused (requests are judged first): the core crate's
    /// [`RateWindow`], here always the bulkhead-level `Requests` or `Tokens` (the ledger keeps
    /// no class windows).
    pub window: RateWindow,
    /// The units the call asked of it (1 request, or its reservation in tokens).
    pub requested: u64,
    /// The window's limit.
    pub limit: u64,
    /// The window's length.
    pub period: Duration,
    /// When the call would fit if nothing else arrived, on Redis's clock (milliseconds,
    /// rounded up); `None`: never (more tokens than the window's whole limit).
    pub retry_after: Option<Duration>,
    /// The local bulkhead's token figures just after its admission was returned.
    pub local: Option<TokenBudgetStats>,
    /// The local bulkhead's capacity snapshot just after its admission was returned.
    pub local_capacity: CapacityDetail,
}

impl GlobalRateRejection {
    /// This refusal as the core crate's [`Rejection`]: `rate_limit`, scoped `global`, with
    /// the window and the exact wait, the figures the local bulkhead's; answered as a local
    /// window's refusal is (429 with `Retry-After`, or 413 for a call larger than the window).
    pub fn rejection(&self) -> Rejection {
        Rejection::rate_limit(self.local_capacity, self.window, self.retry_after)
            .scoped(Scope::Global)
    }
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
    /// Redis answered, but the ledger is recovering from a data loss (every live replica puts
    /// back what it holds first): how long until it admits again. `None` when Redis is out of
    /// reach.
    pub recovering: Option<Duration>,
}

/// A call the ledger refused, typed like the local bulkhead's refusals.
#[derive(Debug)]
pub enum LedgerRefusal {
    /// The local bulkhead refused (or the request was invalid).
    Local(AcquireError),
    /// The global ledger refused.
    Global(GlobalRejection),
    /// A global rate window refused.
    GlobalRate(GlobalRateRejection),
    /// Redis was unavailable and the failure policy refused.
    Unavailable(UnavailableRejection),
}

impl LedgerRefusal {
    /// The reason, in the local bulkhead's terms: a global refusal is a
    /// [`RejectReason::BudgetLimit`], a global window's a [`RejectReason::RateLimit`]; `None`
    /// for an invalid request or an unavailable ledger.
    pub fn reason(&self) -> Option<RejectReason> {
        match self {
            LedgerRefusal::Local(AcquireError::Rejected(r)) => Some(r.reason()),
            LedgerRefusal::Local(_) => None,
            LedgerRefusal::Global(_) => Some(RejectReason::BudgetLimit),
            LedgerRefusal::GlobalRate(_) => Some(RejectReason::RateLimit),
            LedgerRefusal::Unavailable(_) => None,
        }
    }

    /// For a `rate_limit` refusal (a local or a global window), when the call would fit if
    /// nothing else arrived (milliseconds, rounded up: a gateway's `Retry-After`); for a
    /// recovering ledger, when it admits again; `None` for any other refusal and for a call
    /// that can never fit its window.
    pub fn retry_after(&self) -> Option<Duration> {
        match self {
            LedgerRefusal::Local(AcquireError::Rejected(r)) => r.retry_after(),
            LedgerRefusal::GlobalRate(g) => g.retry_after,
            LedgerRefusal::Unavailable(u) => u.recovering,
            _ => None,
        }
    }

    /// A capacity refusal, local or global, as the core crate's [`Rejection`] (a global one
    /// scoped `global`, with the ledger's figures): one type for both, so a gateway answers
    /// them alike; `None` for an invalid request or an unavailable ledger.
    pub fn rejection(&self) -> Option<Rejection> {
        match self {
            LedgerRefusal::Local(AcquireError::Rejected(r)) => Some(*r),
            LedgerRefusal::Global(g) => Some(g.rejection()),
            LedgerRefusal::GlobalRate(g) => Some(g.rejection()),
            LedgerRefusal::Local(_) | LedgerRefusal::Unavailable(_) => None,
        }
    }

    /// The answer a gateway sends, as the core crate builds it for a local refusal (status,
    /// provider-shaped JSON body, `scope`): the same mapping for local and global refusals and
    /// invalid requests; `None` for an unavailable ledger (answer 503: see
    /// [`http_status`](Self::http_status)).
    pub fn http_refusal(&self) -> Option<HttpRefusal> {
        match self {
            LedgerRefusal::Local(error) => Some(HttpRefusal::from(error)),
            LedgerRefusal::Global(_) | LedgerRefusal::GlobalRate(_) => {
                self.rejection().map(HttpRefusal::from)
            }
            LedgerRefusal::Unavailable(_) => None,
        }
    }

    /// The HTTP status a gateway answers with: the core crate's mapping for every capacity
    /// refusal, local or global (429; 413 for a call that can never fit; 503 for a closed
    /// bulkhead), 503 for an unavailable ledger, 400 for an invalid request.
    pub fn http_status(&self) -> u16 {
        match self {
            LedgerRefusal::Local(AcquireError::Rejected(r)) => r.http_status(),
            LedgerRefusal::Local(_) => 400,
            LedgerRefusal::Global(g) => g.rejection().http_status(),
            LedgerRefusal::GlobalRate(g) => g.rejection().http_status(),
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
            LedgerRefusal::GlobalRate(g) => {
                let window = g.window.as_str();
                write!(
                    f,
                    "global {window} window: {} asked of {} per {:?}",
                    g.requested, g.limit, g.period
                )?;
                match g.retry_after {
                    Some(wait) => write!(f, ", retry after {wait:?}"),
                    None => write!(f, ", can never fit"),
                }
            }
            LedgerRefusal::Unavailable(u) => write!(f, "ledger unavailable: {}", u.cause),
        }
    }
}

impl std::error::Error for LedgerRefusal {}
