//! kvmux's core: the bookkeeping of a KV-connector multiplexer, in plain Rust.
//!
//! Nothing here knows vLLM or Python except `bindings` (behind the default
//! `python` feature): `cargo test --no-default-features` needs no interpreter.
#![forbid(unsafe_code)]

pub mod block_index;
pub mod breaker;
pub mod completions;
pub mod error;
pub mod merge;
pub mod mux;
pub mod requests;
pub mod stats;

#[cfg(feature = "python")]
mod bindings;
