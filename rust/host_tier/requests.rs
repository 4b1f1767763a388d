//! The host tier's per-request bookkeeping, beside its [`BlockIndex`]: per
//! request the latest lookup's offer (pinned slots), the blocks saved or
//! reserved, the tokens loaded (credited by the multiplexer's rule,
//! [`Credits`]: each token once) and what the request added to the tier.
//! [`HostTier`] holds both, so each of vLLM's scheduler hooks is one call:
//! `get_num_new_matched_tokens` is [`HostTier::lookup`],
//! `update_state_after_alloc` [`HostTier::allocated`],
//! `build_connector_meta` [`HostTier::saves_due`] and
//! [`HostTier::reserve_saves`] (with [`HostTier::take_loads`]),
//! `request_finished` [`HostTier::finished`]. Nothing here knows vLLM's
//! objects: the bindings hand it block hashes and block ids.

use std::collections::HashMap;

use super::block_index::{BlockIndex, Reach, SlotEvent};
use crate::mux::Credits;

/// vLLM's null block: a windowed group's blocks before its window.
pub const NULL_BLOCK: u32 = 0;

/// One request's state in the tier.
#[derive(Clone, Debug, Default)]
pub struct HostRequest {
    /// vLLM's local computed tokens at the latest lookup.
    lookup_computed: u64,
    /// Leading blocks already saved, being saved, or found cached.
    saved_blocks: usize,
    /// The tokens this tier loaded, each credited once across admissions
    /// (the multiplexer's rule: `by_child[0]` is the tier's).
    credits: Credits,
    loaded_per_group: Vec<usize>,
    saved_per_group: Vec<usize>,
    /// Blocks this request added to the tier (all groups).
    saved_new: usize,
    /// The latest lookup's pinned slots, per group: (first block, slots).
    offer: Vec<(usize, Vec<u32>)>,
    /// It was scheduled once (what it held then is known).
    scheduled: bool,
    /// Blocks [first, end) another child loaded for it.
    promoted: (usize, usize),
    /// Block boundaries where it joined a prefix cached before it.
    junctions: Vec<usize>,
    prompt_tokens: u64,
}

impl HostRequest {
    /// The tokens this tier supplied the request, each counted once.
    pub fn loaded_tokens(&self) -> u64 {
        self.credits.by_child.first().copied().unwrap_or(0)
    }

    /// Whether a group reading `window` blocks before a resume point keeps
    /// `block`: it lies in the window before a junction, or from the window
    /// before the prompt's resume point on.
    fn wants(&self, block: usize, window: usize, block_size: u64) -> bool {
        let replay = (self.prompt_tokens.saturating_sub(1) / block_size) as usize;
        block + window >= replay
            || self
                .junctions
                .iter()
                .any(|&j| j.saturating_sub(window) <= block && block < j)
    }
}

/// A load for the workers: copy `slots` into the device `blocks` of
/// `group`; `failed`: the blocks are load errors (nothing to copy).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LoadPlan {
    pub req_id: Box<str>,
    pub slots: Vec<u32>,
    pub blocks: Vec<u32>,
    pub group: usize,
    pub failed: bool,
}

/// What an allocation did, for the tier's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocated {
    /// Tokens queued to load (0 when none or failed).
    pub loaded_tokens: u64,
    /// Blocks queued to load, per group.
    pub group_blocks: Vec<usize>,
    /// Device blocks reported as load errors.
    pub load_errors: usize,
}

/// The multi-group refusal: vLLM allocated blocks the lookup did not offer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NotOffered;

/// One group's save: device `blocks` into `slots`, the request's blocks
/// `positions` (absolute), and what the index reported reserving them.
#[derive(Clone, Debug)]
pub struct GroupSave {
    pub group: usize,
    pub positions: Vec<usize>,
    pub slots: Vec<u32>,
    pub blocks: Vec<u32>,
    pub events: Vec<SlotEvent>,
}

/// One step's saves of a request.
#[derive(Clone, Debug, Default)]
pub struct SavePlan {
    pub groups: Vec<GroupSave>,
    /// Per group, the blocks a windowed group does not keep.
    pub skipped: Vec<usize>,
    /// Blocks saved that another child loaded (group 0).
    pub promoted: usize,
}

/// A finished request's numbers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Finished {
    /// Its saves are in flight: vLLM keeps its blocks until reported.
    pub async_save: bool,
    pub loaded_tokens: u64,
    pub saved_blocks: usize,
    pub loaded_per_group: Vec<usize>,
    pub saved_per_group: Vec<usize>,
}

/// The host tier's scheduler state: its index and its requests.
pub struct HostTier {
    pub index: BlockIndex,
    reqs: HashMap<Box<str>, HostRequest>,
    /// Loads allocated, not yet shipped to the workers.
    loads: Vec<LoadPlan>,
    reach: Vec<Reach>,
    block_size: u64,
    promote: bool,
}

impl HostTier {
    /// `reach`: one per group of `index`; `promote`: save the blocks other
    /// children loaded too.
    pub fn new(index: BlockIndex, block_size: u64, reach: Vec<Reach>, promote: bool) -> Self {
        assert_eq!(reach.len(), index.num_groups(), "one reach per group");
        Self {
            index,
            reqs: HashMap::new(),
            loads: Vec::new(),
            reach,
            block_size: block_size.max(1),
            promote,
        }
    }

    pub fn num_requests(&self) -> usize {
        self.reqs.len()
    }

    pub fn request(&self, req_id: &str) -> Option<&HostRequest> {
        self.reqs.get(req_id)
    }

    fn entry(&mut self, req_id: &str, prompt_tokens: u64) -> &mut HostRequest {
        if !self.reqs.contains_key(req_id) {
            let groups = self.reach.len();
            self.reqs.insert(
                req_id.into(),
                HostRequest {
                    loaded_per_group: vec![0; groups],
                    saved_per_group: vec![0; groups],
                    prompt_tokens,
                    ..HostRequest::default()
                },
            );
        }
        self.reqs.get_mut(req_id).expect("inserted")
    }

    /// `get_num_new_matched_tokens`: the tokens beyond vLLM's local hit
    /// (`num_computed`) every group can serve; the slots offered are pinned
    /// until the allocation takes them (or a new lookup, or the end,
    /// releases them). `keys`: the request's block identities.
    pub fn lookup<K: AsRef<[u8]>>(
        &mut self,
        req_id: &str,
        keys: &[K],
        num_computed: u64,
        num_tokens: u64,
        prompt_tokens: u64,
    ) -> u64 {
        let bs = self.block_size;
        let start = (num_computed / bs) as usize;
        // vLLM must compute at least the last prompt token itself.
        let cap = (num_tokens.saturating_sub(1) / bs) as usize;
        let offer = std::mem::take(&mut self.entry(req_id, prompt_tokens).offer);
        release(&mut self.index, offer);
        let hit = self.index.servable_prefix(keys, start, cap, &self.reach);
        let offer = if hit.blocks > start {
            pin_offer(&mut self.index, &self.reach, keys, start, hit.blocks)
        } else {
            Vec::new()
        };
        let external = if offer.is_empty() {
            0
        } else {
            (hit.blocks as u64 * bs).saturating_sub(num_computed)
        };
        let st = self.entry(req_id, prompt_tokens);
        st.lookup_computed = num_computed;
        for j in [start, hit.prefix_blocks] {
            if j > 0 && !st.junctions.contains(&j) {
                st.junctions.push(j);
            }
        }
        st.offer = offer;
        external
    }

    /// `update_state_after_alloc`: in every group, each block vLLM
    /// allocated for the `num_external` tokens (`block_ids`: the request's
    /// blocks per group) gets its offered slot and the loads are queued;
    /// offered slots left over are released. Blocks not offered and not
    /// ready are load errors with one group; with several, vLLM cannot
    /// recompute part of a prefix: [`NotOffered`].
    pub fn allocated<K: AsRef<[u8]>>(
        &mut self,
        req_id: &str,
        keys: &[K],
        block_ids: &[Vec<u32>],
        num_external: u64,
    ) -> Result<Allocated, NotOffered> {
        let groups = self.reach.len();
        let st = self.entry(req_id, 0);
        let offer = std::mem::take(&mut st.offer);
        let lookup_computed = st.lookup_computed;
        if num_external == 0 {
            release(&mut self.index, offer);
            return Ok(Allocated::default());
        }
        let bs = self.block_size;
        let (start, n) = (
            (lookup_computed / bs) as usize,
            (num_external / bs) as usize,
        );
        let keys = &keys[start.min(keys.len())..(start + n).min(keys.len())];
        let mut failed = keys.len() < n;
        let mut jobs = Vec::new();
        for g in 0..groups {
            let (first, slots) = offer.get(g).map_or((start, &[][..]), |(f, s)| (*f, &s[..]));
            let all = block_ids.get(g).map_or(&[][..], |v| &v[..]);
            let ids = &all[start.min(all.len())..(start + n).min(all.len())];
            failed |= ids.len() < n;
            let windowed = self.reach[g] != Reach::Prefix;
            let mut pairs: Vec<(u32, u32)> = Vec::new();
            let mut extra: Vec<usize> = Vec::new();
            let mut used = vec![false; slots.len()];
            for (i, &block) in ids.iter().enumerate() {
                if block == NULL_BLOCK && windowed {
                    continue; // before the window: vLLM reads nothing there
                }
                match (start + i).checked_sub(first).filter(|&j| j < slots.len()) {
                    Some(j) => {
                        pairs.push((slots[j], block));
                        used[j] = true;
                    }
                    None => extra.push(i),
                }
            }
            let unused: Vec<u32> = slots
                .iter()
                .zip(&used)
                .filter(|(_, &u)| !u)
                .map(|(&s, _)| s)
                .collect();
            self.index.unpin(&unused);
            if !extra.is_empty() && !failed {
                // Not offered (a safety net): pin them now if ready.
                let want: Vec<&[u8]> = extra.iter().map(|&i| keys[i].as_ref()).collect();
                match self.index.pin_ready_in(g, &want) {
                    None => failed = true,
                    Some(more) => pairs.extend(more.into_iter().zip(extra.iter().map(|&i| ids[i]))),
                }
            }
            if !pairs.is_empty() {
                let (slots, blocks) = pairs.into_iter().unzip();
                jobs.push(LoadPlan {
                    req_id: req_id.into(),
                    slots,
                    blocks,
                    group: g,
                    failed: false,
                });
            }
        }
        if failed {
            for job in &jobs {
                self.index.unpin(&job.slots);
            }
            if groups > 1 {
                return Err(NotOffered);
            }
            let blocks: Vec<u32> = block_ids
                .iter()
                .flat_map(|ids| &ids[start.min(ids.len())..(start + n).min(ids.len())])
                .copied()
                .filter(|&b| b != NULL_BLOCK)
                .collect();
            let load_errors = blocks.len();
            self.loads.push(LoadPlan {
                req_id: req_id.into(),
                slots: Vec::new(),
                blocks,
                group: 0,
                failed: true,
            });
            return Ok(Allocated {
                load_errors,
                ..Allocated::default()
            });
        }
        let st = self.entry(req_id, 0);
        st.credits.add(lookup_computed, &[num_external]);
        let mut group_blocks = vec![0; groups];
        for job in &jobs {
            // Per group, the largest admission's (a reload is not added).
            let g = &mut st.loaded_per_group[job.group];
            *g = (*g).max(job.blocks.len());
            group_blocks[job.group] += job.blocks.len();
        }
        self.loads.extend(jobs);
        Ok(Allocated {
            loaded_tokens: num_external,
            group_blocks,
            load_errors: 0,
        })
    }

    /// The loads allocated since the last call, for the workers.
    pub fn take_loads(&mut self) -> Vec<LoadPlan> {
        std::mem::take(&mut self.loads)
    }

    /// `build_connector_meta`, first half: the blocks `[first, full)` the
    /// request (`num_computed` tokens, `num_scheduled` more this step,
    /// `num_keys` blocks with an identity) fills and has not saved; None
    /// when nothing (most decode steps) or the request is unknown.
    pub fn saves_due(
        &mut self,
        req_id: &str,
        num_computed: u64,
        num_scheduled: u64,
        num_keys: usize,
    ) -> Option<(usize, usize)> {
        let bs = self.block_size;
        let promote = self.promote;
        let st = self.reqs.get_mut(req_id)?;
        if !st.scheduled {
            // What it holds before its first step beyond vLLM's local hit
            // and this tier's own load, another child loaded.
            st.scheduled = true;
            let end = (num_computed / bs) as usize;
            st.promoted = (
                ((st.lookup_computed + st.loaded_tokens()) / bs) as usize,
                end,
            );
            if !promote {
                st.saved_blocks = st.saved_blocks.max(end);
            }
        }
        let full = (((num_computed + num_scheduled) / bs) as usize).min(num_keys);
        (full > st.saved_blocks).then_some((st.saved_blocks, full))
    }

    /// `build_connector_meta`, second half: reserve slots for the blocks
    /// `[first, first + keys.len())` (`keys`: their identities) of every
    /// group (a windowed group's it keeps and still holds on the device,
    /// `block_ids`: the request's blocks per group), held by `tenant` (the
    /// request's `cache_salt`, empty without one).
    pub fn reserve_saves<K: AsRef<[u8]>>(
        &mut self,
        req_id: &str,
        tenant: &str,
        keys: &[K],
        first: usize,
        block_ids: &[Vec<u32>],
    ) -> SavePlan {
        let bs = self.block_size;
        let Some(st) = self.reqs.get_mut(req_id) else {
            return SavePlan::default();
        };
        let n = keys.len();
        let mut plan = SavePlan {
            skipped: vec![0; self.reach.len()],
            ..SavePlan::default()
        };
        for (g, reach) in self.reach.iter().enumerate() {
            let ids = block_ids.get(g).map_or(&[][..], |v| &v[..]);
            // Positions a windowed group keeps (None: all).
            let sub: Option<Vec<usize>> = match *reach {
                Reach::Prefix => None,
                Reach::Window(w) => Some(
                    (0..n)
                        .filter(|&p| {
                            let b = first + p;
                            st.wants(b, w, bs) && b < ids.len() && ids[b] != NULL_BLOCK
                        })
                        .collect(),
                ),
            };
            let (reserved, events) = match &sub {
                None => self.index.reserve_reporting(g, keys, req_id, tenant),
                Some(sub) => {
                    plan.skipped[g] = n - sub.len();
                    let ks: Vec<&[u8]> = sub.iter().map(|&p| keys[p].as_ref()).collect();
                    self.index.reserve_reporting(g, &ks, req_id, tenant)
                }
            };
            let (positions, slots): (Vec<usize>, Vec<u32>) = reserved
                .into_iter()
                .map(|(p, s)| (first + sub.as_ref().map_or(p, |sub| sub[p]), s))
                .unzip();
            let (lo, hi) = st.promoted;
            if g == 0 && hi > lo {
                plan.promoted = positions.iter().filter(|&&b| lo <= b && b < hi).count();
            }
            st.saved_new += slots.len();
            st.saved_per_group[g] += slots.len();
            let blocks = positions
                .iter()
                .map(|&b| ids.get(b).copied().unwrap_or(NULL_BLOCK))
                .collect();
            plan.groups.push(GroupSave {
                group: g,
                positions,
                slots,
                blocks,
                events,
            });
        }
        st.saved_blocks = st.saved_blocks.max(first + n);
        plan
    }

    /// `request_finished`: the request's state goes, its offer and its
    /// loads not yet shipped are released; None if it was never seen.
    pub fn finished(&mut self, req_id: &str) -> Option<Finished> {
        let mut dropped = Vec::new();
        self.loads.retain(|job| {
            if &*job.req_id == req_id {
                if !job.failed {
                    dropped.extend_from_slice(&job.slots);
                }
                return false;
            }
            true
        });
        self.index.unpin(&dropped);
        let st = self.reqs.remove(req_id)?;
        release(&mut self.index, st.offer);
        Some(Finished {
            async_save: st.saved_new > 0 && self.index.saving(req_id) > 0,
            loaded_tokens: st.credits.by_child.first().copied().unwrap_or(0),
            saved_blocks: st.saved_new,
            loaded_per_group: st.loaded_per_group,
            saved_per_group: st.saved_per_group,
        })
    }
}

fn release(index: &mut BlockIndex, offer: Vec<(usize, Vec<u32>)>) {
    for (_, slots) in offer {
        index.unpin(&slots);
    }
}

/// Pin, per group, the slots a resume at block `end` reads beyond `start`:
/// `(first block, slots)`; empty if one is not ready.
fn pin_offer<K: AsRef<[u8]>>(
    index: &mut BlockIndex,
    reach: &[Reach],
    keys: &[K],
    start: usize,
    end: usize,
) -> Vec<(usize, Vec<u32>)> {
    let mut offer = Vec::with_capacity(reach.len());
    for (g, r) in reach.iter().enumerate() {
        let first = match *r {
            Reach::Prefix => start,
            Reach::Window(w) => start.max(end.saturating_sub(w)),
        };
        match index.pin_ready_in(g, &keys[first..end]) {
            Some(slots) => offer.push((first, slots)),
            None => {
                release(index, offer);
                return Vec::new();
            }
        }
    }
    offer
}

#[cfg(test)]
mod tests {
    use super::*;

    const BS: u64 = 16;

    fn k(i: u32) -> Vec<u8> {
        i.to_le_bytes().repeat(4)
    }

    fn keys(n: u32) -> Vec<Vec<u8>> {
        (0..n).map(k).collect()
    }

    fn tier(capacity: usize, reach: Vec<Reach>) -> HostTier {
        let index = BlockIndex::with_workers(capacity, reach.len(), 1).unwrap();
        HostTier::new(index, BS, reach, true)
    }

    /// `req` (`n` full blocks, nothing on the device) is scheduled whole,
    /// its saves reserved and acknowledged by the one worker.
    fn save_all(t: &mut HostTier, req: &str, n: u32) {
        let ks = keys(n);
        assert_eq!(t.lookup(req, &ks, 0, u64::from(n) * BS + 1, 0), 0);
        t.allocated(req, &ks, &[vec![]], 0).unwrap();
        let ids: Vec<u32> = (1..=n).collect();
        let (first, full) = t
            .saves_due(req, 0, u64::from(n) * BS + 1, n as usize)
            .unwrap();
        let plan = t.reserve_saves(req, "", &ks[first..full], first, &[ids]);
        let acks: Vec<(u32, u32)> = plan.groups[0].slots.iter().map(|&s| (s, 1)).collect();
        t.index.workers_reported(&[], &acks, &[]);
        assert!(!t.finished(req).unwrap().async_save);
    }

    fn idle(t: &HostTier) {
        assert_eq!(t.num_requests(), 0);
        assert_eq!(t.index.usage().pinned, 0, "a pin leaked");
        assert_eq!(t.index.occupancy().1, 0, "a reservation leaked");
        t.index.check().unwrap();
    }

    #[test]
    fn a_load_pins_what_the_lookup_offers_until_the_workers_acknowledge() {
        let mut t = tier(8, vec![Reach::Prefix]);
        save_all(&mut t, "a", 3);
        let ks = keys(4);
        assert_eq!(t.lookup("b", &ks, 0, 4 * BS + 1, 0), 48);
        assert_eq!(t.index.usage().pinned, 3);
        let got = t.allocated("b", &ks, &[vec![7, 8, 9, 10]], 48).unwrap();
        assert_eq!(got.loaded_tokens, 48);
        let loads = t.take_loads();
        assert_eq!(loads.len(), 1);
        assert_eq!(loads[0].blocks, vec![7, 8, 9]);
        let acks: Vec<(u32, u32)> = loads[0].slots.iter().map(|&s| (s, 1)).collect();
        t.index.workers_reported(&[], &[], &acks);
        assert_eq!(t.finished("b").unwrap().loaded_tokens, 48);
        idle(&t);
    }

    #[test]
    fn a_new_lookup_or_the_end_releases_the_offer() {
        let mut t = tier(8, vec![Reach::Prefix]);
        save_all(&mut t, "a", 2);
        let ks = keys(2);
        assert_eq!(t.lookup("b", &ks, 0, 2 * BS + 1, 0), 32);
        assert_eq!(t.lookup("b", &ks, 0, 2 * BS + 1, 0), 32);
        assert_eq!(t.index.usage().pinned, 2, "the first offer was released");
        t.finished("b").unwrap(); // aborted before its allocation
        idle(&t);
    }

    #[test]
    fn an_abort_within_the_step_drops_its_unshipped_loads() {
        let mut t = tier(8, vec![Reach::Prefix]);
        save_all(&mut t, "a", 2);
        let ks = keys(2);
        t.lookup("b", &ks, 0, 2 * BS + 1, 0);
        t.allocated("b", &ks, &[vec![5, 6]], 32).unwrap();
        t.finished("b").unwrap();
        assert!(t.take_loads().is_empty());
        idle(&t);
    }

    #[test]
    fn a_preempted_request_reloading_a_span_is_credited_once() {
        let mut t = tier(8, vec![Reach::Prefix]);
        save_all(&mut t, "a", 3);
        let ks = keys(3);
        for _ in 0..2 {
            // Admitted, then preempted: its blocks on the device are gone.
            assert_eq!(t.lookup("b", &ks, 0, 3 * BS + 1, 0), 48);
            t.allocated("b", &ks, &[vec![1, 2, 3]], 48).unwrap();
            let loads = t.take_loads();
            let acks: Vec<(u32, u32)> = loads[0].slots.iter().map(|&s| (s, 1)).collect();
            t.index.workers_reported(&[], &[], &acks);
        }
        assert_eq!(t.finished("b").unwrap().loaded_tokens, 48);
        idle(&t);
    }

    #[test]
    fn a_load_not_offered_is_a_load_error_with_one_group_and_refused_with_two() {
        let mut t = tier(8, vec![Reach::Prefix]);
        let ks = keys(2);
        t.lookup("b", &ks, 0, 2 * BS + 1, 0);
        let got = t.allocated("b", &ks, &[vec![4, 5]], 32).unwrap();
        assert_eq!(got.load_errors, 2);
        let loads = t.take_loads();
        assert!(loads[0].failed && loads[0].blocks == vec![4, 5]);
        assert_eq!(t.finished("b").unwrap().loaded_tokens, 0);
        idle(&t);

        let mut t = tier(8, vec![Reach::Prefix, Reach::Window(1)]);
        t.lookup("b", &ks, 0, 2 * BS + 1, 0);
        assert_eq!(
            t.allocated("b", &ks, &[vec![4, 5], vec![0, 6]], 32),
            Err(NotOffered)
        );
        t.finished("b").unwrap();
        idle(&t);
    }

    #[test]
    fn a_request_finishing_with_saves_in_flight_is_async_and_failed_saves_free_their_slots() {
        let mut t = tier(8, vec![Reach::Prefix]);
        let ks = keys(2);
        t.lookup("a", &ks, 0, 2 * BS + 1, 0);
        t.allocated("a", &ks, &[vec![]], 0).unwrap();
        let (first, full) = t.saves_due("a", 0, 2 * BS, 2).unwrap();
        assert_eq!((first, full), (0, 2));
        let plan = t.reserve_saves("a", "", &ks[first..full], first, &[vec![3, 4]]);
        assert_eq!(plan.groups[0].blocks, vec![3, 4]);
        assert_eq!(t.saves_due("a", 2 * BS, 1, 2), None, "saved once");
        let fin = t.finished("a").unwrap();
        assert!(fin.async_save && fin.saved_blocks == 2);
        t.index.workers_reported(&plan.groups[0].slots, &[], &[]);
        idle(&t);
        assert_eq!(t.index.usage().used, 0);
    }

    #[test]
    fn a_windowed_group_saves_only_the_window_before_the_resume_point() {
        let mut t = tier(16, vec![Reach::Prefix, Reach::Window(1)]);
        let ks = keys(4);
        // A 4-block prompt (65 tokens): it resumes at block 4.
        t.lookup("a", &ks, 0, 4 * BS + 1, 4 * BS + 1);
        t.allocated("a", &ks, &[vec![], vec![]], 0).unwrap();
        let (first, full) = t.saves_due("a", 0, 4 * BS + 1, 4).unwrap();
        let ids = [vec![1, 2, 3, 4], vec![5, 6, 7, 8]];
        let plan = t.reserve_saves("a", "", &ks[first..full], first, &ids);
        assert_eq!(plan.groups[0].positions, vec![0, 1, 2, 3]);
        assert_eq!(plan.groups[1].positions, vec![3]);
        assert_eq!(plan.groups[1].blocks, vec![8]);
        assert_eq!(plan.skipped, vec![0, 3]);
        t.finished("a").unwrap();
        let slots: Vec<u32> = plan.groups.iter().flat_map(|g| g.slots.clone()).collect();
        t.index.workers_reported(&slots, &[], &[]);
        idle(&t);
    }
}
