//! The one error type of the multiplexer. The bindings map each variant to
//! one Python exception, in one place.

use thiserror::Error;

/// How a child let the multiplexer down in one hook. `E` is the error the
/// child itself raised (a Python exception, in the bindings).
#[derive(Debug, Error)]
pub enum ChildFault<E> {
    /// The child raised.
    #[error("the child raised")]
    Raised(E),
    /// The child raised something that is not an error (Python's
    /// `KeyboardInterrupt`, `SystemExit`: a `BaseException` that is not an
    /// `Exception`): never contained, handed back as it is.
    #[error("the child was interrupted")]
    Interrupt(E),
    /// The child answered something the hook's contract does not allow
    /// (the text says what, and what it must answer instead).
    #[error("{0}")]
    Malformed(String),
}

/// Why a multiplexer event failed.
#[derive(Debug, Error)]
pub enum MuxError<E> {
    /// A child failed in a hook: the request's state is dropped and the
    /// error names the child.
    #[error("child {child} failed in {hook}: {fault}")]
    Child {
        child: usize,
        hook: &'static str,
        fault: ChildFault<E>,
    },
    /// Two sources returned one `kv_transfer_params` key and the clash
    /// policy refuses it. `first`/`second` are source indices: the children,
    /// then the multiplexer itself (index = number of children).
    #[error("params key {key:?} returned by sources {first} and {second} ({policy})")]
    ParamClash {
        key: String,
        first: usize,
        second: usize,
        policy: &'static str,
    },
    /// The host failed on something no child answered (e.g. Python's `==`
    /// on two params values raised, or reading vLLM's block ids did).
    #[error("the host raised")]
    Host(E),
    /// A request holds KV in several cache groups but some children can be
    /// given only one (they lack HMA support).
    #[error(
        "request {request:?} holds KV in {groups} cache groups; children {children:?} take one"
    )]
    TooManyGroups {
        request: String,
        groups: usize,
        children: Vec<usize>,
    },
    /// The multiplexer cannot be built as asked.
    #[error("{0}")]
    Config(String),
}

impl<E> MuxError<E> {
    pub fn child(child: usize, hook: &'static str, fault: ChildFault<E>) -> Self {
        MuxError::Child { child, hook, fault }
    }
}

/// Why a host-tier block index cannot be built.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum IndexError {
    #[error("host index capacity must be 1 to {max} blocks, got {got}")]
    Capacity { got: usize, max: usize },
    #[error("host index groups must be 1 to {max}, got {got}")]
    Groups { got: usize, max: usize },
    #[error("host index workers must be 1 to {max}, got {got}")]
    Workers { got: usize, max: usize },
    #[error(
        "host index of {capacity} blocks in {groups} group(s) needs about {bytes} bytes, \
         more than this machine can allocate"
    )]
    Memory {
        capacity: usize,
        groups: usize,
        bytes: usize,
    },
    #[error("host index eviction must be one of {allowed}, got {got:?}")]
    Eviction { got: String, allowed: &'static str },
    #[error("host index tenant_max_share must be a fraction in (0, 1], got {got}")]
    TenantShare { got: String },
}
