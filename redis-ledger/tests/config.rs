//! Bad configuration is a typed error, found before anything connects or changes.

use std::time::Duration;

use async_bulkhead_llm::{LlmBulkhead, TokenBudget, limits::MAX_BUDGET};
use async_bulkhead_llm_redis::{ConfigError, ExactLedger, LeasedLedger, LedgerConfig, LedgerError};

/// Nothing listens on port 1: a configuration error must come before any connection.
const NOWHERE: &str = "redis://127.0.0.1:1/";

#[test]
fn each_rule_is_its_own_error_in_order() {
    let base = || LedgerConfig::new(NOWHERE, "{ns}", 1_000).replica_id("a");
    assert_eq!(base().validate(), Ok(()));
    assert_eq!(
        LedgerConfig::new(NOWHERE, "", 0).validate(),
        Err(ConfigError::ZeroBudget),
        "the budget is checked first"
    );
    assert_eq!(
        LedgerConfig::new(NOWHERE, "{ns}", MAX_BUDGET + 1).validate(),
        Err(ConfigError::BudgetTooLarge {
            value: MAX_BUDGET + 1,
            max: MAX_BUDGET
        })
    );
    assert_eq!(
        LedgerConfig::new(NOWHERE, "", 1_000).validate(),
        Err(ConfigError::EmptyNamespace)
    );
    for bad in ["", "a b", "a|b"] {
        assert_eq!(
            base().replica_id(bad).validate(),
            Err(ConfigError::BadReplicaId(bad.into()))
        );
    }
    assert_eq!(
        base().timeout(Duration::ZERO).validate(),
        Err(ConfigError::ZeroTimeout)
    );
    assert_eq!(
        base()
            .lease(Duration::from_secs(1))
            .renew_every(Duration::from_millis(400))
            .validate(),
        Err(ConfigError::LeaseTooShort {
            lease: Duration::from_secs(1),
            renew_every: Duration::from_millis(400)
        })
    );
    assert_eq!(
        base().lease(Duration::from_millis(99)).validate(),
        Err(ConfigError::LeaseTooShort {
            lease: Duration::from_millis(99),
            renew_every: Duration::from_millis(33)
        })
    );
    // The default id is usable as it is.
    assert_eq!(LedgerConfig::new(NOWHERE, "{ns}", 1).validate(), Ok(()));
}

#[tokio::test]
async fn a_bulkhead_without_a_token_budget_is_refused_before_connecting() {
    let bulkhead = LlmBulkhead::builder("m", 4).build().unwrap();
    let config = LedgerConfig::new(NOWHERE, "{ns}", 1_000).replica_id("a");
    let exact = ExactLedger::connect(bulkhead.clone(), config.clone()).await;
    assert!(matches!(
        exact,
        Err(LedgerError::Config(ConfigError::NoTokenBudget))
    ));
    let leased = LeasedLedger::start(bulkhead, config).await;
    assert!(matches!(
        leased,
        Err(LedgerError::Config(ConfigError::NoTokenBudget))
    ));
}

#[tokio::test]
async fn an_invalid_config_changes_nothing_on_the_bulkhead() {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(5_000))
        .build()
        .unwrap();
    let config = LedgerConfig::new(NOWHERE, "{ns}", 0);
    let leased = LeasedLedger::start(bulkhead.clone(), config).await;
    assert!(matches!(
        leased,
        Err(LedgerError::Config(ConfigError::ZeroBudget))
    ));
    let limits = bulkhead.limits();
    assert_eq!(
        (limits.revision, limits.token_budget.unwrap().budget),
        (0, 5_000)
    );
}

#[test]
fn a_cluster_namespace_needs_a_hash_tag_and_the_cluster_a_node() {
    let nodes = [NOWHERE, "redis://127.0.0.1:2/"];
    let cluster = |ns: &str| LedgerConfig::cluster(nodes, ns, 1_000).replica_id("a");
    for tagged in ["{ns}", "{gpt-4o}:eu", "eu:{gpt-4o}", "a}{b}", "{a}{}"] {
        assert_eq!(cluster(tagged).validate(), Ok(()), "{tagged}");
    }
    // As Redis Cluster reads a tag: the first `{`, the first `}` after it, not empty; a tag
    // left open in the namespace would be closed by each key's own suffix.
    for untagged in ["ns", "{}", "{}{ns}", "{ns", "ns}", "}{"] {
        let refused = cluster(untagged).validate();
        assert_eq!(
            refused,
            Err(ConfigError::NamespaceWithoutHashTag(untagged.into())),
            "{untagged}"
        );
        // One server takes any namespace.
        assert_eq!(
            LedgerConfig::new(NOWHERE, untagged, 1_000).validate(),
            Ok(())
        );
    }
    assert_eq!(
        ConfigError::NamespaceWithoutHashTag("ns".into()).to_string(),
        "namespace \"ns\" has no hash tag: on a Redis Cluster it must contain a non-empty {tag} \
         (such as \"{gpt-4o}\") so that every key of the ledger lives in one slot"
    );
    // In order: the budget, then the namespace (empty, then no node, then no tag), then the id.
    assert_eq!(
        LedgerConfig::cluster(nodes, "ns", 0).validate(),
        Err(ConfigError::ZeroBudget)
    );
    assert_eq!(
        LedgerConfig::cluster(nodes, "", 1_000).validate(),
        Err(ConfigError::EmptyNamespace)
    );
    assert_eq!(
        LedgerConfig::cluster(Vec::<String>::new(), "ns", 1_000).validate(),
        Err(ConfigError::NoClusterNodes)
    );
    assert_eq!(
        cluster("ns").replica_id("a b").validate(),
        Err(ConfigError::NamespaceWithoutHashTag("ns".into()))
    );
    assert!(cluster("{ns}").is_cluster());
    assert!(!LedgerConfig::new(NOWHERE, "{ns}", 1).is_cluster());
}

#[tokio::test]
async fn an_untagged_cluster_namespace_is_refused_before_connecting() {
    let bulkhead = LlmBulkhead::builder("m", 4)
        .token_budget(TokenBudget::new(5_000))
        .build()
        .unwrap();
    let config = LedgerConfig::cluster([NOWHERE], "gpt-4o", 1_000);
    let exact = ExactLedger::connect(bulkhead.clone(), config.clone()).await;
    assert!(matches!(
        exact,
        Err(LedgerError::Config(ConfigError::NamespaceWithoutHashTag(ns))) if ns == "gpt-4o"
    ));
    let leased = LeasedLedger::start(bulkhead, config).await;
    assert!(matches!(
        leased,
        Err(LedgerError::Config(ConfigError::NamespaceWithoutHashTag(ns))) if ns == "gpt-4o"
    ));
}
