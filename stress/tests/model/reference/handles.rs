//! Class handles in the driver (design §U6.2): the bulkhead's handles and lookups, which
//! class a call names, and the class part of a limits snapshot.

use async_bulkhead_llm::{classes::AdmissionClass, classes::ClassLookupError};

use super::driver::Driver;
use super::harness::Call;
use super::state::Named;
use super::values::{CLASS_IDS, ClassCaps, UNKNOWN_CLASS};

impl Driver<'_> {
    /// The class handles (design §U6.2): one per class in order, the default class, lookups
    /// by id (verbatim), and the lookup errors.
    pub(super) fn check_handles(&self, default_class: Option<usize>) {
        let count = self.model.limits.classes.map_or(0, |t| t.len);
        let ids: Vec<&str> = self.handles.iter().map(|h| h.id()).collect();
        self.agree("the classes' ids", ids, CLASS_IDS[..count].to_vec());
        for (i, handle) in self.handles.iter().enumerate() {
            self.agree("a class's index", usize::from(handle.index()), i);
            self.agree(
                "a class looked up by id",
                self.bulkhead.class(CLASS_IDS[i]),
                Ok(*handle),
            );
            self.agree(
                "another bulkhead's handle is not ours",
                self.foreign[i] == *handle,
                false,
            );
        }
        self.agree(
            "the default class",
            self.bulkhead.default_class(),
            default_class.map(|i| self.handles[i]),
        );
        let unknown = if count == 0 {
            ClassLookupError::NotConfigured
        } else {
            ClassLookupError::Unknown {
                class: UNKNOWN_CLASS.into(),
            }
        };
        self.agree(
            "looking up an unknown class",
            self.bulkhead.class(UNKNOWN_CLASS),
            Err(unknown),
        );
        if let Some(trimmed) = CLASS_IDS[..count].iter().find(|id| id.trim() != **id) {
            self.agree(
                "looking up an id trimmed",
                self.bulkhead.class(trimmed.trim()),
                Err(ClassLookupError::Unknown {
                    class: trimmed.trim().into(),
                }),
            );
        }
    }

    /// The class part of an `ApplyLimits` operation (see [`Op::ApplyLimits`]).
    pub(super) fn class_part(
        &self,
        shape: u8,
        order: u8,
        given: &[ClassCaps; 4],
    ) -> Option<Vec<(&'static str, ClassCaps)>> {
        let built = self.model.limits.classes;
        let shape = shape % 9;
        let mut table: Vec<(&'static str, ClassCaps)> = match (built, shape) {
            (None, 5) => vec![(CLASS_IDS[0], ClassCaps::default())],
            (None, _) | (Some(_), 5) => return None,
            (Some(built), 0) => built.iter().copied().collect(),
            (Some(built), _) => built
                .iter()
                .enumerate()
                .map(|(i, &(id, _))| (id, given[i]))
                .collect(),
        };
        match shape {
            6 => {
                table.pop();
            }
            7 => table.last_mut().expect("a class").0 = UNKNOWN_CLASS,
            8 => table.push((UNKNOWN_CLASS, ClassCaps::default())),
            _ => {}
        }
        if !table.is_empty() {
            let len = table.len();
            table.rotate_left(usize::from(order / 2) % len);
            if order % 2 == 1 {
                table.reverse();
            }
        }
        Some(table)
    }

    /// What a call names as its class (see [`Call::class`]), for the model and the crate.
    pub(super) fn named(&self, call: &Call) -> (Named, Option<AdmissionClass>) {
        let count = self.handles.len();
        match call.class {
            0 => (Named::Default, None),
            n if count > 0 && n <= 4 => {
                let i = usize::from(n - 1) % count;
                (Named::Own(i), Some(self.handles[i]))
            }
            n => {
                let handle = self.foreign[usize::from(n - 1) % self.foreign.len()];
                (Named::Foreign(handle), Some(handle))
            }
        }
    }
}
