//! The model-aware estimator: chars-per-token ratios by model family, exactly as the
//! JavaScript original's `createModelAwareTokenEstimator` (`docs/design.md` §U13.3-§U13.4).

use core::fmt;
use std::collections::HashMap;

use super::{Estimator, TokenEstimate, add_input, text_tokens, with_lowercase};
use crate::llm::request::LlmRequest;
use crate::vocabulary::error::{EstimatorError, RequestError};
use crate::vocabulary::reservation::DEFAULT_OUTPUT_CAP;

/// The built-in ratio table: model-name prefix (lowercase) and characters per token. The
/// longest prefix the lowercased model starts with wins, so the table is kept sorted by prefix
/// length, longest first, and the first match is the answer (checked by a unit test).
const FAMILIES: [(&str, f64); 22] = [
    ("claude-3-5-sonnet", 3.9),
    ("claude-sonnet-4-5", 3.9),
    ("claude-3-5-haiku", 3.8),
    ("claude-haiku-4-5", 3.8),
    ("claude-3-sonnet", 3.9),
    ("claude-sonnet-4", 3.9),
    ("claude-opus-4-5", 3.9),
    ("claude-3-haiku", 3.8),
    ("claude-haiku-4", 3.8),
    ("claude-3-opus", 3.9),
    ("claude-opus-4", 3.9),
    ("gpt-4-turbo", 3.7),
    ("gemini-2.5", 3.8),
    ("gemini-1.5", 3.8),
    ("gemini-2", 3.8),
    ("gpt-4.1", 3.7),
    ("gpt-3.5", 3.8),
    ("o4-mini", 3.7),
    ("gpt-4o", 3.7),
    ("gpt-4", 3.7),
    ("o1", 3.7),
    ("o3", 3.7),
];

/// The ratio of a model no table entry or override knows.
const FALLBACK_RATIO: f64 = 4.0;

/// A hook told about every request whose model is unknown.
type UnknownModelHook = Box<dyn Fn(&str) + Send + Sync>;

/// Per-block surcharge for opaque (non-text) content blocks: images, documents, tool results.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::estimate::OpaqueBlockTokens;
///
/// assert_eq!(OpaqueBlockTokens::None.cost("image"), 0);
/// assert_eq!(OpaqueBlockTokens::Each(2048).cost("image"), 2048);
/// let by_type = OpaqueBlockTokens::by_type(Some(100), [("image", 1500)]);
/// assert_eq!((by_type.cost("image"), by_type.cost("document")), (1500, 100));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum OpaqueBlockTokens {
    /// No surcharge (the default): opaque blocks count nothing.
    #[default]
    None,
    /// Every opaque block costs this many tokens.
    Each(u64),
    /// A block costs its type's figure, else `default`, else nothing.
    ByType {
        /// Cost of a block whose type has no figure of its own.
        default: Option<u64>,
        /// Cost by block type.
        by_type: HashMap<String, u64>,
    },
}

impl OpaqueBlockTokens {
    /// Costs by block type, with a default for the other types.
    ///
    /// # Examples
    ///
    /// ```
    /// let t = async_bulkhead_llm::estimate::OpaqueBlockTokens::by_type(None, [("document", 800)]);
    /// assert_eq!(t.cost("image"), 0);
    /// ```
    pub fn by_type<K: Into<String>>(
        default: Option<u64>,
        by_type: impl IntoIterator<Item = (K, u64)>,
    ) -> OpaqueBlockTokens {
        OpaqueBlockTokens::ByType {
            default,
            by_type: by_type.into_iter().map(|(k, v)| (k.into(), v)).collect(),
        }
    }

    /// The cost of one opaque block of type `kind`.
    ///
    /// # Examples
    ///
    /// ```
    /// assert_eq!(async_bulkhead_llm::estimate::OpaqueBlockTokens::Each(5).cost(""), 5);
    /// ```
    pub fn cost(&self, kind: &str) -> u64 {
        match self {
            OpaqueBlockTokens::None => 0,
            OpaqueBlockTokens::Each(tokens) => *tokens,
            OpaqueBlockTokens::ByType { default, by_type } => {
                by_type.get(kind).copied().or(*default).unwrap_or(0)
            }
        }
    }
}

/// Estimates input as `ceil(chars / ratio)`, with the ratio of the request's model family (or
/// the bulkhead's default model), plus an optional per-opaque-block surcharge and the
/// request's `extra_input_tokens`; maximum output is the request's ceiling or the output cap.
///
/// Ratios: an override for the exact model name, else for its lowercase form; else the
/// built-in family whose prefix is the longest one the lowercased model starts with
/// (`claude-sonnet-4-5...` 3.9, `gpt-4o...` 3.7, `gemini-2...` 3.8, ...); else 4.0, after
/// telling the unknown-model hook.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{estimate::Estimator, LlmRequest, estimate::ModelAwareEstimator, estimate::OpaqueBlockTokens, request::ContentBlock};
///
/// let estimator = ModelAwareEstimator::builder()
///     .default_model("claude-sonnet-4")
///     .opaque_block_tokens(OpaqueBlockTokens::Each(2048))
///     .build()?;
/// let request = LlmRequest::new().user(vec![
///     ContentBlock::text("x".repeat(39)),
///     ContentBlock::opaque("image"),
///     ContentBlock::opaque("document"),
/// ]);
/// // 39 chars at 3.9 per token, plus two opaque blocks.
/// assert_eq!(estimator.estimate(&request)?.input, 10 + 4096);
/// // The request's own model wins over the default.
/// let gpt = LlmRequest::new().model("gpt-4o-mini").user("x".repeat(370));
/// assert_eq!(estimator.estimate(&gpt)?.input, 100);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct ModelAwareEstimator {
    overrides: HashMap<String, f64>,
    default_model: Option<String>,
    /// The default model's ratio, looked up once (`None`: unknown, the hook must fire).
    default_ratio: Option<f64>,
    output_cap: u64,
    on_unknown_model: Option<UnknownModelHook>,
    opaque: OpaqueBlockTokens,
}

impl ModelAwareEstimator {
    /// A builder with no overrides, no default model, output cap 2048, no surcharge.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = async_bulkhead_llm::estimate::ModelAwareEstimator::builder().build()?;
    /// assert_eq!(e.ratio_for("GPT-4o-2024"), 3.7);
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    pub fn builder() -> ModelAwareEstimatorBuilder {
        ModelAwareEstimatorBuilder {
            overrides: Vec::new(),
            default_model: None,
            output_cap: DEFAULT_OUTPUT_CAP,
            on_unknown_model: None,
            opaque: OpaqueBlockTokens::None,
        }
    }

    /// The model whose ratio a request uses: its own, else the default, else `""`.
    pub(crate) fn model_of<'a>(&'a self, request: &'a LlmRequest) -> &'a str {
        request
            .model
            .as_deref()
            .or(self.default_model.as_deref())
            .unwrap_or("")
    }

    /// Characters per token for `model`, calling the unknown-model hook (every time) when
    /// neither an override nor the family table knows it.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = async_bulkhead_llm::estimate::ModelAwareEstimator::builder().ratio("my-azure-gpt", 3.5).build()?;
    /// assert_eq!(e.ratio_for("my-azure-gpt"), 3.5);
    /// assert_eq!(e.ratio_for("claude-opus-4-1"), 3.9);
    /// assert_eq!(e.ratio_for("o3-mini"), 3.7);
    /// assert_eq!(e.ratio_for("gpt-5"), 4.0); // unknown: the fallback
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    pub fn ratio_for(&self, model: &str) -> f64 {
        self.lookup(model).unwrap_or_else(|| self.unknown(model))
    }

    fn unknown(&self, model: &str) -> f64 {
        if let Some(hook) = &self.on_unknown_model {
            hook(model);
        }
        FALLBACK_RATIO
    }

    /// The ratio for `request`: its model's, else the default model's (looked up once, at
    /// build time).
    fn ratio_of(&self, request: &LlmRequest) -> f64 {
        match &request.model {
            Some(model) => self.ratio_for(model),
            None => self
                .default_ratio
                .unwrap_or_else(|| self.unknown(self.model_of(request))),
        }
    }

    fn lookup(&self, model: &str) -> Option<f64> {
        if !self.overrides.is_empty() {
            if let Some(ratio) = self.overrides.get(model) {
                return Some(*ratio);
            }
            if let Some(ratio) = with_lowercase(model, |lower| self.overrides.get(lower).copied()) {
                return Some(ratio);
            }
        }
        with_lowercase(model, |lower| {
            FAMILIES
                .iter()
                .find(|(prefix, _)| lower.starts_with(prefix))
                .map(|&(_, ratio)| ratio)
        })
    }

    /// The estimate before any correction (the adaptive estimator corrects this one).
    pub(crate) fn base(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        // The ratio is looked up first: the hook fires even when the request is refused.
        let ratio = self.ratio_of(request);
        let text = text_tokens(request.text_len(), ratio)?;
        let extra = request.extra_input_tokens.unwrap_or(0);
        let mut opaque = Some(0u64);
        if self.opaque != OpaqueBlockTokens::None {
            request.for_each_opaque_block(|kind| {
                opaque = opaque.and_then(|sum| sum.checked_add(self.opaque.cost(kind)));
            });
        }
        let Some(opaque) = opaque else {
            // The surcharge alone overflows: report it at its ceiling.
            return Err(RequestError::InputOverflow {
                text_tokens: text,
                opaque_tokens: u64::MAX,
                extra_input_tokens: extra,
            });
        };
        let input = add_input(text, opaque, extra)?;
        Ok(TokenEstimate::new(
            input,
            request.output_ceiling().unwrap_or(self.output_cap),
        ))
    }
}

impl Estimator for ModelAwareEstimator {
    fn estimate(&self, request: &LlmRequest) -> Result<TokenEstimate, RequestError> {
        self.base(request)
    }
}

impl fmt::Debug for ModelAwareEstimator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelAwareEstimator")
            .field("overrides", &self.overrides)
            .field("default_model", &self.default_model)
            .field("output_cap", &self.output_cap)
            .field(
                "on_unknown_model",
                &self.on_unknown_model.as_ref().map(|_| ".."),
            )
            .field("opaque_block_tokens", &self.opaque)
            .finish()
    }
}

/// Builds a [`ModelAwareEstimator`](crate::estimate::ModelAwareEstimator); ratios are validated when built.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{estimate::EstimatorError, estimate::ModelAwareEstimator};
///
/// let err = ModelAwareEstimator::builder().ratio("m", 0.0).build().unwrap_err();
/// assert_eq!(err, EstimatorError::InvalidRatio { model: "m".into(), ratio: 0.0 });
/// ```
#[must_use = "a builder does nothing until `build()` is called"]
pub struct ModelAwareEstimatorBuilder {
    overrides: Vec<(String, f64)>,
    default_model: Option<String>,
    output_cap: u64,
    on_unknown_model: Option<UnknownModelHook>,
    opaque: OpaqueBlockTokens,
}

impl ModelAwareEstimatorBuilder {
    /// Uses `chars_per_token` for `model` (matched exactly, or by its lowercase form), ahead of
    /// the family table.
    ///
    /// # Examples
    ///
    /// ```
    /// let e = async_bulkhead_llm::estimate::ModelAwareEstimator::builder().ratio("my-deployment", 3.2).build()?;
    /// assert_eq!(e.ratio_for("MY-DEPLOYMENT"), 3.2);
    /// # Ok::<(), async_bulkhead_llm::estimate::EstimatorError>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn ratio(mut self, model: impl Into<String>, chars_per_token: f64) -> Self {
        self.overrides.push((model.into(), chars_per_token));
        self
    }

    /// The model of requests that name none.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::Estimator, LlmRequest, estimate::ModelAwareEstimator};
    ///
    /// let e = ModelAwareEstimator::builder().default_model("gpt-4o").build()?;
    /// assert_eq!(e.estimate(&LlmRequest::new().user("x".repeat(370)))?.input, 100);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn default_model(mut self, model: impl Into<String>) -> Self {
        self.default_model = Some(model.into());
        self
    }

    /// Maximum output of requests that state no ceiling (default 2048).
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{estimate::Estimator, LlmRequest, estimate::ModelAwareEstimator};
    ///
    /// let e = ModelAwareEstimator::builder().output_cap(64).build()?;
    /// assert_eq!(e.estimate(&LlmRequest::new())?.max_output, 64);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn output_cap(mut self, output_cap: u64) -> Self {
        self.output_cap = output_cap;
        self
    }

    /// Calls `hook` with the model name every time a request's model is unknown (the name may
    /// be empty).
    ///
    /// # Examples
    ///
    /// ```
    /// use std::sync::{Arc, Mutex};
    /// use async_bulkhead_llm::{estimate::Estimator, LlmRequest, estimate::ModelAwareEstimator};
    ///
    /// let seen = Arc::new(Mutex::new(Vec::new()));
    /// let log = seen.clone();
    /// let e = ModelAwareEstimator::builder()
    ///     .on_unknown_model(move |model| log.lock().unwrap().push(model.to_owned()))
    ///     .build()?;
    /// e.estimate(&LlmRequest::new().model("gpt-5"))?;
    /// e.estimate(&LlmRequest::new())?;
    /// assert_eq!(*seen.lock().unwrap(), ["gpt-5", ""]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn on_unknown_model(mut self, hook: impl Fn(&str) + Send + Sync + 'static) -> Self {
        self.on_unknown_model = Some(Box::new(hook));
        self
    }

    /// Charges opaque blocks (images, documents, ...) with this surcharge.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::{request::ContentBlock, estimate::Estimator, LlmRequest, estimate::ModelAwareEstimator, estimate::OpaqueBlockTokens};
    ///
    /// let e = ModelAwareEstimator::builder()
    ///     .opaque_block_tokens(OpaqueBlockTokens::by_type(Some(10), [("image", 1500)]))
    ///     .build()?;
    /// let request = LlmRequest::new()
    ///     .user(vec![ContentBlock::opaque("image"), ContentBlock::opaque("tool_result")]);
    /// assert_eq!(e.estimate(&request)?.input, 1510);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    #[must_use = "a builder method returns the changed value; it does not change the receiver"]
    pub fn opaque_block_tokens(mut self, tokens: OpaqueBlockTokens) -> Self {
        self.opaque = tokens;
        self
    }

    /// Validates the overrides and builds the estimator.
    ///
    /// # Errors
    ///
    /// [`EstimatorError::InvalidRatio`](crate::estimate::EstimatorError::InvalidRatio) for the first ratio that is not finite and positive.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::estimate::ModelAwareEstimator;
    ///
    /// assert!(ModelAwareEstimator::builder().ratio("m", f64::NAN).build().is_err());
    /// assert!(ModelAwareEstimator::builder().ratio("m", -1.0).build().is_err());
    /// assert!(ModelAwareEstimator::builder().ratio("m", 1e-3).build().is_ok());
    /// ```
    pub fn build(self) -> Result<ModelAwareEstimator, EstimatorError> {
        let mut overrides = HashMap::with_capacity(self.overrides.len());
        for (model, ratio) in self.overrides {
            if !(ratio.is_finite() && ratio > 0.0) {
                return Err(EstimatorError::InvalidRatio { model, ratio });
            }
            overrides.insert(model, ratio);
        }
        let mut estimator = ModelAwareEstimator {
            overrides,
            default_model: self.default_model,
            default_ratio: None,
            output_cap: self.output_cap,
            on_unknown_model: self.on_unknown_model,
            opaque: self.opaque,
        };
        estimator.default_ratio =
            estimator.lookup(estimator.default_model.as_deref().unwrap_or(""));
        Ok(estimator)
    }
}

impl fmt::Debug for ModelAwareEstimatorBuilder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelAwareEstimatorBuilder")
            .finish_non_exhaustive()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    fn plain() -> ModelAwareEstimator {
        ModelAwareEstimator::builder().build().unwrap()
    }

    #[test]
    fn the_table_is_sorted_longest_prefix_first() {
        assert!(FAMILIES.windows(2).all(|w| w[0].0.len() >= w[1].0.len()));
    }

    #[test]
    fn family_matching_examples_of_the_original() {
        let e = plain();
        for (model, ratio) in [
            ("claude-3-7-sonnet-20250219", 4.0),
            ("gpt-5-mini", 4.0),
            ("o3-mini", 3.7),
            ("gpt-4o-mini", 3.7),
            ("gemini-2.0-flash", 3.8),
            ("claude-opus-4-1", 3.9),
            ("o4", 4.0),
            ("chatgpt-4o-latest", 4.0),
            ("GPT-4O", 3.7),
            ("Claude-Haiku-4-5", 3.8),
            ("claude-3-5-haiku-latest", 3.8),
            ("claude-sonnet-4-5-20250929", 3.9),
            ("gpt-4-turbo-preview", 3.7),
            ("gpt-3.5-turbo", 3.8),
            ("", 4.0),
        ] {
            assert_eq!(e.ratio_for(model), ratio, "{model}");
        }
    }

    #[test]
    fn test_pinned_numbers() {
        let e = plain();
        for (model, chars) in [
            ("claude-sonnet-4", 390),
            ("claude-3-haiku", 380),
            ("gpt-4o", 370),
            ("x", 400),
        ] {
            let request = LlmRequest::new().model(model).user("x".repeat(chars));
            assert_eq!(e.estimate(&request).unwrap().input, 100, "{model}");
        }
    }

    #[test]
    fn overrides_match_exact_then_lowercase() {
        let e = ModelAwareEstimator::builder()
            .ratio("Mixed-Case", 2.0)
            .ratio("lower", 3.0)
            .build()
            .unwrap();
        assert_eq!(e.ratio_for("Mixed-Case"), 2.0);
        assert_eq!(e.ratio_for("mixed-case"), 4.0, "the key is not lowercased");
        assert_eq!(e.ratio_for("LOWER"), 3.0);
        let e = ModelAwareEstimator::builder()
            .ratio("gpt-4o", 1.0)
            .build()
            .unwrap();
        assert_eq!(e.ratio_for("gpt-4o"), 1.0, "an override beats the table");
        assert_eq!(
            e.ratio_for("gpt-4o-mini"),
            3.7,
            "overrides are exact, not prefixes"
        );
    }

    #[test]
    fn unicode_lowercasing_like_javascript() {
        // KELVIN SIGN lowercases to ASCII 'k' in JavaScript and in Rust alike.
        assert_eq!("\u{212A}".to_lowercase(), "k");
        let e = ModelAwareEstimator::builder()
            .ratio("k", 2.5)
            .build()
            .unwrap();
        assert_eq!(e.ratio_for("\u{212A}"), 2.5);
    }

    #[test]
    fn surcharge_counts_system_blocks_and_malformed_text_blocks() {
        let e = ModelAwareEstimator::builder()
            .opaque_block_tokens(OpaqueBlockTokens::by_type(Some(1), [("text", 7)]))
            .build()
            .unwrap();
        let request = LlmRequest::new()
            .user(vec![
                crate::llm::request::ContentBlock::opaque("text"),
                crate::llm::request::ContentBlock::text("abcd"),
            ])
            .system(vec![crate::llm::request::ContentBlock::opaque("image")]);
        assert_eq!(e.estimate(&request).unwrap().input, 1 + 7 + 1);
    }
}
