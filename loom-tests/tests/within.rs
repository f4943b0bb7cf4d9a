//! loom models of a tenant admitted within global limits (`try_acquire_within`): the tenant's
//! provisional admission racing a global refusal, another call of the same tenant, and a
//! global release. No level is ever over its limits, each level counts exactly the
//! admissions and refusals it made (a call refused globally is counted nowhere at the
//! tenant), every refusal names its level, and slots and tokens return exactly.
//!
//! Run: see `loom-tests/README.md`.
#![cfg(loom)]
// Results carrying a `Rejection` (its capacity snapshot by value) are large by design.
#![allow(clippy::result_large_err, clippy::large_enum_variant)]

use async_bulkhead_llm::rejection::Scope;
use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RejectReason, Reservation, TokenBudget,
};
use loom::sync::Arc;
use loom::sync::atomic::AtomicU64;
use loom::sync::atomic::Ordering::AcqRel;
use loom::thread;

fn with_tokens(input: u64, max_output: u64) -> AcquireOptions {
    AcquireOptions::new().reservation(Reservation::new(input, max_output).unwrap())
}

/// What one call of a model came to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Admitted,
    Refused(Scope, RejectReason),
}

/// Calls running at each level, checked against the limits at every admission.
struct Running {
    tenant: AtomicU64,
    global: AtomicU64,
}

impl Running {
    fn enter(&self, tenant_max: u64, global_max: u64) {
        let tenant = self.tenant.fetch_add(1, AcqRel) + 1;
        let global = self.global.fetch_add(1, AcqRel) + 1;
        assert!(
            tenant <= tenant_max,
            "{tenant} tenant calls, limit {tenant_max}"
        );
        assert!(
            global <= global_max,
            "{global} global calls, limit {global_max}"
        );
    }

    fn leave(&self) {
        self.tenant.fetch_sub(1, AcqRel);
        self.global.fetch_sub(1, AcqRel);
    }
}

/// One call of `tenant` within `global`, held for a moment if admitted.
fn call(tenant: &LlmBulkhead, global: &LlmBulkhead, running: &Running, tokens: u64) -> Outcome {
    match tenant.try_acquire_within(global, &LlmRequest::new(), with_tokens(0, tokens)) {
        Ok(permit) => {
            running.enter(1, 1);
            running.leave();
            drop(permit);
            Outcome::Admitted
        }
        Err(error) => {
            let rejection = error.rejection().expect("a capacity refusal");
            Outcome::Refused(
                rejection.scope().expect("a refusal within names its level"),
                rejection.reason(),
            )
        }
    }
}

fn assert_idle(bulkhead: &LlmBulkhead) {
    let stats = bulkhead.stats();
    assert_eq!(stats.in_flight, 0, "slots returned exactly");
    assert_eq!(
        stats.token_budget.unwrap().in_flight_tokens,
        0,
        "tokens returned exactly"
    );
    assert_eq!(stats.admitted, stats.released);
}

#[test]
fn a_tenant_admission_races_a_global_refusal_and_a_release() {
    loom::model(|| {
        // The global level has one slot, held by another tenant's call that the main thread
        // releases; two calls of one tenant (one slot, 1000 tokens) race for it.
        let global = LlmBulkhead::builder("m", 1)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let tenant = LlmBulkhead::builder("m", 1)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let other = LlmBulkhead::builder("m", 1)
            .token_budget(TokenBudget::new(1000))
            .build()
            .unwrap();
        let running = Arc::new(Running {
            tenant: AtomicU64::new(0),
            global: AtomicU64::new(1),
        });
        let held = other
            .try_acquire_within(&global, &LlmRequest::new(), with_tokens(0, 100))
            .unwrap();

        let racers: Vec<_> = [300u64, 200]
            .into_iter()
            .map(|tokens| {
                let (tenant, global, running) = (tenant.clone(), global.clone(), running.clone());
                thread::spawn(move || call(&tenant, &global, &running, tokens))
            })
            .collect();
        running.global.fetch_sub(1, AcqRel);
        drop(held);
        let outcomes: Vec<Outcome> = racers.into_iter().map(|t| t.join().unwrap()).collect();

        let count =
            |wanted: fn(&Outcome) -> bool| outcomes.iter().filter(|o| wanted(o)).count() as u64;
        let admitted = count(|o| *o == Outcome::Admitted);
        let tenant_refused = count(|o| matches!(o, Outcome::Refused(Scope::Tenant, _)));
        let global_refused = count(|o| matches!(o, Outcome::Refused(Scope::Global, _)));
        for outcome in &outcomes {
            if let Outcome::Refused(_, reason) = outcome {
                assert_eq!(*reason, RejectReason::ConcurrencyLimit, "{outcomes:?}");
            }
        }
        let (t, g) = (tenant.stats(), global.stats());
        assert_eq!(
            (t.admitted, t.rejected),
            (admitted, tenant_refused),
            "{outcomes:?}"
        );
        assert_eq!(
            (g.admitted, g.rejected),
            (admitted + 1, global_refused),
            "{outcomes:?}"
        );
        assert_eq!(
            t.token_budget.unwrap().total_reserved,
            match outcomes.as_slice() {
                [a, b] => [(a, 300), (b, 200)]
                    .iter()
                    .filter(|(o, _)| **o == Outcome::Admitted)
                    .map(|(_, tokens)| tokens)
                    .sum::<u64>(),
                _ => unreachable!(),
            }
        );
        assert_idle(&tenant);
        assert_idle(&global);
        assert_idle(&other);
    });
}
