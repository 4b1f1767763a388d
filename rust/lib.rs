//! kvmux's core: the bookkeeping of a KV-connector multiplexer, in plain Rust.
//!
//! Two products, one folder each: [`mux`], the multiplexer (its rules, its
//! per-request table, merge, completions, breakers, counters), and
//! [`host_tier`], the host tier's block index; [`error`] is the one error
//! type both share.
//!
//! Nothing here knows vLLM or Python except `bindings` (behind the default
//! `python` feature): `cargo test --no-default-features` needs no interpreter.
#![forbid(unsafe_code)]

pub mod error;
pub mod host_tier;
pub mod mux;

#[cfg(feature = "python")]
mod bindings;
