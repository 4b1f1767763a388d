//! Fixtures shared by the unit tests of several scheduler phases: a test
//! child's params ([`P`], [`V`]), [`SchedulerMux::finish`] driven by
//! closures ([`FinishFns`]), and short ways to build a multiplexer and
//! its children's answers.

use super::*;

/// Params of a test child: (key, value) pairs; an empty key stands for
/// a key that is not a string.
#[derive(Clone, Debug, PartialEq)]
pub(super) struct P(pub(super) Vec<(&'static str, i64)>);

#[derive(Clone, Debug, PartialEq)]
pub(super) struct V(pub(super) i64);

impl ValueEq for V {
    type Error = String;
    fn value_eq(&self, other: &Self) -> Result<bool, String> {
        if self.0 < 0 || other.0 < 0 {
            return Err("cannot compare".into());
        }
        Ok(self.0 == other.0)
    }
}

impl Params for P {
    type Value = V;
    type Error = String;
    fn entries(&self) -> Result<Vec<(String, V)>, ChildFault<String>> {
        self.0
            .iter()
            .map(|&(k, v)| {
                if k.is_empty() {
                    Err(ChildFault::Malformed("a key that is not a str".into()))
                } else {
                    Ok((k.to_owned(), V(v)))
                }
            })
            .collect()
    }
}

pub(super) type R<T> = Result<T, ChildFault<String>>;

/// A finish hook's calls as the tests' closures ([`FinishHooks`]).
struct Fns<K, A, O, C> {
    hook: K,
    asked: A,
    own: Option<O>,
    call: C,
}

impl<K, A, O, C> FinishHooks for Fns<K, A, O, C>
where
    K: Fn(usize) -> &'static str,
    A: Fn(&str) -> bool,
    O: FnOnce(&Supplied) -> Result<P, String>,
    C: FnMut(usize) -> R<ChildFinish<P>>,
{
    type Params = P;
    fn hook(&self, i: usize) -> &'static str {
        (self.hook)(i)
    }
    fn asked(&self, key: &str) -> bool {
        (self.asked)(key)
    }
    fn own(&mut self, s: &Supplied) -> Result<P, String> {
        (self.own.take().expect("own is called at most once"))(s)
    }
    fn call(&mut self, i: usize) -> R<ChildFinish<P>> {
        (self.call)(i)
    }
}

/// [`SchedulerMux::finish`] with each of its calls a closure.
pub(super) trait FinishFns {
    fn finish_fns(
        &self,
        req: &str,
        hook: impl Fn(usize) -> &'static str,
        want: Want,
        asked: impl Fn(&str) -> bool,
        own: impl FnOnce(&Supplied) -> Result<P, String>,
        call: impl FnMut(usize) -> R<ChildFinish<P>>,
    ) -> FinishResult<P>;
}

impl FinishFns for SchedulerMux {
    fn finish_fns(
        &self,
        req: &str,
        hook: impl Fn(usize) -> &'static str,
        want: Want,
        asked: impl Fn(&str) -> bool,
        own: impl FnOnce(&Supplied) -> Result<P, String>,
        call: impl FnMut(usize) -> R<ChildFinish<P>>,
    ) -> FinishResult<P> {
        let mut calls = Fns {
            hook,
            asked,
            own: Some(own),
            call,
        };
        self.finish(req, want, &mut calls)
    }
}

pub(super) fn mux(n: usize, clash: ClashPolicy, load: LoadPolicy) -> SchedulerMux {
    let names = (0..n).map(|i| format!("c{i}")).collect();
    SchedulerMux::new::<String>(names, clash, load, 16).unwrap()
}

pub(super) fn hit(tokens: u64) -> R<ChildMatch> {
    Ok(ChildMatch {
        tokens: Some(tokens),
        load_async: false,
    })
}

pub(super) fn own(s: &Supplied) -> Result<P, String> {
    Ok(P(vec![(EXTRA_KEY, s.extra as i64)]))
}

/// Finish `req` asking for both own params; what the mux credited.
pub(super) fn supplied(m: &SchedulerMux, req: &str) -> Supplied {
    let mut got = None;
    m.finish_fns(
        req,
        |_| hook::FINISHED,
        Want {
            extra: true,
            by_child: true,
        },
        |_| false,
        |s: &Supplied| {
            got = Some(s.clone());
            own(s)
        },
        |_| done(false, None),
    )
    .unwrap();
    got.unwrap()
}

pub(super) fn want(extra: bool) -> Want {
    Want {
        extra,
        by_child: false,
    }
}

pub(super) fn done(async_save: bool, params: Option<P>) -> R<ChildFinish<P>> {
    Ok(ChildFinish { async_save, params })
}

pub(super) fn finish_with(
    m: &SchedulerMux,
    req: &str,
    want_extra: bool,
    answers: Vec<R<ChildFinish<P>>>,
) -> Result<Finished<P, V, String>, MuxError<String>> {
    let mut answers = answers.into_iter();
    m.finish_fns(
        req,
        |_| hook::FINISHED,
        want(want_extra),
        |k| k == "asked",
        own,
        |_| answers.next().unwrap(),
    )
}

pub(super) fn no_tell(_: usize, _: u64) -> R<()> {
    Ok(())
}

pub(super) fn no_blocks(_: std::ops::Range<usize>) -> Result<Vec<Vec<u32>>, String> {
    Ok(vec![])
}

/// A request's device blocks per KV cache group (`all`), handed over as the
/// bindings do: each group's blocks in the load's range.
pub(super) fn blocks(
    all: Vec<Vec<u32>>,
) -> impl FnOnce(std::ops::Range<usize>) -> Result<Vec<Vec<u32>>, String> {
    move |r| {
        Ok(all
            .into_iter()
            .map(|g| g[r.start.min(g.len())..r.end.min(g.len())].to_vec())
            .collect())
    }
}

/// A lookup where child 0 loads `tokens` asynchronously, and the
/// allocation of its load.
pub(super) fn async_load(m: &SchedulerMux, req: &str, tokens: u64) {
    m.lookup(req, 0, |i, _| {
        R::Ok(ChildMatch {
            tokens: Some(if i == 0 { tokens } else { 0 }),
            load_async: i == 0,
        })
    })
    .unwrap();
    m.allocated(req, tokens, no_blocks, no_tell).unwrap();
}
