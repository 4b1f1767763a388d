//! The host tier's bindings (`crate::host_tier`): `block_index.rs`, the
//! index's (`HostIndex`, `ServablePrefix`, `Reservation`,
//! `chain_token_hashes`). Conversions only, as every binding.

mod block_index;

pub(super) use block_index::{py_chain_token_hashes, PyHostIndex, PyReservation, PyServablePrefix};
