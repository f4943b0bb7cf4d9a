//! The request table of the dedup scenarios: 4 prompts × 3 variants (the *identities*: two
//! requests share only when their identities are equal), each written in several *forms* that
//! must share; 3 scopes. One deterministic test checks the table against a bulkhead.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use async_bulkhead_llm::{
    AcquireOptions, LlmBulkhead, LlmRequest, RunOptions, dedup::DedupScope, dedup::Deduplication,
    events::Event,
};

/// The scopes calls are made in (`None`: the unnamed scope).
pub(crate) const SCOPES: [Option<&str>; 3] = [None, Some("tenant-a"), Some("tenant-b")];

const PROMPTS: usize = 4;
/// Base, `max_tokens` + 100, warmer (the temperature in `extra`; without `serde`,
/// `extra_input_tokens`).
const VARIANTS: usize = 3;
/// Prompt lengths in words (the estimator sizes reservations from them).
const WORDS: [usize; PROMPTS] = [60, 150, 280, 20];
const MAX_TOKENS: [u64; PROMPTS] = [200, 300, 400, 100];
const SYSTEM: &str = "You are a terse assistant. Answer in one paragraph.";

/// The request table: `forms[identity]` are the requests of one identity.
pub(crate) struct Table {
    forms: Vec<Vec<LlmRequest>>,
}

impl Table {
    pub(crate) fn new() -> Table {
        let forms = (0..PROMPTS * VARIANTS)
            .map(|identity| forms(identity / VARIANTS, identity % VARIANTS))
            .collect();
        Table { forms }
    }

    pub(crate) fn identities(&self) -> usize {
        self.forms.len()
    }

    pub(crate) fn forms(&self, identity: usize) -> usize {
        self.forms[identity].len()
    }

    pub(crate) fn request(&self, identity: usize, form: usize) -> &LlmRequest {
        &self.forms[identity][form]
    }

    /// The index of the (identity, scope) key.
    pub(crate) fn key(&self, identity: usize, scope: usize) -> usize {
        identity * SCOPES.len() + scope
    }

    pub(crate) fn keys(&self) -> usize {
        self.identities() * SCOPES.len()
    }

    /// A random identity, skewed towards prompt 0 and the base variant (so that identical
    /// calls meet often), and a random form of it.
    pub(crate) fn pick(&self, rng: &mut fastrand::Rng) -> (usize, usize) {
        let prompt = if rng.bool() { 0 } else { rng.usize(1..PROMPTS) };
        let variant = match rng.u8(0..10) {
            0..=6 => 0,
            7 | 8 => 1,
            _ => 2,
        };
        let identity = prompt * VARIANTS + variant;
        (identity, rng.usize(0..self.forms(identity)))
    }
}

/// A random scope, the unnamed one most often.
pub(crate) fn pick_scope(rng: &mut fastrand::Rng) -> usize {
    match rng.u8(0..10) {
        0..=5 => 0,
        6 | 7 => 1,
        _ => 2,
    }
}

fn prompt(p: usize) -> String {
    let mut text = format!("Summarise incident report {p}:");
    for w in 0..WORDS[p] {
        text.push_str([" disk", " latency", " rollback", " page", " quorum"][(w + p) % 5]);
    }
    text
}

/// The forms of (prompt `p`, variant `v`): JSON bodies with the same members in other orders
/// (top level, messages, a nested object), with null members (equal to absent ones), with
/// whole numbers written as floats, and the request built in code.
#[cfg(feature = "serde")]
fn forms(p: usize, v: usize) -> Vec<LlmRequest> {
    let text = prompt(p);
    let max_tokens = MAX_TOKENS[p] + if v == 1 { 100 } else { 0 };
    let (temperature, spelled) = if v == 2 { (0.7, "0.70") } else { (0.2, "2e-1") };
    let bodies = [
        format!(
            r#"{{"model":"gpt-4o","messages":[{{"role":"system","content":"{SYSTEM}"}},{{"role":"user","content":"{text}"}}],"max_tokens":{max_tokens},"temperature":{temperature},"response_format":{{"type":"json_schema","json_schema":{{"name":"reply","strict":true}}}}}}"#
        ),
        format!(
            r#"{{"response_format":{{"json_schema":{{"strict":true,"name":"reply"}},"type":"json_schema"}},"temperature":{temperature},"max_tokens":{max_tokens},"messages":[{{"content":"{SYSTEM}","role":"system"}},{{"content":"{text}","role":"user"}}],"model":"gpt-4o"}}"#
        ),
        format!(
            r#"{{"stop":null,"model":"gpt-4o","max_completion_tokens":null,"temperature":{spelled},"messages":[{{"role":"system","content":"{SYSTEM}","name":null}},{{"role":"user","content":"{text}"}}],"response_format":{{"type":"json_schema","json_schema":{{"strict":true,"name":"reply","description":null}}}},"max_tokens":{max_tokens}.0}}"#
        ),
    ];
    let mut forms: Vec<LlmRequest> = bodies
        .iter()
        .map(|body| serde_json::from_str(body).expect("a valid body"))
        .collect();
    let mut built = LlmRequest::new()
        .model("gpt-4o")
        .message("system", SYSTEM)
        .user(text)
        .max_tokens(max_tokens);
    built
        .extra
        .insert("temperature".into(), serde_json::json!(temperature));
    built.extra.insert(
        "response_format".into(),
        serde_json::json!({"type": "json_schema", "json_schema": {"name": "reply", "strict": true}}),
    );
    forms.push(built);
    forms
}

/// Without `serde` a request has only its typed fields: the forms are built in different
/// orders, and the warmer variant differs by `extra_input_tokens`.
#[cfg(not(feature = "serde"))]
fn forms(p: usize, v: usize) -> Vec<LlmRequest> {
    let text = prompt(p);
    let max_tokens = MAX_TOKENS[p] + if v == 1 { 100 } else { 0 };
    let warm = |request: LlmRequest| {
        if v == 2 {
            request.extra_input_tokens(16)
        } else {
            request
        }
    };
    vec![
        warm(
            LlmRequest::new()
                .model("gpt-4o")
                .message("system", SYSTEM)
                .user(text.clone())
                .max_tokens(max_tokens),
        ),
        warm(
            LlmRequest::new()
                .max_tokens(max_tokens)
                .message("system", SYSTEM)
                .model("gpt-4o")
                .user(text),
        ),
    ]
}

/// Every form of every identity, in every scope, made before any is polled: the first of
/// each (identity, scope) leads and every other form follows it (followers 1, 2, ...);
/// nothing else shares (36 flights), and each caller gets its own leader's value.
#[test]
fn every_form_of_an_identity_shares_and_nothing_else_does() {
    let table = Table::new();
    let bulkhead = LlmBulkhead::builder("gpt-4o", 64)
        .deduplication(Deduplication::new())
        .build()
        .unwrap();
    // The dedup events of this thread's calls, in order.
    let joins = Arc::new(Mutex::new(Vec::new()));
    let heard = Arc::clone(&joins);
    let _subscription = bulkhead.on(move |event| {
        if let Event::Dedup(e) = event {
            heard.lock().unwrap().push(e.followers);
        }
    });
    let runs = Arc::new(AtomicU64::new(0));
    let mut calls = Vec::new();
    let mut followers = 0;
    for identity in 0..table.identities() {
        for (scope, name) in SCOPES.iter().enumerate() {
            for form in 0..table.forms(identity) {
                let mut options = RunOptions::from(AcquireOptions::new());
                if let Some(name) = name {
                    options = options.dedup_scope(DedupScope::new(name));
                }
                let runs = Arc::clone(&runs);
                let call = bulkhead.run_shared(
                    table.request(identity, form),
                    options,
                    move |_ctx| async move {
                        let run = runs.fetch_add(1, Ordering::Relaxed);
                        Ok::<_, ()>((identity, scope, run))
                    },
                );
                // Exactly one dedup event per follower, numbering it.
                let heard = std::mem::take(&mut *joins.lock().unwrap());
                let expected: Vec<u64> = (form > 0).then_some(form as u64).into_iter().collect();
                assert_eq!(
                    heard,
                    expected,
                    "identity {identity}, scope {scope}, form {form}: {:?}",
                    table.request(identity, form)
                );
                followers += u64::from(form > 0);
                calls.push((identity, scope, call));
            }
        }
    }
    let flights = (table.identities() * SCOPES.len()) as u64;
    let dedup = bulkhead.stats().deduplication.unwrap();
    assert_eq!((dedup.active, dedup.hits), (flights, followers));
    let results = futures::executor::block_on(futures::future::join_all(calls.into_iter().map(
        |(identity, scope, call)| async move {
            let (i, s, run) = call.await.unwrap();
            assert_eq!((i, s), (identity, scope));
            run
        },
    )));
    let mut distinct = results.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len() as u64, flights);
    let stats = bulkhead.stats();
    assert_eq!(stats.admitted, flights);
    assert_eq!(runs.load(Ordering::Relaxed), flights);
    assert_eq!(stats.deduplication.unwrap().active, 0);
}
