//! Observe mode's execution on [`LlmCore`]: starting a bypass (after its hard checks), the
//! usage reports of a bypassed call and its end. A bypass holds nothing, so these only
//! validate, count and announce.

use core::time::Duration;

use crate::events::{
    BypassEvent, BypassReleaseEvent, BypassUsageEvent, Event, EventKind, RejectEvent,
};
use crate::vocabulary::admission_class::AdmissionClass;
use crate::vocabulary::error::UsageError;
use crate::vocabulary::rejection::{RejectReason, Rejection};
use crate::vocabulary::reservation::{Progressive, TokenUsage, UsageReport};

use super::observe::{Bypass, BypassCall};
use super::shared::LlmCore;
use super::usage::{cumulative, report_figures};

impl LlmCore {
    /// Starts `bypass` after its hard check: a closed bulkhead refuses it with `shutdown`
    /// (counted and announced, the callback never runs). Otherwise counts and announces it.
    ///
    /// # Errors
    ///
    /// The `shutdown` rejection.
    pub(crate) fn begin_bypass(&self, bypass: Bypass) -> Result<BypassCall, Rejection> {
        if self.engine().is_closed() {
            let rejection = self.engine().refuse_undecided(
                RejectReason::Shutdown,
                bypass.priority,
                bypass.class,
            );
            self.announce_reject_untimed(&rejection, bypass.class);
            return Err(rejection);
        }
        self.observe_counters().count_bypass(&bypass);
        if self.listeners().hears(EventKind::Bypass, true) {
            let event = BypassEvent {
                shadow_id: bypass.shadow_id,
                limit_revision: bypass.limit_revision,
                priority: bypass.priority,
                class: bypass.class,
                reason: bypass.reason,
                detail: bypass.detail,
                reservation: bypass.reservation,
                raced: bypass.raced,
            };
            self.listeners().emit(&Event::Bypass(&event), true);
        }
        Ok(BypassCall::new(bypass))
    }

    /// Applies a cumulative usage report to a bypassed call: validated and clamped as an
    /// admitted call's (`report`), holding nothing. Checks everything before changing anything.
    pub(crate) fn report_bypass(
        &self,
        call: &mut BypassCall,
        usage: TokenUsage,
        progressive: Option<Progressive>,
    ) -> Result<UsageReport, UsageError> {
        let bypass = call.bypass;
        let reported = cumulative(call.reported, usage, progressive, bypass.reservation)?;
        // Nothing is held, so only a change of the usage itself is effective.
        let effective = call.reported != Some(reported);
        call.reported = Some(reported);
        if effective {
            call.sequence += 1;
        }
        let report = UsageReport {
            shadow_id: Some(bypass.shadow_id),
            ..report_figures(
                bypass.shadow_id.as_admission_id(),
                bypass.limit_revision,
                call.sequence,
                bypass.reservation,
                0,
                reported,
            )
        };
        if effective && self.listeners().hears(EventKind::BypassUsage, true) {
            let event = BypassUsageEvent {
                shadow_id: bypass.shadow_id,
                limit_revision: bypass.limit_revision,
                priority: bypass.priority,
                class: bypass.class,
                reason: bypass.reason,
                sequence: call.sequence,
                reservation: bypass.reservation,
                usage: reported,
                output_cap: report.output_cap,
                output_remaining: report.output_remaining,
                over_reservation: report.over_reservation,
                progressive,
            };
            self.listeners().emit(&Event::BypassUsage(&event), true);
        }
        Ok(report)
    }

    /// Ends a bypassed call with `usage`, else the last reported usage: counts the usage and
    /// announces the end.
    pub(crate) fn finish_bypass(&self, call: &BypassCall, usage: Option<TokenUsage>) {
        let usage = usage.or(call.reported);
        if let Some(usage) = usage {
            self.observe_counters().count_usage(usage);
        }
        if self.listeners().hears(EventKind::BypassRelease, true) {
            let bypass = call.bypass;
            let event = BypassReleaseEvent {
                shadow_id: bypass.shadow_id,
                limit_revision: bypass.limit_revision,
                priority: bypass.priority,
                class: bypass.class,
                reason: bypass.reason,
                reservation: bypass.reservation,
                usage_sequence: call.sequence,
                usage,
            };
            self.listeners().emit(&Event::BypassRelease(&event), true);
        }
    }

    /// Emits the reject event of a refusal that no decision timed (a hard refusal of a
    /// bypass, a deduplication follower's own wait): both durations are zero.
    pub(crate) fn announce_reject_untimed(
        &self,
        rejection: &Rejection,
        class: Option<AdmissionClass>,
    ) {
        if self.listeners().hears(EventKind::Reject, false) {
            let event = RejectEvent {
                reason: rejection.reason(),
                class,
                limit_revision: rejection.limit_revision(),
                detail: *rejection.detail(),
                decision_duration: Duration::ZERO,
                queue_wait: Duration::ZERO,
            };
            self.listeners().emit(&Event::Reject(&event), false);
        }
    }
}
