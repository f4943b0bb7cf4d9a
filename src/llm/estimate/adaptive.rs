//! The adaptive estimator: the model-aware estimate, corrected per model by an exponentially
//! weighted moving average of actual / estimated input (`docs/design.md` §U13.5).
//!
//! # Concurrency
//!
//! The per-model table sits behind a read-write lock that is written only when a model is seen
//! for the first time, evicted or reset. An estimate takes the read lock and one atomic load
//! (the model's applied factor); an observation of a known model takes the read lock and that
//! model's own mutex. So many threads estimating and observing at once only contend when they
//! observe the same model at the same instant.
//!
//! # How releases reach it
//!
//! An estimate carries a [`Memo`](crate::estimate::Memo): the model's slot and generation, and the *uncorrected* base
//! input. The bulkhead keeps it with the admission and hands it back to
//! [`Estimator::observe`](crate::estimate::Estimator::observe) when the admission settles with usage, so wiring an
//! `AdaptiveEstimator` into a bulkhead is one line (`.estimator(adaptive.clone())`). Observing
//! against the uncorrected base keeps the loop from compounding its own corrections. A model
//! seen by an estimate but not yet observed waits in a separate, equally bounded list, so it
//! does not count toward (or evict from) the `max_models` observed models, exactly as the
//! original creates state only on observation.

use core::fmt;
use std::collections::{HashMap, VecDeque};

use super::model_aware::ModelAwareEstimator;
use super::{Estimator, Memo, TokenEstimate, with_lowercase};
use crate::llm::request::LlmRequest;
use crate::support::sync::unmodeled::{AtomicU64, Mutex, Ordering, RwLock, lock};
use crate::vocabulary::error::{EstimatorError, RequestError};
use crate::vocabulary::reservation::TokenUsage;

/// One model's correction, as [`AdaptiveEstimator::corrections`](crate::estimate::AdaptiveEstimator::corrections) reports it.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::Correction, LlmRequest, estimate::ModelAwareEstimator, TokenUsage};
///
/// let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).build()?;
/// adaptive.observe_request(&LlmRequest::new().model("gpt-4o").user("x".repeat(37)), TokenUsage::new(20, 0)?)?;
/// let c: Vec<Correction> = adaptive.corrections();
/// assert_eq!((c[0].model.as_str(), c[0].samples, c[0].factor), ("gpt-4o", 1, 2.0));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub struct Correction {
    /// The normalised (lowercased) model name; empty when requests named none.
    pub model: String,
    /// Observations so far.
    pub samples: u64,
    /// The raw moving average of actual / estimated input.
    pub factor: f64,
    /// The factor applied to estimates: 1 until `min_samples`, then `factor` clamped to
    /// `[min_correction, max_correction]`.
    pub applied: f64,
}

#[derive(Debug, Default)]
struct Ewma {
    samples: u64,
    factor: f64,
}

#[derive(Debug)]
struct Slot {
    /// The model; kept after the slot is freed, until it is reused, so a late observation of
    /// an evicted model can still name it.
    key: Box<str>,
    /// Changes whenever the slot is freed, so a memo taken before is recognised (never 0).
    generation: u32,
    observed: bool,
    free: bool,
    ewma: Mutex<Ewma>,
    /// The applied factor, as `f64` bits, for lock-free reads by estimates.
    applied: AtomicU64,
}

#[derive(Debug, Default)]
struct Table {
    slots: Vec<Slot>,
    index: HashMap<Box<str>, usize>,
    /// Observed models, oldest first.
    observed: VecDeque<usize>,
    /// Models estimated but not yet observed, oldest first.
    pending: VecDeque<usize>,
    /// Freed slots, oldest first: reused in that order, so a freed slot keeps naming its model
    /// for as long as possible.
    free: VecDeque<usize>,
}

impl Table {
    /// A slot for `key` (not yet in the index), reusing the longest-free one.
    fn allocate(&mut self, key: &str) -> usize {
        let slot = match self.free.pop_front() {
            Some(i) => {
                let slot = &mut self.slots[i];
                slot.key = key.into();
                slot.observed = false;
                slot.free = false;
                *lock(&slot.ewma) = Ewma::default();
                slot.applied.store(1f64.to_bits(), Ordering::Relaxed);
                i
            }
            None => {
                self.slots.push(Slot {
                    key: key.into(),
                    generation: 1,
                    observed: false,
                    free: false,
                    ewma: Mutex::new(Ewma::default()),
                    applied: AtomicU64::new(1f64.to_bits()),
                });
                self.slots.len() - 1
            }
        };
        self.index.insert(key.into(), slot);
        slot
    }

    /// Frees slot `i` (evicted or reset): memos taken before stop matching it.
    fn release(&mut self, i: usize) {
        let slot = &mut self.slots[i];
        self.index.remove(&slot.key);
        slot.generation = slot.generation.wrapping_add(1).max(1);
        slot.free = true;
        self.free.push_back(i);
    }

    /// The model a memo names: its slot if the memo is current, else the model the slot held
    /// when it was freed (if it was freed once since and not reused).
    fn resolve(&self, i: usize, generation: u32) -> Option<Resolved<'_>> {
        let slot = self.slots.get(i)?;
        if slot.generation == generation && !slot.free {
            Some(Resolved::Slot(i))
        } else if slot.free && slot.generation == generation.wrapping_add(1).max(1) {
            Some(Resolved::Evicted(&slot.key))
        } else {
            None
        }
    }
}

/// What a memo names now.
enum Resolved<'a> {
    /// The slot it was taken from.
    Slot(usize),
    /// That slot was freed since (evicted or reset): the model, to insert again.
    Evicted(&'a str),
}

/// Where an observation goes.
#[derive(Clone, Copy)]
enum Target<'a> {
    /// A memo's slot and generation.
    Memo(usize, u32),
    /// A (lowercased) model name.
    Key(&'a str),
}

/// The model-aware estimate with a per-model correction learned from reported usage.
///
/// For each model (lowercased request model, else the default model, else `""`) it keeps a
/// moving average of `actual input / uncorrected estimated input`. After `min_samples`
/// observations, estimates' input is multiplied by that average clamped to
/// `[min_correction, max_correction]` (rounded up); output is never corrected (`max_tokens` is
/// a ceiling, not an estimate). At most `max_models` models are tracked; the oldest-inserted is
/// evicted first. Estimates with a factor of exactly 1 are the base estimates unchanged.
///
/// # Examples
///
/// ```
/// use std::sync::Arc;
/// use async_bulkhead_llm::{
///     AcquireOptions, estimate::AdaptiveEstimator, LlmBulkhead, LlmRequest, estimate::ModelAwareEstimator,
///     TokenBudget, TokenUsage,
/// };
///
/// let base = ModelAwareEstimator::builder().default_model("gpt-4o").build()?;
/// let adaptive = Arc::new(AdaptiveEstimator::builder(base).smoothing(1.0).min_samples(3).build()?);
/// let bulkhead = LlmBulkhead::builder("gpt-4o", 8)
///     .token_budget(TokenBudget::new(100_000))
///     .estimator(adaptive.clone()) // releases with usage now feed the correction
///     .build()?;
///
/// let request = LlmRequest::new().user("x".repeat(370)).max_tokens(10); // base input 100
/// for _ in 0..3 {
///     let permit = bulkhead.try_acquire(&request, AcquireOptions::new())?;
///     permit.release(Some(TokenUsage::new(150, 5)?)); // the provider counted 150
/// }
/// assert_eq!(bulkhead.estimate(&request)?.unwrap().input(), 150);
/// let c = &adaptive.corrections()[0];
/// assert_eq!((c.model.as_str(), c.samples, c.factor, c.applied), ("gpt-4o", 3, 1.5, 1.5));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct AdaptiveEstimator {
    base: ModelAwareEstimator,
    smoothing: f64,
    min_samples: u64,
    min_correction: f64,
    max_correction: f64,
    max_models: usize,
    table: RwLock<Table>,
}

impl AdaptiveEstimator {
    /// A builder over `base`, with the original's defaults: smoothing 0.2, min samples 5,
    /// corrections clamped to `[0.5, 2]`, at most 64 models.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::ModelAwareEstimator};
    ///
    /// let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).build()?;
    /// assert!(adaptive.corrections().is_empty());
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    pub fn builder(base: ModelAwareEstimator) -> AdaptiveEstimatorBuilder {
        AdaptiveEstimatorBuilder {
            base,
            smoothing: 0.2,
            min_samples: 5,
            min_correction: 0.5,
            max_correction: 2.0,
            max_models: 64,
        }
    }

    fn applied(&self, ewma: &Ewma) -> f64 {
        if ewma.samples < self.min_samples {
            1.0
        } else {
            ewma.factor.clamp(self.min_correction, self.max_correction)
        }
    }

    /// Records that a request of `target`'s model with uncorrected base input `base_input`
    /// really used `usage`: updates the model's average, or inserts the model (evicting the
    /// oldest-inserted one when `max_models` are tracked), exactly as upstream's `observe`.
    fn record(&self, target: Target<'_>, base_input: u64, usage: TokenUsage) {
        if base_input == 0 {
            return;
        }
        let observed = usage.input() as f64 / base_input as f64;
        // Fast path: a model already observed, under the read lock and its own mutex.
        let key: Box<str> = {
            let table = self.table.read().unwrap_or_else(|p| p.into_inner());
            let found = match target {
                Target::Memo(i, generation) => match table.resolve(i, generation) {
                    Some(Resolved::Slot(i)) => Some(i),
                    Some(Resolved::Evicted(key)) => table.index.get(key).copied(),
                    // Freed and reused since: the memo no longer names a model.
                    None => return,
                },
                Target::Key(key) => table.index.get(key).copied(),
            };
            match found {
                Some(i) if table.slots[i].observed => {
                    self.update(&table.slots[i], observed);
                    return;
                }
                Some(i) => table.slots[i].key.clone(),
                None => match target {
                    Target::Key(key) => key.into(),
                    Target::Memo(i, _) => table.slots[i].key.clone(),
                },
            }
        };
        // The model's first observation (or the first since it was evicted): insert it, or
        // promote its pending slot, under the write lock.
        let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
        let i = match table.index.get(&key).copied() {
            Some(i) => i,
            None => table.allocate(&key),
        };
        if table.slots[i].observed {
            // Another thread inserted it meanwhile.
            self.update(&table.slots[i], observed);
            return;
        }
        table.pending.retain(|&p| p != i);
        while table.observed.len() >= self.max_models {
            let oldest = table.observed.pop_front().expect("non-empty");
            table.release(oldest);
        }
        let slot = &mut table.slots[i];
        slot.observed = true;
        let ewma = Ewma {
            samples: 1,
            factor: observed,
        };
        slot.applied
            .store(self.applied(&ewma).to_bits(), Ordering::Relaxed);
        *lock(&slot.ewma) = ewma;
        table.observed.push_back(i);
    }

    /// One more observation of a tracked model.
    fn update(&self, slot: &Slot, observed: f64) {
        let mut ewma = lock(&slot.ewma);
        ewma.factor += self.smoothing * (observed - ewma.factor);
        ewma.samples += 1;
        slot.applied
            .store(self.applied(&ewma).to_bits(), Ordering::Relaxed);
    }

    /// The applied factor for `key` and a memo for later observation, creating a pending slot
    /// for a model never seen (when an observation could follow).
    fn factor_for(&self, key: &str, base_input: u64) -> (f64, Memo) {
        let memo = |i: usize, generation: u32| {
            Memo::new(((i as u64) << 32) | u64::from(generation), base_input)
        };
        {
            let table = self.table.read().unwrap_or_else(|p| p.into_inner());
            if let Some(&i) = table.index.get(key) {
                let slot = &table.slots[i];
                return (
                    f64::from_bits(slot.applied.load(Ordering::Relaxed)),
                    memo(i, slot.generation),
                );
            }
        }
        if base_input == 0 {
            // Such an observation would be ignored: nothing to remember.
            return (1.0, Memo::EMPTY);
        }
        let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
        if let Some(&i) = table.index.get(key) {
            let slot = &table.slots[i];
            return (
                f64::from_bits(slot.applied.load(Ordering::Relaxed)),
                memo(i, slot.generation),
            );
        }
        // Pending models wait for their first observation; they are bounded separately (and
        // more generously, as many may be in flight at once) and evicted oldest first.
        while table.pending.len() >= self.max_models.saturating_mul(4) {
            let oldest = table.pending.pop_front().expect("non-empty");
            table.release(oldest);
        }
        let i = table.allocate(key);
        table.pending.push_back(i);
        (1.0, memo(i, table.slots[i].generation))
    }

    /// Feeds one observation by hand: `request` (as estimated) really used `usage`. A bulkhead
    /// using this estimator does this itself for every release with usage.
    ///
    /// # Errors
    ///
    /// A [`RequestError`](crate::request::RequestError) when the request's base estimate cannot be represented.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::Estimator, LlmRequest, estimate::ModelAwareEstimator, TokenUsage};
    ///
    /// let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?)
    ///     .smoothing(1.0)
    ///     .min_samples(1)
    ///     .build()?;
    /// let request = LlmRequest::new().model("claude-sonnet-4").user("x".repeat(390)); // base 100
    /// adaptive.observe_request(&request, TokenUsage::new(120, 0)?)?;
    /// assert_eq!(adaptive.estimate(&request)?.input, 120);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn observe_request(
        &self,
        request: &LlmRequest,
        usage: TokenUsage,
    ) -> Result<(), RequestError> {
        let base = self.base.base(request)?;
        let model = self.base.model_of(request);
        with_lowercase(model, |key| {
            self.record(Target::Key(key), base.input, usage)
        });
        Ok(())
    }

    /// Every observed model, oldest first.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::AdaptiveEstimator, LlmRequest, estimate::ModelAwareEstimator, TokenUsage};
    ///
    /// let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).build()?;
    /// adaptive.observe_request(&LlmRequest::new().model("GPT-4o").user("x".repeat(37)), TokenUsage::new(20, 0)?)?;
    /// let c = adaptive.corrections();
    /// assert_eq!((c[0].model.as_str(), c[0].samples, c[0].factor, c[0].applied), ("gpt-4o", 1, 2.0, 1.0));
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn corrections(&self) -> Vec<Correction> {
        let table = self.table.read().unwrap_or_else(|p| p.into_inner());
        table
            .observed
            .iter()
            .map(|&i| {
                let slot = &table.slots[i];
                let ewma = lock(&slot.ewma);
                Correction {
                    model: slot.key.to_string(),
                    samples: ewma.samples,
                    factor: ewma.factor,
                    applied: self.applied(&ewma),
                }
            })
            .collect()
    }

    /// Forgets the correction of `model` (matched lowercased), or of every model with `None`.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::AdaptiveEstimator, LlmRequest, estimate::ModelAwareEstimator, TokenUsage};
    ///
    /// let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).build()?;
    /// for model in ["a", "b"] {
    ///     adaptive.observe_request(&LlmRequest::new().model(model).user("xxxx"), TokenUsage::new(1, 0)?)?;
    /// }
    /// adaptive.reset(Some("A"));
    /// assert_eq!(adaptive.corrections().len(), 1);
    /// adaptive.reset(None);
    /// assert!(adaptive.corrections().is_empty());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn reset(&self, model: Option<&str>) {
        let mut table = self.table.write().unwrap_or_else(|p| p.into_inner());
        match model {
            None => {
                let live: Vec<usize> = table.index.values().copied().collect();
                for i in live {
                    table.release(i);
                }
                table.observed.clear();
                table.pending.clear();
            }
            Some(model) => {
                let found = with_lowercase(model, |key| table.index.get(key).copied());
                if let Some(i) = found {
                    table.observed.retain(|&o| o != i);
                    table.pending.retain(|&p| p != i);
                    table.release(i);
                }
            }
        }
    }
}

impl Estimator for AdaptiveEstimator {
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        let base = self.base.base(request)?;
        let (factor, memo) = with_lowercase(self.base.model_of(request), |key| {
            self.factor_for(key, base.input)
        });
        let input = if factor == 1.0 {
            base.input
        } else {
            let corrected = (base.input as f64 * factor).ceil();
            if corrected >= 18_446_744_073_709_551_616.0 {
                return Err(RequestError::TextTooLarge {
                    chars: request.text_len(),
                });
            }
            corrected as u64
        };
        Ok(TokenEstimate::new(input, base.max_output).with_memo(memo))
    }

    fn observe(&self, estimate: &TokenEstimate, usage: TokenUsage) {
        let (slot, base_input) = estimate.memo().parts();
        if slot == 0 {
            return;
        }
        self.record(
            Target::Memo((slot >> 32) as usize, slot as u32),
            base_input,
            usage,
        );
    }
}

impl fmt::Debug for AdaptiveEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AdaptiveEstimator")
            .field("base", &self.base)
            .field("smoothing", &self.smoothing)
            .field("min_samples", &self.min_samples)
            .field("min_correction", &self.min_correction)
            .field("max_correction", &self.max_correction)
            .field("max_models", &self.max_models)
            .finish_non_exhaustive()
    }
}

/// Builds an [`AdaptiveEstimator`](crate::estimate::AdaptiveEstimator); every option is validated when built, in the original's
/// order.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::EstimatorError, estimate::ModelAwareEstimator};
///
/// let base = || ModelAwareEstimator::builder().build().unwrap();
/// let err = AdaptiveEstimator::builder(base()).smoothing(0.0).build().unwrap_err();
/// assert_eq!(err, EstimatorError::Smoothing { value: 0.0 });
/// let err = AdaptiveEstimator::builder(base()).min_correction(2.0).max_correction(1.0).build().unwrap_err();
/// assert_eq!(err, EstimatorError::MaxCorrection { value: 1.0, min: 2.0 });
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
#[derive(Debug)]
pub struct AdaptiveEstimatorBuilder {
    base: ModelAwareEstimator,
    smoothing: f64,
    min_samples: u64,
    min_correction: f64,
    max_correction: f64,
    max_models: usize,
}

impl AdaptiveEstimatorBuilder {
    /// Weight of a new observation in the moving average, in `(0, 1]` (default 0.2).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::ModelAwareEstimator};
    /// assert!(AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).smoothing(1.0).build().is_ok());
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn smoothing(mut self, smoothing: f64) -> Self {
        self.smoothing = smoothing;
        self
    }

    /// Observations before a correction applies, at least 1 (default 5).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::EstimatorError, estimate::ModelAwareEstimator};
    /// let err = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).min_samples(0).build();
    /// assert_eq!(err.unwrap_err(), EstimatorError::MinSamples { value: 0 });
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn min_samples(mut self, min_samples: u64) -> Self {
        self.min_samples = min_samples;
        self
    }

    /// Lowest applied factor, finite and positive (default 0.5).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::ModelAwareEstimator};
    /// assert!(AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).min_correction(-1.0).build().is_err());
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn min_correction(mut self, min_correction: f64) -> Self {
        self.min_correction = min_correction;
        self
    }

    /// Highest applied factor, finite and at least `min_correction` (default 2).
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::ModelAwareEstimator};
    /// assert!(AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).max_correction(f64::INFINITY).build().is_err());
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn max_correction(mut self, max_correction: f64) -> Self {
        self.max_correction = max_correction;
        self
    }

    /// Most models tracked, at least 1 (default 64); the oldest-inserted is evicted first.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::ModelAwareEstimator};
    /// assert!(AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).max_models(0).build().is_err());
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn max_models(mut self, max_models: usize) -> Self {
        self.max_models = max_models;
        self
    }

    /// Validates the options (smoothing, min samples, min correction, max correction, max
    /// models, in that order) and builds the estimator.
    ///
    /// # Errors
    ///
    /// The [`EstimatorError`](crate::estimate::EstimatorError) of the first invalid option.
    ///
    /// # Examples
    ///
    /// ```
    /// # use async_bulkhead_llm::{estimate::AdaptiveEstimator, estimate::ModelAwareEstimator};
    /// let adaptive = AdaptiveEstimator::builder(ModelAwareEstimator::builder().build()?).build()?;
    /// assert!(adaptive.corrections().is_empty());
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    pub fn build(self) -> Result<AdaptiveEstimator, EstimatorError> {
        if !(self.smoothing.is_finite() && self.smoothing > 0.0 && self.smoothing <= 1.0) {
            return Err(EstimatorError::Smoothing {
                value: self.smoothing,
            });
        }
        if self.min_samples == 0 {
            return Err(EstimatorError::MinSamples {
                value: self.min_samples,
            });
        }
        if !(self.min_correction.is_finite() && self.min_correction > 0.0) {
            return Err(EstimatorError::MinCorrection {
                value: self.min_correction,
            });
        }
        if !(self.max_correction.is_finite() && self.max_correction >= self.min_correction) {
            return Err(EstimatorError::MaxCorrection {
                value: self.max_correction,
                min: self.min_correction,
            });
        }
        if self.max_models == 0 {
            return Err(EstimatorError::MaxModels {
                value: self.max_models,
            });
        }
        Ok(AdaptiveEstimator {
            base: self.base,
            smoothing: self.smoothing,
            min_samples: self.min_samples,
            min_correction: self.min_correction,
            max_correction: self.max_correction,
            max_models: self.max_models,
            table: RwLock::new(Table::default()),
        })
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn adaptive(
        smoothing: f64,
        min_samples: u64,
        clamp: (f64, f64),
        max_models: usize,
    ) -> AdaptiveEstimator {
        AdaptiveEstimator::builder(ModelAwareEstimator::builder().build().unwrap())
            .smoothing(smoothing)
            .min_samples(min_samples)
            .min_correction(clamp.0)
            .max_correction(clamp.1)
            .max_models(max_models)
            .build()
            .unwrap()
    }

    fn request(model: &str) -> LlmRequest {
        // 370 chars at 3.7 (gpt-4o family) or 400 at 4.0: base input 100 either way.
        let chars = if model.starts_with("gpt") { 370 } else { 400 };
        LlmRequest::new().model(model).user("x".repeat(chars))
    }

    fn usage(input: u64) -> TokenUsage {
        TokenUsage::new(input, 0).unwrap()
    }

    #[test]
    fn upstream_example_three_observations_of_one_and_a_half() {
        let a = adaptive(1.0, 3, (0.5, 2.0), 64);
        for _ in 0..2 {
            a.observe_request(&request("gpt-4o"), usage(150)).unwrap();
            assert_eq!(
                a.estimate(&request("gpt-4o")).unwrap().input,
                100,
                "not before min_samples"
            );
        }
        a.observe_request(&request("gpt-4o"), usage(150)).unwrap();
        assert_eq!(a.estimate(&request("gpt-4o")).unwrap().input, 150);
        let c = a.corrections();
        assert_eq!(
            c,
            vec![Correction {
                model: "gpt-4o".into(),
                samples: 3,
                factor: 1.5,
                applied: 1.5
            }]
        );
    }

    #[test]
    fn upstream_clamp_examples() {
        let a = adaptive(1.0, 1, (0.8, 1.5), 64);
        a.observe_request(&request("m"), usage(1000)).unwrap();
        assert_eq!(a.estimate(&request("m")).unwrap().input, 150);
        assert_eq!(a.corrections()[0].factor, 10.0);
        assert_eq!(a.corrections()[0].applied, 1.5);
        a.reset(None);
        a.observe_request(&request("m"), usage(1)).unwrap();
        assert_eq!(a.estimate(&request("m")).unwrap().input, 80);
    }

    #[test]
    fn ewma_follows_the_smoothing() {
        let a = adaptive(0.5, 1, (0.1, 10.0), 64);
        a.observe_request(&request("m"), usage(200)).unwrap(); // first sample: factor 2
        a.observe_request(&request("m"), usage(100)).unwrap(); // 2 + 0.5 * (1 - 2) = 1.5
        assert_eq!(a.corrections()[0].factor, 1.5);
        assert_eq!(a.corrections()[0].samples, 2);
    }

    #[test]
    fn evicts_the_oldest_inserted_not_the_least_recent() {
        let a = adaptive(1.0, 1, (0.1, 10.0), 2);
        a.observe_request(&request("a"), usage(100)).unwrap();
        a.observe_request(&request("b"), usage(100)).unwrap();
        a.observe_request(&request("a"), usage(100)).unwrap(); // updating keeps insertion order
        a.observe_request(&request("c"), usage(100)).unwrap(); // evicts "a"
        let models: Vec<String> = a.corrections().into_iter().map(|c| c.model).collect();
        assert_eq!(models, ["b", "c"]);
    }

    #[test]
    fn observations_go_against_the_uncorrected_base() {
        let a = adaptive(1.0, 1, (0.1, 10.0), 8);
        a.observe_request(&request("m"), usage(200)).unwrap();
        let corrected = a.estimate(&request("m")).unwrap();
        assert_eq!(corrected.input, 200);
        // The release path: the memo carries the base (100), so 200 observed means 2 again.
        a.observe(&corrected, usage(200));
        assert_eq!(a.corrections()[0].factor, 2.0);
        assert_eq!(
            a.estimate(&request("m")).unwrap().input,
            200,
            "no compounding"
        );
    }

    #[test]
    fn memos_of_estimated_models_create_state_on_first_observation() {
        let a = adaptive(1.0, 1, (0.1, 10.0), 1);
        let first = a.estimate(&request("new-model")).unwrap();
        assert!(
            a.corrections().is_empty(),
            "estimating alone creates no correction"
        );
        a.observe(&first, usage(300));
        assert_eq!(a.corrections()[0].model, "new-model");
        assert_eq!(a.estimate(&request("new-model")).unwrap().input, 300);
        // A memo whose model was reset meanwhile still names it: like upstream's
        // `observe(request, usage)` from a release, the observation inserts it again.
        let stale = a.estimate(&request("new-model")).unwrap();
        a.reset(Some("NEW-MODEL"));
        a.observe(&stale, usage(100));
        let c = a.corrections();
        assert_eq!(
            (c[0].model.as_str(), c[0].samples, c[0].factor),
            ("new-model", 1, 1.0)
        );
    }

    #[test]
    fn late_observations_of_evicted_models_insert_them_again() {
        let a = adaptive(1.0, 1, (0.1, 10.0), 2);
        // Three new models in flight at once; "a" is observed last, after "b" and "c" filled
        // the two places.
        let [ea, eb, ec] = ["a", "b", "c"].map(|m| a.estimate(&request(m)).unwrap());
        a.observe(&eb, usage(100));
        a.observe(&ec, usage(100));
        a.observe(&ea, usage(150));
        let models: Vec<String> = a.corrections().into_iter().map(|c| c.model).collect();
        assert_eq!(
            models,
            ["c", "a"],
            "\"a\" inserted, evicting the oldest (\"b\")"
        );
        // "b" still in flight, evicted: its release inserts it again.
        let eb2 = a.estimate(&request("c")).unwrap();
        a.observe(&eb, usage(100));
        let models: Vec<String> = a.corrections().into_iter().map(|c| c.model).collect();
        assert_eq!(models, ["a", "b"]);
        a.observe(&eb2, usage(100));
    }

    #[test]
    fn zero_base_input_is_ignored_and_output_never_corrected() {
        let a = adaptive(1.0, 1, (0.1, 10.0), 8);
        let empty = LlmRequest::new().model("m").max_tokens(50);
        a.observe_request(&empty, usage(500)).unwrap();
        assert!(a.corrections().is_empty());
        a.observe_request(&request("m"), usage(300)).unwrap();
        let e = a.estimate(&request("m").max_tokens(77)).unwrap();
        assert_eq!((e.input, e.max_output), (300, 77));
    }
}
