//! The host tier's Rust side: [`block_index`], the index of the blocks the
//! tier holds in host memory (block hash -> slot, eviction (LRU or SLRU, tenant shares), pins, the
//! workers' acknowledgements, its events), and [`requests`], the
//! per-request bookkeeping beside it ([`HostTier`]: offers, saves, loads,
//! crediting by the multiplexer's [`crate::mux::Credits`]); its errors are
//! [`crate::error::IndexError`]. The rest of the tier (the conversions from
//! vLLM's objects, the worker side, the copies) is Python:
//! `python/kvmux/host_cache/`, over the bindings' `HostIndex`.
//!
//! Each vLLM hook of the tier's scheduler side, through the layers (grep
//! the hook's name: `KvmuxHostCache` and `HostCacheScheduler` bear it; the
//! `HostIndex` and [`HostTier`] methods it calls are named here):
//!
//! | vLLM hook                    | `HostIndex` / [`HostTier`]          | file                         |
//! |------------------------------|-------------------------------------|------------------------------|
//! | `get_num_new_matched_tokens` | `lookup`                            | `requests.rs`                |
//! | `update_state_after_alloc`   | `allocated`                         | `requests.rs`                |
//! | `build_connector_meta`       | `take_loads`, `saves_due`, `reserve_saves` | `requests.rs`, `block_index.rs` |
//! | `update_connector_output`    | `workers_reported`                  | `block_index.rs`             |
//! | `request_finished(_all_groups)` | `finished`                       | `requests.rs`                |
//! | `reset_cache`                | `clear_unpinned`                    | `block_index.rs`             |
//! | `take_events`                | `take_events`                       | `block_index.rs`             |

pub mod block_index;
pub mod requests;

pub use block_index::{
    chain_token_hashes, BlockIndex, Eviction, IndexCounters, Policy, PolicyUsage, Reach,
    ServablePrefix, SlotEvent, SlotState, Usage, MAX_GROUPS, MAX_WORKERS, PROTECTED_PERCENT,
    PROTECTED_START_PERCENT,
};
pub use requests::{
    Allocated, Finished, GroupSave, HostRequest, HostTier, LoadPlan, NotOffered, SavePlan,
};
