//! The general bulkhead's permits: the RAII proof of a slot. Dropping one (or calling
//! `release`) returns the slot exactly once, and hands it to the oldest queued call if any.

use core::fmt;

use crate::engine::Grant;
use crate::engine::permit::PermitCore;
use crate::support::sync::Arc;
use crate::vocabulary::admission_id::AdmissionId;

use super::shared::BulkheadCore;

/// One slot of a [`Bulkhead`](super::Bulkhead), borrowed from it, held until the permit is dropped or
/// [`release`](BulkheadPermit::release)d. [`OwnedBulkheadPermit`](crate::bulkhead::OwnedBulkheadPermit) is the `'static` kind.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::Bulkhead;
///
/// let bulkhead = Bulkhead::new(1)?;
/// let permit = bulkhead.try_acquire()?;
/// assert_eq!(bulkhead.state().active, 1);
/// drop(permit); // the slot goes back (to the oldest queued call, if one waits)
/// assert_eq!(bulkhead.state().active, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "the slot is released as soon as the permit is dropped"]
pub struct BulkheadPermit<'a> {
    core: PermitCore<&'a BulkheadCore>,
}

impl<'a> BulkheadPermit<'a> {
    #[inline]
    pub(super) fn new(core: &'a BulkheadCore, grant: Grant) -> BulkheadPermit<'a> {
        BulkheadPermit {
            core: PermitCore::new(core, grant),
        }
    }

    /// Returns the slot now (the same as dropping the permit).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// bulkhead.try_acquire()?.release();
    /// assert!(bulkhead.try_acquire().is_ok());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(self) {}

    /// The admission's id: unique within the process, in admission order per thread.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// let (a, b) = (bulkhead.try_acquire()?, bulkhead.try_acquire()?);
    /// assert_ne!(a.id(), b.id());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn id(&self) -> AdmissionId {
        self.core.held().id()
    }

    /// Revision of the limits that admitted the call.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// assert_eq!(bulkhead.try_acquire()?.limit_revision(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn limit_revision(&self) -> u64 {
        self.core.held().revision()
    }
}

impl fmt::Debug for BulkheadPermit<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("BulkheadPermit")
            .field("id", &self.core.held().id())
            .field("limit_revision", &self.core.held().revision())
            .finish()
    }
}

/// One slot of a [`Bulkhead`](super::Bulkhead), keeping the bulkhead alive: `'static`, `Send`, for spawned
/// tasks and response bodies. Released when dropped.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::Bulkhead;
///
/// let bulkhead = Bulkhead::new(1)?;
/// let permit = bulkhead.try_acquire_owned()?;
/// std::thread::spawn(move || drop(permit)).join().unwrap();
/// assert_eq!(bulkhead.state().active, 0);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[must_use = "the slot is released as soon as the permit is dropped"]
pub struct OwnedBulkheadPermit {
    core: PermitCore<Arc<BulkheadCore>>,
}

impl OwnedBulkheadPermit {
    #[inline]
    pub(super) fn new(core: Arc<BulkheadCore>, grant: Grant) -> OwnedBulkheadPermit {
        OwnedBulkheadPermit {
            core: PermitCore::new(core, grant),
        }
    }

    /// Returns the slot now (the same as dropping the permit).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(1)?;
    /// bulkhead.try_acquire_owned()?.release();
    /// assert_eq!(bulkhead.state().active, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn release(self) {}

    /// The admission's id (see [`BulkheadPermit::id`](crate::bulkhead::BulkheadPermit::id)).
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// let (a, b) = (bulkhead.try_acquire_owned()?, bulkhead.try_acquire_owned()?);
    /// assert_ne!(a.id(), b.id());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn id(&self) -> AdmissionId {
        self.core.held().id()
    }

    /// Revision of the limits that admitted the call.
    ///
    /// # Examples
    ///
    /// ```
    /// let bulkhead = async_bulkhead_llm::Bulkhead::new(2)?;
    /// assert_eq!(bulkhead.try_acquire_owned()?.limit_revision(), 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn limit_revision(&self) -> u64 {
        self.core.held().revision()
    }

    /// The shared core, for [`bulkhead`](OwnedBulkheadPermit::bulkhead) (in `face`).
    pub(super) fn shared_core(&self) -> &Arc<BulkheadCore> {
        self.core.core()
    }
}

impl fmt::Debug for OwnedBulkheadPermit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OwnedBulkheadPermit")
            .field("id", &self.core.held().id())
            .field("limit_revision", &self.core.held().revision())
            .finish()
    }
}
