//! The connection to Redis and one typed call per script, each bounded by the ledger's
//! timeout: what the exact and leased modes build on.

use std::time::Duration;

use redis::aio::ConnectionManager;

use async_bulkhead_llm::LlmBulkhead;

use crate::config::LedgerConfig;
use crate::error::{ConfigError, LedgerError, StoreError};
use crate::scripts::Scripts;

/// The outcome of a reservation in the global ledger.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Reserved {
    /// Reserved; the global total after it.
    Yes { total: u64 },
    /// Refused: the total and the budget it was judged against.
    No { total: u64, budget: u64 },
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

/// What a `PLAN` call granted.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Plan {
    pub(crate) slice: u64,
    pub(crate) target: u64,
    pub(crate) total: u64,
    pub(crate) replicas: u64,
    pub(crate) lost: bool,
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

/// One replica's handle on one ledger.
#[derive(Clone)]
pub(crate) struct Store {
    connection: ConnectionManager,
    scripts: std::sync::Arc<Scripts>,
    namespace: String,
    replica: String,
    keys: [String; 5],
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
            &config.url,
            &config.namespace,
            &config.replica_id,
            config.timeout,
        )
        .await?;
        Ok(store)
    }

    async fn connect(
        url: &str,
        namespace: &str,
        replica: &str,
        timeout: Duration,
    ) -> Result<Store, StoreError> {
        let client = redis::Client::open(url).map_err(StoreError::Redis)?;
        let config = redis::aio::ConnectionManagerConfig::new()
            .set_connection_timeout(Some(timeout))
            .set_response_timeout(Some(timeout))
            .set_number_of_retries(1);
        let connection = tokio::time::timeout(
            timeout * 4,
            client.get_connection_manager_with_config(config),
        )
        .await
        .map_err(|_| StoreError::Timeout(timeout * 4))?
        .map_err(StoreError::Redis)?;
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
            ],
            timeout,
        })
    }

    pub(crate) fn replica(&self) -> &str {
        &self.replica
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

    /// Reserves `tokens` for `id`, releasing the holds of `riders` first.
    pub(crate) async fn reserve(
        &self,
        id: &str,
        tokens: u64,
        budget: u64,
        lease: Duration,
        riders: &[String],
    ) -> Result<Option<Reserved>, StoreError> {
        let (tokens, budget, lease) = (
            tokens.to_string(),
            budget.to_string(),
            millis(lease).to_string(),
        );
        let mut args: Vec<&str> = vec![id, &tokens, &budget, &lease];
        args.extend(riders.iter().map(String::as_str));
        let reply = self.run(&self.scripts.reserve, &args).await?;
        Ok(match reply.first() {
            Some(1) => Some(Reserved::Yes {
                total: unsigned(&reply, 1),
            }),
            Some(0) => Some(Reserved::No {
                total: unsigned(&reply, 1),
                budget: unsigned(&reply, 2),
            }),
            // The id already holds: the caller's ids are unique, so this never happens.
            _ => None,
        })
    }

    pub(crate) async fn usage(
        &self,
        id: &str,
        sequence: u64,
        held: u64,
    ) -> Result<Moved, StoreError> {
        let reply = self
            .run(
                &self.scripts.usage,
                &[id, &sequence.to_string(), &held.to_string()],
            )
            .await?;
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

    /// Renews the lease; `true` when it had lapsed (the replica's holds were purged).
    pub(crate) async fn renew(&self, lease: Duration) -> Result<bool, StoreError> {
        let reply = self
            .run(&self.scripts.renew, &[&millis(lease).to_string()])
            .await?;
        Ok(reply.first() == Some(&1))
    }

    /// Removes the replica, its holds and its slice; the tokens freed.
    pub(crate) async fn leave(&self) -> Result<u64, StoreError> {
        let reply = self.run(&self.scripts.leave, &[]).await?;
        Ok(unsigned(&reply, 0))
    }

    pub(crate) async fn plan(
        &self,
        want: u64,
        floor: u64,
        budget: u64,
        lease: Duration,
    ) -> Result<Plan, StoreError> {
        let reply = self
            .run(
                &self.scripts.plan,
                &[
                    &want.to_string(),
                    &floor.to_string(),
                    &budget.to_string(),
                    &millis(lease).to_string(),
                ],
            )
            .await?;
        Ok(Plan {
            slice: unsigned(&reply, 0),
            target: unsigned(&reply, 1),
            total: unsigned(&reply, 2),
            replicas: unsigned(&reply, 3),
            lost: reply.get(4) == Some(&1),
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
