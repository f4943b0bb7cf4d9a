//! The reference model's limits: `apply_limits` with its validation (design §U8.2, with
//! classes §U6.1 step 3) and `set_budget` (§U8.4).

use async_bulkhead_llm::{
    classes::ClassField, classes::ClassLimitsError, limits::LimitsError, limits::MAX_BUDGET,
    limits::MAX_CONCURRENT, limits::MAX_REVISION,
};

use super::rate::check_rate;
use super::state::Model;
use super::values::{ClassCaps, ClassTable, LimitsOutcome, ModelLimits, Snapshot};

impl Model {
    /// `apply_limits` (design §U8.2): the revision bound first, then staleness without
    /// examining the rest, then the rest (the word's bounds and the budget's presence fixed at
    /// construction, crate limits.rs `validate`; then the classes: present iff built with
    /// them, exactly the construction ids, each class as in design §U6.1 step 3 in the
    /// snapshot's order, the floor sums against the new limits). Installed in construction
    /// order, floors of 0 omitted (design §U6.1, §U8.1).
    pub(crate) fn apply_limits(&mut self, next: &Snapshot) -> Result<LimitsOutcome, LimitsError> {
        let outcome = self.apply_snapshot(next);
        self.last_limits_error = outcome.as_ref().err().cloned();
        outcome
    }

    fn apply_snapshot(&mut self, next: &Snapshot) -> Result<LimitsOutcome, LimitsError> {
        if next.revision > MAX_REVISION {
            self.note("limits refused");
            return Err(LimitsError::RevisionTooLarge {
                value: next.revision,
                max: MAX_REVISION,
            });
        }
        if next.revision <= self.limits.revision {
            self.note("stale limits");
            return Ok(LimitsOutcome::Stale {
                current: self.limits,
            });
        }
        let installed = match self.validate(next) {
            Ok(installed) => installed,
            Err(error) => {
                self.note("limits refused");
                let class_error = match &error {
                    LimitsError::AdmissionClassesRequired => "class limits refused: required",
                    LimitsError::AdmissionClassesNotConfigured => {
                        "class limits refused: not configured"
                    }
                    LimitsError::ClassIdsMismatch => "class limits refused: ids mismatch",
                    LimitsError::Class(ClassLimitsError::TooLarge { .. }) => {
                        "class limits refused: too large"
                    }
                    LimitsError::Class(ClassLimitsError::ProtectedAboveMax { .. }) => {
                        "class limits refused: floor above ceiling"
                    }
                    LimitsError::Class(ClassLimitsError::TokensWithoutBudget { .. }) => {
                        "class limits refused: tokens without a budget"
                    }
                    LimitsError::ProtectedConcurrentSumTooLarge { .. } => {
                        "class limits refused: floor sum"
                    }
                    LimitsError::ProtectedTokensSumTooLarge { .. } => {
                        "class limits refused: token floor sum"
                    }
                    LimitsError::Class(ClassLimitsError::Rate { .. }) => {
                        "class limits refused: rate"
                    }
                    LimitsError::RateLimitsRequired
                    | LimitsError::RateLimitsNotConfigured
                    | LimitsError::RateWindowOutOfRange { .. }
                    | LimitsError::RateLimitsEmpty
                    | LimitsError::RateTokensNeedBudget
                    | LimitsError::RateLimitTooHigh { .. } => {
                        self.note("rate limits refused");
                        ""
                    }
                    _ => "",
                };
                if !class_error.is_empty() {
                    self.note("class limits refused");
                    self.note(class_error);
                }
                return Err(error);
            }
        };
        self.note("limits applied");
        if installed.classes != self.limits.classes {
            self.note("class limits changed");
            if self.slots > 0 {
                self.note("class limits changed under calls in flight");
            }
        }
        let previous = self.install(installed);
        Ok(LimitsOutcome::Applied {
            previous,
            current: installed,
        })
    }

    /// Checks a snapshot (see `apply_limits`) and answers the limits it installs.
    fn validate(&self, next: &Snapshot) -> Result<ModelLimits, LimitsError> {
        if next.max_concurrent > MAX_CONCURRENT {
            return Err(LimitsError::MaxConcurrentTooLarge {
                value: next.max_concurrent,
                max: MAX_CONCURRENT,
            });
        }
        match (self.has_budget, next.budget) {
            (true, None) => return Err(LimitsError::TokenBudgetRequired),
            (false, Some(_)) => return Err(LimitsError::TokenBudgetNotConfigured),
            (true, Some((budget, _))) if budget > MAX_BUDGET => {
                return Err(LimitsError::BudgetTooLarge {
                    value: budget,
                    max: MAX_BUDGET,
                });
            }
            _ => {}
        }
        // Rate limits after the budget, before the classes (crate engine/limits.rs `validate`):
        // required iff the bulkhead was built with them, and valid.
        match (self.limits.rate.is_some(), next.rate) {
            (true, None) => return Err(LimitsError::RateLimitsRequired),
            (false, Some(_)) => return Err(LimitsError::RateLimitsNotConfigured),
            (_, Some(rate)) => check_rate(rate, self.has_budget)?,
            (false, None) => {}
        }
        let classes = match (self.limits.classes, &next.classes) {
            (None, None) => None,
            (Some(_), None) => return Err(LimitsError::AdmissionClassesRequired),
            (None, Some(_)) => return Err(LimitsError::AdmissionClassesNotConfigured),
            (Some(built), Some(given)) => {
                let find = |id: &str| given.iter().find(|(have, _)| *have == id);
                if given.len() != built.len || built.iter().any(|(id, _)| find(id).is_none()) {
                    return Err(LimitsError::ClassIdsMismatch);
                }
                for (id, caps) in given {
                    check_class(id, caps, self.has_budget, self.windows.is_some())
                        .map_err(LimitsError::Class)?;
                }
                let (slots, tokens) = given.iter().fold((0u64, 0u64), |(s, t), (_, caps)| {
                    (s + caps.floor(), t + caps.token_floor())
                });
                if slots > u64::from(next.max_concurrent) {
                    return Err(LimitsError::ProtectedConcurrentSumTooLarge {
                        sum: slots,
                        max_concurrent: next.max_concurrent,
                    });
                }
                if let Some((budget, _)) = next.budget
                    && tokens > budget
                {
                    return Err(LimitsError::ProtectedTokensSumTooLarge {
                        sum: tokens,
                        budget,
                    });
                }
                let ordered: Vec<_> = built
                    .iter()
                    .map(|&(id, _)| (id, find(id).expect("checked").1.normalized()))
                    .collect();
                Some(ClassTable::new(&ordered))
            }
        };
        Ok(ModelLimits {
            revision: next.revision,
            max_concurrent: next.max_concurrent,
            max_queue: next.max_queue,
            budget: next.budget,
            classes,
            rate: next.rate,
        })
    }

    /// `set_budget` (design §U8.4): the budget only, at the next revision, keeping the
    /// reserve.
    pub(crate) fn set_budget(&mut self, tokens: u64) -> Result<ModelLimits, LimitsError> {
        let outcome = self.set_budget_to(tokens);
        self.last_limits_error = outcome.as_ref().err().cloned();
        outcome
    }

    fn set_budget_to(&mut self, tokens: u64) -> Result<ModelLimits, LimitsError> {
        let Some((_, reserve)) = self.limits.budget else {
            return Err(LimitsError::TokenBudgetNotConfigured);
        };
        if self.limits.revision >= MAX_REVISION {
            self.note("limits refused");
            return Err(LimitsError::RevisionExhausted {
                current: self.limits.revision,
            });
        }
        if tokens > MAX_BUDGET {
            self.note("limits refused");
            return Err(LimitsError::BudgetTooLarge {
                value: tokens,
                max: MAX_BUDGET,
            });
        }
        // Not below the classes' token floors (design §U8.4).
        let (_, floors) = self.floor_sums();
        if floors > tokens {
            self.note("budget below the token floors refused");
            return Err(LimitsError::ProtectedTokensSumTooLarge {
                sum: floors,
                budget: tokens,
            });
        }
        let next = ModelLimits {
            revision: self.limits.revision + 1,
            budget: Some((tokens, reserve)),
            ..self.limits
        };
        self.note("budget set");
        self.install(next);
        Ok(next)
    }
}

/// One class's limits (design §U6.1 step 3): each value within what the engine counts, each
/// floor at most its ceiling (slots, then tokens), token limits only with a budget (floor
/// first).
pub(crate) fn check_class(
    id: &str,
    caps: &ClassCaps,
    has_budget: bool,
    has_windows: bool,
) -> Result<(), ClassLimitsError> {
    let class = id.to_owned();
    let slots = u64::from(MAX_CONCURRENT);
    for (field, value, max) in [
        (
            ClassField::ProtectedConcurrent,
            caps.protected_concurrent.map(u64::from),
            slots,
        ),
        (
            ClassField::MaxConcurrent,
            caps.max_concurrent.map(u64::from),
            slots,
        ),
        (
            ClassField::ProtectedInFlightTokens,
            caps.protected_tokens,
            MAX_BUDGET,
        ),
        (ClassField::MaxInFlightTokens, caps.max_tokens, MAX_BUDGET),
    ] {
        if let Some(value) = value
            && value > max
        {
            return Err(ClassLimitsError::TooLarge {
                class,
                field,
                value,
                max,
            });
        }
    }
    if let Some(max) = caps.max_concurrent.map(u64::from)
        && caps.floor() > max
    {
        return Err(ClassLimitsError::ProtectedAboveMax {
            class,
            field: ClassField::ProtectedConcurrent,
            protected: caps.floor(),
            max,
        });
    }
    if let Some(max) = caps.max_tokens
        && caps.token_floor() > max
    {
        return Err(ClassLimitsError::ProtectedAboveMax {
            class,
            field: ClassField::ProtectedInFlightTokens,
            protected: caps.token_floor(),
            max,
        });
    }
    if !has_budget {
        if caps.protected_tokens.is_some() {
            return Err(ClassLimitsError::TokensWithoutBudget {
                class,
                field: ClassField::ProtectedInFlightTokens,
            });
        }
        if caps.max_tokens.is_some() {
            return Err(ClassLimitsError::TokensWithoutBudget {
                class,
                field: ClassField::MaxInFlightTokens,
            });
        }
    }
    // Its rate limits last: only on a bulkhead that keeps windows (always at build, where
    // they make them), checked as the bulkhead's are (crate engine/limits.rs
    // `validate_class`).
    if let Some(rate) = caps.rate {
        let refused = |error| ClassLimitsError::Rate {
            class: id.to_owned(),
            error: Box::new(error),
        };
        if !has_windows {
            return Err(refused(LimitsError::RateLimitsNotConfigured));
        }
        check_rate(rate, has_budget).map_err(refused)?;
    }
    Ok(())
}
