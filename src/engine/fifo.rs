//! A FIFO list with O(1) push, pop and removal by key, in safe code: a slab of entries linked
//! by index, with a generation per slot so a stale key never removes a newer entry. The wait
//! queue keeps its waiters here, under its lock.

/// Identifies an entry; stays valid until that entry is popped or removed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Key {
    index: u32,
    generation: u32,
}

impl Key {
    /// The key's parts, to store it in an atomic.
    pub(crate) fn into_parts(self) -> (u32, u32) {
        (self.index, self.generation)
    }

    /// Rebuilds a key from [`into_parts`](Key::into_parts).
    pub(crate) fn from_parts(index: u32, generation: u32) -> Key {
        Key { index, generation }
    }
}

#[derive(Debug)]
struct Entry<T> {
    value: Option<T>,
    generation: u32,
    prev: u32,
    next: u32,
}

const NIL: u32 = u32::MAX;

#[derive(Debug)]
pub(crate) struct Fifo<T> {
    entries: Vec<Entry<T>>,
    head: u32,
    tail: u32,
    /// First free slot (linked through `next`).
    free: u32,
    len: usize,
}

impl<T> Fifo<T> {
    pub(crate) const fn new() -> Fifo<T> {
        Fifo {
            entries: Vec::new(),
            head: NIL,
            tail: NIL,
            free: NIL,
            len: 0,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends `value`; returns its key.
    pub(crate) fn push_back(&mut self, value: T) -> Key {
        let index = if self.free != NIL {
            let index = self.free;
            self.free = self.entries[index as usize].next;
            index
        } else {
            let index = u32::try_from(self.entries.len()).expect("fewer than 2^32 waiters");
            assert!(index != NIL, "fewer than 2^32 - 1 waiters");
            self.entries.push(Entry {
                value: None,
                generation: 0,
                prev: NIL,
                next: NIL,
            });
            index
        };
        let entry = &mut self.entries[index as usize];
        entry.value = Some(value);
        entry.prev = self.tail;
        entry.next = NIL;
        let key = Key {
            index,
            generation: entry.generation,
        };
        match self.tail {
            NIL => self.head = index,
            tail => self.entries[tail as usize].next = index,
        }
        self.tail = index;
        self.len += 1;
        key
    }

    /// The first value.
    pub(crate) fn front(&self) -> Option<&T> {
        match self.head {
            NIL => None,
            head => self.entries[head as usize].value.as_ref(),
        }
    }

    /// Removes and returns the first value.
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        match self.head {
            NIL => None,
            head => self.unlink(head),
        }
    }

    /// Removes the entry of `key`, if it is still in the list.
    pub(crate) fn remove(&mut self, key: Key) -> Option<T> {
        let entry = self.entries.get(key.index as usize)?;
        if entry.generation != key.generation || entry.value.is_none() {
            return None;
        }
        self.unlink(key.index)
    }

    fn unlink(&mut self, index: u32) -> Option<T> {
        let entry = &mut self.entries[index as usize];
        let value = entry.value.take()?;
        let (prev, next) = (entry.prev, entry.next);
        // The slot is reused with a new generation, so old keys stop matching.
        entry.generation = entry.generation.wrapping_add(1);
        entry.next = self.free;
        entry.prev = NIL;
        self.free = index;
        match prev {
            NIL => self.head = next,
            prev => self.entries[prev as usize].next = next,
        }
        match next {
            NIL => self.tail = prev,
            next => self.entries[next as usize].prev = prev,
        }
        self.len -= 1;
        Some(value)
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use std::collections::VecDeque;

    use proptest::prelude::*;

    use super::*;

    #[test]
    fn keeps_order_and_removes_from_the_middle() {
        let mut fifo = Fifo::new();
        let keys: Vec<Key> = (0..5).map(|i| fifo.push_back(i)).collect();
        assert_eq!(fifo.remove(keys[2]), Some(2));
        assert_eq!(fifo.remove(keys[2]), None, "a removed key stays dead");
        assert_eq!(fifo.pop_front(), Some(0));
        let reused = fifo.push_back(9);
        assert_eq!(
            fifo.remove(keys[0]),
            None,
            "a stale key never hits the reused slot"
        );
        assert_eq!(
            std::iter::from_fn(|| fifo.pop_front()).collect::<Vec<_>>(),
            vec![1, 3, 4, 9]
        );
        assert_eq!(fifo.remove(reused), None);
        assert!(fifo.is_empty());
    }

    #[derive(Clone, Debug)]
    enum Op {
        Push,
        Pop,
        Remove(usize),
    }

    proptest! {
        #[test]
        fn behaves_like_a_vecdeque(ops in proptest::collection::vec(
            prop_oneof![Just(Op::Push), Just(Op::Pop), (0..40usize).prop_map(Op::Remove)], 0..200)
        ) {
            let mut fifo = Fifo::new();
            let mut model: VecDeque<u32> = VecDeque::new();
            let mut keys: Vec<(Key, u32)> = Vec::new();
            let mut next = 0u32;
            for op in ops {
                match op {
                    Op::Push => {
                        keys.push((fifo.push_back(next), next));
                        model.push_back(next);
                        next += 1;
                    }
                    Op::Pop => prop_assert_eq!(fifo.pop_front(), model.pop_front()),
                    Op::Remove(i) => {
                        if let Some(&(key, value)) = keys.get(i) {
                            let expected = model.iter().position(|&v| v == value).and_then(|p| model.remove(p));
                            prop_assert_eq!(fifo.remove(key), expected);
                        }
                    }
                }
                prop_assert_eq!(fifo.len(), model.len());
                prop_assert_eq!(fifo.front(), model.front());
            }
            prop_assert_eq!(std::iter::from_fn(|| fifo.pop_front()).collect::<Vec<_>>(), model.into_iter().collect::<Vec<_>>());
        }
    }
}
