//! Save admission across the tiers: which child may save a request's blocks,
//! decided by what kvmux sees of every tier, counted by block hash across
//! children and requests ([`SaveTable`]).
//!
//! What is counted, per block hash (vLLM's prefix-chained block hash, so a
//! block stands for its whole prefix):
//!
//! - how many requests were seen with it (`seen`: once per request, at the
//!   request's first answered lookup);
//! - how many times a child loaded it (`read`: read back from a tier);
//! - which children hold it as far as kvmux can tell (`held`: the block is
//!   within the child's lookup answer, or kvmux let the child save it; a
//!   later lookup answering less clears it: a tier that evicted it is
//!   known again as not holding it).
//!
//! The rule ([`SaveTable::admit`]), per request and child, for a child whose
//! policy is a reuse threshold `k` ([`Policy`]): the request is saved to the
//! child when at least one of its blocks the child does not hold is worth
//! it there: seen by at least `k` requests (this one included), or read
//! back from any tier. Otherwise the child does not see the request's
//! save: a prefix seen once is written only to the tiers that take every
//! save (by default the first child, kvmux's host tier), and a block the
//! slower tier already holds is not written again. Dynamo KVBM writes to
//! its disk tier only blocks used twice; the same threshold (2) is the
//! default here, and unlike a single tier's threshold it is counted across
//! every tier and request kvmux multiplexes.
//!
//! Memory is bounded: the table holds at most its capacity of blocks
//! (CLOCK replacement: a block counted since the hand last passed is
//! spared once), whatever the number of requests or prefixes. A block
//! evicted from the table is simply unknown again (seen 0): the rule then
//! declines, as for a block seen for the first time, until it is seen
//! again.

use std::collections::HashMap;

/// The values a child's `save_policy` takes besides a reuse threshold:
/// `always` (every save, as vLLM's MultiConnector) and `auto` (kvmux's rule:
/// every save for the first child, the reuse threshold [`DEFAULT_REUSE`]
/// for the others).
pub const SAVE_POLICIES: [&str; 2] = ["always", "auto"];

/// The reuse threshold `auto` gives every child but the first.
pub const DEFAULT_REUSE: u32 = 2;

/// Blocks the table holds by default (64 Ki blocks: about 4 MiB, a million
/// tokens at vLLM's default block size of 16).
pub const DEFAULT_CAPACITY: usize = 1 << 16;

/// A child's `save_policy`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Every save (kvmux without admission).
    Always,
    /// kvmux's rule: [`Policy::Always`] for the first child (the first
    /// storage tier, kvmux's host tier in the README's configs),
    /// [`Policy::Reuse`]`(`[`DEFAULT_REUSE`]`)` for the others.
    Auto,
    /// Saved once a block the child lacks was seen by this many requests
    /// (or read back from a tier); 1 saves every block the child lacks.
    Reuse(u32),
}

impl Policy {
    /// `"always"`, `"auto"`, or a reuse threshold of at least 1.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "always" => Some(Policy::Always),
            "auto" => Some(Policy::Auto),
            _ => s.parse::<u32>().ok().and_then(Self::reuse),
        }
    }

    /// A reuse threshold (None for 0).
    pub fn reuse(k: u32) -> Option<Self> {
        (k >= 1).then_some(Policy::Reuse(k))
    }

    /// The threshold of a child under this policy (None: every save);
    /// `tier`: its place among the storage tiers (None: not a storage tier,
    /// a P/D transport that saves only what a request asks for).
    pub fn threshold(self, tier: Option<usize>) -> Option<u32> {
        match self {
            Policy::Always => None,
            Policy::Auto => match tier {
                Some(t) if t > 0 => Some(DEFAULT_REUSE),
                _ => None,
            },
            Policy::Reuse(k) => Some(k),
        }
    }

    /// Each child's threshold: `transports[i]` marks a child that is not a
    /// storage tier (under `auto` it takes every save, and the first
    /// storage tier is the first child that is not one).
    pub fn thresholds(policies: &[Policy], transports: &[bool]) -> Vec<Option<u32>> {
        let mut tier = 0;
        policies
            .iter()
            .enumerate()
            .map(|(i, p)| {
                if transports.get(i).copied().unwrap_or(false) {
                    p.threshold(None)
                } else {
                    tier += 1;
                    p.threshold(Some(tier - 1))
                }
            })
            .collect()
    }
}

/// Why a save was declined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Declined {
    /// The child holds every block of the request already.
    Held,
    /// The blocks it lacks were seen too few times and never read back.
    NotReused,
}

impl Declined {
    pub fn as_str(self) -> &'static str {
        match self {
            Declined::Held => "held",
            Declined::NotReused => "not_reused",
        }
    }
}

#[derive(Clone, Copy, Debug, Default)]
struct Slot {
    hash: u64,
    seen: u32,
    read: u32,
    /// Bit i: child i holds it (as far as kvmux can tell).
    held: u64,
    /// Counted since the CLOCK hand last passed.
    referenced: bool,
    used: bool,
}

/// What kvmux knows of each block, in a table of fixed capacity.
#[derive(Debug)]
pub struct SaveTable {
    index: HashMap<u64, usize>,
    slots: Vec<Slot>,
    hand: usize,
    capacity: usize,
}

impl SaveTable {
    pub fn new(capacity: usize) -> Self {
        let capacity = capacity.max(1);
        Self {
            index: HashMap::with_capacity(capacity.min(1 << 12)),
            slots: Vec::new(),
            hand: 0,
            capacity,
        }
    }

    /// Blocks it knows now (at most its capacity).
    pub fn len(&self) -> usize {
        self.index.len()
    }

    pub fn is_empty(&self) -> bool {
        self.index.is_empty()
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    fn get(&self, hash: u64) -> Option<&Slot> {
        self.index.get(&hash).map(|&s| &self.slots[s])
    }

    /// The slot of `hash`, made (evicting by CLOCK when full) if new.
    fn slot(&mut self, hash: u64) -> &mut Slot {
        if let Some(&s) = self.index.get(&hash) {
            let slot = &mut self.slots[s];
            slot.referenced = true;
            return slot;
        }
        let s = if self.slots.len() < self.capacity {
            self.slots.push(Slot::default());
            self.slots.len() - 1
        } else {
            loop {
                let s = self.hand;
                self.hand = (self.hand + 1) % self.capacity;
                let slot = &mut self.slots[s];
                if slot.referenced {
                    slot.referenced = false;
                } else {
                    if slot.used {
                        self.index.remove(&slot.hash);
                    }
                    break s;
                }
            }
        };
        self.slots[s] = Slot {
            hash,
            used: true,
            referenced: false,
            ..Slot::default()
        };
        self.index.insert(hash, s);
        &mut self.slots[s]
    }

    /// A request was seen with `hashes` (its full blocks, in order); its
    /// lookup answered that child `i` holds its first `held_blocks[i]`
    /// blocks (None: the child was not asked or not ready: nothing known).
    pub fn seen(&mut self, hashes: &[u64], held_blocks: &[Option<usize>]) {
        for (b, &h) in hashes.iter().enumerate() {
            let slot = self.slot(h);
            slot.seen = slot.seen.saturating_add(1);
            for (i, held) in held_blocks.iter().enumerate().take(64) {
                match held {
                    Some(n) if b < *n => slot.held |= 1u64 << i,
                    Some(_) => slot.held &= !(1u64 << i),
                    None => {}
                }
            }
        }
    }

    /// Child `child` loaded `hashes` (read back from its tier).
    pub fn read_back(&mut self, hashes: &[u64], child: usize) {
        for &h in hashes {
            let slot = self.slot(h);
            slot.read = slot.read.saturating_add(1);
            if child < 64 {
                slot.held |= 1u64 << child;
            }
        }
    }

    /// Whether child `child`, with reuse threshold `k`, saves a request of
    /// `hashes` (see the module's rule); admitted blocks count as held by
    /// the child from now on.
    pub fn admit(&mut self, hashes: &[u64], child: usize, k: u32) -> Result<(), Declined> {
        let bit = 1u64.checked_shl(child as u32).unwrap_or(0);
        let mut lacks = false;
        let mut worth = false;
        for &h in hashes {
            let Some(slot) = self.get(h) else {
                lacks = true;
                continue;
            };
            if slot.held & bit != 0 {
                continue;
            }
            lacks = true;
            if slot.seen >= k || slot.read > 0 {
                worth = true;
                break;
            }
        }
        if !worth {
            return Err(if lacks || hashes.is_empty() {
                Declined::NotReused
            } else {
                Declined::Held
            });
        }
        for &h in hashes {
            self.slot(h).held |= bit;
        }
        Ok(())
    }

    /// `(seen, read, held)` of a block (tests and stats).
    pub fn block(&self, hash: u64) -> Option<(u32, u32, u64)> {
        self.get(hash).map(|s| (s.seen, s.read, s.held))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_and_auto_spares_the_first_child() {
        assert_eq!(Policy::parse("always"), Some(Policy::Always));
        assert_eq!(Policy::parse("auto"), Some(Policy::Auto));
        assert_eq!(Policy::parse("3"), Some(Policy::Reuse(3)));
        assert_eq!(Policy::parse("0"), None);
        assert_eq!(Policy::parse("sometimes"), None);
        assert_eq!(Policy::Auto.threshold(Some(0)), None);
        assert_eq!(Policy::Auto.threshold(Some(1)), Some(DEFAULT_REUSE));
        assert_eq!(Policy::Auto.threshold(None), None);
        assert_eq!(Policy::Always.threshold(Some(1)), None);
        assert_eq!(Policy::Reuse(1).threshold(Some(0)), Some(1));
        // P/D: [NIXL, host tier, LMCache]: the host tier is the first tier.
        let auto = [Policy::Auto; 3];
        assert_eq!(
            Policy::thresholds(&auto, &[true, false, false]),
            vec![None, None, Some(DEFAULT_REUSE)]
        );
        assert_eq!(
            Policy::thresholds(&auto, &[]),
            vec![None, Some(DEFAULT_REUSE), Some(DEFAULT_REUSE)]
        );
    }

    #[test]
    fn a_prefix_seen_once_is_declined_seen_twice_admitted_once() {
        let mut t = SaveTable::new(64);
        let req = [1u64, 2, 3];
        // Child 1 asked and answered 0: it holds nothing.
        t.seen(&req, &[Some(0), Some(0)]);
        assert_eq!(t.admit(&req, 1, 2), Err(Declined::NotReused));
        t.seen(&req, &[Some(3), Some(0)]);
        assert_eq!(t.admit(&req, 1, 2), Ok(()));
        // Written once: a third sighting finds it held.
        t.seen(&req, &[Some(3), None]);
        assert_eq!(t.admit(&req, 1, 2), Err(Declined::Held));
        // A longer prompt with a new block seen once: still nothing worth.
        let longer = [1u64, 2, 3, 4];
        t.seen(&longer, &[Some(3), Some(3)]);
        assert_eq!(t.admit(&longer, 1, 2), Err(Declined::NotReused));
        // The tier evicted it (its lookup answers less): written again.
        t.seen(&req, &[Some(3), Some(1)]);
        assert_eq!(t.admit(&req, 1, 2), Ok(()));
    }

    #[test]
    fn a_block_read_back_from_a_tier_is_admitted_where_it_is_missing() {
        let mut t = SaveTable::new(64);
        let req = [7u64, 8];
        t.seen(&req, &[Some(0), Some(2)]);
        t.read_back(&req, 1); // another instance's save, loaded from child 1
        assert_eq!(t.block(7), Some((1, 1, 0b10)));
        // Child 2 lacks it: seen once but read back, so worth it.
        assert_eq!(t.admit(&req, 2, 2), Ok(()));
        // Child 1 holds it: not written again.
        assert_eq!(t.admit(&req, 1, 2), Err(Declined::Held));
        // A threshold of 1 admits what a child lacks, seen once.
        let mut t = SaveTable::new(64);
        t.seen(&[9], &[None]);
        assert_eq!(t.admit(&[9], 0, 1), Ok(()));
    }

    #[test]
    fn the_table_is_bounded_and_spares_recently_counted_blocks() {
        let mut t = SaveTable::new(4);
        for h in 0..100u64 {
            t.seen(&[h], &[]);
            assert!(t.len() <= 4);
        }
        assert_eq!(t.len(), 4);
        assert_eq!(t.capacity(), 4);
        // A hot block counted between insertions survives a full turn.
        let mut t = SaveTable::new(4);
        for h in 100..200u64 {
            t.seen(&[1], &[]);
            t.seen(&[h], &[]);
        }
        assert!(t.block(1).is_some_and(|(seen, _, _)| seen == 100));
        // An evicted block is unknown: seen again from 0.
        assert_eq!(t.block(100), None);
    }
}
