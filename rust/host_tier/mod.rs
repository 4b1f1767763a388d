//! The host tier's Rust side: [`block_index`], the index of the blocks the
//! tier holds in host memory (block hash -> slot, LRU eviction, pins, the
//! workers' acknowledgements, its events), and [`requests`], the
//! per-request bookkeeping beside it ([`HostTier`]: offers, saves, loads,
//! crediting by the multiplexer's [`crate::mux::Credits`]); its errors are
//! [`crate::error::IndexError`]. The rest of the tier (the conversions from
//! vLLM's objects, the worker side, the copies) is Python:
//! `python/kvmux/host_cache/`, over the bindings' `HostIndex`.

pub mod block_index;
pub mod requests;

pub use block_index::{
    chain_token_hashes, BlockIndex, IndexCounters, Reach, ServablePrefix, SlotEvent, SlotState,
    Usage, MAX_GROUPS, MAX_WORKERS,
};
pub use requests::{
    Allocated, Finished, GroupSave, HostRequest, HostTier, LoadPlan, NotOffered, SavePlan,
};
