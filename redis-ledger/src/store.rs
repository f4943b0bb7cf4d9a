//! The connection to Redis and one typed call per script, each bounded by the ledger's
//! timeout: what the exact and leased modes build on.

use std::time::Duration;

use async_bulkhead_llm::LlmBulkhead;

use crate::config::{Endpoint, LedgerConfig, RateSpec};
use crate::connection::Connection;
use crate::error::{ConfigError, LedgerError, StoreError};
use crate::scripts::Scripts;

/// The outcome of a reservation in the global ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reserved {
    /// Reserved; the global total after it.
    Yes { total: u64 },
    /// Refused: the total and the budget it was judged against.
    No { total: u64, budget: u64 },
    /// Refused by a rate window (`tokens`: the tokens window, else the requests window): the
    /// wait until the call would fit (`None`: never).
    RateLimited {
        tokens: bool,
        retry_after: Option<Duration>,
    },
    /// Redis does not know this replica (restarted without its data, or the lease purged):
    /// nothing reserved; the replica re-registers its holds first.
    Unregistered,
    /// The ledger is recovering from a data loss (every live replica puts its holds back
    /// first): nothing reserved; it admits again after `wait`.
    Recovering { wait: Duration },
}

/// What a renewal did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Renewed {
    /// Redis did not know the replica: nothing renewed (it re-registers).
    pub(crate) lost: bool,
    /// Tokens of holds Redis kept that the replica had released (a lost release), released.
    pub(crate) released: u64,
    /// Tokens of live holds Redis had lost (or held at an older usage), put back.
    pub(crate) put_back: u64,
}

/// A hold as the scripts store it: `"<held>|<seq>"`.
fn hold_values(holds: &[(String, u64, u64)]) -> Vec<String> {
    holds
        .iter()
        .map(|(_, held, sequence)| format!("{held}|{sequence}"))
        .collect()
}

/// What a registration did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Registered {
    /// The tokens its holds put back (holds Redis still had are left as they are).
    pub(crate) added: u64,
    /// The ledger's epoch now.
    pub(crate) epoch: u64,
    /// How long the ledger is still recovering (zero: it admits).
    pub(crate) recovering: Duration,
}

/// The outcome of a usage update.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Moved {
    /// Applied.
    Applied,
    /// Its sequence was not newer than the last applied one: nothing changed.
    Stale,
    /// The hold is gone (released, or purged with the replica's lease).
    Gone,
}

/// What a replica brings to a rebalance (`PLAN`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct PlanAsk {
    pub(crate) want: u64,
    /// Its tokens in flight.
    pub(crate) floor: u64,
    pub(crate) budget: u64,
    pub(crate) lease: Duration,
    pub(crate) renew_every: Duration,
    /// The epoch it knew (0: none).
    pub(crate) known: u64,
    pub(crate) recovery: Duration,
    /// The slice it has installed as its local budget.
    pub(crate) installed: u64,
}

/// What a `PLAN` call granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) slice: u64,
    pub(crate) target: u64,
    pub(crate) total: u64,
    pub(crate) replicas: u64,
    pub(crate) lost: bool,
    /// The ledger's epoch now.
    pub(crate) epoch: u64,
    /// How long the ledger is still recovering (zero: it admits).
    pub(crate) recovering: Duration,
}

/// The global figures of one ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalSnapshot {
    /// The tokens held by every live replica (exact holds and leased slices).
    pub in_flight_tokens: u64,
    /// The replicas with a live lease.
    pub replicas: u64,
    /// The replicas of them in leased mode.
    pub leased_replicas: u64,
}

/// The global rate windows now, read from Redis
/// ([`ExactLedger::global_rate`](crate::ExactLedger::global_rate)): what a gateway's rate-limit
/// headers show for the whole deployment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRateStatus {
    /// The windows' length.
    pub window: Duration,
    /// The requests window, if configured.
    pub requests: Option<GlobalWindow>,
    /// The tokens window, if configured.
    pub tokens: Option<GlobalWindow>,
}

/// One global window's figures now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalWindow {
    /// Units (requests or tokens) per window.
    pub limit: u64,
    /// Units it would let through at once now.
    pub remaining: u64,
    /// How long until it is whole again, nothing else arriving (microseconds of Redis's clock).
    pub reset: Duration,
}

/// One replica's handle on one ledger.
#[derive(Clone)]
pub(crate) struct Store {
    connection: Connection,
    scripts: std::sync::Arc<Scripts>,
    namespace: String,
    replica: String,
    keys: [String; 7],
    timeout: Duration,
}

impl Store {
    /// What both modes do first: validate `config`, check that `bulkhead` has a token budget,
    /// connect.
    pub(crate) async fn open(
        bulkhead: &LlmBulkhead,
        config: &LedgerConfig,
    ) -> Result<Store, LedgerError> {
        config.validate()?;
        if bulkhead.limits().token_budget.is_none() {
            return Err(ConfigError::NoTokenBudget.into());
        }
        let store = Store::connect(
            &config.endpoint,
            &config.namespace,
            &config.replica_id,
            config.timeout,
        )
        .await?;
        let spec = config.rate.as_ref().map(RateSpec::of);
        if let Err(stored) = store.configure(spec).await? {
            return Err(ConfigError::RateLimitsMismatch {
                stored,
                configured: config.rate,
            }
            .into());
        }
        Ok(store)
    }

    /// Checks (or first stores) the namespace's rate limits: `Err` with the limits stored
    /// when they differ from `spec` (nothing changed).
    async fn configure(
        &self,
        spec: Option<RateSpec>,
    ) -> Result<Result<(), Option<async_bulkhead_llm::rate::RateLimits>>, StoreError> {
        let spec = spec.unwrap_or(RateSpec {
            window_us: 0,
            requests: 0,
            tokens: 0,
        });
        let reply = self
            .run(
                &self.scripts.configure,
                &[
                    &spec.window_us.to_string(),
                    &spec.requests.to_string(),
                    &spec.tokens.to_string(),
                ],
            )
            .await?;
        if reply.first() == Some(&1) {
            return Ok(Ok(()));
        }
        let stored = RateSpec {
            window_us: unsigned(&reply, 1),
            requests: unsigned(&reply, 2),
            tokens: unsigned(&reply, 3),
        };
        Ok(Err(stored.limits()))
    }

    async fn connect(
        endpoint: &Endpoint,
        namespace: &str,
        replica: &str,
        timeout: Duration,
    ) -> Result<Store, StoreError> {
        let connection = Connection::open(endpoint, namespace, timeout).await?;
        Ok(Store {
            connection,
            scripts: std::sync::Arc::new(Scripts::new()),
            namespace: namespace.to_owned(),
            replica: replica.to_owned(),
            keys: [
                format!("{namespace}:total"),
                format!("{namespace}:leases"),
                format!("{namespace}:holds:{replica}"),
                format!("{namespace}:slices"),
                format!("{namespace}:wants"),
                format!("{namespace}:rate"),
                format!("{namespace}:rate:limits"),
            ],
            timeout,
        })
    }

    pub(crate) fn replica(&self) -> &str {
        &self.replica
    }

    #[cfg(any(feature = "metrics", feature = "tracing"))]
    pub(crate) fn namespace(&self) -> &str {
        &self.namespace
    }

    /// Runs `script` with the ledger's keys, `ns`, the replica and `args`.
    async fn run(&self, script: &redis::Script, args: &[&str]) -> Result<Vec<i64>, StoreError> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys {
            invocation.key(key);
        }
        invocation.arg(&self.namespace).arg(&self.replica);
        for arg in args {
            invocation.arg(*arg);
        }
        let mut connection = self.connection.clone();
        let reply = tokio::time::timeout(self.timeout, invocation.invoke_async(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(StoreError::Redis)?;
        Ok(reply)
    }

    /// Reserves `tokens` for `id` (charging the rate windows of `rate` too, in the same
    /// script), releasing the holds of `riders` first.
    pub(crate) async fn reserve(
        &self,
        id: &str,
        tokens: u64,
        budget: u64,
        lease: Duration,
        rate: Option<RateSpec>,
        riders: &[String],
    ) -> Result<Option<Reserved>, StoreError> {
        let (tokens, budget, lease) = (
            tokens.to_string(),
            budget.to_string(),
            millis(lease).to_string(),
        );
        let mut args: Vec<&str> = vec![id, &tokens, &budget, &lease];
        let figures;
        let script = match rate {
            None => &self.scripts.reserve,
            Some(spec) => {
                figures = [
                    spec.window_us.to_string(),
                    spec.requests.to_string(),
                    spec.tokens.to_string(),
                ];
                args.extend(figures.iter().map(String::as_str));
                &self.scripts.reserve_rated
            }
        };
        args.extend(riders.iter().map(String::as_str));
        let reply = self.run(script, &args).await?;
        Ok(match reply.first() {
            Some(1) => Some(Reserved::Yes {
                total: unsigned(&reply, 1),
            }),
            Some(0) => Some(Reserved::No {
                total: unsigned(&reply, 1),
                budget: unsigned(&reply, 2),
            }),
            Some(2) => Some(Reserved::RateLimited {
                tokens: reply.get(5) == Some(&2),
                retry_after: reply
                    .get(6)
                    .and_then(|&ms| u64::try_from(ms).ok())
                    .map(Duration::from_millis),
            }),
            Some(-2) => return Err(StoreError::RateLimitsMismatch),
            Some(-3) => Some(Reserved::Unregistered),
            Some(-4) => Some(Reserved::Recovering {
                wait: Duration::from_millis(unsigned(&reply, 6)),
            }),
            // The id already holds (-1): the caller's ids are unique, so only this reservation,
            // run twice, can hold it.
            _ => None,
        })
    }

    /// The global rate windows now (`None`: the namespace stores no rate limits).
    pub(crate) async fn rate_status(&self) -> Result<Option<GlobalRateStatus>, StoreError> {
        let reply = self.run(&self.scripts.rate_status, &[]).await?;
        let window_us = unsigned(&reply, 0);
        if window_us == 0 {
            return Ok(None);
        }
        let window = |at: usize| {
            let limit = unsigned(&reply, at);
            (limit > 0).then(|| GlobalWindow {
                limit,
                remaining: unsigned(&reply, at + 1),
                reset: Duration::from_micros(unsigned(&reply, at + 2)),
            })
        };
        Ok(Some(GlobalRateStatus {
            window: Duration::from_micros(window_us),
            requests: window(1),
            tokens: window(4),
        }))
    }

    /// Moves `id`'s hold to `held` (sequence `sequence`); with `used` (the call's cumulative
    /// usage), usage beyond what the tokens window was charged for it is charged.
    pub(crate) async fn usage(
        &self,
        id: &str,
        sequence: u64,
        held: u64,
        used: Option<u64>,
    ) -> Result<Moved, StoreError> {
        let (sequence, held) = (sequence.to_string(), held.to_string());
        let used = used.map(|u| u.to_string());
        let mut args: Vec<&str> = vec![id, &sequence, &held];
        args.extend(used.as_deref());
        let reply = self.run(&self.scripts.usage, &args).await?;
        Ok(match reply.first() {
            Some(1) => Moved::Applied,
            Some(0) => Moved::Stale,
            _ => Moved::Gone,
        })
    }

    /// Releases the holds of `ids` (one script); how many held.
    pub(crate) async fn release(&self, ids: &[String]) -> Result<u64, StoreError> {
        let args: Vec<&str> = ids.iter().map(String::as_str).collect();
        let reply = self.run(&self.scripts.release, &args).await?;
        Ok(unsigned(&reply, 0))
    }

    /// Renews the lease (renewed every `renew_every`); `true` when it had lapsed (the
    /// replica's holds were purged).
    /// Renews the lease and reconciles the replica's `holds` (`(id, held, sequence)`: every
    /// live one) with Redis's ([`RENEW`](crate::scripts::RENEW)).
    pub(crate) async fn renew(
        &self,
        lease: Duration,
        renew_every: Duration,
        holds: &[(String, u64, u64)],
    ) -> Result<Renewed, StoreError> {
        let (lease, period) = (millis(lease).to_string(), millis(renew_every).to_string());
        let values = hold_values(holds);
        let mut args: Vec<&str> = vec![&lease, &period];
        for ((id, _, _), value) in holds.iter().zip(&values) {
            args.push(id);
            args.push(value);
        }
        let reply = self.run(&self.scripts.renew, &args).await?;
        Ok(Renewed {
            lost: reply.first() == Some(&1),
            released: unsigned(&reply, 3),
            put_back: unsigned(&reply, 4),
        })
    }

    /// Registers the replica (its lease) and its live `holds` (`(id, held, sequence)`) in
    /// the ledger's epoch, as a replica that knew epoch `known` (0: none) with recovery period
    /// `recovery` ([`REGISTER`](crate::scripts::REGISTER)).
    pub(crate) async fn register(
        &self,
        lease: Duration,
        known: u64,
        recovery: Duration,
        holds: &[(String, u64, u64)],
    ) -> Result<Registered, StoreError> {
        let values = hold_values(holds);
        let (lease, known, recovery) = (
            millis(lease).to_string(),
            known.to_string(),
            millis(recovery).to_string(),
        );
        let mut args: Vec<&str> = vec![&lease, &known, &recovery];
        for ((id, _, _), value) in holds.iter().zip(&values) {
            args.push(id);
            args.push(value);
        }
        let reply = self.run(&self.scripts.register, &args).await?;
        Ok(Registered {
            added: unsigned(&reply, 0),
            epoch: unsigned(&reply, 2),
            recovering: Duration::from_millis(unsigned(&reply, 3)),
        })
    }

    /// Removes the replica, its holds and its slice; the tokens freed.
    pub(crate) async fn leave(&self) -> Result<u64, StoreError> {
        let reply = self.run(&self.scripts.leave, &[]).await?;
        Ok(unsigned(&reply, 0))
    }

    /// One rebalance ([`PLAN`](crate::scripts::PLAN)): `ask` says what the replica wants,
    /// holds in flight and has installed, and which epoch it knew.
    pub(crate) async fn plan(&self, ask: &PlanAsk) -> Result<Plan, StoreError> {
        let reply = self
            .run(
                &self.scripts.plan,
                &[
                    &ask.want.to_string(),
                    &ask.floor.to_string(),
                    &ask.budget.to_string(),
                    &millis(ask.lease).to_string(),
                    &millis(ask.renew_every).to_string(),
                    &ask.known.to_string(),
                    &millis(ask.recovery).to_string(),
                    &ask.installed.to_string(),
                ],
            )
            .await?;
        Ok(Plan {
            slice: unsigned(&reply, 0),
            target: unsigned(&reply, 1),
            total: unsigned(&reply, 2),
            replicas: unsigned(&reply, 3),
            lost: reply.get(4) == Some(&1),
            epoch: unsigned(&reply, 5),
            recovering: Duration::from_millis(unsigned(&reply, 6)),
        })
    }

    /// Lowers the slice to `value` (never raises it); the slice now.
    pub(crate) async fn shrink(&self, value: u64) -> Result<u64, StoreError> {
        let reply = self
            .run(&self.scripts.shrink, &[&value.to_string()])
            .await?;
        Ok(unsigned(&reply, 0))
    }

    pub(crate) async fn snapshot(&self) -> Result<GlobalSnapshot, StoreError> {
        let reply = self.run(&self.scripts.snapshot, &[]).await?;
        Ok(GlobalSnapshot {
            in_flight_tokens: unsigned(&reply, 0),
            replicas: unsigned(&reply, 1),
            leased_replicas: unsigned(&reply, 2),
        })
    }

    /// One `PING` round trip (what the benches compare a reservation with).
    pub(crate) async fn ping(&self) -> Result<(), StoreError> {
        let mut connection = self.connection.clone();
        let ping = redis::cmd("PING");
        tokio::time::timeout(self.timeout, ping.query_async::<String>(&mut connection))
            .await
            .map_err(|_| StoreError::Timeout(self.timeout))?
            .map_err(StoreError::Redis)?;
        Ok(())
    }
}

fn millis(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// Field `i` of a script's reply, as the non-negative integer the scripts return.
fn unsigned(reply: &[i64], i: usize) -> u64 {
    reply.get(i).map_or(0, |&v| u64::try_from(v).unwrap_or(0))
}
