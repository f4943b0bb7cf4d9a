//! Class configurations: random class limits (valid by construction) and invalid ones with
//! the error they must be refused with, and the book of every revision applied.

use std::sync::RwLock;

use async_bulkhead_llm::{
    Limits, Priority, classes::ClassField, classes::ClassLimits, classes::ClassLimitsError,
    classes::ClassLimitsTable, limits::LimitsError, limits::MAX_BUDGET, limits::MAX_CONCURRENT,
};

/// The limits of one revision, as the callers check decisions against them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Caps {
    pub(crate) max_concurrent: u32,
    pub(crate) budget: u64,
    pub(crate) reserve: u64,
    /// Normalized (floors of 0 omitted), in class order.
    pub(crate) classes: Vec<ClassLimits>,
}

impl Caps {
    pub(crate) fn of(limits: &Limits) -> Caps {
        let budget = limits.token_budget.expect("a token budget");
        Caps {
            max_concurrent: limits.max_concurrent,
            budget: budget.budget,
            reserve: budget.high_priority_reserve,
            classes: limits
                .admission_classes
                .as_ref()
                .expect("classes")
                .iter()
                .map(|(_, limits)| *limits)
                .collect(),
        }
    }

    pub(crate) fn floor(&self, class: usize) -> u64 {
        u64::from(self.classes[class].protected_concurrent.unwrap_or(0))
    }

    pub(crate) fn token_floor(&self, class: usize) -> u64 {
        self.classes[class].protected_in_flight_tokens.unwrap_or(0)
    }

    pub(crate) fn ceiling(&self, class: usize) -> Option<u64> {
        self.classes[class].max_concurrent.map(u64::from)
    }

    pub(crate) fn token_ceiling(&self, class: usize) -> Option<u64> {
        self.classes[class].max_in_flight_tokens
    }

    pub(crate) fn floors(&self) -> u64 {
        (0..self.classes.len()).map(|c| self.floor(c)).sum()
    }

    pub(crate) fn token_floors(&self) -> u64 {
        (0..self.classes.len()).map(|c| self.token_floor(c)).sum()
    }

    /// The shared pool of slots: `max_concurrent` minus the floors.
    pub(crate) fn shared_slots(&self) -> u64 {
        u64::from(self.max_concurrent).saturating_sub(self.floors())
    }

    /// The shared pool of tokens for a call of `priority`: `E(p)` minus the token floors.
    pub(crate) fn shared_tokens(&self, priority: Priority) -> u64 {
        let effective = match priority {
            Priority::High => self.budget,
            _ => self.budget.saturating_sub(self.reserve),
        };
        effective.saturating_sub(self.token_floors())
    }
}

/// Every revision applied so far, by revision (they are consecutive: only the control plane
/// changes the limits, each time to the next revision). A revision is recorded before it is
/// applied, so an admission or a refusal always finds the limits that decided it.
#[derive(Default)]
pub(crate) struct Revisions(RwLock<Vec<Caps>>);

impl Revisions {
    pub(crate) fn record(&self, revision: u64, caps: Caps) {
        let mut all = self.0.write().unwrap();
        assert_eq!(all.len() as u64, revision, "revisions are consecutive");
        all.push(caps);
    }

    /// The limits of `revision`, which must have been applied.
    pub(crate) fn get(&self, revision: u64) -> Caps {
        let all = self.0.read().unwrap();
        all.get(revision as usize)
            .unwrap_or_else(|| panic!("revision {revision} was never applied ({})", all.len()))
            .clone()
    }

    /// The largest value of `f` over the revisions from `since` on (`None` if any is `None`:
    /// unbounded). Read after the fact, it covers every revision in force since `since`.
    pub(crate) fn max_since(&self, since: u64, f: impl Fn(&Caps) -> Option<u64>) -> Option<u64> {
        let all = self.0.read().unwrap();
        all[since as usize..]
            .iter()
            .try_fold(0, |max, caps| f(caps).map(|v| v.max(max)))
    }
}

/// Floors of 0 omitted, as the bulkhead reports limits.
pub(crate) fn normalize(mut limits: ClassLimits) -> ClassLimits {
    limits.protected_concurrent = limits.protected_concurrent.filter(|&n| n > 0);
    limits.protected_in_flight_tokens = limits.protected_in_flight_tokens.filter(|&n| n > 0);
    limits
}

/// A floor of `n`: omitted or explicit when 0.
fn floor_of<T: Copy + Default + PartialEq>(rng: &mut fastrand::Rng, n: T) -> Option<T> {
    (n != T::default() || rng.bool()).then_some(n)
}

/// Random limits for `n` classes, valid under `max_concurrent` and `budget`: floors summing to
/// at most those (often some slots and tokens left shared, often classes without a floor; a
/// third of the time no slot floor at all, so that nothing is protected and a full bulkhead
/// queues), ceilings at or above the floors or none.
pub(crate) fn random_classes(
    rng: &mut fastrand::Rng,
    n: usize,
    max_concurrent: u32,
    budget: u64,
) -> Vec<ClassLimits> {
    let slot_floors = rng.u8(0..3) != 0;
    let (mut slots, mut tokens) = (if slot_floors { max_concurrent } else { 0 }, budget);
    let mut order: Vec<usize> = (0..n).collect();
    rng.shuffle(&mut order);
    let mut classes = vec![ClassLimits::new(); n];
    for c in order {
        let floor = match rng.u8(0..3) {
            0 => 0,
            _ => rng.u32(0..=slots.min(3)),
        };
        slots -= floor;
        let token_floor = match rng.u8(0..3) {
            0 => 0,
            _ => rng.u64(0..=tokens.min(budget / 2)),
        };
        tokens -= token_floor;
        let limits = &mut classes[c];
        limits.protected_concurrent = floor_of(rng, floor);
        // A ceiling at the floor (0 too: a class refusing everything) only now and then.
        limits.max_concurrent = match rng.u8(0..8) {
            0 | 1 => None,
            2 => Some(floor),
            _ => Some(floor + rng.u32(1..=4)),
        };
        limits.protected_in_flight_tokens = floor_of(rng, token_floor);
        limits.max_in_flight_tokens = (rng.u8(0..4) != 0).then(|| token_floor + rng.u64(0..=2_000));
    }
    classes
}

/// The table of `classes` under `ids`, its entries in a random order (the bulkhead keeps its
/// own order).
pub(crate) fn table(
    rng: &mut fastrand::Rng,
    ids: &[&str],
    classes: &[ClassLimits],
) -> ClassLimitsTable {
    let mut order: Vec<usize> = (0..ids.len()).collect();
    rng.shuffle(&mut order);
    order.into_iter().fold(ClassLimitsTable::new(), |table, c| {
        table.with(ids[c], classes[c])
    })
}

/// The class table of `limits` in class order (normalized).
pub(crate) fn normalized_table(ids: &[&str], classes: &[ClassLimits]) -> ClassLimitsTable {
    ids.iter()
        .zip(classes)
        .fold(ClassLimitsTable::new(), |table, (id, limits)| {
            table.with(*id, normalize(*limits))
        })
}

/// A snapshot one revision after `before` that must be refused whole, and its error.
pub(crate) fn invalid_snapshot(
    rng: &mut fastrand::Rng,
    before: &Limits,
    ids: &[&str],
) -> (Limits, LimitsError) {
    let caps = Caps::of(before);
    let mut classes = caps.classes.clone();
    let c = rng.usize(0..ids.len());
    let class = ids[c].to_owned();
    let mut next = before.clone();
    next.revision += 1;
    let error = match rng.u8(0..8) {
        0 => {
            next.admission_classes = None;
            return (next, LimitsError::AdmissionClassesRequired);
        }
        1 => {
            // A class missing, one too many, or one renamed.
            let mut table = ClassLimitsTable::new();
            for (i, id) in ids.iter().enumerate() {
                if i != c {
                    table.insert(*id, classes[i]);
                }
            }
            match rng.u8(0..3) {
                0 => {}
                1 => {
                    table.insert(ids[c], classes[c]);
                    table.insert("ghost", ClassLimits::new());
                }
                _ => {
                    table.insert(format!("{}-renamed", ids[c]), classes[c]);
                }
            }
            next.admission_classes = Some(table);
            return (next, LimitsError::ClassIdsMismatch);
        }
        2 => {
            let max = rng.u32(0..3);
            let protected = max + 1 + rng.u32(0..3);
            classes[c] = classes[c]
                .protected_concurrent(protected)
                .max_concurrent(max);
            LimitsError::Class(ClassLimitsError::ProtectedAboveMax {
                class,
                field: ClassField::ProtectedConcurrent,
                protected: u64::from(protected),
                max: u64::from(max),
            })
        }
        3 => {
            let max = rng.u64(0..500);
            let protected = max + 1 + rng.u64(0..500);
            classes[c] = classes[c]
                .protected_in_flight_tokens(protected)
                .max_in_flight_tokens(max);
            LimitsError::Class(ClassLimitsError::ProtectedAboveMax {
                class,
                field: ClassField::ProtectedInFlightTokens,
                protected,
                max,
            })
        }
        4 => {
            let value = MAX_CONCURRENT + 1 + rng.u32(0..10);
            classes[c] = classes[c].max_concurrent(value);
            LimitsError::Class(ClassLimitsError::TooLarge {
                class,
                field: ClassField::MaxConcurrent,
                value: u64::from(value),
                max: u64::from(MAX_CONCURRENT),
            })
        }
        5 => {
            let value = MAX_BUDGET + 1 + rng.u64(0..10);
            classes[c] = classes[c].max_in_flight_tokens(value);
            LimitsError::Class(ClassLimitsError::TooLarge {
                class,
                field: ClassField::MaxInFlightTokens,
                value,
                max: MAX_BUDGET,
            })
        }
        6 => {
            // Floors one or more slots above `max_concurrent`.
            let others = caps.floors() - caps.floor(c);
            let floor = (u64::from(caps.max_concurrent) + 1 + rng.u64(0..3)).saturating_sub(others);
            let floor = u32::try_from(floor).unwrap().max(1);
            classes[c].protected_concurrent = Some(floor);
            classes[c].max_concurrent = None;
            LimitsError::ProtectedConcurrentSumTooLarge {
                sum: others + u64::from(floor),
                max_concurrent: caps.max_concurrent,
            }
        }
        _ => {
            // Token floors above the budget.
            let others = caps.token_floors() - caps.token_floor(c);
            let floor = (caps.budget + 1 + rng.u64(0..100))
                .saturating_sub(others)
                .max(1);
            classes[c].protected_in_flight_tokens = Some(floor);
            classes[c].max_in_flight_tokens = None;
            LimitsError::ProtectedTokensSumTooLarge {
                sum: others + floor,
                budget: caps.budget,
            }
        }
    };
    next.admission_classes = Some(table(rng, ids, &classes));
    (next, error)
}
