//! A tenant within global limits, decided together: [`LlmBulkhead::try_acquire_within`] and
//! [`LlmBulkhead::acquire_within`] admit a call when it fits its tenant's bulkhead *and* the
//! global one, and [`TenantPermit`] holds both admissions until the call settles.
//!
//! The protocol: the request is sized once (by the global bulkhead's estimator when it has a
//! token budget, else by the tenant's), so both levels hold the same reservation. The tenant's
//! slot and tokens are then taken *provisionally* (on its word, counted nowhere); the global
//! level decides (and may queue, for `acquire_within`); the tenant's admission is confirmed
//! (counted, its id minted, its admit event announced) only when the global level admitted
//! the call, and cancelled (given back, counted nowhere) when it refused. So no level counts an
//! admission another level refused, each level counts exactly the refusals it made, and a
//! refusal says which level made it ([`Rejection::scope`]).

use core::fmt;

use crate::engine::{Engine, Provisional};
use crate::events::Timing;
use crate::support::sync::Arc;
use crate::vocabulary::error::{AcquireError, UsageError};
use crate::vocabulary::rejection::{Rejection, Scope};
use crate::vocabulary::reservation::{ReleaseReport, TokenUsage, UsageReport};

use super::acquire::AcquireOwned;
use super::admission::Admission;
use super::bulkhead::LlmBulkhead;
use super::options::AcquireOptions;
use super::permit::OwnedPermit;
use super::request::LlmRequest;
use super::shared::{Call, LlmCore, fast_ask};

/// One call admitted by its tenant's bulkhead and the global one together: it holds a slot and
/// the reservation in both until it is released or dropped. Usage reports move both holds.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::*;
///
/// let global = LlmBulkhead::builder("gpt-4o", 32).token_budget(TokenBudget::new(100_000)).build()?;
/// let acme = LlmBulkhead::builder("gpt-4o", 4).token_budget(TokenBudget::new(10_000)).tenant("acme").build()?;
/// let options = AcquireOptions::new().reservation(Reservation::new(100, 100)?);
/// let mut permit = acme.try_acquire_within(&global, &LlmRequest::new(), options)?;
/// assert_eq!((permit.tenant().held_tokens(), permit.global().held_tokens()), (200, 200));
/// permit.report_usage(TokenUsage::new(80, 20)?)?;
/// assert_eq!(global.stats().token_budget.unwrap().in_flight_tokens, 180);
/// let report = permit.release(None);
/// assert_eq!(report.global.held_tokens, 180);
/// assert_eq!((acme.stats().in_flight, global.stats().in_flight), (0, 0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "dropping a permit releases its capacity immediately"]
#[clippy::has_significant_drop]
pub struct TenantPermit {
    tenant: OwnedPermit,
    global: OwnedPermit,
}

/// What [`TenantPermit::release`] settled at each level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct TenantReleaseReport {
    /// The tenant level's settlement.
    pub tenant: ReleaseReport,
    /// The global level's settlement.
    pub global: ReleaseReport,
}

impl TenantPermit {
    /// The tenant level's admission (its id, revision, hold and usage).
    pub fn tenant(&self) -> &OwnedPermit {
        &self.tenant
    }

    /// The global level's admission.
    pub fn global(&self) -> &OwnedPermit {
        &self.global
    }

    /// Reports the call's cumulative usage to both levels (see
    /// [`OwnedPermit::report_usage`]); returns the global level's report.
    ///
    /// # Errors
    ///
    /// The global level's [`UsageError`](crate::usage::UsageError), with nothing changed at
    /// either level; or the tenant level's (its hold could not move: the global one did).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let global = LlmBulkhead::builder("m", 8).token_budget(TokenBudget::new(10_000)).build()?;
    /// let tenant = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(1_000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 400)?);
    /// let mut permit = tenant.try_acquire_within(&global, &LlmRequest::new(), opts)?;
    /// assert_eq!(permit.report_usage(TokenUsage::new(40, 10)?)?.held, 440);
    /// assert_eq!(tenant.stats().token_budget.unwrap().in_flight_tokens, 440);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn report_usage(&mut self, usage: TokenUsage) -> Result<UsageReport, UsageError> {
        let report = self.global.report_usage(usage)?;
        self.tenant.report_usage(usage)?;
        Ok(report)
    }

    /// Settles both levels with `usage` (else the last reported usage, if any), as
    /// [`OwnedPermit::release`] does.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// let global = LlmBulkhead::builder("m", 8).token_budget(TokenBudget::new(10_000)).build()?;
    /// let tenant = LlmBulkhead::builder("m", 2).token_budget(TokenBudget::new(1_000)).build()?;
    /// let opts = AcquireOptions::new().reservation(Reservation::new(100, 400)?);
    /// let permit = tenant.try_acquire_within(&global, &LlmRequest::new(), opts)?;
    /// let report = permit.release(Some(TokenUsage::new(100, 50)?));
    /// assert_eq!((report.tenant.refunded_tokens, report.global.refunded_tokens), (350, 350));
    /// assert_eq!(tenant.stats().token_budget.unwrap().total_consumed, 150);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(mut self, usage: Option<TokenUsage>) -> TenantReleaseReport {
        // Usage known only to one level (reported to both, so the same) settles both alike.
        // The global level first, both in place (not moved out of `self`, whose drop then only
        // lets both bulkheads go).
        TenantReleaseReport {
            global: self.global.release_in_place(usage),
            tenant: self.tenant.release_in_place(usage),
        }
    }
}

impl fmt::Debug for TenantPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantPermit")
            .field("tenant", &self.tenant)
            .field("global", &self.global)
            .finish()
    }
}

/// Both levels' calls, sized once: the global bulkhead's estimator sizes the request when it
/// has a token budget (the tenant holds the same reservation), else the tenant's does.
fn resolve_both(
    tenant: &LlmCore,
    global: &LlmCore,
    request: &LlmRequest,
    options: AcquireOptions,
) -> Result<(Call, Call), AcquireError> {
    // The options' class is the global bulkhead's; the tenant's calls take its default class.
    let tenant_options = AcquireOptions {
        class: None,
        ..options
    };
    let (tenant_call, global_call) = if global.engine().has_budget() {
        let global_call = global.resolve(request, options)?;
        let sized = AcquireOptions {
            reservation: global_call.reservation().or(options.reservation),
            ..tenant_options
        };
        (tenant.resolve(request, sized)?, global_call)
    } else {
        let tenant_call = tenant.resolve(request, tenant_options)?;
        let sized = AcquireOptions {
            reservation: tenant_call.reservation().or(options.reservation),
            ..options
        };
        (tenant_call, global.resolve(request, sized)?)
    };
    Ok((tenant_call, global_call))
}

/// The tenant level's side of a decision: its call, its provisional admission and the timing
/// of its events. Dropped unconfirmed (a refusal above, an error, a dropped future), it cancels
/// the provisional admission: the tenant's slot and tokens return, counted nowhere.
struct TenantSide<'a> {
    core: &'a Arc<LlmCore>,
    call: Call,
    timing: Option<Timing>,
    provisional: Option<Provisional>,
}

impl<'a> TenantSide<'a> {
    /// Takes the tenant's slot and tokens for `call` provisionally, or refuses it (counted and
    /// announced by the tenant's bulkhead, scoped `tenant`). `timing`: the call's, at the
    /// tenant.
    fn take(
        core: &'a Arc<LlmCore>,
        call: Call,
        timing: Option<Timing>,
    ) -> Result<TenantSide<'a>, AcquireError> {
        match core.engine().try_provisional(call.ask()) {
            Ok(provisional) => Ok(TenantSide {
                core,
                call,
                timing,
                provisional: Some(provisional),
            }),
            Err(rejection) => {
                let rejection = rejection.with_scope(Scope::Tenant);
                core.announce_reject(&rejection, call.class(), timing, None);
                Err(AcquireError::Rejected(rejection))
            }
        }
    }

    fn engine(&self) -> &Engine {
        self.core.engine()
    }

    /// The global level admitted the call: the tenant's admission is counted and announced,
    /// and both become the permit.
    fn confirm(mut self, global: OwnedPermit) -> TenantPermit {
        let provisional = self.provisional.take().expect("confirmed once");
        let grant = self.engine().confirm(provisional);
        let admission = self.call.admission(grant, self.timing);
        self.core.announce_admit(&admission, self.timing, None);
        TenantPermit {
            tenant: OwnedPermit::new(Arc::clone(self.core), admission),
            global,
        }
    }
}

impl Drop for TenantSide<'_> {
    fn drop(&mut self) {
        if let Some(provisional) = self.provisional.take() {
            self.core.engine().cancel_provisional(provisional);
        }
    }
}

/// The fast lane of a call within: neither level timed (the caller checked), no class, its
/// tokens known without an estimator (no budget, or the options' reservation) and both levels
/// on their fast lanes: the tenant's provisional admission and the global one decided as
/// `try_acquire`'s fast lane decides, the tenant's confirmed once the global one admitted.
/// `None` (nothing changed, nothing counted: a tenant admission the global lane did not
/// follow is cancelled) leaves the call to the general path. `permit` makes the caller's
/// result in place.
#[inline(always)]
fn fast_within<P>(
    tenant: &LlmCore,
    global: &LlmCore,
    options: &AcquireOptions,
    permit: impl FnOnce(Admission, Admission) -> P,
) -> Option<P> {
    if options.class.is_some() {
        return None;
    }
    let (tenant_ask, tenant_ledger) = fast_ask(tenant.engine().has_budget(), options).ok()?;
    let (global_ask, global_ledger) = fast_ask(global.engine().has_budget(), options).ok()?;
    let provisional = tenant.engine().try_provisional_fast(tenant_ask)?;
    match global.engine().try_admit_fast(global_ask) {
        Some(global_grant) => {
            let tenant_grant = tenant.engine().confirm(provisional);
            Some(permit(
                Admission::new(tenant_grant, tenant_ledger),
                Admission::new(global_grant, global_ledger),
            ))
        }
        None => {
            tenant.engine().cancel_provisional(provisional);
            None
        }
    }
}

/// A global refusal, scoped; any other error as it is.
fn scoped_global(error: AcquireError) -> AcquireError {
    match error {
        AcquireError::Rejected(rejection) => {
            AcquireError::Rejected(Rejection::with_scope(rejection, Scope::Global))
        }
        invalid => invalid,
    }
}

impl LlmBulkhead {
    /// Admits the call through this bulkhead (a tenant's) and `global` together, now or not at
    /// all: admitted only when it fits both, counted only by both. The request is sized once
    /// (see the `within` protocol: the global estimator's reservation, held at both levels);
    /// the options' class, if any, is the global bulkhead's.
    ///
    /// A refusal names its level in [`Rejection::scope`]: [`Scope::Tenant`] (counted and
    /// announced by this bulkhead; the global one was not asked) or [`Scope::Global`] (counted
    /// and announced by `global`; this bulkhead counts nothing: its slot was taken
    /// provisionally and given back). While the global level decides, the tenant's slot is
    /// taken: a concurrent call of the same tenant may be refused for it, never admitted
    /// beyond the tenant's limits.
    ///
    /// # Errors
    ///
    /// [`AcquireError::Rejected`] with the refusing level's rejection, scoped;
    /// [`AcquireError::Invalid`] when the request cannot be sized or names a class that is not
    /// the global bulkhead's (nothing held, nothing counted).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, rejection::Scope};
    ///
    /// let global = LlmBulkhead::builder("gpt-4o", 2).build()?;
    /// let acme = LlmBulkhead::builder("gpt-4o", 2).tenant("acme").build()?;
    /// let globex = LlmBulkhead::builder("gpt-4o", 2).tenant("globex").build()?;
    /// let request = LlmRequest::new();
    /// let _a = acme.try_acquire_within(&global, &request, AcquireOptions::new())?;
    /// let _b = acme.try_acquire_within(&global, &request, AcquireOptions::new())?;
    /// // The global limit of 2 is reached: globex's own limits had room, the global did not.
    /// let err = globex.try_acquire_within(&global, &request, AcquireOptions::new()).unwrap_err();
    /// assert_eq!(err.rejection().unwrap().scope(), Some(Scope::Global));
    /// assert_eq!((globex.stats().admitted, globex.stats().rejected), (0, 0));
    /// assert_eq!((global.stats().admitted, global.stats().rejected), (2, 1));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[inline(never)]
    pub fn try_acquire_within(
        &self,
        global: &LlmBulkhead,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<TenantPermit, AcquireError> {
        // Tested without deciding a sampling, as `acquire_within` tests it: the general path
        // decides the call's timing (once, where it starts), so the lane builds none.
        let untimed = self.core.untimed() && global.core.untimed();
        if untimed && let Some(permit) = self.fast_within(global, &options) {
            return Ok(permit);
        }
        self.try_acquire_within_general(global, request, options, untimed)
    }

    /// The fast lane of both `_within` doors ([`fast_within`]), its permit built in place.
    #[inline(always)]
    fn fast_within(&self, global: &LlmBulkhead, options: &AcquireOptions) -> Option<TenantPermit> {
        fast_within(&self.core, &global.core, options, |t, g| TenantPermit {
            tenant: OwnedPermit::new(Arc::clone(&self.core), t),
            global: OwnedPermit::new(Arc::clone(&global.core), g),
        })
    }

    /// [`try_acquire_within`](LlmBulkhead::try_acquire_within) beyond its fast lane (a call
    /// to size, with a class, timed, or refused). The call's timing starts here, at both
    /// levels. `tried`: the caller tried the fast lane (nobody listened at either level).
    #[inline(never)]
    fn try_acquire_within_general(
        &self,
        global: &LlmBulkhead,
        request: &LlmRequest,
        options: AcquireOptions,
        tried: bool,
    ) -> Result<TenantPermit, AcquireError> {
        let (tenant_timing, global_timing) = (self.core.timing(), global.core.timing());
        // Sampled listeners, and this call sampled by neither: the fast lane after all.
        if !tried
            && tenant_timing.is_none()
            && global_timing.is_none()
            && let Some(permit) = self.fast_within(global, &options)
        {
            return Ok(permit);
        }
        let (tenant_call, global_call) = resolve_both(&self.core, &global.core, request, options)?;
        let tenant = TenantSide::take(&self.core, tenant_call, tenant_timing)?;
        let admitted = global
            .core
            .try_admit(global_call, global_timing, |admission| {
                OwnedPermit::new(Arc::clone(&global.core), admission)
            });
        match admitted {
            Ok(global) => Ok(tenant.confirm(global)),
            // `tenant` dropped: its provisional admission is cancelled.
            Err(error) => Err(scoped_global(error)),
        }
    }

    /// [`try_acquire_within`](LlmBulkhead::try_acquire_within), waiting in the global
    /// bulkhead's queue when only a global slot is missing (as
    /// [`acquire`](LlmBulkhead::acquire) waits; the call's timeout, else the global
    /// bulkhead's). The tenant level never queues: its limits are decided at once, and its
    /// slot is held (provisionally, uncounted) while the call waits for a global one.
    ///
    /// # Errors
    ///
    /// As for [`try_acquire_within`](LlmBulkhead::try_acquire_within), and the global level's
    /// `queue_limit`, `timeout` and `shutdown` after a wait.
    ///
    /// # Cancel safety
    ///
    /// Dropping the future gives up the global place in the queue (as `acquire`) and the
    /// tenant's provisional slot, counting nothing at the tenant level.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
    ///
    /// # futures::executor::block_on(async {
    /// let global = LlmBulkhead::builder("gpt-4o", 1).max_queue(8).build()?;
    /// let acme = LlmBulkhead::builder("gpt-4o", 4).tenant("acme").build()?;
    /// let request = LlmRequest::new();
    /// let first = acme.acquire_within(&global, &request, AcquireOptions::new()).await?;
    /// let mut second = Box::pin(acme.acquire_within(&global, &request, AcquireOptions::new()));
    /// assert!(futures::poll!(second.as_mut()).is_pending()); // waits for a global slot
    /// assert_eq!((acme.stats().in_flight, acme.stats().admitted), (2, 1)); // its slot is taken, not counted
    /// drop(first);
    /// let second = second.await?;
    /// assert_eq!(acme.stats().admitted, 2);
    /// # drop(second);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub async fn acquire_within(
        &self,
        global: &LlmBulkhead,
        request: &LlmRequest,
        options: AcquireOptions,
    ) -> Result<TenantPermit, AcquireError> {
        // `try_acquire_within`'s fast lane first, while nobody listens at either level (tested
        // without deciding a sampling: the general path below decides the call's timing, as
        // it did).
        if self.core.untimed()
            && global.core.untimed()
            && let Some(permit) = self.fast_within(global, &options)
        {
            return Ok(permit);
        }
        let (tenant_call, global_call) = resolve_both(&self.core, &global.core, request, options)?;
        let tenant = TenantSide::take(&self.core, tenant_call, self.core.timing())?;
        let admitted = AcquireOwned::resolved(Arc::clone(&global.core), global_call, options, 0)
            .await
            .map_err(scoped_global)?;
        Ok(tenant.confirm(admitted))
    }
}
