//! Operation sequences against the reference model of `stress/tests/model/reference/`.
//!
//! An arbitrary `Config` and up to [`MAX_OPS`] arbitrary `Op`s are fed to `model::Harness`,
//! which drives a real `LlmBulkhead` and the sequential reference model side by side and panics
//! on the first disagreement (every result, rejection detail, usage and release report, limits
//! outcome, live permit, `stats()` field and recorded event, after every operation and after
//! every re-poll of the waiters and drains). That panic is the oracle; `finish` then checks the
//! end invariants. The harness runs the crate on a worker thread and libFuzzer's panic hook
//! aborts on a panic in any thread, so a disagreement is reported as a crash either way.
//!
//! The mirror types below are what `arbitrary` builds; they are converted into the model's
//! `Config` and `Op` with the same shape as the proptest generators of `stress/tests/model/proptests.rs`:
//! mostly small values against budgets of a few thousand tokens, and a steady share of the
//! edges the crate must refuse or saturate at (0, 1, `MAX_CONCURRENT`, `MAX_BUDGET` = 2^35 - 1,
//! `MAX_REVISION` = 2^53 - 1, `u64::MAX` and their neighbours).

#![no_main]

// The model is shared with the `model` test binary (`stress/tests/model/`), which uses more of it than
// this target does (`finish_with_tally`, `tally`): whatever the model adds for the tests may be
// unused here.
#[allow(dead_code)]
#[path = "../../stress/tests/model/reference/mod.rs"]
mod model;

use arbitrary::Arbitrary;
use async_bulkhead_llm::{limits::MAX_BUDGET, limits::MAX_CONCURRENT, limits::MAX_REVISION};
use libfuzzer_sys::fuzz_target;
use model::{Call, ClassCaps, Config, Harness, MAX_CHARS, Op};

/// Most operations applied per input (the proptest sequences have up to 60).
const MAX_OPS: usize = 64;

fuzz_target!(|input: Input| {
    let mut harness = Harness::new(input.config.into_model());
    for op in input.ops.iter().take(MAX_OPS) {
        harness.apply(&op.into_model());
    }
    harness.finish();
});

#[derive(Arbitrary, Debug)]
struct Input {
    config: FuzzConfig,
    ops: Vec<FuzzOp>,
}

// ===== numbers =====

/// A value near one of the edges the limits care about.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Edge {
    Zero,
    MaxConcurrent,
    U32Max,
    MaxBudget,
    MaxRevision,
    HalfU64,
    U64Max,
}

impl Edge {
    /// The edge moved by `delta` (saturating at 0 and `u64::MAX`).
    fn near(self, delta: i8) -> u64 {
        let base = match self {
            Edge::Zero => 0,
            Edge::MaxConcurrent => u64::from(MAX_CONCURRENT),
            Edge::U32Max => u64::from(u32::MAX),
            Edge::MaxBudget => MAX_BUDGET,
            Edge::MaxRevision => MAX_REVISION,
            Edge::HalfU64 => u64::MAX / 2 + 1,
            Edge::U64Max => u64::MAX,
        };
        // Mostly the edge itself or one step off it.
        base.saturating_add_signed(i64::from(delta % 3))
    }
}

/// Token counts: mostly small (against budgets of a few thousand), sometimes at the edges of
/// what the crate can count or represent (`tokens()` in `stress/tests/model/proptests.rs`).
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Tokens {
    Small(u16),
    Small2(u16),
    Medium(u16),
    Zero,
    Edge(Edge, i8),
    Raw(u64),
}

impl Tokens {
    fn get(self) -> u64 {
        match self {
            Tokens::Small(n) | Tokens::Small2(n) => u64::from(n % 400),
            Tokens::Medium(n) => 400 + u64::from(n % 2100),
            Tokens::Zero => 0,
            Tokens::Edge(edge, delta) => edge.near(delta),
            Tokens::Raw(n) => n,
        }
    }
}

/// A budget or reserve for `ApplyLimits` / `SetBudget`: mostly below 4000, else any `Tokens`.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Amount {
    Small(u16),
    Small2(u16),
    Any(Tokens),
}

impl Amount {
    fn get(self, small_below: u16) -> u64 {
        match self {
            Amount::Small(n) | Amount::Small2(n) => u64::from(n % small_below),
            Amount::Any(t) => t.get(),
        }
    }
}

// ===== the configuration =====

#[derive(Arbitrary, Debug, Clone, Copy)]
enum MaxConcurrent {
    Small(u8),
    Small2(u8),
    Limit,
    Over(bool),
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum MaxQueue {
    Small(u8),
    Small2(u8),
    Zero,
    Max,
    Raw(u32),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Revision {
    Small(u8),
    Small2(u8),
    NearMax(u8),
    Over(bool),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Budget {
    Small(u16),
    Small2(u16),
    Zero,
    Max,
    Over(bool),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum Reserve {
    Zero,
    Small(u16),
    Raw(u64),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct FuzzConfig {
    max_concurrent: MaxConcurrent,
    max_queue: MaxQueue,
    budget: (Budget, Reserve),
    /// No token budget when this is 0 (of 0..=3): a budget three times in four, as in
    /// `any_config()`.
    unbudgeted: u8,
    initial_revision: Revision,
}

impl FuzzConfig {
    fn into_model(self) -> Config {
        let max_concurrent = match self.max_concurrent {
            MaxConcurrent::Small(n) | MaxConcurrent::Small2(n) => u32::from(n % 4),
            MaxConcurrent::Limit => MAX_CONCURRENT,
            MaxConcurrent::Over(false) => MAX_CONCURRENT + 1,
            MaxConcurrent::Over(true) => u32::MAX,
            MaxConcurrent::Raw(n) => n,
        };
        let max_queue = match self.max_queue {
            MaxQueue::Small(n) | MaxQueue::Small2(n) => 1 + u32::from(n % 4),
            MaxQueue::Zero => 0,
            MaxQueue::Max => u32::MAX,
            MaxQueue::Raw(n) => n,
        };
        let budget = Some(self.budget)
            .filter(|_| !self.unbudgeted.is_multiple_of(4))
            .map(|(b, r)| {
                let budget = match b {
                    Budget::Small(n) | Budget::Small2(n) => u64::from(n % 4000),
                    Budget::Zero => 0,
                    Budget::Max => MAX_BUDGET,
                    Budget::Over(false) => MAX_BUDGET + 1,
                    Budget::Over(true) => u64::MAX,
                };
                let reserve = match r {
                    Reserve::Zero => 0,
                    Reserve::Small(n) => u64::from(n % 1500),
                    Reserve::Raw(n) => n,
                };
                (budget, reserve)
            });
        let initial_revision = match self.initial_revision {
            Revision::Small(n) | Revision::Small2(n) => u64::from(n % 4),
            Revision::NearMax(n) => MAX_REVISION - u64::from(n % 3),
            Revision::Over(false) => MAX_REVISION + 1,
            Revision::Over(true) => u64::MAX,
            Revision::Raw(n) => n,
        };
        // Admission classes and deduplication are left to the model's proptests (stress/tests/model).
        Config {
            max_concurrent,
            max_queue,
            budget,
            initial_revision,
            classes: None,
            dedup: None,
            rate: None,
        }
    }
}

// ===== operations =====

/// Characters of the user message: mostly short, any length up to `MAX_CHARS`.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Chars {
    Short(u16),
    Short2(u16),
    Short3(u16),
    Any(u16),
}

#[derive(Arbitrary, Debug, Clone, Copy)]
struct FuzzCall {
    high: bool,
    /// Explicit reservation unless this is 0 or 1 (of 0..=3): mostly explicit, as in `call()`.
    estimated: u8,
    input: Tokens,
    max_output: Tokens,
    model: u8,
    chars: Chars,
    max_tokens: Option<Tokens>,
    extra_input: Option<Tokens>,
}

impl FuzzCall {
    fn into_model(self) -> Call {
        let chars = match self.chars {
            Chars::Short(n) | Chars::Short2(n) | Chars::Short3(n) => u32::from(n % 2000),
            Chars::Any(n) => u32::from(n) % MAX_CHARS,
        };
        Call {
            high: self.high,
            explicit: !self.estimated.is_multiple_of(4),
            input: self.input.get(),
            max_output: self.max_output.get(),
            model: self.model % 4,
            class: 0,
            chars,
            has_max_tokens: self.max_tokens.is_some(),
            max_tokens: self.max_tokens.map_or(0, Tokens::get),
            has_extra_input: self.extra_input.is_some(),
            extra_input: self.extra_input.map_or(0, Tokens::get),
        }
    }
}

/// A revision step for `ApplyLimits`: mostly forward by one or two, sometimes stale or huge.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum Delta {
    Forward(bool),
    Forward2(bool),
    Forward3(bool),
    Stale(bool),
    Max,
    Raw(i64),
}

impl Delta {
    fn get(self) -> i64 {
        match self {
            Delta::Forward(two) | Delta::Forward2(two) | Delta::Forward3(two) => 1 + i64::from(two),
            Delta::Stale(back) => -i64::from(back),
            Delta::Max => i64::MAX,
            Delta::Raw(n) => n,
        }
    }
}

#[derive(Arbitrary, Debug, Clone, Copy)]
enum LimitConcurrent {
    Small(u8),
    Small2(u8),
    Over,
}

/// One operation; indices are taken modulo the live permits or waiters by the harness.
#[derive(Arbitrary, Debug, Clone, Copy)]
enum FuzzOp {
    TryAcquire {
        owned: bool,
        call: FuzzCall,
    },
    Acquire {
        owned: bool,
        timeout: u8,
        call: FuzzCall,
    },
    WouldAdmit {
        with_detail: bool,
        call: FuzzCall,
    },
    Estimate {
        call: FuzzCall,
    },
    ReportUsage {
        permit: u8,
        input: Tokens,
        output: Tokens,
    },
    ReportProgressive {
        permit: u8,
        input: Tokens,
        output: Tokens,
        remaining: Tokens,
        /// A small margin (below 200) unless given.
        margin: Option<Tokens>,
        small_margin: u8,
    },
    Release {
        permit: u8,
        /// With usage unless this is 0 (of 0..=3).
        usage: u8,
        input: Tokens,
        output: Tokens,
    },
    DropPermit {
        permit: u8,
    },
    CancelWaiter {
        waiter: u8,
    },
    PollWaiter {
        waiter: u8,
    },
    AutoPoll {
        on: bool,
    },
    ApplyLimits {
        revision_delta: Delta,
        max_concurrent: LimitConcurrent,
        max_queue: u8,
        /// Flips the budget's presence when this is 0 (of 0..=15), rarely as in `op()`.
        flip: u8,
        budget: Amount,
        reserve: Amount,
    },
    SetBudget {
        tokens: Amount,
    },
    Close,
    Drain {
        zero_timeout: bool,
    },
    Listen {
        on: bool,
    },
}

impl FuzzOp {
    fn into_model(self) -> Op {
        match self {
            FuzzOp::TryAcquire { owned, call } => Op::TryAcquire {
                owned,
                call: call.into_model(),
            },
            FuzzOp::Acquire {
                owned,
                timeout,
                call,
            } => Op::Acquire {
                owned,
                // 0 or 3: no timeout, 1: zero, 2: one hour.
                timeout: timeout % 4,
                call: call.into_model(),
            },
            FuzzOp::WouldAdmit { with_detail, call } => Op::WouldAdmit {
                with_detail,
                call: call.into_model(),
            },
            FuzzOp::Estimate { call } => Op::Estimate {
                call: call.into_model(),
            },
            FuzzOp::ReportUsage {
                permit,
                input,
                output,
            } => Op::ReportUsage {
                permit: permit.into(),
                input: input.get(),
                output: output.get(),
            },
            FuzzOp::ReportProgressive {
                permit,
                input,
                output,
                remaining,
                margin,
                small_margin,
            } => Op::ReportProgressive {
                permit: permit.into(),
                input: input.get(),
                output: output.get(),
                remaining: remaining.get(),
                margin: margin.map_or(u64::from(small_margin % 200), Tokens::get),
            },
            FuzzOp::Release {
                permit,
                usage,
                input,
                output,
            } => Op::Release {
                permit: permit.into(),
                with_usage: !usage.is_multiple_of(4),
                input: input.get(),
                output: output.get(),
            },
            FuzzOp::DropPermit { permit } => Op::DropPermit {
                permit: permit.into(),
            },
            FuzzOp::CancelWaiter { waiter } => Op::CancelWaiter {
                waiter: waiter.into(),
            },
            FuzzOp::PollWaiter { waiter } => Op::PollWaiter {
                waiter: waiter.into(),
            },
            FuzzOp::AutoPoll { on } => Op::AutoPoll { on },
            FuzzOp::ApplyLimits {
                revision_delta,
                max_concurrent,
                max_queue,
                flip,
                budget,
                reserve,
            } => Op::ApplyLimits {
                revision_delta: revision_delta.get(),
                max_concurrent: match max_concurrent {
                    LimitConcurrent::Small(n) | LimitConcurrent::Small2(n) => u32::from(n % 5),
                    LimitConcurrent::Over => MAX_CONCURRENT + 1,
                },
                max_queue: u32::from(max_queue % 5),
                flip_budget: flip.is_multiple_of(16),
                budget: budget.get(4000),
                reserve: reserve.get(1500),
                class_shape: 0,
                class_order: 0,
                classes: [ClassCaps::default(); 4],
            },
            FuzzOp::SetBudget { tokens } => Op::SetBudget {
                tokens: tokens.get(4000),
            },
            FuzzOp::Close => Op::Close,
            FuzzOp::Drain { zero_timeout } => Op::Drain { zero_timeout },
            FuzzOp::Listen { on } => Op::Listen { on },
        }
    }
}
