//! The connection the ledger's scripts run on: one Redis server (a [`ConnectionManager`]) or a
//! Redis Cluster (a [`ClusterConnection`]), opened within the ledger's timeout and used
//! through [`redis::aio::ConnectionLike`], so that everything above it is the same for both.

use std::time::Duration;

use redis::aio::{ConnectionLike, ConnectionManager};
use redis::cluster_async::ClusterConnection;
use redis::cluster_routing::{Route, RoutingInfo, SingleNodeRoutingInfo, SlotAddr};
use redis::{Cmd, Pipeline, RedisFuture, Value};

use crate::config::Endpoint;
use crate::error::StoreError;

/// A connection to the ledger's Redis; cloning shares it.
#[derive(Clone)]
pub(crate) enum Connection {
    /// One server: reconnects by itself after a failure.
    Single(ConnectionManager),
    /// A cluster: commands go to the master of their key's slot. No command is ever sent
    /// twice by the client (a script whose connection dropped after it ran would otherwise run
    /// again: a reservation twice); a call the cluster refused without running it because the
    /// slot moved (a failover, a resharding) is sent again, to the new master (or, asked
    /// with `ASK`, to the master importing the slot), within the ledger's timeout.
    Cluster {
        connection: ClusterConnection,
        /// The master of the namespace's slot: where a bare `PING` goes, so that it measures
        /// the round trip the scripts make (a cluster would otherwise send it to every node).
        home: Route,
        /// The ledger's timeout: how long a refused call is tried again.
        patience: Duration,
    },
}

impl Connection {
    /// Connects to `endpoint`: every connection attempt and every answer bounded by
    /// `timeout`, the whole opening by four times it. `namespace` (its hash tag) places the
    /// ledger's keys on a cluster.
    pub(crate) async fn open(
        endpoint: &Endpoint,
        namespace: &str,
        timeout: Duration,
    ) -> Result<Connection, StoreError> {
        let opening = async {
            match endpoint {
                Endpoint::Single(url) => {
                    let client = redis::Client::open(url.as_str())?;
                    let config = redis::aio::ConnectionManagerConfig::new()
                        .set_connection_timeout(Some(timeout))
                        .set_response_timeout(Some(timeout))
                        .set_number_of_retries(1);
                    let manager = client.get_connection_manager_with_config(config).await?;
                    Ok(Connection::Single(manager))
                }
                Endpoint::Cluster(nodes) => {
                    // No retry by the client (see `Connection::Cluster`): an error fails the
                    // call, and a redirection or a failed node also refreshes the slot map.
                    let client =
                        redis::cluster::ClusterClient::builder(nodes.iter().map(String::as_str))
                            .connection_timeout(timeout)
                            .response_timeout(timeout)
                            .retries(0)
                            .build()?;
                    let connection = client.get_async_connection().await?;
                    Ok(Connection::Cluster {
                        connection,
                        home: Route::with_key(namespace, SlotAddr::Master),
                        patience: timeout,
                    })
                }
            }
        };
        tokio::time::timeout(timeout * 4, opening)
            .await
            .map_err(|_| StoreError::Timeout(timeout * 4))?
            .map_err(StoreError::Redis)
    }
}

/// Whether `cmd` is a `PING` without a message.
fn is_bare_ping(cmd: &Cmd) -> bool {
    let mut args = cmd.args_iter();
    args.len() == 1
        && matches!(args.next(), Some(redis::Arg::Simple(name)) if name.eq_ignore_ascii_case(b"PING"))
}

/// Whether the cluster refused `error`'s command without running it because its slot is
/// served elsewhere now, or for a moment by no one: `MOVED` (the slot map is being refreshed),
/// `TRYAGAIN` (a slot being migrated), `READONLY` (a master just demoted).
fn refused_unrun(error: &redis::RedisError) -> bool {
    use redis::{ErrorKind, ServerErrorKind};
    matches!(
        error.kind(),
        ErrorKind::Server(
            ServerErrorKind::Moved | ServerErrorKind::TryAgain | ServerErrorKind::ReadOnly
        )
    )
}

/// The node an `ASK` refusal names: while a slot is being migrated, its old master runs a
/// command only if every key it names is still there; otherwise it refuses it unrun with
/// `ASK <slot> <host>:<port>`, the node importing the slot, which runs it once asked
/// (`ASKING`, for the next command of that connection only). `None` for any other error.
fn ask_target(error: &redis::RedisError) -> Option<SingleNodeRoutingInfo> {
    use redis::{ErrorKind, ServerErrorKind};
    if error.kind() != ErrorKind::Server(ServerErrorKind::Ask) {
        return None;
    }
    let (address, _slot) = error.redirect_node()?;
    let (host, port) = address.rsplit_once(':')?;
    Some(SingleNodeRoutingInfo::ByAddress {
        host: host.to_owned(),
        port: port.parse().ok()?,
    })
}

/// Sends `cmd` to the cluster. While it is [`refused_unrun`], again (after 2 ms, doubling up
/// to 50 ms) until `patience` has passed; refused with `ASK` ([`ask_target`]), at once to the
/// node it names, after `ASKING` in one pipeline (nothing else can run on that connection
/// between them).
async fn send(
    connection: &mut ClusterConnection,
    cmd: &Cmd,
    patience: Duration,
) -> redis::RedisResult<Value> {
    let deadline = tokio::time::Instant::now() + patience;
    let mut pause = Duration::from_millis(2);
    let mut redirect = None;
    loop {
        let reply = match redirect.take() {
            None => connection.req_packed_command(cmd).await,
            Some(node) => {
                let mut asked = redis::pipe();
                asked.cmd("ASKING").add_command(cmd.clone());
                connection
                    .route_pipeline(asked, 1, 1, node)
                    .await
                    .and_then(|mut replies| {
                        // A refusal comes back as a value in a pipeline's replies: as an error,
                        // so that what follows (a script's `NOSCRIPT`, another refusal) is
                        // handled as for any command.
                        replies.pop().map_or_else(
                            || {
                                Err(redis::RedisError::from((
                                    redis::ErrorKind::Client,
                                    "no reply to an ASK redirection",
                                )))
                            },
                            Value::extract_error,
                        )
                    })
            }
        };
        let Err(error) = reply else {
            return reply;
        };
        let now = tokio::time::Instant::now();
        if now < deadline
            && let Some(node) = ask_target(&error)
        {
            redirect = Some(node);
        } else if refused_unrun(&error) && now + pause < deadline {
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(50));
        } else {
            return Err(error);
        }
    }
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(connection) => connection.req_packed_command(cmd),
            Connection::Cluster {
                connection,
                home,
                patience,
            } => {
                if is_bare_ping(cmd) {
                    let node = SingleNodeRoutingInfo::SpecificNode(*home);
                    Box::pin(connection.route_command(cmd.clone(), RoutingInfo::SingleNode(node)))
                } else {
                    Box::pin(send(connection, cmd, *patience))
                }
            }
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(connection) => {
                connection.req_packed_commands(pipeline, offset, count)
            }
            Connection::Cluster { connection, .. } => {
                connection.req_packed_commands(pipeline, offset, count)
            }
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(connection) => connection.get_db(),
            Connection::Cluster { connection, .. } => connection.get_db(),
        }
    }
}
