//! Benches of kvmux's core, with no Python (`cargo bench --no-default-features`
//! or `cargo bench`): the per-request table on one and on two threads, the
//! multiplexer's scheduler-side lifecycle over constant children, the
//! clash-checked merge, and the host tier's prefix lookup over 2,048 blocks.

use std::hint::black_box;
use std::thread;

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvmux_core::error::ChildFault;
use kvmux_core::host_tier::BlockIndex;
use kvmux_core::mux::merge::{merge, ClashPolicy, ValueEq};
use kvmux_core::mux::requests::{ChildMatch, LoadPolicy, RequestTable};
use kvmux_core::mux::{ChildFinish, FinishHooks, Params, SchedulerMux, Supplied, Want};

const CHILDREN: usize = 3;
const REQUESTS: usize = 1024;

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i:08x}")).collect()
}

fn matches() -> [ChildMatch; CHILDREN] {
    [
        ChildMatch {
            tokens: Some(0),
            load_async: false,
        },
        ChildMatch {
            tokens: Some(64),
            load_async: false,
        },
        ChildMatch {
            tokens: Some(32),
            load_async: true,
        },
    ]
}

/// One request's scheduler-side events: lookup (insert), allocation
/// (update), finish (remove).
fn lifecycle(table: &RequestTable, id: &str, m: &[ChildMatch]) {
    black_box(table.lookup(id, 16, LoadPolicy::First, m));
    black_box(table.allocated(id, CHILDREN, 64));
    black_box(table.finish(id));
}

fn request_table(c: &mut Criterion) {
    let mut g = c.benchmark_group("request_table");
    g.throughput(Throughput::Elements(REQUESTS as u64));
    let m = matches();
    let one = ids("req", REQUESTS);
    g.bench_function("insert_update_finish/1_thread", |b| {
        let table = RequestTable::new();
        b.iter(|| {
            for id in &one {
                lifecycle(&table, id, &m);
            }
        });
    });
    g.bench_function("insert/1_thread", |b| {
        b.iter_batched(
            RequestTable::new,
            |table| {
                for id in &one {
                    black_box(table.lookup(id, 16, LoadPolicy::First, &m));
                }
                table
            },
            BatchSize::LargeInput,
        );
    });
    // Two threads, each running half the requests' lifecycles on one table
    // (distinct ids, as two scheduler threads would).
    let halves = [ids("a", REQUESTS / 2), ids("b", REQUESTS / 2)];
    g.bench_function("insert_update_finish/2_threads", |b| {
        let table = RequestTable::new();
        b.iter(|| {
            thread::scope(|s| {
                for half in &halves {
                    let (table, m) = (&table, &m);
                    s.spawn(move || {
                        for id in half {
                            lifecycle(table, id, m);
                        }
                    });
                }
            });
        });
    });
    g.finish();
}

/// The mux bench's children never fail.
type Never = std::convert::Infallible;

/// A child's params in the mux bench (never returned: no child has any).
struct NoParams;

impl Params for NoParams {
    type Value = Val;
    type Error = Never;
    fn entries(&self) -> Result<Vec<(String, Val)>, ChildFault<Self::Error>> {
        Ok(Vec::new())
    }
}

/// The bench's finish calls: every child answers no params, no async save.
struct NoParamsCalls;

impl FinishHooks for NoParamsCalls {
    type Params = NoParams;
    fn hook(&self, _: usize) -> &'static str {
        "request_finished"
    }
    fn asked(&self, _: &str) -> bool {
        false
    }
    fn own(&mut self, _: &Supplied) -> Result<NoParams, Never> {
        Ok(NoParams)
    }
    fn call(&mut self, i: usize) -> Result<ChildFinish<NoParams>, ChildFault<Never>> {
        black_box(i);
        Ok(ChildFinish {
            async_save: false,
            params: None,
        })
    }
}

/// The Rust side of bench P1: `SchedulerMux`'s lookup (`first`, every child a
/// miss), allocation (0 tokens) and finish (no params, no async save) of
/// each request over 3 children whose answers are constants, so the time
/// is the multiplexer's own bookkeeping only.
fn mux_lifecycle(c: &mut Criterion) {
    let names = (0..CHILDREN).map(|i| format!("c{i}")).collect();
    let mux = SchedulerMux::new::<Never>(names, ClashPolicy::Error, LoadPolicy::First, 16)
        .expect("a valid multiplexer");
    let reqs = ids("req", REQUESTS);
    let miss = ChildMatch {
        tokens: Some(0),
        load_async: false,
    };
    let mut g = c.benchmark_group("mux");
    g.throughput(Throughput::Elements(REQUESTS as u64));
    g.bench_function("lifecycle_3_children", |b| {
        b.iter(|| {
            // Opaque to the optimiser but in registers, as a converted
            // Python answer is (a `black_box` of each answer would add a
            // store-forwarding stall of its own).
            let miss = black_box(miss);
            for id in &reqs {
                let got = mux
                    .lookup(id, 16, |i, _computed| {
                        black_box(i);
                        Ok::<_, ChildFault<Never>>(miss)
                    })
                    .expect("no child fails");
                black_box(got.tokens);
                let chosen = mux
                    .allocated(
                        id,
                        0,
                        |_| Ok::<_, Never>(Vec::new()),
                        |i, n| {
                            black_box((i, n));
                            Ok(())
                        },
                    )
                    .expect("no child fails");
                black_box(chosen);
                let done = mux
                    .finish(id, Want::default(), &mut NoParamsCalls)
                    .expect("no child fails");
                black_box(done.async_save);
            }
        });
    });
    g.finish();
}

#[derive(Clone)]
struct Val(i64);

impl ValueEq for Val {
    type Error = std::convert::Infallible;
    fn value_eq(&self, other: &Self) -> Result<bool, Self::Error> {
        Ok(self.0 == other.0)
    }
}

fn clash_merge(c: &mut Criterion) {
    // Three children's params plus kvmux's own key, one equal-valued clash:
    // the shape of a finished request's merge.
    let sources: Vec<(usize, Vec<(&str, Val)>)> = vec![
        (
            0,
            vec![("remote_block_ids", Val(1)), ("remote_engine_id", Val(2))],
        ),
        (
            1,
            vec![("cached_token_stats", Val(3)), ("remote_engine_id", Val(2))],
        ),
        (2, vec![("host_cache_stats", Val(4))]),
        (3, vec![("num_extra_cached_tokens", Val(5))]),
    ];
    let mut g = c.benchmark_group("merge");
    for policy in [ClashPolicy::Error, ClashPolicy::Last] {
        g.bench_function(format!("4_sources_6_keys/{}", policy.as_str()), |b| {
            b.iter_batched(
                || sources.clone(),
                |s| black_box(merge(policy, s)),
                BatchSize::SmallInput,
            );
        });
    }
    g.finish();
}

fn host_prefix_lookup(c: &mut Criterion) {
    // A 32k-token prompt: 2,048 blocks of 16 tokens, keyed by 32-byte hashes
    // (vLLM's sha256 block hashes), all cached.
    const BLOCKS: usize = 2048;
    let keys: Vec<Vec<u8>> = (0..BLOCKS as u64)
        .map(|i| {
            let mut k = vec![0u8; 32];
            k[..8].copy_from_slice(&i.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes());
            k[8..16].copy_from_slice(&i.to_le_bytes());
            k
        })
        .collect();
    let mut index = BlockIndex::new(2 * BLOCKS).expect("a valid capacity");
    let slots: Vec<u32> = index.reserve(&keys).into_iter().map(|(_, s)| s).collect();
    assert_eq!(index.commit(&slots), BLOCKS);
    let mut g = c.benchmark_group("host_index");
    g.throughput(Throughput::Elements(BLOCKS as u64));
    g.bench_function("longest_prefix/2048_blocks", |b| {
        b.iter(|| {
            let n = index.longest_prefix(black_box(&keys));
            assert_eq!(n, BLOCKS);
        });
    });
    g.finish();
}

criterion_group!(
    benches,
    request_table,
    mux_lifecycle,
    clash_merge,
    host_prefix_lookup
);
criterion_main!(benches);
