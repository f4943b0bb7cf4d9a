//! The request a bulkhead admits: just enough of an LLM call to estimate its token reservation.

/// An LLM request as the bulkhead sees it: the text that will be sent and the output ceiling.
///
/// Only the fields that drive estimation are modelled. Build one in code with the chaining
/// helpers, or fill the public fields directly.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Content, LlmRequest};
///
/// let request = LlmRequest::new()
///     .model("claude-sonnet-4")
///     .system("You are terse.")
///     .user("Summarise the attached report.")
///     .max_tokens(512);
/// assert_eq!(request.messages.len(), 1);
/// assert_eq!(request.max_tokens, Some(512));
/// assert_eq!(request.system, Some(Content::from("You are terse.")));
/// ```
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LlmRequest {
    /// The model this call targets; estimation falls back to the bulkhead's model when absent.
    pub model: Option<String>,
    /// The conversation, in order.
    pub messages: Vec<Message>,
    /// The system prompt, when sent separately from the messages.
    pub system: Option<Content>,
    /// The output ceiling the provider will enforce; the bulkhead's output cap when absent.
    pub max_tokens: Option<u64>,
    /// Input tokens the caller has already counted (tool schemas, media priced by the
    /// provider); added to the estimated input as is.
    pub extra_input_tokens: Option<u64>,
}

impl LlmRequest {
    /// An empty request: no model, no messages, no output ceiling.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new();
    /// assert!(request.messages.is_empty());
    /// ```
    pub fn new() -> LlmRequest {
        LlmRequest::default()
    }

    /// Sets the model.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new().model("gpt-4o");
    /// assert_eq!(request.model.as_deref(), Some("gpt-4o"));
    /// ```
    pub fn model(mut self, model: impl Into<String>) -> LlmRequest {
        self.model = Some(model.into());
        self
    }

    /// Appends a message with the given role.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new().message("assistant", "Hello!");
    /// assert_eq!(request.messages[0].role, "assistant");
    /// ```
    pub fn message(mut self, role: impl Into<String>, content: impl Into<Content>) -> LlmRequest {
        self.messages.push(Message {
            role: role.into(),
            content: content.into(),
        });
        self
    }

    /// Appends a `user` message.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new().user("What is a bulkhead?");
    /// assert_eq!(request.messages[0].role, "user");
    /// ```
    pub fn user(self, content: impl Into<Content>) -> LlmRequest {
        self.message("user", content)
    }

    /// Sets the system prompt.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new().system("Be brief.");
    /// assert!(request.system.is_some());
    /// ```
    pub fn system(mut self, content: impl Into<Content>) -> LlmRequest {
        self.system = Some(content.into());
        self
    }

    /// Sets the output ceiling.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new().max_tokens(256);
    /// assert_eq!(request.max_tokens, Some(256));
    /// ```
    pub fn max_tokens(mut self, max_tokens: u64) -> LlmRequest {
        self.max_tokens = Some(max_tokens);
        self
    }

    /// Sets the caller-counted extra input tokens.
    ///
    /// # Examples
    ///
    /// ```
    /// let request = async_bulkhead_llm::LlmRequest::new().extra_input_tokens(300);
    /// assert_eq!(request.extra_input_tokens, Some(300));
    /// ```
    pub fn extra_input_tokens(mut self, tokens: u64) -> LlmRequest {
        self.extra_input_tokens = Some(tokens);
        self
    }

    /// Number of characters of text in the messages and the system prompt, counted in UTF-16
    /// code units exactly as the JavaScript original counts them (so its chars-per-token
    /// ratios keep their meaning). Opaque blocks count nothing.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::LlmRequest;
    ///
    /// let request = LlmRequest::new().system("12345678").user("abcd");
    /// assert_eq!(request.text_len(), 12);
    /// // One emoji outside the Basic Multilingual Plane is two UTF-16 units.
    /// assert_eq!(LlmRequest::new().user("\u{1F600}").text_len(), 2);
    /// ```
    pub fn text_len(&self) -> u64 {
        let messages: u64 = self.messages.iter().map(|m| m.content.text_len()).sum();
        messages + self.system.as_ref().map_or(0, Content::text_len)
    }
}

/// One message of a conversation.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Content, Message};
///
/// let message = Message { role: "user".into(), content: Content::from("hi") };
/// assert_eq!(message.content.text_len(), 2);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    /// The speaker (`user`, `assistant`, `system`, `tool`, ...).
    pub role: String,
    /// What was said.
    pub content: Content,
}

/// Message content: plain text, or a list of blocks (text and opaque media).
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::{Content, ContentBlock};
///
/// let content = Content::Blocks(vec![
///     ContentBlock::text("Describe this image"),
///     ContentBlock::opaque("image"),
/// ]);
/// assert_eq!(content.text_len(), 19);
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Content {
    /// A plain string.
    Text(String),
    /// Structured content blocks.
    Blocks(Vec<ContentBlock>),
}

impl Content {
    /// UTF-16 length of the text this content carries; opaque blocks count 0.
    ///
    /// # Examples
    ///
    /// ```
    /// use async_bulkhead_llm::Content;
    ///
    /// assert_eq!(Content::from("héllo").text_len(), 5);
    /// assert_eq!(Content::Blocks(vec![]).text_len(), 0);
    /// ```
    pub fn text_len(&self) -> u64 {
        match self {
            Content::Text(text) => utf16_len(text),
            Content::Blocks(blocks) => blocks
                .iter()
                .map(|block| match block {
                    ContentBlock::Text(text) => utf16_len(text),
                    ContentBlock::Opaque { .. } => 0,
                })
                .sum(),
        }
    }
}

impl From<&str> for Content {
    fn from(text: &str) -> Content {
        Content::Text(text.to_owned())
    }
}

impl From<String> for Content {
    fn from(text: String) -> Content {
        Content::Text(text)
    }
}

impl From<Vec<ContentBlock>> for Content {
    fn from(blocks: Vec<ContentBlock>) -> Content {
        Content::Blocks(blocks)
    }
}

/// One block of structured content.
///
/// # Examples
///
/// ```
/// use async_bulkhead_llm::ContentBlock;
///
/// assert_eq!(ContentBlock::text("hi"), ContentBlock::Text("hi".into()));
/// assert_eq!(ContentBlock::opaque("image"), ContentBlock::Opaque { kind: "image".into() });
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ContentBlock {
    /// A text block; its text counts toward the estimate.
    Text(String),
    /// Anything else (images, documents, tool results...), identified by its type. A malformed
    /// text block is opaque too, with kind `"text"`.
    Opaque {
        /// The block's `type`.
        kind: String,
    },
}

impl ContentBlock {
    /// A text block.
    ///
    /// # Examples
    ///
    /// ```
    /// assert!(matches!(async_bulkhead_llm::ContentBlock::text("a"), async_bulkhead_llm::ContentBlock::Text(_)));
    /// ```
    pub fn text(text: impl Into<String>) -> ContentBlock {
        ContentBlock::Text(text.into())
    }

    /// An opaque block of the given type.
    ///
    /// # Examples
    ///
    /// ```
    /// let block = async_bulkhead_llm::ContentBlock::opaque("document");
    /// assert!(matches!(block, async_bulkhead_llm::ContentBlock::Opaque { .. }));
    /// ```
    pub fn opaque(kind: impl Into<String>) -> ContentBlock {
        ContentBlock::Opaque { kind: kind.into() }
    }
}

/// UTF-16 code units of `text`: every byte that starts a character counts one unit, and a
/// four-byte sequence (a character outside the BMP, a surrogate pair in UTF-16) one more.
/// ASCII text takes the `len()` fast path.
fn utf16_len(text: &str) -> u64 {
    if text.is_ascii() {
        return text.len() as u64;
    }
    text.bytes()
        .map(|b| u64::from((b & 0xC0) != 0x80) + u64::from(b >= 0xF0))
        .sum()
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::utf16_len;

    #[test]
    fn utf16_len_matches_encode_utf16() {
        for text in [
            "",
            "abc",
            "héllo",
            "日本語",
            "\u{1F600}x",
            "a\u{10FFFF}\u{80}\u{800}",
        ] {
            assert_eq!(
                utf16_len(text),
                text.encode_utf16().count() as u64,
                "{text:?}"
            );
        }
    }
}
