//! The token budget never makes a call wait (Q7).

use async_bulkhead_llm::{Limits, LlmBulkhead, Profile, RejectReason, TokenBudget};

use crate::support::{
    assert_pending, budgeted, count, figures, queued, ready, reason_of, rejection, req, tokens,
    toks,
};

/// An empty request for futures that outlive the statement that made them (an acquire
/// borrows its request until its first poll).
static EMPTY_REQUEST: std::sync::LazyLock<async_bulkhead_llm::LlmRequest> =
    std::sync::LazyLock::new(async_bulkhead_llm::LlmRequest::new);

#[test]
fn tokens_that_do_not_fit_are_refused_at_once_even_with_a_queue() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(600)).expect("free slot");
    let mut big = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, toks(500)));
    let refused = rejection(ready(&mut big));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    let d = refused.detail();
    let t = d.token_budget.expect("budget detail");
    assert_eq!(
        (t.budget, t.in_flight_tokens, t.available, t.requested),
        (1000, 600, 400, 500)
    );
    assert_eq!(d.pending, 0);
    assert_eq!(bulkhead.stats().pending, 0);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 1);

    // Tokens that fit wait for the slot instead.
    let mut fits = queued(&bulkhead, toks(400));
    assert_eq!(bulkhead.stats().pending, 1);
    // A newcomer that does not fit is still refused at once, not queued behind it.
    let mut big = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, toks(401)));
    assert_eq!(reason_of(ready(&mut big)), RejectReason::BudgetLimit);
    assert_eq!(bulkhead.stats().pending, 1);
    drop(held);
    let permit = ready(&mut fits).expect("handed the slot and its tokens");
    assert_eq!(permit.held_tokens(), 400);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 400);
    drop(permit);
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 2);
}

#[test]
fn the_batch_profile_does_not_queue_for_tokens() {
    let bulkhead = LlmBulkhead::builder("test-model", 4)
        .profile(Profile::Batch)
        .token_budget(TokenBudget::new(1000))
        .build()
        .expect("valid configuration");
    let held = bulkhead.try_acquire(&req(), toks(600)).expect("free slot");
    let mut fut = Box::pin(bulkhead.acquire(&EMPTY_REQUEST, toks(500)));
    assert_eq!(reason_of(ready(&mut fut)), RejectReason::BudgetLimit);
    assert_eq!(bulkhead.stats().pending, 0);
    drop(held);
}

#[test]
fn a_waiter_whose_tokens_do_not_fit_at_its_turn_passes_the_turn_on() {
    // The slots are raised to 4; the head takes 500, which leaves 400 of the 1000: the second
    // waiter's 450 no longer fit at its turn, the third's 100 do.
    let bulkhead = budgeted(1, 5, 1000);
    let held = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(500));
    let mut b = queued(&bulkhead, toks(450));
    let mut c = queued(&bulkhead, toks(100));
    assert_eq!(figures(&bulkhead), (1, 3, 1));
    bulkhead
        .apply_limits(
            Limits::new(1, 4)
                .with_max_queue(5)
                .with_token_budget(1000, 0),
        )
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (3, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 700);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 1);

    let refused = rejection(ready(&mut b));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(refused.limit_revision(), 1);
    let t = refused.detail().token_budget.expect("budget detail");
    assert_eq!((t.in_flight_tokens, t.requested), (600, 450));
    let pc = ready(&mut c).expect("the turn passed to C");
    let pa = ready(&mut a).expect("A was granted first");
    assert_eq!((pa.held_tokens(), pc.held_tokens()), (500, 100));
    assert_eq!(figures(&bulkhead), (3, 0, 3));

    drop((held, pa, pc));
    assert_eq!(figures(&bulkhead), (0, 0, 3));
    let t = tokens(&bulkhead);
    assert_eq!((t.in_flight_tokens, t.total_reserved), (0, 700));
    assert_eq!(bulkhead.stats().released, 3);
}

#[test]
fn a_waiter_whose_tokens_no_longer_fit_is_refused_at_its_turn_and_the_next_gets_the_slot() {
    let bulkhead = budgeted(1, 4, 1000);
    let held = bulkhead.try_acquire(&req(), toks(600)).expect("free slot");
    let mut a = queued(&bulkhead, toks(400));
    let mut b = queued(&bulkhead, toks(100));
    let shrunk = bulkhead.set_budget(300).expect("has a budget");
    assert_eq!(shrunk.revision, 1);
    // No slot has freed: nobody has reached its turn, both keep their places.
    assert_eq!(figures(&bulkhead), (1, 2, 1));
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 0);
    assert_pending(&mut a);
    assert_pending(&mut b);

    drop(held);
    // A's turn: 400 > 300, refused; the turn passes to B, whose 100 fit: B holds the slot.
    assert_eq!(figures(&bulkhead), (1, 0, 1));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 100);
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 1);
    let refused = rejection(ready(&mut a));
    assert_eq!(refused.reason(), RejectReason::BudgetLimit);
    assert_eq!(refused.limit_revision(), 1);
    let t = refused.detail().token_budget.expect("budget detail");
    assert_eq!((t.budget, t.requested), (300, 400));
    let pb = ready(&mut b).expect("B gets the slot");
    assert_eq!((pb.held_tokens(), pb.limit_revision()), (100, 1));
    drop(pb);
    assert_eq!(figures(&bulkhead), (0, 0, 2));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

#[test]
fn a_waiter_behind_a_granted_head_keeps_its_place_until_a_slot_frees_for_it() {
    let bulkhead = budgeted(2, 4, 1000);
    let h1 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let h2 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(500)); // 200 + 500 fit
    let mut b = queued(&bulkhead, toks(450)); // 200 + 450 fit
    drop(h1);
    // A takes the freed slot (100 + 500 held). B is now the head but no slot is free for it:
    // its turn has not come, so it keeps waiting.
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 600);
    assert_eq!(figures(&bulkhead), (2, 1, 2));
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 0);
    let pa = ready(&mut a).expect("A gets the freed slot");
    assert_pending(&mut b);
    drop(h2);
    // B's turn: 500 + 450 = 950 fit in 1000.
    let pb = ready(&mut b).expect("B gets the next slot");
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 950);
    drop((pa, pb));
    assert_eq!(figures(&bulkhead), (0, 0, 4));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}

#[test]
fn a_limit_change_that_frees_no_slot_does_not_refuse_a_waiter_for_tokens() {
    let bulkhead = budgeted(2, 4, 1000);
    let h1 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let h2 = bulkhead.try_acquire(&req(), toks(100)).expect("free slot");
    let mut a = queued(&bulkhead, toks(500)); // 200 + 500 fit
    let mut b = queued(&bulkhead, toks(450)); // 200 + 450 fit
    drop(h1);
    let pa = ready(&mut a).expect("A gets the freed slot");
    assert_eq!(figures(&bulkhead), (2, 1, 3));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 600);
    // Only the queue grows: no slot frees, so B's turn has not come and it keeps waiting.
    bulkhead
        .apply_limits(
            Limits::new(1, 2)
                .with_max_queue(8)
                .with_token_budget(1000, 0),
        )
        .expect("valid limits");
    assert_eq!(figures(&bulkhead), (2, 1, 3));
    assert_eq!(count(&bulkhead, RejectReason::BudgetLimit), 0);
    assert_pending(&mut b);
    drop(h2);
    // B's turn: 500 + 450 = 950 fit in 1000.
    let pb = ready(&mut b).expect("B gets the next slot");
    assert_eq!((pb.held_tokens(), pb.limit_revision()), (450, 1));
    drop((pa, pb));
    assert_eq!(figures(&bulkhead), (0, 0, 4));
    assert_eq!(tokens(&bulkhead).in_flight_tokens, 0);
}
