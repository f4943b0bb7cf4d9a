//! What the listener hears: every event counted per class and checked against the admission
//! it belongs to (admit, usage, abandon and release events of one admission agree on its class
//! and resources; an abandonment comes at most once, inside its admission).

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::AtomicU64;

use async_bulkhead_llm::{
    admission::AdmissionId, classes::AbandonCause, classes::AdmissionClass, classes::Resources,
    events::Event,
};

use super::books::{MAX_CLASSES, add, bump, reason_index};

/// What the listener heard of one class.
#[derive(Default)]
pub(crate) struct ClassHeard {
    pub(crate) admits: AtomicU64,
    pub(crate) releases: AtomicU64,
    pub(crate) usages: AtomicU64,
    pub(crate) rejects: [AtomicU64; 6],
    pub(crate) abandons: [AtomicU64; 2],
    pub(crate) borrowed_admissions: AtomicU64,
    pub(crate) borrowed_tokens: AtomicU64,
    pub(crate) reserved: AtomicU64,
}

/// An admission between its admit and release events.
pub(crate) struct Open {
    class: AdmissionClass,
    resources: Resources,
    abandoned: bool,
}

/// What the listener heard, checked event by event against the admission it belongs to.
#[derive(Default)]
pub(crate) struct Heard {
    pub(crate) classes: [ClassHeard; MAX_CLASSES],
    pub(crate) reconfigures: AtomicU64,
    pub(crate) open: Mutex<(HashMap<AdmissionId, Open>, Vec<String>)>,
}

impl Heard {
    pub(crate) fn hear(&self, event: &Event<'_>) {
        let index = |class: Option<AdmissionClass>| usize::from(class.unwrap().index());
        let mut open = self.open.lock().unwrap();
        let (admissions, errors) = &mut *open;
        match event {
            Event::Admit(e) => {
                let h = &self.classes[index(e.class)];
                bump(&h.admits);
                add(&h.reserved, e.reserved_tokens);
                add(&h.borrowed_tokens, e.resources.borrowed_tokens);
                add(
                    &h.borrowed_admissions,
                    u64::from(e.resources.borrowed_concurrency),
                );
                if e.resources.borrowed_tokens > e.reserved_tokens {
                    errors.push(format!("{e:?}: borrows more than it reserves"));
                }
                let new = Open {
                    class: e.class.unwrap(),
                    resources: e.resources,
                    abandoned: false,
                };
                if admissions.insert(e.admission_id, new).is_some() {
                    errors.push(format!("admission {} admitted twice", e.admission_id));
                }
            }
            Event::Usage(e) => {
                bump(&self.classes[index(e.class)].usages);
                match admissions.get(&e.admission_id) {
                    Some(a) if Some(a.class) == e.class => {}
                    _ => errors.push(format!("usage outside its admission: {e:?}")),
                }
            }
            Event::BorrowedConcurrencyAbandon(e) => {
                let cause = usize::from(e.cause == AbandonCause::Deadline);
                bump(&self.classes[index(e.class)].abandons[cause]);
                match admissions.get_mut(&e.admission_id) {
                    Some(a)
                        if Some(a.class) == e.class
                            && a.resources == e.resources
                            && e.resources.borrowed_concurrency
                            && !a.abandoned =>
                    {
                        a.abandoned = true;
                    }
                    _ => errors.push(format!("abandon outside a borrowed admission: {e:?}")),
                }
            }
            Event::Release(e) => {
                bump(&self.classes[index(e.class)].releases);
                match admissions.remove(&e.admission_id) {
                    Some(a) if Some(a.class) == e.class && a.resources == e.resources => {}
                    _ => errors.push(format!("release unlike its admission: {e:?}")),
                }
            }
            Event::Reject(e) => bump(&self.classes[index(e.class)].rejects[reason_index(e.reason)]),
            Event::Reconfigure(_) => bump(&self.reconfigures),
            _ => {}
        }
    }
}
