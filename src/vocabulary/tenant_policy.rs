//! Per-tenant limits as data: [`TenantPolicy`] (one [`Limits`] per known key, a default for
//! every other key, at one revision) and [`PolicyError`], why a policy was refused.

use core::fmt;
use std::collections::BTreeMap;

use crate::vocabulary::error::LimitsError;
use crate::vocabulary::limits::{Limits, MAX_REVISION};

/// The limits of every tenant of a family, as data a control plane keeps (JSON, TOML, ...): one
/// [`Limits`] per known key and a default for every other key, at one revision.
///
/// A family given a policy ([`TenantsBuilder::policy`](crate::tenants::TenantsBuilder::policy))
/// applies it to each tenant it creates, and [`Tenants::apply_policy`](crate::tenants::Tenants::apply_policy)
/// installs a newer one on every live tenant. The policy outlives the tenants: one evicted and
/// created again starts with its limits from the policy in force, not the template's.
///
/// Every limits snapshot a tenant receives carries the policy's revision (the `revision` of the
/// entries themselves is ignored, and may be left out of a serialized policy), so a tenant's
/// limits change only when a policy of a higher revision arrives.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Limits, tenants::TenantPolicy};
///
/// let policy = TenantPolicy::new(1, Limits::new(0, 2)).tenant("ent-acme", Limits::new(0, 16));
/// assert_eq!(policy.limits_for("ent-acme").max_concurrent, 16);
/// assert_eq!(policy.limits_for("anyone-else").max_concurrent, 2);
/// assert_eq!(policy.limits_for("anyone-else").revision, 1); // the policy's
/// # #[cfg(feature = "serde")] {
/// let json = r#"{"revision": 2, "default": {"max_concurrent": 2},
///                "tenants": {"ent-acme": {"max_concurrent": 16, "max_queue": 8}}}"#;
/// let policy: TenantPolicy = serde_json::from_str(json)?;
/// assert_eq!(policy.limits_for("ent-acme").max_queue, 8);
/// # }
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
#[non_exhaustive]
pub struct TenantPolicy {
    /// Version of this policy; each one installed must be strictly greater (and at least 1: a
    /// new tenant's own limits are at revision 0).
    pub revision: u64,
    /// The limits of every key without an entry of its own.
    #[cfg_attr(feature = "serde", serde(deserialize_with = "entry::limits"))]
    pub default: Limits,
    /// The limits of each known key.
    #[cfg_attr(feature = "serde", serde(default, deserialize_with = "entry::table"))]
    pub tenants: BTreeMap<String, Limits>,
}

/// A policy's entries as serialized: a [`Limits`] whose `revision` may be left out (the
/// policy's applies).
#[cfg(feature = "serde")]
mod entry {
    use std::collections::BTreeMap;

    use serde::{Deserialize, Deserializer};

    use crate::vocabulary::limits::{BudgetLimits, ClassLimitsTable, Limits};
    use crate::vocabulary::rate_limits::RateLimits;

    #[derive(Deserialize)]
    struct Entry {
        #[serde(default)]
        revision: u64,
        max_concurrent: u32,
        #[serde(default)]
        max_queue: u32,
        #[serde(default)]
        token_budget: Option<BudgetLimits>,
        #[serde(default)]
        admission_classes: Option<ClassLimitsTable>,
        #[serde(default)]
        rate: Option<RateLimits>,
    }

    impl From<Entry> for Limits {
        fn from(entry: Entry) -> Limits {
            Limits {
                revision: entry.revision,
                max_concurrent: entry.max_concurrent,
                max_queue: entry.max_queue,
                token_budget: entry.token_budget,
                admission_classes: entry.admission_classes,
                rate: entry.rate,
            }
        }
    }

    pub(super) fn limits<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Limits, D::Error> {
        Entry::deserialize(deserializer).map(Limits::from)
    }

    pub(super) fn table<'de, D: Deserializer<'de>>(
        deserializer: D,
    ) -> Result<BTreeMap<String, Limits>, D::Error> {
        let entries = BTreeMap::<String, Entry>::deserialize(deserializer)?;
        Ok(entries
            .into_iter()
            .map(|(k, e)| (k, Limits::from(e)))
            .collect())
    }
}

impl TenantPolicy {
    /// A policy at `revision` giving every key `default`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, tenants::TenantPolicy};
    ///
    /// let policy = TenantPolicy::new(3, Limits::new(0, 4));
    /// assert_eq!((policy.revision, policy.tenants.len()), (3, 0));
    /// ```
    pub fn new(revision: u64, default: Limits) -> TenantPolicy {
        TenantPolicy {
            revision,
            default,
            tenants: BTreeMap::new(),
        }
    }

    /// This policy with `limits` for `key`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, tenants::TenantPolicy};
    ///
    /// let policy = TenantPolicy::new(1, Limits::new(0, 4)).tenant("acme", Limits::new(0, 9));
    /// assert_eq!(policy.tenants["acme"].max_concurrent, 9);
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn tenant(mut self, key: impl Into<String>, limits: Limits) -> TenantPolicy {
        self.tenants.insert(key.into(), limits);
        self
    }

    /// The limits of `key` (its entry, else the default), at the policy's revision.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{Limits, tenants::TenantPolicy};
    ///
    /// let policy = TenantPolicy::new(7, Limits::new(0, 4));
    /// assert_eq!(policy.limits_for("x"), Limits::new(7, 4));
    /// ```
    pub fn limits_for(&self, key: &str) -> Limits {
        let mut limits = self.tenants.get(key).unwrap_or(&self.default).clone();
        limits.revision = self.revision;
        limits
    }

    /// Checks what can be checked without a tenant: the revision's range.
    pub(crate) fn check_revision(&self) -> Result<(), PolicyError> {
        if self.revision == 0 {
            return Err(PolicyError::RevisionZero);
        }
        if self.revision > MAX_REVISION {
            return Err(PolicyError::RevisionTooLarge {
                value: self.revision,
                max: MAX_REVISION,
            });
        }
        Ok(())
    }
}

/// Why a [`TenantPolicy`] was refused; nothing changed.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Limits, tenants::{PolicyError, TenantPolicy, Tenants}, LlmBulkhead};
///
/// let tenants = Tenants::builder(|_: &String| LlmBulkhead::builder("m", 1))
///     .policy(TenantPolicy::new(1, Limits::new(0, 2)))
///     .build()?;
/// let err = tenants.apply_policy(TenantPolicy::new(0, Limits::new(0, 2))).unwrap_err();
/// assert_eq!(err, PolicyError::RevisionZero);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PolicyError {
    /// The family was built without a policy
    /// ([`TenantsBuilder::policy`](crate::tenants::TenantsBuilder::policy)).
    NotConfigured,
    /// A policy's revision must be at least 1 (a new tenant's own limits are at revision 0).
    RevisionZero,
    /// The revision is above what a bulkhead's limits hold.
    RevisionTooLarge {
        /// The policy's revision.
        value: u64,
        /// The largest revision allowed.
        max: u64,
    },
    /// The limits the policy gives a live tenant do not fit it (its budget, its classes).
    Tenant {
        /// The tenant's key.
        key: String,
        /// What its bulkhead said of the limits.
        error: LimitsError,
    },
}

impl fmt::Display for PolicyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PolicyError::NotConfigured => f.write_str("this tenant family has no policy"),
            PolicyError::RevisionZero => {
                f.write_str("a tenant policy's revision must be at least 1")
            }
            PolicyError::RevisionTooLarge { value, max } => {
                write!(f, "tenant policy revision {value} is above {max}")
            }
            PolicyError::Tenant { key, error } => {
                write!(
                    f,
                    "the policy's limits for tenant {key:?} were refused: {error}"
                )
            }
        }
    }
}

impl std::error::Error for PolicyError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            PolicyError::Tenant { error, .. } => Some(error),
            _ => None,
        }
    }
}
