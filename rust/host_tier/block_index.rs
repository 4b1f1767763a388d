//! The host tier's index: block hash -> host slot, eviction, pins.
//!
//! A fixed pool of `capacity` slots. A slot is `Free`, `Writing` (reserved
//! for a save the workers have not confirmed: never readable) or `Ready`.
//! Pinned slots (an in-flight load reads them, an in-flight save writes them)
//! are never evicted: they are in no eviction list at all, so eviction is
//! O(1) (pop the head of a list of unpinned ready slots).
//!
//! Eviction ([`Eviction`]): `Lru` keeps one recency list (least recently
//! used first). `Slru` (the default of the tier) splits it in two: a ready
//! block starts in the probationary list, and moves to the protected list
//! once it is read back (pinned for a load, or found cached by a later
//! save). Eviction takes the probationary list's least recent block
//! first: a pass of blocks written once (a batch job, a crawler) evicts
//! blocks written once, not the blocks that were read back. A first-time
//! block is always admitted, as under LRU.
//!
//! The protected list's size is a target: its blocks within it (the most
//! recently read) are never evicted for the probationary list's; beyond it,
//! its least recent block competes by recency with the probationary list's
//! (the older of the two goes: with a target of 0 this is LRU exactly). The
//! target adapts as ARC adapts its own: the index remembers the keys it evicted lately (at most
//! `capacity` of them, the "ghosts"). A block saved again after it was
//! evicted never read back says the probationary list was too short (the
//! target shrinks: under a returning-user pattern, where LRU is right, until
//! the probationary list holds the users' contexts until they return); one
//! evicted after it was read back says the protected list was (it grows, up
//! to [`PROTECTED_PERCENT`] of the slots). Each step is ARC's: one block, or
//! the ghosts of the other kind per ghost of this kind if more; a block
//! evicted after a read and saved again is protected again once stored. The
//! target starts at [`PROTECTED_START_PERCENT`].
//!
//! Tenants: each block belongs to the tenant that saved it (the tier's
//! requests' `cache_salt`; the empty name is the requests without one). A
//! tenant holding its share of the slots (`tenant_max_share` of the
//! capacity) or more while the pool is full and another tenant holds blocks
//! evicts its own blocks (its probationary ones first), and a tenant below its share evicts an
//! over-share tenant's blocks before anyone else's. With a share of 1.0 no
//! tenant is ever over it: eviction is the policy's alone. A tenant's state
//! is a count and its two lists' ends, gone when it holds nothing.
//!
//! Free slots are handed out lowest first, so a step's saves into a fresh
//! pool get consecutive slots and the copy path can move them in one op.
//!
//! One `BlockIndex` is one global LRU order, so it is not sharded; callers
//! hold it behind one lock and make one call per request or per step.
//!
//! Groups: a hybrid model's KV cache has several groups (vLLM's KV cache
//! groups: full attention, sliding window), whose blocks share one token
//! identity (the block hash) but hold different layers. Each group has its
//! own key map, so the same hash is a different block in each group; the
//! slots, the LRU order and the capacity are shared, as vLLM's own block
//! pool is shared by the groups (a device block belongs to one group at a
//! time). `servable_prefix` answers the hybrid lookup: the longest prefix
//! every group can resume from.
//!
//! A slot's whole state is here: its key and group, who saves into it (the
//! owner, a request id), its pins, and the workers' acknowledgements: a
//! save is `Writing` until each of the index's `workers` acknowledged its
//! copy ([`BlockIndex::ack_saves`]), and a load's pin is released once each
//! worker acknowledged the load ([`BlockIndex::ack_loads`]). What the index
//! stores, aborts, evicts and drops it reports as [`SlotEvent`]s, collected
//! until [`BlockIndex::take_events`] drains them.

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use crate::error::IndexError;
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

/// Keys are block hashes already (vLLM's sha256, our xxh3 chain): a fast
/// non-cryptographic hasher is enough, and 2-3x cheaper than SipHash.
type KeyMap = HashMap<Box<[u8]>, u32, Xxh3DefaultBuilder>;

/// Evicted keys: (it had been read back, its sequence number).
type KeyGhosts = HashMap<Box<[u8]>, (bool, u64), Xxh3DefaultBuilder>;

/// The most KV cache groups an index takes (vLLM's models have a handful).
pub const MAX_GROUPS: usize = 1024;

/// The most workers whose acknowledgements an index counts.
pub const MAX_WORKERS: usize = 1 << 16;

/// Under [`Eviction::Slru`], the protected list's largest target, in percent
/// of the capacity (at least one slot).
pub const PROTECTED_PERCENT: usize = 80;

/// Under [`Eviction::Slru`], the protected list's target at first, in
/// percent of the capacity.
pub const PROTECTED_START_PERCENT: usize = 25;

const NIL: u32 = u32::MAX;

/// The probationary list (every block under LRU) and the protected list.
const PROBATION: usize = 0;
const PROTECTED: usize = 1;

/// How an index picks the block to evict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Eviction {
    /// Least recently used first: recency only.
    Lru,
    /// Segmented LRU: the blocks written once and never read back go first
    /// (see the module's doc).
    #[default]
    Slru,
}

impl Eviction {
    /// The names the tier's `eviction` setting takes, the default first.
    pub const NAMES: &'static str = "\"slru\", \"lru\"";

    /// The policy named `name` (`"slru"` or `"lru"`).
    pub fn parse(name: &str) -> Result<Self, IndexError> {
        match name {
            "slru" => Ok(Self::Slru),
            "lru" => Ok(Self::Lru),
            _ => Err(IndexError::Eviction {
                got: name.to_owned(),
                allowed: Self::NAMES,
            }),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Self::Lru => "lru",
            Self::Slru => "slru",
        }
    }
}

/// An index's eviction policy and tenant share.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Policy {
    pub eviction: Eviction,
    /// The most one tenant holds of the capacity while others want room, a
    /// fraction in (0, 1] (1.0: no limit).
    pub tenant_max_share: f64,
}

impl Policy {
    /// Recency only, one shared pool: the tier before eviction policies.
    pub const LRU: Self = Self {
        eviction: Eviction::Lru,
        tenant_max_share: 1.0,
    };
}

impl Default for Policy {
    fn default() -> Self {
        Self {
            eviction: Eviction::Slru,
            tenant_max_share: 1.0,
        }
    }
}

/// The ends of one intrusive list of slots.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Ends {
    head: u32,
    tail: u32,
    len: usize,
}

const EMPTY: Ends = Ends {
    head: NIL,
    tail: NIL,
    len: 0,
};

/// A tenant holding blocks: how many slots (writing or ready) and its own
/// lists (the unpinned ready blocks of each list, in the same order).
#[derive(Debug)]
struct Tenant {
    name: Arc<str>,
    held: usize,
    lists: [Ends; 2],
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotState {
    Free,
    Writing,
    Ready,
}

#[derive(Debug)]
struct Slot {
    key: Option<Box<[u8]>>,
    /// The group whose map holds `key` (meaningless while free).
    group: u32,
    state: SlotState,
    pins: u32,
    /// Who saves into it (a request id), while `Writing`.
    owner: Option<Arc<str>>,
    /// `Writing`: the workers' save acknowledgements still needed (1 to
    /// `workers`); 0 otherwise.
    save_acks: u32,
    /// `Ready` and pinned: load acknowledgements counted toward releasing
    /// the next load pin (below `workers`); 0 otherwise.
    load_acks: u32,
    /// Links in its list ([`PROBATION`] or [`PROTECTED`]), while `linked`.
    prev: u32,
    next: u32,
    /// Links in its tenant's list of the same kind, while `linked`.
    tprev: u32,
    tnext: u32,
    /// In the lists: ready and unpinned.
    linked: bool,
    /// Which list it is (or goes back to once unpinned).
    list: u8,
    /// Read back since it was stored.
    read: bool,
    /// When it was last put in its list (the index's clock).
    stamp: u64,
    /// Its tenant's id (while not free).
    tenant: u32,
}

/// What happened to a block, as the index reports it ([`BlockIndex::take_events`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SlotEvent {
    /// Every worker acknowledged the save (or it was committed): the block
    /// is readable now.
    Stored {
        group: u32,
        key: Box<[u8]>,
        owner: Arc<str>,
    },
    /// A save failed or was dropped: the block was never readable.
    Aborted {
        group: u32,
        key: Box<[u8]>,
        owner: Arc<str>,
    },
    /// A readable block was evicted (by the policy or a tenant's share) to
    /// make room for a save.
    Evicted { group: u32, key: Box<[u8]> },
    /// A readable block was dropped by [`BlockIndex::clear_unpinned`].
    Dropped { group: u32, key: Box<[u8]> },
}

/// Lifetime counters of an index.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct IndexCounters {
    pub stored: u64,
    /// Every block evicted, whatever the cause.
    pub evicted: u64,
    pub aborted: u64,
    /// Of `evicted`: by the tenant share rule (a tenant over its share).
    pub evicted_share: u64,
    /// Of `evicted`: blocks that had been read back (the protected list).
    pub evicted_protected: u64,
}

/// How much of a prefix a group needs to resume a request at a block
/// boundary `k`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reach {
    /// Full attention: every block before `k`.
    Prefix,
    /// Sliding window (or chunked local attention, served as its window):
    /// only the last `n` blocks before `k`.
    Window(usize),
}

/// The answer of [`BlockIndex::servable_prefix`], in blocks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServablePrefix {
    /// The longest prefix every group can serve (`start` when none).
    pub blocks: usize,
    /// Where the prefix groups' (full attention) run of ready blocks ends: a
    /// resume point the tier would serve if the windowed groups had the
    /// window before it (`blocks` when every group is windowed).
    pub prefix_blocks: usize,
}

#[derive(Debug)]
pub struct BlockIndex {
    slots: Vec<Slot>,
    /// One key map per group.
    maps: Vec<KeyMap>,
    free: BTreeSet<u32>,
    /// The unpinned ready slots: [`PROBATION`] and [`PROTECTED`], each from
    /// its least recently used end (`head`).
    lists: [Ends; 2],
    policy: Policy,
    /// The protected list's target size (adapted by the ghosts, at most
    /// `protected_max`).
    protected_cap: usize,
    protected_max: usize,
    /// Under SLRU, per group: the keys evicted lately -> (it had been read
    /// back, its sequence number), at most `capacity` in all.
    ghosts: Vec<KeyGhosts>,
    /// The ghosts in eviction order: (group, key, sequence number); an entry
    /// whose sequence number its map no longer holds is stale.
    ghost_order: VecDeque<(u32, Box<[u8]>, u64)>,
    ghost_seq: u64,
    /// Ticks at each link into a list: the slots' stamps.
    clock: u64,
    /// Live ghosts: never read back, read back.
    ghost_counts: [usize; 2],
    /// The most slots a tenant holds while others want room.
    tenant_cap: usize,
    /// Tenants by id (None: a free id).
    tenants: Vec<Option<Tenant>>,
    tenant_ids: HashMap<Arc<str>, u32>,
    free_tenants: Vec<u32>,
    /// Tenants holding more than `tenant_cap` slots.
    over: BTreeSet<u32>,
    /// Tenants whose count fell to 0, dropped at the end of the call.
    emptied: Vec<u32>,
    counters: IndexCounters,
    group_counters: Vec<IndexCounters>,
    /// Slots with a pin (kept as pins come and go: [`BlockIndex::usage`]
    /// is O(groups), cheap enough for every scheduler step).
    pinned: usize,
    /// The acknowledgements a save or a load needs: one per worker.
    workers: u32,
    /// Owner -> its `Writing` slots (no zero entries).
    saving: HashMap<Arc<str>, usize>,
    /// Reported, not yet taken.
    events: Vec<SlotEvent>,
}

/// How full an index is now (a gauge's worth, O(groups) to read).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Usage {
    pub capacity: usize,
    /// Slots holding a block (ready or being written).
    pub used: usize,
    /// Slots an in-flight load or save holds (never evicted).
    pub pinned: usize,
    /// Per group: the slots holding its blocks.
    pub group_used: Vec<usize>,
}

/// What the eviction policy and the tenant shares hold now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PolicyUsage {
    /// Tenants holding a block.
    pub tenants: usize,
    /// Unpinned ready blocks in the protected list (read back).
    pub protected: usize,
    /// The protected list's target now (0 under LRU).
    pub protected_target: usize,
    /// Lifetime evictions by the tenant share rule.
    pub evicted_share: u64,
    /// Lifetime evictions of blocks that had been read back.
    pub evicted_protected: u64,
}

impl BlockIndex {
    /// An index of one group (a model with one KV cache group).
    pub fn new(capacity: usize) -> Result<Self, IndexError> {
        Self::with_groups(capacity, 1)
    }

    /// An index whose `capacity` slots (1 to `u32::MAX - 1`: slots are u32)
    /// are shared by `groups` key spaces (1 to [`MAX_GROUPS`]), for one
    /// worker. Memory the machine cannot give is an [`IndexError::Memory`],
    /// never an abort.
    pub fn with_groups(capacity: usize, groups: usize) -> Result<Self, IndexError> {
        Self::with_workers(capacity, groups, 1)
    }

    /// [`BlockIndex::with_groups`] for `workers` workers (1 to
    /// [`MAX_WORKERS`]): each save and each load needs an acknowledgement
    /// from every one of them. Recency-only eviction ([`Policy::LRU`]).
    pub fn with_workers(
        capacity: usize,
        groups: usize,
        workers: usize,
    ) -> Result<Self, IndexError> {
        Self::with_policy(capacity, groups, workers, Policy::LRU)
    }

    /// [`BlockIndex::with_workers`] under `policy` (a share outside (0, 1]
    /// is an [`IndexError::TenantShare`]).
    pub fn with_policy(
        capacity: usize,
        groups: usize,
        workers: usize,
        policy: Policy,
    ) -> Result<Self, IndexError> {
        let share = policy.tenant_max_share;
        if !(share > 0.0 && share <= 1.0) {
            return Err(IndexError::TenantShare {
                got: share.to_string(),
            });
        }
        if !(1..=MAX_WORKERS).contains(&workers) {
            return Err(IndexError::Workers {
                got: workers,
                max: MAX_WORKERS,
            });
        }
        let max = NIL as usize - 1;
        if !(1..=max).contains(&capacity) {
            return Err(IndexError::Capacity { got: capacity, max });
        }
        if !(1..=MAX_GROUPS).contains(&groups) {
            return Err(IndexError::Groups {
                got: groups,
                max: MAX_GROUPS,
            });
        }
        // About what the index holds: a slot and a free-set entry per
        // block, a map entry per block and group (a key when it is ready),
        // and under SLRU up to one ghost per block (a map entry and an
        // order entry, each with its key: grown as blocks are evicted).
        let ghosts = match policy.eviction {
            Eviction::Slru => capacity.saturating_mul(128),
            Eviction::Lru => 0,
        };
        let bytes = capacity
            .saturating_mul(std::mem::size_of::<Slot>() + 8)
            .saturating_add(capacity.saturating_mul(groups).saturating_mul(48))
            .saturating_add(ghosts);
        let no_memory = |_| IndexError::Memory {
            capacity,
            groups,
            bytes,
        };
        // Asked of the allocator once, as a whole, before anything is built
        // (untouched, so it costs no memory): the free set's nodes cannot be
        // allocated fallibly, and an allocation failure there would abort.
        Vec::<u8>::new()
            .try_reserve_exact(bytes)
            .map_err(no_memory)?;
        let mut slots = Vec::new();
        slots.try_reserve_exact(capacity).map_err(no_memory)?;
        slots.extend((0..capacity).map(|_| Slot {
            key: None,
            group: 0,
            state: SlotState::Free,
            pins: 0,
            owner: None,
            save_acks: 0,
            load_acks: 0,
            prev: NIL,
            next: NIL,
            tprev: NIL,
            tnext: NIL,
            linked: false,
            list: PROBATION as u8,
            read: false,
            stamp: 0,
            tenant: 0,
        }));
        let free = (0..capacity as u32).collect();
        let mut maps = Vec::with_capacity(groups);
        for _ in 0..groups {
            let mut map = KeyMap::with_hasher(Xxh3DefaultBuilder::new());
            map.try_reserve(capacity).map_err(no_memory)?;
            maps.push(map);
        }
        Ok(Self {
            slots,
            maps,
            free,
            lists: [EMPTY; 2],
            policy,
            protected_cap: percent(capacity, PROTECTED_START_PERCENT)
                .clamp(1, percent(capacity, PROTECTED_PERCENT).max(1)),
            protected_max: percent(capacity, PROTECTED_PERCENT).max(1),
            ghosts: (0..groups)
                .map(|_| KeyGhosts::with_hasher(Xxh3DefaultBuilder::new()))
                .collect(),
            ghost_order: VecDeque::new(),
            ghost_seq: 0,
            clock: 0,
            ghost_counts: [0; 2],
            // The share in slots, at least one (1.0: the capacity, never
            // exceeded).
            tenant_cap: ((capacity as f64 * share).floor() as usize).clamp(1, capacity),
            tenants: Vec::new(),
            tenant_ids: HashMap::new(),
            free_tenants: Vec::new(),
            over: BTreeSet::new(),
            emptied: Vec::new(),
            counters: IndexCounters::default(),
            group_counters: vec![IndexCounters::default(); groups],
            pinned: 0,
            workers: workers as u32,
            saving: HashMap::new(),
            events: Vec::new(),
        })
    }

    /// The acknowledgements each save and each load needs.
    pub fn workers(&self) -> usize {
        self.workers as usize
    }

    pub fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub fn num_groups(&self) -> usize {
        self.maps.len()
    }

    fn is_ready<K: AsRef<[u8]>>(&self, group: usize, key: &K) -> bool {
        self.maps[group]
            .get(key.as_ref())
            .is_some_and(|&s| self.slots[s as usize].state == SlotState::Ready)
    }

    /// Number of leading `keys` whose blocks are ready to load (group 0).
    pub fn longest_prefix<K: AsRef<[u8]>>(&self, keys: &[K]) -> usize {
        self.longest_prefix_in(0, keys)
    }

    /// Number of leading `keys` whose blocks of `group` are ready to load.
    pub fn longest_prefix_in<K: AsRef<[u8]>>(&self, group: usize, keys: &[K]) -> usize {
        keys.iter().take_while(|k| self.is_ready(group, k)).count()
    }

    /// The longest prefix of `keys[..end]` every group can resume from,
    /// given that the first `start` blocks are already on the device (vLLM's
    /// own prefix-cache hit): a resume point `k` (`start < k <= end`) is
    /// servable when each [`Reach::Prefix`] group has `keys[start..k]` ready
    /// and each [`Reach::Window`]`(n)` group has `keys[max(start, k - n)..k]`
    /// ready. `reach` has one entry per group. The longest such `k` wins;
    /// `start` when there is none.
    pub fn servable_prefix<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        start: usize,
        end: usize,
        reach: &[Reach],
    ) -> ServablePrefix {
        assert_eq!(reach.len(), self.maps.len(), "one reach per group");
        let end = end.min(keys.len());
        if end <= start {
            return ServablePrefix {
                blocks: start,
                prefix_blocks: start,
            };
        }
        let mut top = end;
        for (g, r) in reach.iter().enumerate() {
            if *r == Reach::Prefix {
                top = top.min(start + self.longest_prefix_in(g, &keys[start..top]));
            }
        }
        let windows: Vec<(usize, usize)> = reach
            .iter()
            .enumerate()
            .filter_map(|(g, r)| match r {
                Reach::Window(n) => Some((g, *n)),
                Reach::Prefix => None,
            })
            .collect();
        // Ready-run lengths ending at each position, per windowed group.
        let runs: Vec<(usize, Vec<usize>)> = windows
            .iter()
            .map(|&(g, n)| {
                let mut run = 0;
                let v = keys[start..top]
                    .iter()
                    .map(|k| {
                        run = if self.is_ready(g, k) { run + 1 } else { 0 };
                        run
                    })
                    .collect();
                (n, v)
            })
            .collect();
        let blocks = (start + 1..=top)
            .rev()
            .find(|&k| {
                runs.iter()
                    .all(|(n, run)| run[k - 1 - start] >= (*n).min(k - start))
            })
            .unwrap_or(start);
        ServablePrefix {
            blocks,
            prefix_blocks: top,
        }
    }

    /// Pin the slots of `keys` for a load (group 0). All must be ready;
    /// otherwise nothing is pinned and `None` is returned.
    pub fn pin_ready<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Option<Vec<u32>> {
        self.pin_ready_in(0, keys)
    }

    /// Pin the slots of `group`'s blocks of `keys` for a load. All must be
    /// ready; otherwise nothing is pinned and `None` is returned. A block
    /// pinned is read back: under [`Eviction::Slru`] it is protected once
    /// unpinned.
    pub fn pin_ready_in<K: AsRef<[u8]>>(&mut self, group: usize, keys: &[K]) -> Option<Vec<u32>> {
        let mut slots = Vec::with_capacity(keys.len());
        for k in keys {
            let &s = self.maps[group].get(k.as_ref())?;
            if self.slots[s as usize].state != SlotState::Ready {
                return None;
            }
            slots.push(s);
        }
        for &s in &slots {
            self.pin(s);
            self.read_back(s);
        }
        Some(slots)
    }

    /// Reserve slots to save the blocks of `keys` that are not cached yet
    /// (group 0, no owner); see [`BlockIndex::reserve_in`].
    pub fn reserve<K: AsRef<[u8]>>(&mut self, keys: &[K]) -> Vec<(usize, u32)> {
        self.reserve_in(0, keys, "")
    }

    /// [`BlockIndex::reserve_for`] for the tenant without a name.
    pub fn reserve_in<K: AsRef<[u8]>>(
        &mut self,
        group: usize,
        keys: &[K],
        owner: &str,
    ) -> Vec<(usize, u32)> {
        self.reserve_for(group, keys, owner, "")
    }

    /// Reserve slots for `owner` (a request id) of `tenant` to save
    /// `group`'s blocks of `keys` that are not cached yet. Returns
    /// `(position in keys, slot)` for each reserved block, in order;
    /// reserved slots are `Writing`, pinned and owned by `owner` until every
    /// worker acknowledged the save ([`BlockIndex::ack_saves`]), a `commit`
    /// or an `abort`. Cached keys are marked recently used (and read back).
    /// A ready block evicted to make room is reported
    /// ([`SlotEvent::Evicted`]). Stops early when every other slot is
    /// pinned (the pool is full of in-flight work), or when the pool is
    /// full and `tenant` holds its share with all of it in flight.
    pub fn reserve_for<K: AsRef<[u8]>>(
        &mut self,
        group: usize,
        keys: &[K],
        owner: &str,
        tenant: &str,
    ) -> Vec<(usize, u32)> {
        for k in keys {
            if let Some(&s) = self.maps[group].get(k.as_ref()) {
                self.touch(s);
            }
        }
        let t = self.tenant_id(tenant);
        let owner: Arc<str> = match self.saving.get_key_value(owner) {
            Some((o, _)) => Arc::clone(o),
            None => Arc::from(owner),
        };
        let mut out = Vec::new();
        for (pos, k) in keys.iter().enumerate() {
            if self.maps[group].contains_key(k.as_ref()) {
                continue;
            }
            // A block evicted lately and saved again adapts the target
            // before this save's eviction picks its victim; one that had
            // been read back is protected again once stored (ARC's rule).
            let read = self.ghost_hit(group, k.as_ref());
            let Some(s) = self.take_slot(t) else { break };
            let key: Box<[u8]> = k.as_ref().into();
            let slot = &mut self.slots[s as usize];
            slot.key = Some(key.clone());
            slot.group = group as u32;
            slot.state = SlotState::Writing;
            slot.pins = 1;
            slot.owner = Some(Arc::clone(&owner));
            slot.save_acks = self.workers;
            slot.list = if read { PROTECTED } else { PROBATION } as u8;
            slot.read = read;
            slot.tenant = t;
            self.pinned += 1;
            self.held(t, true);
            self.maps[group].insert(key, s);
            out.push((pos, s));
        }
        if !out.is_empty() {
            *self.saving.entry(owner).or_insert(0) += out.len();
        }
        self.emptied.push(t);
        self.sweep_tenants();
        out
    }

    /// Workers acknowledged saves: `(slot, acknowledgements)` pairs. A save
    /// every worker acknowledged becomes ready ([`SlotEvent::Stored`]);
    /// acknowledgements of slots not `Writing` are ignored. Returns how
    /// many saves became ready.
    pub fn ack_saves(&mut self, acks: &[(u32, u32)]) -> usize {
        let mut n = 0;
        for &(s, k) in acks {
            if self.state(s) != Some(SlotState::Writing) {
                continue;
            }
            let slot = &mut self.slots[s as usize];
            slot.save_acks = slot.save_acks.saturating_sub(k);
            if slot.save_acks == 0 {
                self.make_ready(s);
                n += 1;
            }
        }
        n
    }

    /// Saves into `slots` are done, whatever the workers acknowledged: they
    /// become ready (and unpinned). Returns how many were committed (others
    /// were not `Writing`).
    pub fn commit(&mut self, slots: &[u32]) -> usize {
        let mut n = 0;
        for &s in slots {
            if self.state(s) == Some(SlotState::Writing) {
                self.make_ready(s);
                n += 1;
            }
        }
        n
    }

    /// Saves into `slots` failed or were dropped: free them
    /// ([`SlotEvent::Aborted`]). Returns how many were aborted (others were
    /// not `Writing`).
    pub fn abort(&mut self, slots: &[u32]) -> usize {
        let mut n = 0;
        for &s in slots {
            if self.state(s) != Some(SlotState::Writing) {
                continue;
            }
            let group = self.slots[s as usize].group;
            self.counters.aborted += 1;
            self.group_counters[group as usize].aborted += 1;
            let owner = self.end_save(s);
            if let Some(key) = self.release(s) {
                self.events.push(SlotEvent::Aborted { group, key, owner });
            }
            n += 1;
        }
        self.sweep_tenants();
        n
    }

    /// Release a load pin of each of `slots` (ready ones; a slot twice in
    /// `slots` is unpinned twice).
    pub fn unpin(&mut self, slots: &[u32]) {
        for &s in slots {
            if self.state(s) == Some(SlotState::Ready) {
                self.unpin_one(s);
            }
        }
    }

    /// Workers acknowledged loads: `(slot, acknowledgements)` pairs. Each
    /// `workers` acknowledgements of a slot release one of its load pins
    /// (the rest are counted toward the next); acknowledgements of slots no
    /// load pins are ignored.
    pub fn ack_loads(&mut self, acks: &[(u32, u32)]) {
        let workers = u64::from(self.workers);
        for &(s, k) in acks {
            let Some(slot) = self.slots.get_mut(s as usize) else {
                continue;
            };
            if slot.state != SlotState::Ready || slot.pins == 0 {
                continue;
            }
            let total = u64::from(slot.load_acks) + u64::from(k);
            slot.load_acks = (total % workers) as u32;
            let releases = (total / workers).min(u64::from(slot.pins));
            for _ in 0..releases {
                self.unpin_one(s);
            }
        }
    }

    /// Drop every ready, unpinned block (vLLM's `reset_cache`), each
    /// reported ([`SlotEvent::Dropped`]). Returns the number dropped;
    /// in-flight work is untouched.
    pub fn clear_unpinned(&mut self) -> usize {
        let mut n = 0;
        for list in [PROBATION, PROTECTED] {
            while self.lists[list].head != NIL {
                let s = self.lists[list].head;
                let group = self.slots[s as usize].group;
                if let Some(key) = self.release(s) {
                    self.events.push(SlotEvent::Dropped { group, key });
                }
                n += 1;
            }
        }
        self.sweep_tenants();
        n
    }

    /// `owner`'s saves in flight (`Writing` slots).
    pub fn saving(&self, owner: &str) -> usize {
        self.saving.get(owner).copied().unwrap_or(0)
    }

    /// [`BlockIndex::reserve_in`], with everything the index reported
    /// since the last drain, the blocks this reservation evicted last: what
    /// the scheduler needs of one request's save, in one call.
    pub fn reserve_reporting<K: AsRef<[u8]>>(
        &mut self,
        group: usize,
        keys: &[K],
        owner: &str,
        tenant: &str,
    ) -> (Vec<(usize, u32)>, Vec<SlotEvent>) {
        let reserved = self.reserve_for(group, keys, owner, tenant);
        (reserved, self.take_events())
    }

    /// The workers' report of one step, at once: the saves that failed are
    /// aborted, then the save and load acknowledgements counted; returns
    /// everything the index reported since the last drain (what became
    /// readable is `Stored`).
    pub fn workers_reported(
        &mut self,
        failed_saves: &[u32],
        saved: &[(u32, u32)],
        loaded: &[(u32, u32)],
    ) -> Vec<SlotEvent> {
        self.abort(failed_saves);
        self.ack_saves(saved);
        self.ack_loads(loaded);
        self.take_events()
    }

    /// What the index stored, aborted, evicted and dropped since the last
    /// call, in order.
    pub fn take_events(&mut self) -> Vec<SlotEvent> {
        std::mem::take(&mut self.events)
    }

    pub fn state(&self, slot: u32) -> Option<SlotState> {
        self.slots.get(slot as usize).map(|s| s.state)
    }

    pub fn pins(&self, slot: u32) -> u32 {
        self.slots.get(slot as usize).map_or(0, |s| s.pins)
    }

    pub fn counters(&self) -> IndexCounters {
        self.counters
    }

    /// Lifetime counters of one group's blocks.
    pub fn group_counters(&self, group: usize) -> IndexCounters {
        self.group_counters[group]
    }

    /// Capacity, used and pinned slots, and each group's used slots.
    pub fn usage(&self) -> Usage {
        Usage {
            capacity: self.slots.len(),
            used: self.slots.len() - self.free.len(),
            pinned: self.pinned,
            group_used: self.maps.iter().map(|m| m.len()).collect(),
        }
    }

    /// The index's eviction policy and tenant share.
    pub fn policy(&self) -> Policy {
        self.policy
    }

    /// The tenants, the protected blocks and the evictions by cause now.
    pub fn policy_usage(&self) -> PolicyUsage {
        PolicyUsage {
            tenants: self.tenant_ids.len(),
            protected: self.lists[PROTECTED].len,
            protected_target: match self.policy.eviction {
                Eviction::Slru => self.protected_cap,
                Eviction::Lru => 0,
            },
            evicted_share: self.counters.evicted_share,
            evicted_protected: self.counters.evicted_protected,
        }
    }

    /// The slots `tenant` holds (writing or ready).
    pub fn tenant_held(&self, tenant: &str) -> usize {
        self.tenant_ids
            .get(tenant)
            .and_then(|&t| self.tenants[t as usize].as_ref())
            .map_or(0, |t| t.held)
    }

    /// Whether `slot` is in the protected list (or goes back to it once
    /// unpinned): it was read back.
    pub fn is_protected(&self, slot: u32) -> bool {
        self.slots
            .get(slot as usize)
            .is_some_and(|s| s.state == SlotState::Ready && s.list as usize == PROTECTED)
    }

    /// (writing, ready) slots holding `group`'s blocks.
    pub fn group_occupancy(&self, group: usize) -> (usize, usize) {
        let mut c = (0, 0);
        for s in &self.slots {
            if s.group as usize != group {
                continue;
            }
            match s.state {
                SlotState::Writing => c.0 += 1,
                SlotState::Ready => c.1 += 1,
                SlotState::Free => {}
            }
        }
        c
    }

    /// (free, writing, ready, pinned) slot counts.
    pub fn occupancy(&self) -> (usize, usize, usize, usize) {
        let mut c = (0, 0, 0, 0);
        for s in &self.slots {
            match s.state {
                SlotState::Free => c.0 += 1,
                SlotState::Writing => c.1 += 1,
                SlotState::Ready => c.2 += 1,
            }
            if s.pins > 0 {
                c.3 += 1;
            }
        }
        c
    }

    /// Check every structural invariant; `Err` names the first broken one:
    /// every slot is in exactly one state (free, writing, pinned ready, or
    /// in exactly one list and its tenant's list of the same kind), each
    /// list's links and length agree, each tenant's count is its slots,
    /// the protected list is within its cap and empty under LRU.
    pub fn check(&self) -> Result<(), String> {
        let mut seen = vec![0u8; self.slots.len()];
        for list in [PROBATION, PROTECTED] {
            let ends = &self.lists[list];
            let (mut cur, mut prev, mut len) = (ends.head, NIL, 0);
            while cur != NIL {
                let s = &self.slots[cur as usize];
                if s.prev != prev {
                    return Err(format!("slot {cur}: broken list back link"));
                }
                if s.state != SlotState::Ready || s.pins != 0 || !s.linked {
                    return Err(format!(
                        "slot {cur}: in list {list} but {:?} with {} pins",
                        s.state, s.pins
                    ));
                }
                if s.list as usize != list || seen[cur as usize] != 0 {
                    return Err(format!("slot {cur}: in list {list} twice or wrongly"));
                }
                seen[cur as usize] = 1;
                len += 1;
                prev = cur;
                cur = s.next;
            }
            if prev != ends.tail || len != ends.len {
                return Err(format!("list {list}: tail or length mismatch"));
            }
        }
        if self.policy.eviction == Eviction::Lru && self.lists[PROTECTED].len != 0 {
            return Err("a protected block under LRU".into());
        }
        if self.protected_cap > self.protected_max {
            return Err("the protected target over its max".into());
        }
        let ghosts: usize = self.ghosts.iter().map(|m| m.len()).sum();
        let read = self
            .ghosts
            .iter()
            .flat_map(|m| m.values())
            .filter(|g| g.0)
            .count();
        if [ghosts - read, read] != self.ghost_counts || ghosts > self.slots.len() {
            return Err(format!(
                "{ghosts} ghosts ({read} read), counted {:?}",
                self.ghost_counts
            ));
        }
        if self.policy.eviction == Eviction::Lru && ghosts != 0 {
            return Err("ghosts under LRU".into());
        }
        let mut held: HashMap<u32, usize> = HashMap::new();
        for (t, tenant) in self.tenants.iter().enumerate() {
            let Some(tenant) = tenant else { continue };
            if self.tenant_ids.get(&tenant.name) != Some(&(t as u32)) {
                return Err(format!("tenant {t}: id map disagrees"));
            }
            if tenant.held == 0 {
                return Err(format!("tenant {t}: holds nothing but kept"));
            }
            if (tenant.held > self.tenant_cap) != self.over.contains(&(t as u32)) {
                return Err(format!("tenant {t}: over-share set disagrees"));
            }
            for list in [PROBATION, PROTECTED] {
                let ends = &tenant.lists[list];
                let (mut cur, mut prev, mut len) = (ends.head, NIL, 0);
                while cur != NIL {
                    let s = &self.slots[cur as usize];
                    if s.tprev != prev || s.tenant != t as u32 || s.list as usize != list {
                        return Err(format!("slot {cur}: wrong in tenant {t}'s list {list}"));
                    }
                    if seen[cur as usize] != 1 {
                        return Err(format!("slot {cur}: in a tenant's list, not in one list"));
                    }
                    seen[cur as usize] = 2;
                    len += 1;
                    prev = cur;
                    cur = s.tnext;
                }
                if prev != ends.tail || len != ends.len {
                    return Err(format!("tenant {t}'s list {list}: tail or length mismatch"));
                }
            }
        }
        if self.tenant_ids.len() != self.tenants.iter().flatten().count() {
            return Err("tenant id map and tenants disagree".into());
        }
        for (i, s) in self.slots.iter().enumerate() {
            let free = self.free.contains(&(i as u32));
            let acks_ok = match s.state {
                SlotState::Free => s.save_acks == 0 && s.load_acks == 0 && s.owner.is_none(),
                SlotState::Writing => {
                    (1..=self.workers).contains(&s.save_acks)
                        && s.load_acks == 0
                        && s.owner.is_some()
                }
                SlotState::Ready => {
                    s.save_acks == 0
                        && s.owner.is_none()
                        && s.load_acks < self.workers
                        && (s.load_acks == 0 || s.pins > 0)
                }
            };
            if !acks_ok {
                return Err(format!(
                    "slot {i}: {:?} with owner {:?}, {} save and {} load acks ({} workers, {} pins)",
                    s.state, s.owner, s.save_acks, s.load_acks, self.workers, s.pins
                ));
            }
            let listed = s.state == SlotState::Ready && s.pins == 0;
            if s.linked != listed || (seen[i] == 2) != listed {
                return Err(format!(
                    "slot {i}: {:?} with {} pins, in the lists: {} ({})",
                    s.state, s.pins, s.linked, seen[i]
                ));
            }
            if s.state != SlotState::Free {
                *held.entry(s.tenant).or_insert(0) += 1;
            }
            match s.state {
                SlotState::Free if !free || s.key.is_some() || s.pins != 0 => {
                    return Err(format!("slot {i}: free slot not clean"))
                }
                SlotState::Writing if s.pins == 0 => {
                    return Err(format!("slot {i}: writing but unpinned"))
                }
                SlotState::Writing | SlotState::Ready => {
                    let key = s.key.as_ref().ok_or(format!("slot {i}: no key"))?;
                    let map = self
                        .maps
                        .get(s.group as usize)
                        .ok_or(format!("slot {i}: group {} out of range", s.group))?;
                    if map.get(key) != Some(&(i as u32)) || free {
                        return Err(format!("slot {i}: map or free list disagrees"));
                    }
                }
                SlotState::Free => {}
            }
        }
        for (&t, &n) in &held {
            let kept = self.tenants.get(t as usize).and_then(|t| t.as_ref());
            if kept.map(|t| t.held) != Some(n) {
                return Err(format!("tenant {t}: holds {n} slots, counted {kept:?}"));
            }
        }
        if held.len() != self.tenant_ids.len() {
            return Err("a tenant kept that holds no slot".into());
        }
        let mapped: usize = self.maps.iter().map(|m| m.len()).sum();
        if mapped + self.free.len() != self.slots.len() {
            return Err("map + free != capacity".into());
        }
        let pinned = self.slots.iter().filter(|s| s.pins > 0).count();
        if pinned != self.pinned {
            return Err(format!("{pinned} pinned slots, counted {}", self.pinned));
        }
        let mut saving: HashMap<&str, usize> = HashMap::new();
        for s in &self.slots {
            if let Some(o) = &s.owner {
                *saving.entry(o).or_insert(0) += 1;
            }
        }
        let counted: HashMap<&str, usize> = self.saving.iter().map(|(o, &n)| (&**o, n)).collect();
        if saving != counted {
            return Err(format!("saves per owner {saving:?}, counted {counted:?}"));
        }
        Ok(())
    }

    /// The id of `name`'s tenant, made if it holds nothing yet (and dropped
    /// by [`BlockIndex::sweep_tenants`] if it still holds nothing then).
    fn tenant_id(&mut self, name: &str) -> u32 {
        if let Some(&t) = self.tenant_ids.get(name) {
            return t;
        }
        let name: Arc<str> = Arc::from(name);
        let tenant = Tenant {
            name: Arc::clone(&name),
            held: 0,
            lists: [EMPTY; 2],
        };
        let t = match self.free_tenants.pop() {
            Some(t) => {
                self.tenants[t as usize] = Some(tenant);
                t
            }
            None => {
                self.tenants.push(Some(tenant));
                (self.tenants.len() - 1) as u32
            }
        };
        self.tenant_ids.insert(name, t);
        t
    }

    fn tenant(&mut self, t: u32) -> &mut Tenant {
        self.tenants[t as usize]
            .as_mut()
            .expect("a slot's tenant is kept while it holds the slot")
    }

    /// Tenant `t` holds one slot more (`true`) or one less.
    fn held(&mut self, t: u32, more: bool) {
        let cap = self.tenant_cap;
        let tenant = self.tenant(t);
        if more {
            tenant.held += 1;
        } else {
            tenant.held -= 1;
        }
        let (held, over) = (tenant.held, tenant.held > cap);
        if over {
            self.over.insert(t);
        } else {
            self.over.remove(&t);
        }
        if held == 0 {
            self.emptied.push(t);
        }
    }

    /// Drop the tenants that hold nothing (their memory goes with them).
    fn sweep_tenants(&mut self) {
        while let Some(t) = self.emptied.pop() {
            let Some(tenant) = self.tenants[t as usize].as_ref() else {
                continue;
            };
            if tenant.held == 0 {
                let name = Arc::clone(&tenant.name);
                self.tenant_ids.remove(&name);
                self.tenants[t as usize] = None;
                self.free_tenants.push(t);
            }
        }
    }

    /// The least recent unpinned ready block of tenant `t` (its
    /// probationary blocks first).
    fn tenant_victim(&self, t: u32) -> Option<u32> {
        let tenant = self.tenants[t as usize].as_ref()?;
        [PROBATION, PROTECTED]
            .into_iter()
            .map(|l| tenant.lists[l].head)
            .find(|&s| s != NIL)
    }

    /// A slot for a save of tenant `t`: a free one, else one evicted. A
    /// tenant at its share evicts its own blocks (none evictable: None); one
    /// below it evicts an over-share tenant's blocks first; otherwise the
    /// policy's victim (the probationary list's least recent block first).
    fn take_slot(&mut self, t: u32) -> Option<u32> {
        if let Some(s) = self.free.pop_first() {
            return Some(s);
        }
        // Shares bind while others want room: a lone tenant has the policy.
        let shared = self.tenant_cap < self.slots.len() && self.tenant_ids.len() > 1;
        let own = self.tenants[t as usize].as_ref().map_or(0, |t| t.held);
        let by_share = if !shared {
            None
        } else if own >= self.tenant_cap {
            Some(self.tenant_victim(t)?)
        } else {
            self.over.iter().find_map(|&o| self.tenant_victim(o))
        };
        let victim = match by_share {
            Some(v) => v,
            None => self.policy_victim()?,
        };
        let (group, list, read) = {
            let v = &self.slots[victim as usize];
            (v.group, v.list as usize, v.read)
        };
        for c in [&mut self.counters, &mut self.group_counters[group as usize]] {
            c.evicted += 1;
            c.evicted_share += u64::from(by_share.is_some());
            c.evicted_protected += u64::from(list == PROTECTED);
        }
        if let Some(key) = self.release(victim) {
            if self.policy.eviction == Eviction::Slru {
                self.remember(group, &key, read);
            }
            self.events.push(SlotEvent::Evicted { group, key });
        }
        self.free.pop_first()
    }

    /// Remember an evicted key (the oldest ghosts beyond `capacity` go).
    fn remember(&mut self, group: u32, key: &[u8], read: bool) {
        self.ghost_seq += 1;
        let seq = self.ghost_seq;
        if let Some((was, _)) = self.ghosts[group as usize].insert(key.into(), (read, seq)) {
            self.ghost_counts[usize::from(was)] -= 1;
        }
        self.ghost_counts[usize::from(read)] += 1;
        self.ghost_order.push_back((group, key.into(), seq));
        let cap = self.slots.len();
        while self.ghost_counts[0] + self.ghost_counts[1] > cap || self.ghost_order.len() > 2 * cap
        {
            let Some((g, k, seq)) = self.ghost_order.pop_front() else {
                break;
            };
            let map = &mut self.ghosts[g as usize];
            if let Some(&(was, s)) = map.get(&k) {
                if s == seq {
                    map.remove(&k);
                    self.ghost_counts[usize::from(was)] -= 1;
                }
            }
        }
    }

    /// A key is saved again: if it was evicted lately, adapt the protected
    /// list's target (see the module's doc). Returns whether it had been
    /// evicted after a read.
    fn ghost_hit(&mut self, group: usize, key: &[u8]) -> bool {
        if self.policy.eviction != Eviction::Slru {
            return false;
        }
        let Some((read, _)) = self.ghosts[group].remove(key) else {
            return false;
        };
        // ARC's step: one block, or the other kind's ghosts per this kind's.
        let [unread, was_read] = self.ghost_counts;
        self.ghost_counts[usize::from(read)] -= 1;
        if read {
            let step = (unread / was_read.max(1)).max(1);
            self.protected_cap = (self.protected_cap + step).min(self.protected_max);
        } else {
            let step = (was_read / unread.max(1)).max(1);
            self.protected_cap = self.protected_cap.saturating_sub(step);
        }
        read
    }

    /// A `Writing` slot becomes ready: its owner's save ends, it is unpinned
    /// and reported stored.
    fn make_ready(&mut self, s: u32) {
        let owner = self.end_save(s);
        let slot = &mut self.slots[s as usize];
        slot.state = SlotState::Ready;
        let group = slot.group;
        let key = slot.key.clone().unwrap_or_default();
        self.counters.stored += 1;
        self.group_counters[group as usize].stored += 1;
        self.unpin_one(s);
        self.events.push(SlotEvent::Stored { group, key, owner });
    }

    /// The save into `s` ends (ready or aborted): no acknowledgement owed,
    /// no owner. Returns the owner (empty if it had none).
    fn end_save(&mut self, s: u32) -> Arc<str> {
        let slot = &mut self.slots[s as usize];
        slot.save_acks = 0;
        let Some(owner) = slot.owner.take() else {
            return Arc::from("");
        };
        if let Some(n) = self.saving.get_mut(&owner) {
            *n -= 1;
            if *n == 0 {
                self.saving.remove(&owner);
            }
        }
        owner
    }

    /// Make `s` free: out of the lists, the map and its tenant's count.
    /// Returns its key.
    fn release(&mut self, s: u32) -> Option<Box<[u8]>> {
        self.unlink(s);
        let slot = &mut self.slots[s as usize];
        let key = slot.key.take();
        if let Some(key) = &key {
            self.maps[slot.group as usize].remove(key);
        }
        let was_held = slot.state != SlotState::Free;
        let tenant = slot.tenant;
        slot.state = SlotState::Free;
        slot.list = PROBATION as u8;
        if slot.pins > 0 {
            self.pinned -= 1;
        }
        slot.pins = 0;
        slot.load_acks = 0;
        self.free.insert(s);
        if was_held {
            self.held(tenant, false);
        }
        key
    }

    fn pin(&mut self, s: u32) {
        if self.slots[s as usize].pins == 0 {
            self.unlink(s);
            self.pinned += 1;
        }
        self.slots[s as usize].pins += 1;
    }

    fn unpin_one(&mut self, s: u32) {
        let slot = &mut self.slots[s as usize];
        if slot.pins == 0 {
            return;
        }
        slot.pins -= 1;
        if slot.pins == 0 {
            // No load holds it: no load acknowledgement is owed.
            slot.load_acks = 0;
            self.pinned -= 1;
            if slot.state == SlotState::Ready {
                self.link(s);
            }
        }
    }

    /// A cached block is used again (a save found it): the most recent of
    /// its list, and read back.
    fn touch(&mut self, s: u32) {
        if self.slots[s as usize].state != SlotState::Ready {
            return;
        }
        self.read_back(s);
        if self.slots[s as usize].linked {
            self.unlink(s);
            self.link(s);
        }
    }

    /// A ready block is read back: under SLRU it goes to the protected
    /// list (now if it is in the lists, else once unpinned).
    fn read_back(&mut self, s: u32) {
        if self.policy.eviction != Eviction::Slru {
            return;
        }
        self.slots[s as usize].read = true;
        let slot = &self.slots[s as usize];
        if slot.list as usize == PROTECTED {
            return;
        }
        if slot.linked {
            self.unlink(s);
            self.slots[s as usize].list = PROTECTED as u8;
            self.link(s);
        } else {
            self.slots[s as usize].list = PROTECTED as u8;
        }
    }

    /// The policy's victim: the probationary list's least recent block,
    /// unless the protected list is beyond its target and its least recent
    /// block is older (or the probationary list is empty).
    fn policy_victim(&self) -> Option<u32> {
        let (p, q) = (self.lists[PROBATION].head, self.lists[PROTECTED].head);
        let stamp = |s: u32| self.slots[s as usize].stamp;
        if q != NIL
            && (p == NIL || (self.lists[PROTECTED].len > self.protected_cap && stamp(q) < stamp(p)))
        {
            Some(q)
        } else {
            (p != NIL).then_some(p)
        }
    }

    /// Put `s` at the recent end of its list and of its tenant's list.
    fn link(&mut self, s: u32) {
        self.clock += 1;
        self.slots[s as usize].stamp = self.clock;
        let (list, t) = {
            let slot = &self.slots[s as usize];
            (slot.list as usize, slot.tenant)
        };
        push_tail(&mut self.slots, &mut self.lists[list], s, false);
        let tenant = self.tenants[t as usize]
            .as_mut()
            .expect("a slot's tenant is kept while it holds the slot");
        push_tail(&mut self.slots, &mut tenant.lists[list], s, true);
        self.slots[s as usize].linked = true;
    }

    fn unlink(&mut self, s: u32) {
        let (linked, list, t) = {
            let slot = &self.slots[s as usize];
            (slot.linked, slot.list as usize, slot.tenant)
        };
        if !linked {
            return;
        }
        remove(&mut self.slots, &mut self.lists[list], s, false);
        let tenant = self.tenants[t as usize]
            .as_mut()
            .expect("a slot's tenant is kept while it holds the slot");
        remove(&mut self.slots, &mut tenant.lists[list], s, true);
        self.slots[s as usize].linked = false;
    }
}

/// `pct` percent of `n`, rounded down (no overflow).
fn percent(n: usize, pct: usize) -> usize {
    n / 100 * pct + n % 100 * pct / 100
}

/// A slot's links: its list's (`tenant` false) or its tenant's list's.
fn links(slot: &mut Slot, tenant: bool) -> (&mut u32, &mut u32) {
    if tenant {
        (&mut slot.tprev, &mut slot.tnext)
    } else {
        (&mut slot.prev, &mut slot.next)
    }
}

fn push_tail(slots: &mut [Slot], ends: &mut Ends, s: u32, tenant: bool) {
    let old = ends.tail;
    {
        let (prev, next) = links(&mut slots[s as usize], tenant);
        *prev = old;
        *next = NIL;
    }
    if old == NIL {
        ends.head = s;
    } else {
        *links(&mut slots[old as usize], tenant).1 = s;
    }
    ends.tail = s;
    ends.len += 1;
}

fn remove(slots: &mut [Slot], ends: &mut Ends, s: u32, tenant: bool) {
    let (prev, next) = {
        let (p, n) = links(&mut slots[s as usize], tenant);
        let out = (*p, *n);
        *p = NIL;
        *n = NIL;
        out
    };
    if prev == NIL {
        ends.head = next;
    } else {
        *links(&mut slots[prev as usize], tenant).1 = next;
    }
    if next == NIL {
        ends.tail = prev;
    } else {
        *links(&mut slots[next as usize], tenant).0 = prev;
    }
    ends.len -= 1;
}

/// Chained block hashes of a token sequence, for requests vLLM gives no
/// block hashes (prefix caching off): block i's hash covers block i's tokens
/// and, through the chain, every token before it. Only full blocks.
pub fn chain_token_hashes(tokens: &[u32], block_size: usize, seed: &[u8]) -> Vec<[u8; 16]> {
    use xxhash_rust::xxh3::Xxh3;
    if block_size == 0 {
        return Vec::new();
    }
    let mut prev: [u8; 16] = xxhash_rust::xxh3::xxh3_128(seed).to_le_bytes();
    tokens
        .chunks_exact(block_size)
        .map(|block| {
            let mut h = Xxh3::new();
            h.update(&prev);
            for t in block {
                h.update(&t.to_le_bytes());
            }
            prev = h.digest128().to_le_bytes();
            prev
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn k(i: u32) -> Vec<u8> {
        i.to_le_bytes().to_vec()
    }

    fn keys(r: std::ops::Range<u32>) -> Vec<Vec<u8>> {
        r.map(k).collect()
    }

    fn save(ix: &mut BlockIndex, ks: &[Vec<u8>]) -> Vec<u32> {
        let slots: Vec<u32> = ix.reserve(ks).into_iter().map(|(_, s)| s).collect();
        ix.commit(&slots);
        slots
    }

    #[test]
    fn saved_prefix_is_found_and_writing_blocks_are_not() {
        let mut ix = BlockIndex::new(8).unwrap();
        save(&mut ix, &keys(0..3));
        let writing = ix.reserve(&keys(3..4));
        assert_eq!(ix.longest_prefix(&keys(0..6)), 3);
        ix.commit(&[writing[0].1]);
        assert_eq!(ix.longest_prefix(&keys(0..6)), 4);
        assert_eq!(ix.longest_prefix(&keys(1..6)), 3);
        ix.check().unwrap();
    }

    #[test]
    fn fresh_pool_hands_out_consecutive_slots() {
        let mut ix = BlockIndex::new(8).unwrap();
        let got: Vec<u32> = ix
            .reserve(&keys(10..14))
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        assert_eq!(got, [0, 1, 2, 3]);
    }

    #[test]
    fn lru_evicts_least_recent_and_never_pinned() {
        let mut ix = BlockIndex::new(3).unwrap();
        save(&mut ix, &keys(0..3));
        let pinned = ix.pin_ready(&keys(0..1)).unwrap();
        ix.reserve(&keys(1..2)); // touch key 1: key 2 is now least recent unpinned
        let got = save(&mut ix, &keys(10..11));
        assert_eq!(got.len(), 1);
        assert_eq!(ix.longest_prefix(&keys(0..2)), 2);
        assert_eq!(ix.longest_prefix(&keys(2..3)), 0);
        assert_eq!(ix.counters().evicted, 1);
        // Everything else pinned or in flight: a reservation stops early.
        ix.pin_ready(&keys(1..2)).unwrap();
        ix.pin_ready(&keys(10..11)).unwrap();
        assert!(ix.reserve(&keys(20..22)).is_empty());
        ix.unpin(&pinned);
        assert_eq!(ix.reserve(&keys(20..22)).len(), 1);
        ix.check().unwrap();
    }

    #[test]
    fn usage_counts_used_pinned_and_each_groups_slots() {
        let mut ix = BlockIndex::with_groups(4, 2).unwrap();
        let usage = |ix: &BlockIndex| {
            let u = ix.usage();
            (u.capacity, u.used, u.pinned, u.group_used)
        };
        assert_eq!(usage(&ix), (4, 0, 0, vec![0, 0]));
        let w: Vec<u32> = ix
            .reserve_in(0, &keys(0..2), "")
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        ix.reserve_in(1, &keys(0..1), "");
        assert_eq!(
            usage(&ix),
            (4, 3, 3, vec![2, 1]),
            "saves in flight are pinned"
        );
        ix.commit(&w);
        assert_eq!(usage(&ix), (4, 3, 1, vec![2, 1]));
        // Two loads of one block pin one slot.
        let p = ix.pin_ready_in(0, &keys(0..1)).unwrap();
        ix.pin_ready_in(0, &keys(0..1)).unwrap();
        assert_eq!(ix.usage().pinned, 2);
        ix.unpin(&p);
        ix.unpin(&p);
        assert_eq!(ix.usage().pinned, 1);
        ix.clear_unpinned();
        assert_eq!(usage(&ix), (4, 1, 1, vec![0, 1]));
        ix.check().unwrap();
    }

    #[test]
    fn abort_frees_and_clear_keeps_in_flight_work() {
        let mut ix = BlockIndex::new(4).unwrap();
        save(&mut ix, &keys(0..2));
        let w: Vec<u32> = ix
            .reserve(&keys(5..6))
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        assert_eq!(ix.clear_unpinned(), 2);
        assert_eq!(ix.state(w[0]), Some(SlotState::Writing));
        assert_eq!(ix.abort(&w), 1);
        assert_eq!(ix.occupancy(), (4, 0, 0, 0));
        ix.check().unwrap();
    }

    #[test]
    fn chained_hashes_depend_on_every_earlier_token() {
        let a = chain_token_hashes(&[1, 2, 3, 4, 5, 6, 7], 2, b"s");
        assert_eq!(a.len(), 3);
        let b = chain_token_hashes(&[9, 2, 3, 4, 5, 6], 2, b"s");
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let c = chain_token_hashes(&[1, 2, 3, 4, 0, 0], 2, b"s");
        assert_eq!(a[..2], c[..2]);
        assert_ne!(a[2], c[2]);
        assert_ne!(chain_token_hashes(&[1, 2], 2, b"salt")[0], a[0]);
    }

    #[test]
    fn the_same_hash_is_a_different_block_in_each_group() {
        let mut ix = BlockIndex::with_groups(8, 2).unwrap();
        let ks = keys(0..3);
        let s0: Vec<u32> = ix
            .reserve_in(0, &ks, "")
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        ix.commit(&s0);
        assert_eq!(ix.longest_prefix_in(0, &ks), 3);
        assert_eq!(ix.longest_prefix_in(1, &ks), 0);
        let s1: Vec<u32> = ix
            .reserve_in(1, &ks[1..], "")
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        assert_eq!(s1, [3, 4]); // its own slots, from the shared pool
        ix.commit(&s1);
        assert_eq!(ix.pin_ready_in(1, &ks), None); // key 0 is not in group 1
        assert_eq!(ix.pin_ready_in(1, &ks[1..]), Some(vec![3, 4]));
        assert_eq!(ix.group_occupancy(0), (0, 3));
        assert_eq!(ix.group_occupancy(1), (0, 2));
        assert_eq!(ix.group_counters(1).stored, 2);
        assert_eq!(ix.counters().stored, 5);
        ix.check().unwrap();
    }

    #[test]
    fn eviction_is_one_lru_order_across_groups() {
        let mut ix = BlockIndex::with_groups(2, 2).unwrap();
        save(&mut ix, &keys(0..1));
        let s = ix.reserve_in(1, &keys(0..1), "");
        ix.commit(&[s[0].1]);
        let s = ix.reserve_in(1, &keys(1..2), ""); // evicts group 0's block, the older
        ix.commit(&[s[0].1]);
        assert_eq!(ix.longest_prefix_in(0, &keys(0..1)), 0);
        assert_eq!(ix.longest_prefix_in(1, &keys(0..2)), 2);
        assert_eq!(ix.group_counters(0).evicted, 1);
        ix.check().unwrap();
    }

    fn ready(ix: &mut BlockIndex, group: usize, ks: &[Vec<u8>]) {
        let s: Vec<u32> = ix
            .reserve_in(group, ks, "")
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        ix.commit(&s);
    }

    #[test]
    fn a_window_group_needs_only_the_blocks_before_the_resume_point() {
        // Group 0 full attention, group 1 a window of 2 blocks.
        let mut ix = BlockIndex::with_groups(32, 2).unwrap();
        let ks = keys(0..8);
        let reach = [Reach::Prefix, Reach::Window(2)];
        ready(&mut ix, 0, &ks[..6]);
        ready(&mut ix, 1, &ks[2..4]); // the window before 4
        let hit = ix.servable_prefix(&ks, 0, 8, &reach);
        assert_eq!(
            hit,
            ServablePrefix {
                blocks: 4,
                prefix_blocks: 6
            }
        );
        ready(&mut ix, 1, &ks[4..6]); // and the window before 6
        assert_eq!(ix.servable_prefix(&ks, 0, 8, &reach).blocks, 6);
        assert_eq!(ix.servable_prefix(&ks, 0, 5, &reach).blocks, 5);
        // Blocks already on the device count as present.
        assert_eq!(ix.servable_prefix(&ks, 3, 8, &reach).blocks, 6);
        // Near the start the window is shorter than n.
        let mut ix = BlockIndex::with_groups(32, 2).unwrap();
        ready(&mut ix, 0, &ks[..3]);
        ready(&mut ix, 1, &ks[..1]);
        assert_eq!(ix.servable_prefix(&ks, 0, 8, &reach).blocks, 1);
        assert_eq!(ix.servable_prefix(&ks, 5, 8, &reach).blocks, 5); // nothing new
    }

    fn owned(ix: &mut BlockIndex, group: usize, ks: &[Vec<u8>], owner: &str) -> Vec<u32> {
        ix.reserve_in(group, ks, owner)
            .into_iter()
            .map(|(_, s)| s)
            .collect()
    }

    #[test]
    fn a_save_is_ready_once_every_worker_acknowledged_it() {
        let mut ix = BlockIndex::with_workers(8, 1, 3).unwrap();
        let w = owned(&mut ix, 0, &keys(0..2), "req-a");
        assert_eq!(ix.saving("req-a"), 2);
        assert_eq!(ix.ack_saves(&[(w[0], 1), (w[1], 2)]), 0);
        assert_eq!(ix.ack_saves(&[(w[0], 1)]), 0);
        assert_eq!(ix.longest_prefix(&keys(0..2)), 0, "not every worker yet");
        ix.check().unwrap();
        assert_eq!(ix.ack_saves(&[(w[1], 1), (w[0], 1)]), 2);
        assert_eq!(ix.longest_prefix(&keys(0..2)), 2);
        assert_eq!(ix.saving("req-a"), 0);
        // Late or stray acknowledgements change nothing.
        assert_eq!(ix.ack_saves(&[(w[0], 1), (99, 1)]), 0);
        assert_eq!(ix.counters().stored, 2);
        let owner: Arc<str> = Arc::from("req-a");
        assert_eq!(
            ix.take_events(),
            [
                SlotEvent::Stored {
                    group: 0,
                    key: k(1).into(),
                    owner: owner.clone()
                },
                SlotEvent::Stored {
                    group: 0,
                    key: k(0).into(),
                    owner
                },
            ]
        );
        assert!(ix.take_events().is_empty(), "taken once");
        ix.check().unwrap();
    }

    #[test]
    fn a_save_reports_its_evictions_and_its_storing_in_one_call_each() {
        // Two slots, both ready: a reservation of two new blocks evicts them
        // and says so with the reservation.
        let mut ix = BlockIndex::with_workers(2, 1, 2).unwrap();
        save(&mut ix, &keys(0..2));
        ix.take_events();
        let (got, events) = ix.reserve_reporting(0, &keys(5..7), "r", "");
        let slots: Vec<u32> = got.iter().map(|&(_, s)| s).collect();
        assert_eq!(slots.len(), 2);
        assert!(
            events
                .iter()
                .all(|e| matches!(e, SlotEvent::Evicted { group: 0, .. })),
            "{events:?}"
        );
        assert_eq!(events.len(), 2);
        // The workers' step: one save failed, the other acknowledged by
        // both workers (one in this report, one earlier).
        ix.ack_saves(&[(slots[1], 1)]);
        let events = ix.workers_reported(&[slots[0]], &[(slots[1], 1)], &[]);
        let kinds: Vec<&str> = events
            .iter()
            .map(|e| match e {
                SlotEvent::Aborted { .. } => "aborted",
                SlotEvent::Stored { .. } => "stored",
                _ => "other",
            })
            .collect();
        assert_eq!(kinds, ["aborted", "stored"]);
        assert_eq!(ix.longest_prefix(&keys(6..7)), 1);
        assert_eq!(ix.saving("r"), 0);
        ix.check().unwrap();
    }

    #[test]
    fn a_load_pin_is_released_once_every_worker_acknowledged_the_load() {
        let mut ix = BlockIndex::with_workers(4, 1, 2).unwrap();
        save(&mut ix, &keys(0..1));
        let s = ix.pin_ready(&keys(0..1)).unwrap()[0];
        ix.pin_ready(&keys(0..1)).unwrap(); // a second load of the same block
        ix.ack_loads(&[(s, 1)]);
        assert_eq!(ix.pins(s), 2, "one worker of two");
        ix.check().unwrap();
        ix.ack_loads(&[(s, 2)]); // the first load's second, the next's first
        assert_eq!(ix.pins(s), 1);
        ix.ack_loads(&[(s, 1)]);
        assert_eq!(ix.pins(s), 0);
        // Acknowledgements of a slot no load pins are ignored.
        ix.ack_loads(&[(s, 5), (99, 1)]);
        assert_eq!(ix.pins(s), 0);
        // A pin released otherwise (an offer dropped) owes nothing after.
        ix.pin_ready(&keys(0..1)).unwrap();
        ix.ack_loads(&[(s, 1)]);
        ix.unpin(&[s]);
        ix.pin_ready(&keys(0..1)).unwrap();
        ix.ack_loads(&[(s, 1)]);
        assert_eq!(ix.pins(s), 1, "the earlier acknowledgement was dropped");
        ix.check().unwrap();
    }

    #[test]
    fn evictions_aborts_and_clears_are_reported_with_their_blocks() {
        let mut ix = BlockIndex::with_groups(2, 2).unwrap();
        let a = owned(&mut ix, 0, &keys(0..1), "a");
        ix.commit(&a);
        let b = owned(&mut ix, 1, &keys(0..1), "b");
        ix.commit(&b);
        ix.take_events();
        let c = owned(&mut ix, 1, &keys(7..8), "c"); // evicts group 0's key 0
        assert_eq!(
            ix.take_events(),
            [SlotEvent::Evicted {
                group: 0,
                key: k(0).into()
            }]
        );
        assert_eq!(ix.abort(&c), 1);
        assert_eq!(ix.saving("c"), 0);
        assert_eq!(ix.clear_unpinned(), 1);
        assert_eq!(
            ix.take_events(),
            [
                SlotEvent::Aborted {
                    group: 1,
                    key: k(7).into(),
                    owner: Arc::from("c")
                },
                SlotEvent::Dropped {
                    group: 1,
                    key: k(0).into()
                },
            ]
        );
        ix.check().unwrap();
    }

    #[test]
    fn each_owner_counts_its_saves_in_flight_across_groups() {
        let mut ix = BlockIndex::with_groups(8, 2).unwrap();
        let a0 = owned(&mut ix, 0, &keys(0..2), "a");
        let a1 = owned(&mut ix, 1, &keys(0..1), "a");
        owned(&mut ix, 0, &keys(5..6), "b");
        // Already cached or being saved: nothing more reserved, or owed.
        assert!(owned(&mut ix, 0, &keys(0..2), "c").is_empty());
        assert_eq!((ix.saving("a"), ix.saving("b"), ix.saving("c")), (3, 1, 0));
        ix.check().unwrap();
        ix.abort(&a0[..1]);
        ix.ack_saves(&[(a0[1], 1)]);
        assert_eq!(ix.saving("a"), 1);
        ix.commit(&a1);
        assert_eq!((ix.saving("a"), ix.saving("b")), (0, 1));
        ix.check().unwrap();
    }

    fn with(cap: usize, eviction: Eviction, share: f64) -> BlockIndex {
        let policy = Policy {
            eviction,
            tenant_max_share: share,
        };
        BlockIndex::with_policy(cap, 1, 1, policy).unwrap()
    }

    fn save_for(ix: &mut BlockIndex, ks: &[Vec<u8>], tenant: &str) -> usize {
        let s: Vec<u32> = ix
            .reserve_for(0, ks, "r", tenant)
            .into_iter()
            .map(|(_, s)| s)
            .collect();
        ix.commit(&s)
    }

    /// The issue's case in the index: a 64-slot pool, two hot prefixes of 8
    /// blocks read back twice, then one pass of ten one-off 8-block prompts.
    fn hot_blocks_after_a_scan(eviction: Eviction) -> usize {
        let mut ix = with(64, eviction, 1.0);
        let hot = [keys(0..8), keys(8..16)];
        for h in &hot {
            save(&mut ix, h);
        }
        for _ in 0..2 {
            for h in &hot {
                let p = ix.pin_ready(h).unwrap();
                ix.unpin(&p);
            }
        }
        for i in 0..10 {
            save(&mut ix, &keys(1000 + i * 8..1008 + i * 8));
        }
        ix.check().unwrap();
        hot.iter().map(|h| ix.longest_prefix(h)).sum()
    }

    #[test]
    fn slru_keeps_the_blocks_read_back_through_a_scan_larger_than_the_pool() {
        assert_eq!(hot_blocks_after_a_scan(Eviction::Lru), 0);
        assert_eq!(hot_blocks_after_a_scan(Eviction::Slru), 16);
    }

    #[test]
    fn slru_admits_first_time_blocks_and_without_reads_evicts_as_lru() {
        for eviction in [Eviction::Lru, Eviction::Slru] {
            let mut ix = with(4, eviction, 1.0);
            save(&mut ix, &keys(0..4));
            assert_eq!(
                save(&mut ix, &keys(4..6)).len(),
                2,
                "first-time blocks admitted"
            );
            assert_eq!(ix.longest_prefix(&keys(0..2)), 0, "{eviction:?}");
            assert_eq!(ix.longest_prefix(&keys(2..6)), 4);
            assert_eq!(ix.counters().evicted, 2);
            ix.check().unwrap();
        }
    }

    #[test]
    fn a_block_found_by_a_later_save_is_read_back_too() {
        let mut ix = with(4, Eviction::Slru, 1.0);
        let s = save(&mut ix, &keys(0..2));
        assert!(!ix.is_protected(s[0]));
        assert!(
            ix.reserve(&keys(0..1)).is_empty(),
            "cached: nothing to reserve"
        );
        assert!(ix.is_protected(s[0]) && !ix.is_protected(s[1]));
        save(&mut ix, &keys(5..8)); // one eviction: the block written once
        assert_eq!(ix.longest_prefix(&keys(0..1)), 1);
        assert_eq!(ix.longest_prefix(&keys(1..2)), 0);
        ix.check().unwrap();
    }

    #[test]
    fn protected_blocks_beyond_the_target_compete_by_recency() {
        // 8 slots: a target of 2 protected blocks (at most 6).
        let mut ix = with(8, Eviction::Slru, 1.0);
        assert_eq!(ix.policy_usage().protected_target, 2);
        save(&mut ix, &keys(0..4));
        for i in 0..3 {
            let p = ix.pin_ready(&keys(i..i + 1)).unwrap();
            ix.unpin(&p);
        }
        save(&mut ix, &keys(100..104)); // written after the reads
        assert_eq!(ix.policy_usage().protected, 3);
        // Key 3, written once and older than every read: the first to go.
        save(&mut ix, &keys(10..11));
        assert_eq!(ix.longest_prefix(&keys(3..4)), 0);
        // Key 0, read before key 100 was written, beyond the target: next.
        save(&mut ix, &keys(11..12));
        assert_eq!(ix.longest_prefix(&keys(0..1)), 0);
        assert_eq!(ix.counters().evicted_protected, 1);
        // Two protected now, within the target: key 100 goes, newer or not.
        save(&mut ix, &keys(12..13));
        assert_eq!(ix.longest_prefix(&keys(100..101)), 0);
        assert_eq!(ix.longest_prefix(&keys(1..3)), 2);
        assert_eq!(ix.longest_prefix(&keys(10..13)), 3);
        // Key 0 comes back: evicted after a read, the target grows (ARC's
        // step: 2 ghosts evicted unread per ghost evicted read).
        let back = save(&mut ix, &keys(0..1));
        assert_eq!(ix.policy_usage().protected_target, 4);
        assert!(ix.is_protected(back[0]), "protected again once stored");
        ix.check().unwrap();
        // Only protected blocks left to evict: the least recent goes.
        let mut ix = with(1, Eviction::Slru, 1.0);
        save(&mut ix, &keys(0..1));
        let p = ix.pin_ready(&keys(0..1)).unwrap();
        ix.unpin(&p);
        save(&mut ix, &keys(1..2));
        assert_eq!(ix.longest_prefix(&keys(0..2)), 0);
        assert_eq!(ix.longest_prefix(&keys(1..2)), 1);
        ix.check().unwrap();
    }

    #[test]
    fn returning_users_are_served_as_under_lru_and_unread_ghosts_shrink_the_target() {
        // Returning users: each context (2 blocks) is saved, read back once
        // when its user returns, and never again; the next users' contexts
        // come back later. LRU serves every return, and so does SLRU: the
        // protected blocks beyond the target (the stale ones) go by recency.
        let returns = |eviction| {
            let mut ix = with(24, eviction, 1.0);
            let ctx = |u: u32| keys(100 * u..100 * u + 2);
            let mut served = 0;
            for t in 0..400u32 {
                save(&mut ix, &ctx(t));
                if t >= 5 {
                    let back = ctx(t - 5);
                    let hit = ix.longest_prefix(&back);
                    served += hit;

                    if let Some(p) = ix.pin_ready(&back[..hit]) {
                        ix.unpin(&p);
                    }
                    save(&mut ix, &back); // what missed is saved again
                }
            }
            ix.check().unwrap();
            (served, ix.policy_usage().protected_target)
        };
        let (lru, _) = returns(Eviction::Lru);
        let (slru, target) = returns(Eviction::Slru);
        assert_eq!(lru, 2 * 395);
        assert!(slru * 100 >= lru * 95, "slru {slru} against lru {lru}");
        assert!(target <= 12, "{target}");
        // A block evicted unread and saved again: the target shrinks.
        let mut ix = with(8, Eviction::Slru, 1.0);
        save(&mut ix, &keys(0..8));
        save(&mut ix, &keys(8..16));
        assert_eq!(ix.policy_usage().protected_target, 2);
        save(&mut ix, &keys(0..1));
        assert_eq!(ix.policy_usage().protected_target, 1);
        ix.check().unwrap();
    }

    #[test]
    fn a_pinned_block_read_back_is_protected_once_unpinned_and_never_evicted_pinned() {
        let mut ix = with(3, Eviction::Slru, 1.0);
        save(&mut ix, &keys(0..3));
        let p = ix.pin_ready(&keys(0..1)).unwrap();
        assert_eq!(ix.policy_usage().protected, 0, "pinned: in no list");
        save(&mut ix, &keys(5..7));
        assert_eq!(ix.longest_prefix(&keys(0..1)), 1);
        ix.unpin(&p);
        assert_eq!(ix.policy_usage().protected, 1);
        save(&mut ix, &keys(8..10));
        assert_eq!(
            ix.longest_prefix(&keys(0..1)),
            1,
            "protected outlives two saves"
        );
        ix.check().unwrap();
    }

    #[test]
    fn a_tenant_over_its_share_evicts_its_own_blocks_first() {
        // Tenant b's prefix, then tenant a floods 1.5x the pool.
        for eviction in [Eviction::Lru, Eviction::Slru] {
            let mut ix = with(64, eviction, 0.5);
            save_for(&mut ix, &keys(0..8), "b");
            for i in 0..12 {
                save_for(&mut ix, &keys(100 + i * 8..108 + i * 8), "a");
            }
            assert_eq!(ix.longest_prefix(&keys(0..8)), 8, "{eviction:?}");
            // a took the free slots, then only its own.
            assert_eq!(ix.tenant_held("a"), 56);
            assert_eq!(ix.counters().evicted_share, 40);
            // b wants room: a, over its share, gives it back down to 32.
            save_for(&mut ix, &keys(1000..1040), "b");
            assert_eq!((ix.tenant_held("a"), ix.tenant_held("b")), (32, 32));
            assert_eq!(ix.policy_usage().tenants, 2);
            ix.check().unwrap();
            // Without a share, a's flood evicts b's prefix (the issue's case).
            let mut ix = with(64, eviction, 1.0);
            save_for(&mut ix, &keys(0..8), "b");
            for i in 0..12 {
                save_for(&mut ix, &keys(100 + i * 8..108 + i * 8), "a");
            }
            assert_eq!(ix.longest_prefix(&keys(0..8)), 0);
            assert_eq!(ix.counters().evicted_share, 0);
        }
    }

    #[test]
    fn a_lone_tenant_is_evicted_by_the_policy_not_by_its_share() {
        let mut ix = with(8, Eviction::Slru, 0.5);
        save_for(&mut ix, &keys(0..8), "a");
        let p = ix.pin_ready(&keys(0..2)).unwrap();
        ix.unpin(&p); // read back: protected, within the target of 2
        save_for(&mut ix, &keys(10..12), "a");
        assert_eq!(
            ix.longest_prefix(&keys(0..2)),
            2,
            "the policy kept what was read"
        );
        assert_eq!(ix.counters().evicted_share, 0);
        assert_eq!(ix.counters().evicted, 2);
        ix.check().unwrap();
    }

    #[test]
    fn a_tenant_that_holds_nothing_is_forgotten() {
        let mut ix = with(4, Eviction::Slru, 0.5);
        for i in 0..100u32 {
            assert_eq!(save_for(&mut ix, &keys(i..i + 1), &format!("t{i}")), 1);
        }
        assert_eq!(
            ix.policy_usage().tenants,
            4,
            "only the tenants holding a block"
        );
        assert!(
            ix.tenants.len() <= 5,
            "ids are reused: {}",
            ix.tenants.len()
        );
        ix.clear_unpinned();
        assert_eq!(ix.policy_usage().tenants, 0);
        ix.check().unwrap();
    }

    #[test]
    fn a_policy_is_parsed_by_name_and_a_share_outside_0_1_refused() {
        assert_eq!(Eviction::parse("lru"), Ok(Eviction::Lru));
        assert_eq!(Eviction::parse("slru"), Ok(Eviction::Slru));
        assert!(matches!(
            Eviction::parse("arc"),
            Err(IndexError::Eviction { .. })
        ));
        for bad in [0.0, -0.5, 1.5, f64::NAN] {
            let policy = Policy {
                eviction: Eviction::Slru,
                tenant_max_share: bad,
            };
            assert!(matches!(
                BlockIndex::with_policy(4, 1, 1, policy),
                Err(IndexError::TenantShare { .. })
            ));
        }
    }

    #[derive(Clone, Debug)]
    enum Op {
        /// (group, keys, tenant): reserved and committed.
        Save(usize, Vec<u8>, usize),
        Reserve(usize, Vec<u8>, usize),
        CommitOldest,
        AbortOldest,
        /// Every worker acknowledges the oldest reservation's saves, one
        /// worker's acknowledgements at a time.
        AckOldest,
        PinPrefix(usize, u8),
        UnpinOldest,
        /// Every worker acknowledges the oldest load, one at a time.
        AckLoadOldest,
        Clear,
    }

    fn op() -> impl Strategy<Value = Op> {
        let ks = proptest::collection::vec(0u8..24, 1..6);
        prop_oneof![
            4 => (0usize..2, ks.clone(), 0usize..3).prop_map(|(g, k, t)| Op::Save(g, k, t)),
            2 => (0usize..2, ks, 0usize..3).prop_map(|(g, k, t)| Op::Reserve(g, k, t)),
            1 => Just(Op::CommitOldest),
            1 => Just(Op::AbortOldest),
            2 => Just(Op::AckOldest),
            2 => (0usize..2, 1u8..5).prop_map(|(g, n)| Op::PinPrefix(g, n)),
            1 => Just(Op::UnpinOldest),
            1 => Just(Op::AckLoadOldest),
            1 => Just(Op::Clear),
        ]
    }

    /// The (group, key) of every ready slot.
    fn ready_blocks(ix: &BlockIndex) -> BTreeSet<(u32, Vec<u8>)> {
        ix.slots
            .iter()
            .filter(|s| s.state == SlotState::Ready)
            .filter_map(|s| Some((s.group, s.key.as_deref()?.to_vec())))
            .collect()
    }

    /// `servable_prefix` by its definition, resume point by resume point.
    fn servable_by_definition(
        ix: &BlockIndex,
        ks: &[Vec<u8>],
        start: usize,
        end: usize,
        reach: &[Reach],
    ) -> usize {
        let ok = |k: usize| {
            reach.iter().enumerate().all(|(g, r)| {
                let from = match r {
                    Reach::Prefix => start,
                    Reach::Window(n) => start.max(k.saturating_sub(*n)),
                };
                ks[from..k].iter().all(|key| ix.is_ready(g, key))
            })
        };
        (start + 1..=end.min(ks.len()))
            .rev()
            .find(|&k| ok(k))
            .unwrap_or(start)
    }

    #[test]
    fn construction_refuses_empty_or_oversized_indexes() {
        let max = NIL as usize - 1;
        assert_eq!(
            BlockIndex::new(0).err(),
            Some(IndexError::Capacity { got: 0, max })
        );
        assert!(BlockIndex::with_groups(4, 0).is_err());
        assert_eq!(
            BlockIndex::with_workers(4, 1, 0).err(),
            Some(IndexError::Workers {
                got: 0,
                max: MAX_WORKERS
            })
        );
        assert!(BlockIndex::with_workers(4, 1, MAX_WORKERS + 1).is_err());
        assert!(BlockIndex::with_groups(max + 1, 1).is_err());
        assert!(BlockIndex::with_groups(4, MAX_GROUPS + 1).is_err());
    }

    #[test]
    fn an_index_beyond_the_machines_memory_is_an_error_not_an_abort() {
        // u32::MAX - 2 slots in MAX_GROUPS groups: petabytes, which no
        // allocator gives (the probe asks for it whole, touching nothing).
        let max = NIL as usize - 1;
        let err = BlockIndex::with_groups(max, MAX_GROUPS).err();
        assert!(matches!(err, Some(IndexError::Memory { capacity, .. }) if capacity == max));
        assert!(err.unwrap().to_string().contains("more than this machine"));
    }

    proptest! {
        /// Under any sequence of operations: the structure stays consistent
        /// (owners, acknowledgements and pins included), a pinned slot keeps
        /// its key, nothing is ever beyond capacity, and the events tell
        /// exactly which blocks are readable.
        #[test]
        fn invariants_hold(
            ops in proptest::collection::vec(op(), 1..80),
            cap in 1usize..10,
            workers in 1usize..4,
            slru in any::<bool>(),
            share in prop_oneof![Just(1.0), Just(0.5), Just(0.34)],
        ) {
            let eviction = if slru { Eviction::Slru } else { Eviction::Lru };
            let policy = Policy { eviction, tenant_max_share: share };
            let mut ix = BlockIndex::with_policy(cap, 2, workers, policy).unwrap();
            let tenant_cap = ix.tenant_cap;
            let mut writing: Vec<(String, Vec<u32>)> = Vec::new();
            let mut pins: Vec<(usize, Vec<u32>, Vec<Vec<u8>>)> = Vec::new();
            let mut announced: BTreeSet<(u32, Vec<u8>)> = BTreeSet::new();
            // Whose each block being written or ready is.
            let mut tenant_of: HashMap<(u32, Vec<u8>), usize> = HashMap::new();
            let names = ["", "a", "b"];
            for (i, op) in ops.into_iter().enumerate() {
                // A save's tenant, if it held its share already.
                let mut at_share: Option<usize> = None;
                // Blocks reserved now: whose, once this op's events are seen.
                let mut reserved: Vec<((u32, Vec<u8>), usize)> = Vec::new();
                let commit = matches!(op, Op::Save(..));
                match op {
                    Op::Save(g, ks, t) | Op::Reserve(g, ks, t) => {
                        let ks: Vec<Vec<u8>> = ks.into_iter().map(|b| vec![b]).collect();
                        let owner = format!("r{}", i % 3);
                        if ix.tenant_held(names[t]) >= tenant_cap && tenant_cap < cap {
                            at_share = Some(t);
                        }
                        let got = ix.reserve_for(g, &ks, &owner, names[t]);
                        for &(p, _) in &got {
                            reserved.push(((g as u32, ks[p].clone()), t));
                        }
                        let w: Vec<u32> = got.into_iter().map(|(_, s)| s).collect();
                        if commit { ix.commit(&w); } else { writing.push((owner, w)); }
                    }
                    Op::CommitOldest => if !writing.is_empty() { let (_, w) = writing.remove(0); ix.commit(&w); },
                    Op::AbortOldest => if !writing.is_empty() { let (_, w) = writing.remove(0); ix.abort(&w); },
                    Op::AckOldest => if !writing.is_empty() {
                        let (_, w) = writing.remove(0);
                        for _ in 0..workers {
                            let acks: Vec<(u32, u32)> = w.iter().map(|&s| (s, 1)).collect();
                            ix.ack_saves(&acks);
                        }
                    },
                    Op::PinPrefix(g, n) => {
                        let ks: Vec<Vec<u8>> = (0..n).map(|b| vec![b]).collect();
                        if let Some(s) = ix.pin_ready_in(g, &ks) { pins.push((g, s, ks)); }
                    }
                    Op::UnpinOldest => if !pins.is_empty() { let (_, s, _) = pins.remove(0); ix.unpin(&s); },
                    Op::AckLoadOldest => if !pins.is_empty() {
                        let (_, s, _) = pins.remove(0);
                        for _ in 0..workers {
                            let acks: Vec<(u32, u32)> = s.iter().map(|&s| (s, 1)).collect();
                            ix.ack_loads(&acks);
                        }
                    },
                    Op::Clear => { ix.clear_unpinned(); }
                }
                for e in ix.take_events() {
                    match e {
                        SlotEvent::Stored { group, key, .. } => {
                            prop_assert!(announced.insert((group, key.to_vec())), "stored twice");
                        }
                        SlotEvent::Evicted { group, key } => {
                            prop_assert!(announced.remove(&(group, key.to_vec())), "removed unannounced");
                            let whose = tenant_of.remove(&(group, key.to_vec()));
                            if let Some(t) = at_share {
                                prop_assert_eq!(whose, Some(t), "a tenant at its share evicted another's block");
                            }
                        }
                        SlotEvent::Dropped { group, key } => {
                            prop_assert!(announced.remove(&(group, key.to_vec())), "removed unannounced");
                            tenant_of.remove(&(group, key.to_vec()));
                        }
                        SlotEvent::Aborted { group, key, .. } => {
                            prop_assert!(!announced.contains(&(group, key.to_vec())), "aborted a ready block");
                            tenant_of.remove(&(group, key.to_vec()));
                        }
                    }
                }
                tenant_of.extend(reserved);
                prop_assert_eq!(&announced, &ready_blocks(&ix));
                prop_assert!(ix.check().is_ok(), "{:?}", ix.check());
                for (owner, w) in &writing {
                    prop_assert!(ix.saving(owner) >= w.len());
                }
                for (g, slots, ks) in &pins {
                    prop_assert_eq!(ix.longest_prefix_in(*g, ks), ks.len());
                    for &s in slots { prop_assert!(ix.pins(s) > 0); }
                }
                for (_, w) in &writing {
                    for &s in w { prop_assert_eq!(ix.state(s), Some(SlotState::Writing)); }
                }
                let (f, w, r, _) = ix.occupancy();
                prop_assert_eq!(f + w + r, cap);
                // Each tenant's count is what it saved and still holds.
                for (t, name) in names.iter().enumerate() {
                    let n = tenant_of.values().filter(|&&o| o == t).count();
                    prop_assert_eq!(ix.tenant_held(name), n);
                }
                prop_assert_eq!(ix.policy_usage().tenants, tenant_of.values().collect::<BTreeSet<_>>().len());
                if eviction == Eviction::Lru {
                    prop_assert_eq!(ix.policy_usage().protected, 0);
                }
                let (w0, r0) = ix.group_occupancy(0);
                let (w1, r1) = ix.group_occupancy(1);
                prop_assert_eq!((w0 + w1, r0 + r1), (w, r));
            }
        }

        /// The hybrid lookup equals its definition: the longest resume point
        /// at which every prefix group has every block after `start` and
        /// every window group the last n blocks.
        #[test]
        fn servable_prefix_matches_its_definition(
            present in proptest::collection::vec((0usize..3, 0u32..12), 0..30),
            windows in proptest::collection::vec(proptest::option::of(0usize..4), 1..4),
            start in 0usize..6,
            end in 0usize..14,
        ) {
            let groups = windows.len();
            let reach: Vec<Reach> = windows
                .iter()
                .map(|w| w.map_or(Reach::Prefix, Reach::Window))
                .collect();
            let mut ix = BlockIndex::with_groups(64, groups).unwrap();
            for (g, key) in present {
                if g < groups {
                    ready(&mut ix, g, &[k(key)]);
                }
            }
            let ks = keys(0..12);
            let got = ix.servable_prefix(&ks, start, end, &reach);
            prop_assert_eq!(got.blocks, servable_by_definition(&ix, &ks, start, end, &reach));
            prop_assert!(got.blocks <= got.prefix_blocks.max(start));
        }
    }
}
