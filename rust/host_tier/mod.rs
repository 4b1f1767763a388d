//! The host tier's Rust side: [`block_index`], the index of the blocks the
//! tier holds in host memory (block hash -> slot, LRU eviction, pins, the
//! workers' acknowledgements, its events); its errors are
//! [`crate::error::IndexError`]. The rest of the tier (its scheduler and
//! worker sides, the copies) is Python: `python/kvmux/host_cache/`, over
//! the bindings' `HostIndex`.

pub mod block_index;

pub use block_index::{
    chain_token_hashes, BlockIndex, IndexCounters, Reach, ServablePrefix, SlotEvent, SlotState,
    Usage, MAX_GROUPS, MAX_WORKERS,
};
