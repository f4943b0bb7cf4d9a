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
