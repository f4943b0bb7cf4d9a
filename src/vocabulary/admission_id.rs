//! Admission ids: 128-bit, RFC 4122 version-4 compatible, unique, and minted without a shared
//! counter or an allocation (formatting happens only when asked).
//!
//! Admissions are counted in per-thread statistics shards (see `crate::stats`), and a shard's
//! admission count doubles as its id sequence: an id is the shard's *tag* (60 bits: a 28-bit
//! shard number from a process-wide counter taken once per shard, and 32 random bits chosen once
//! per process) and the shard's sequence number passed through a bijective mixer (62 bits), with
//! the version nibble `4` and the RFC 4122 variant bits in their places. A shard has one writer
//! at a time, so two ids of one shard differ in the sequence and two ids of different shards in
//! the shard number: ids never repeat within a process (until one shard mints 2^62 of them or
//! 2^28 shards have been created); the random bits make collisions across processes unlikely. The mixer only makes consecutive ids look unrelated (good for log
//! sharding and for not leaking admission rates).

use crate::support::sync::unmodeled::OnceLock;
use core::fmt;
use std::hash::{BuildHasher, Hasher, RandomState};

use crate::support::sync::unmodeled::{AtomicU64, Ordering};

/// The unique id of one admission.
///
/// Copying it is free; it turns into text (the hyphenated UUID form) only when displayed, or
/// serialized (feature `serde`: as the same string).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest};
///
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 2).build()?;
/// let a = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
/// let b = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
/// assert_ne!(a.admission_id(), b.admission_id());
/// let text = a.admission_id().to_string();
/// assert_eq!(text.len(), 36);
/// assert_eq!(&text[14..15], "4"); // a version-4 UUID
/// assert_eq!(a.admission_id().to_uuid().get_version_num(), 4);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct AdmissionId(u128);

impl AdmissionId {
    /// The id as a 128-bit integer (big-endian UUID bit order).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// let id = permit.admission_id();
    /// assert_eq!(id.to_uuid().as_u128(), id.as_u128());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn as_u128(self) -> u128 {
        self.0
    }

    /// The id as a [`uuid::Uuid`].
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # let bulkhead = LlmBulkhead::builder("m", 1).build()?;
    /// let permit = bulkhead.try_acquire(&LlmRequest::new(), AcquireOptions::new())?;
    /// assert_eq!(permit.admission_id().to_uuid().get_variant(), uuid::Variant::RFC4122);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub const fn to_uuid(self) -> uuid::Uuid {
        uuid::Uuid::from_u128(self.0)
    }
}

impl fmt::Display for AdmissionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(&self.to_uuid().hyphenated(), f)
    }
}

impl fmt::Debug for AdmissionId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "AdmissionId({self})")
    }
}

impl From<AdmissionId> for uuid::Uuid {
    fn from(id: AdmissionId) -> uuid::Uuid {
        id.to_uuid()
    }
}

/// The id of an observe-mode bypass: a call the bulkhead would have refused that ran anyway,
/// holding no capacity (see [`RunOptions::observe`](crate::RunOptions::observe)). It shows as
/// `shadow-` and a version-4 UUID, so a bypass is never mistaken for an admission in logs;
/// with the `serde` feature it serializes as the same string.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{AcquireOptions, LlmBulkhead, LlmRequest, observe::ShadowReasons};
///
/// # ::futures::executor::block_on(async {
/// let bulkhead = LlmBulkhead::builder("m", 0).build()?; // refuses everything
/// let options = AcquireOptions::new().observe(ShadowReasons::ALL);
/// let id = bulkhead
///     .run(&LlmRequest::new(), options, async |ctx| {
///         Ok::<_, std::io::Error>(ctx.bypass().expect("bypassed").shadow_id)
///     })
///     .await?;
/// assert!(id.to_string().starts_with("shadow-"));
/// assert_eq!(id.to_string().len(), 7 + 36);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// # }).unwrap();
/// ```
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ShadowId(u128);

impl ShadowId {
    /// The same UUID as an [`AdmissionId`](crate::admission::AdmissionId) (for the id fields a bypass shares with
    /// admissions, e.g. [`UsageReport::admission_id`](crate::usage::UsageReport::admission_id)).
    pub(crate) const fn as_admission_id(self) -> AdmissionId {
        AdmissionId(self.0)
    }

    /// A fresh id (a process-wide sequence through the admission ids' mixer: bypasses are
    /// rare enough for one shared counter).
    pub(crate) fn next() -> ShadowId {
        static TAG: OnceLock<u64> = OnceLock::new();
        static SEQ: AtomicU64 = AtomicU64::new(0);
        let tag = *TAG.get_or_init(new_tag);
        ShadowId(
            IdParts::new(tag, SEQ.fetch_add(1, Ordering::Relaxed))
                .id()
                .0,
        )
    }

    /// The id as a [`uuid::Uuid`] (without the `shadow-` prefix).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::*;
    /// # use async_bulkhead_llm::{observe::ShadowReasons};
    /// # ::futures::executor::block_on(async {
    /// # let bulkhead = LlmBulkhead::builder("m", 0).build()?;
    /// # let options = AcquireOptions::new().observe(ShadowReasons::ALL);
    /// let id = bulkhead
    ///     .run(&LlmRequest::new(), options, async |ctx| Ok::<_, std::io::Error>(ctx.bypass().unwrap().shadow_id))
    ///     .await?;
    /// assert_eq!(id.to_uuid().get_version_num(), 4);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// # }).unwrap();
    /// ```
    pub const fn to_uuid(self) -> uuid::Uuid {
        uuid::Uuid::from_u128(self.0)
    }
}

impl fmt::Display for ShadowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "shadow-{}", self.to_uuid().hyphenated())
    }
}

impl fmt::Debug for ShadowId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ShadowId({self})")
    }
}

/// Ids serialize as the text they display: `AdmissionId` as a hyphenated UUID, `ShadowId`
/// with its `shadow-` prefix.
#[cfg(feature = "serde")]
mod serialize {
    use serde::{Serialize, Serializer};

    use super::{AdmissionId, ShadowId};

    impl Serialize for AdmissionId {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.collect_str(self)
        }
    }

    impl Serialize for ShadowId {
        fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.collect_str(self)
        }
    }
}

/// Bits of the shard number in a tag.
const SHARD_BITS: u32 = 28;
/// Bits of the sequence in an id.
const SEQ_BITS: u32 = 62;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// Numbers statistics shards for their tags. Touched once per shard, never on the fast path.
static NEXT_SHARD: AtomicU64 = AtomicU64::new(0);
/// 32 random bits shared by every tag of this process.
static PROCESS_SALT: OnceLock<u32> = OnceLock::new();

/// A fresh 60-bit tag: a process-unique shard number (28 bits) and the process salt (32).
pub(crate) fn new_tag() -> u64 {
    let salt = *PROCESS_SALT.get_or_init(|| RandomState::new().build_hasher().finish() as u32);
    let shard = NEXT_SHARD.fetch_add(1, Ordering::Relaxed) & ((1 << SHARD_BITS) - 1);
    (shard << 32) | u64::from(salt)
}

/// An admission id before mixing: a shard tag and the shard's admission sequence number.
/// Mixing them into an [`AdmissionId`](crate::admission::AdmissionId) waits until someone asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct IdParts {
    tag: u64,
    seq: u64,
}

impl IdParts {
    #[inline]
    pub(crate) fn new(tag: u64, seq: u64) -> IdParts {
        IdParts { tag, seq }
    }

    #[inline]
    pub(crate) fn id(self) -> AdmissionId {
        AdmissionId(compose(self.tag, mix62(self.seq)))
    }
}

/// Places a 60-bit tag and 62 bits of sequence around the UUID version and variant fields.
#[inline]
fn compose(tag: u64, seq: u64) -> u128 {
    // High half: tag bits 59..12 | version 4 | tag bits 11..0.
    let hi = ((tag >> 12) << 16) | (0x4 << 12) | (tag & 0xFFF);
    // Low half: variant 0b10 | 62 sequence bits.
    let lo = (0b10 << 62) | (seq & SEQ_MASK);
    (u128::from(hi) << 64) | u128::from(lo)
}

/// A bijection on 62-bit integers (xor-shifts and odd multipliers modulo 2^62), so distinct
/// sequence numbers give distinct ids that do not look consecutive.
#[inline]
fn mix62(x: u64) -> u64 {
    let mut x = x & SEQ_MASK;
    x ^= x >> 31;
    x = x.wrapping_mul(0x7fb5_d329_728e_a185) & SEQ_MASK;
    x ^= x >> 27;
    x = x.wrapping_mul(0x81da_def4_bc2d_d44d) & SEQ_MASK;
    x ^= x >> 33;
    x
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::HashSet;

    use super::*;

    #[test]
    fn ids_are_v4_and_distinct_within_and_across_shards() {
        let mut seen = HashSet::new();
        let (a, b) = (new_tag(), new_tag());
        assert_ne!(a, b);
        for seq in 0..10_000 {
            for id in [IdParts::new(a, seq).id(), IdParts::new(b, seq).id()] {
                let uuid = id.to_uuid();
                assert_eq!(uuid.get_version_num(), 4);
                assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122);
                assert!(seen.insert(id), "duplicate id {id}");
            }
        }
    }

    #[test]
    fn mix_is_injective_on_a_dense_range_and_the_top() {
        let mut seen = HashSet::new();
        for x in (0..50_000).chain(SEQ_MASK - 50_000..=SEQ_MASK) {
            let y = mix62(x);
            assert!(y <= SEQ_MASK);
            assert!(seen.insert(y));
        }
    }
}
