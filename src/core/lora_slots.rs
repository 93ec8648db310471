//! Adapter slots on the devices: which adapter each of the `--max-loras` slots holds. An
//! adapter used by a running sequence is pinned; others are evicted least recently used
//! when a new adapter needs a slot. A plain struct owned with the scheduler, since
//! admission depends on it (a batch never holds more distinct adapters than slots).

use std::collections::HashSet;

#[derive(Debug, Clone, Copy)]
struct Entry {
    adapter: u64,
    last_used: u64,
}

#[derive(Debug)]
pub struct LoraSlots {
    slots: Vec<Option<Entry>>,
    clock: u64,
}

/// The slot an adapter got, and whether its weights must be loaded there first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Acquired {
    pub slot: usize,
    pub load: bool,
}

impl LoraSlots {
    pub fn new(n: usize) -> Self {
        Self { slots: vec![None; n], clock: 0 }
    }

    pub fn slot_of(&self, adapter: u64) -> Option<usize> {
        self.slots.iter().position(|e| e.is_some_and(|e| e.adapter == adapter))
    }

    pub fn occupied(&self) -> usize {
        self.slots.iter().filter(|e| e.is_some()).count()
    }

    /// A slot for `adapter`: its own, a free one, or the least recently used one whose
    /// adapter is not in `pinned`. None when every slot is pinned by another adapter.
    pub fn acquire(&mut self, adapter: u64, pinned: &HashSet<u64>) -> Option<Acquired> {
        self.clock += 1;
        if let Some(slot) = self.slot_of(adapter) {
            self.slots[slot] = Some(Entry { adapter, last_used: self.clock });
            return Some(Acquired { slot, load: false });
        }
        let victim = self
            .slots
            .iter()
            .enumerate()
            .filter(|(_, e)| e.is_none_or(|e| !pinned.contains(&e.adapter)))
            .min_by_key(|(_, e)| e.map_or(0, |e| e.last_used))
            .map(|(i, _)| i)?;
        self.slots[victim] = Some(Entry { adapter, last_used: self.clock });
        Some(Acquired { slot: victim, load: true })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_reused_pinned_and_evicted_lru() {
        let mut s = LoraSlots::new(2);
        let none = HashSet::new();
        assert_eq!(s.acquire(10, &none), Some(Acquired { slot: 0, load: true }));
        assert_eq!(s.acquire(20, &none), Some(Acquired { slot: 1, load: true }));
        assert_eq!(s.acquire(10, &none), Some(Acquired { slot: 0, load: false }));
        // 20 is the least recently used: evicted for 30.
        assert_eq!(s.acquire(30, &none), Some(Acquired { slot: 1, load: true }));
        // Both pinned: no slot for a fourth adapter.
        let pinned: HashSet<u64> = [10, 30].into();
        assert_eq!(s.acquire(40, &pinned), None);
        assert_eq!(s.slot_of(30), Some(1));
        assert_eq!(s.occupied(), 2);
    }
}
