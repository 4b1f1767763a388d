//! Where a request's external hits came from, for vLLM's hits-by-source
//! split (`get_external_cache_hit_sources`, counted by vLLM as
//! `prompt_tokens_cached_by_source`).
//!
//! The rule: each child that supplied tokens of the request's load splits
//! its own span by source (`first`/`longest`: the one chosen child, all of
//! the load; `compose`: each child its span, cut from the end to what vLLM
//! allocated, as [`SchedulerMux::allocated`] told them), and the splits are summed.
//! A child that answers nothing, or a split that does not sum to its span,
//! counts its whole span under the child's own source. The counts always
//! sum to the load. Sources are opaque keys (`K`): the bindings pass vLLM's
//! `CacheHitSource` values as strings.

use super::SchedulerMux;
use crate::mux::requests::{cut_spans, LoadPolicy};

/// Child `i` supplied `tokens` of a load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Span {
    pub child: usize,
    pub tokens: u64,
}

impl SchedulerMux {
    /// The children that supply a request's `num_external` tokens, each
    /// with its span, in config order (empty when no child loads it). The
    /// spans sum to `num_external`.
    pub fn supplied_spans(&self, req_id: &str, num_external: u64) -> Vec<Span> {
        let Some(chosen) = self.table.chosen(req_id).filter(|_| num_external > 0) else {
            return Vec::new();
        };
        let mut out = Vec::new();
        let mut left = num_external;
        if self.load == LoadPolicy::Compose {
            self.table.with(req_id, |r| {
                let spans = r.spans.iter().flat_map(|s| s.iter()).map(|&(t, _)| t);
                for (child, tokens) in cut_spans(spans, left).enumerate() {
                    if tokens > 0 {
                        out.push(Span { child, tokens });
                        left -= tokens;
                    }
                }
            });
        }
        if left > 0 {
            // Not under `compose` (or vLLM allocated beyond the spans): the
            // chosen child loads the rest.
            match out.iter_mut().find(|s| s.child == chosen) {
                Some(s) => s.tokens += left,
                None => {
                    out.push(Span {
                        child: chosen,
                        tokens: left,
                    });
                    out.sort_by_key(|s| s.child);
                }
            }
        }
        out
    }

    /// vLLM's hits-by-source split of a request's `num_external` tokens:
    /// `split(i, span)` is child i's own split of its span (None: it
    /// answered nothing usable), `own(i)` its own source. See the module's
    /// rule. Empty when no child loads the request.
    pub fn hit_sources<K: PartialEq, E>(
        &self,
        req_id: &str,
        num_external: u64,
        split: impl FnMut(usize, u64) -> Result<Option<Vec<(K, u64)>>, E>,
        own: impl FnMut(usize) -> K,
    ) -> Result<Vec<(K, u64)>, E> {
        combine(&self.supplied_spans(req_id, num_external), split, own)
    }
}

/// Sum each span's split (a child's own source for a missing or wrong one),
/// keys in the order first seen, zero counts left out.
pub fn combine<K: PartialEq, E>(
    spans: &[Span],
    mut split: impl FnMut(usize, u64) -> Result<Option<Vec<(K, u64)>>, E>,
    mut own: impl FnMut(usize) -> K,
) -> Result<Vec<(K, u64)>, E> {
    let mut out: Vec<(K, u64)> = Vec::new();
    let mut add = |k: K, n: u64| {
        if n == 0 {
            return;
        }
        match out.iter_mut().find(|(have, _)| *have == k) {
            Some((_, c)) => *c += n,
            None => out.push((k, n)),
        }
    };
    for s in spans {
        let parts = split(s.child, s.tokens)?.filter(|p| {
            p.iter().try_fold(0u64, |acc, (_, n)| acc.checked_add(*n)) == Some(s.tokens)
        });
        match parts {
            Some(parts) => parts.into_iter().for_each(|(k, n)| add(k, n)),
            None => add(own(s.child), s.tokens),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ChildFault;
    use crate::mux::merge::ClashPolicy;
    use crate::mux::requests::ChildMatch;

    type Split = Option<Vec<(&'static str, u64)>>;

    fn mux(n: usize, load: LoadPolicy, held: &'static [u64]) -> SchedulerMux {
        let names = (0..n).map(|i| format!("c{i}")).collect();
        let m = SchedulerMux::new::<String>(names, ClashPolicy::Error, load, 16).unwrap();
        let compose = load == LoadPolicy::Compose;
        m.lookup("r", 0, |i, nct| -> Result<ChildMatch, ChildFault<String>> {
            let t = if compose {
                held[i].saturating_sub(nct)
            } else {
                held[i]
            };
            Ok(ChildMatch {
                tokens: Some(t),
                load_async: false,
            })
        })
        .unwrap();
        m
    }

    const OWN: [&str; 3] = ["host", "p2p", "external_unspecified"];

    fn sources(
        m: &SchedulerMux,
        n: u64,
        split: impl FnMut(usize, u64) -> Split,
    ) -> Vec<(&'static str, u64)> {
        let mut split = split;
        m.hit_sources::<_, ()>("r", n, |i, t| Ok(split(i, t)), |i| OWN[i])
            .unwrap()
    }

    fn plain(_: usize, _: u64) -> Split {
        None
    }

    #[test]
    fn first_and_longest_credit_the_one_child_that_loaded() {
        let m = mux(3, LoadPolicy::First, &[0, 32, 64]);
        m.allocated("r", 32, |_| Ok::<_, String>(vec![]), |_, _| Ok(()))
            .unwrap();
        assert_eq!(
            m.supplied_spans("r", 32),
            [Span {
                child: 1,
                tokens: 32
            }]
        );
        assert_eq!(sources(&m, 32, plain), [("p2p", 32)]);
        let m = mux(3, LoadPolicy::Longest, &[0, 32, 64]);
        assert_eq!(sources(&m, 48, plain), [("external_unspecified", 48)]);
    }

    #[test]
    fn compose_sums_each_childs_own_split_over_its_span() {
        // Child 0 holds [0, 32), child 1 [32, 80), child 2 [80, 96).
        let m = mux(3, LoadPolicy::Compose, &[32, 80, 96]);
        let mut asked = vec![];
        let got = sources(&m, 96, |i, t| {
            asked.push((i, t));
            // Child 1 splits its span itself (some of it from its own disk).
            (i == 1).then(|| vec![("p2p", 40), ("disk", 8)])
        });
        assert_eq!(asked, [(0, 32), (1, 48), (2, 16)]);
        assert_eq!(
            got,
            [
                ("host", 32),
                ("p2p", 40),
                ("disk", 8),
                ("external_unspecified", 16)
            ]
        );
        assert_eq!(got.iter().map(|(_, n)| n).sum::<u64>(), 96);
    }

    #[test]
    fn compose_cuts_the_spans_to_what_vllm_allocated() {
        let m = mux(3, LoadPolicy::Compose, &[32, 80, 96]);
        assert_eq!(
            m.supplied_spans("r", 40),
            [
                Span {
                    child: 0,
                    tokens: 32
                },
                Span {
                    child: 1,
                    tokens: 8
                }
            ]
        );
        assert_eq!(sources(&m, 40, plain), [("host", 32), ("p2p", 8)]);
    }

    #[test]
    fn a_wrong_or_empty_split_counts_under_the_childs_own_source() {
        let m = mux(2, LoadPolicy::Compose, &[32, 64]);
        // Child 0 sums to 30 of its 32; child 1 answers nothing at all.
        let got = sources(&m, 64, |i, _| {
            if i == 0 {
                Some(vec![("disk", 30)])
            } else {
                Some(vec![])
            }
        });
        assert_eq!(got, [("host", 32), ("p2p", 32)]);
        // An overflowing split is a wrong sum too, never a panic.
        let got = sources(&m, 64, |i, _| {
            (i == 0).then(|| vec![("disk", u64::MAX), ("p2p", 2)])
        });
        assert_eq!(got, [("host", 32), ("p2p", 32)]);
        // Zero counts are left out.
        let got = sources(&m, 64, |_, t| Some(vec![("disk", t), ("host", 0)]));
        assert_eq!(got, [("disk", 64)]);
    }

    #[test]
    fn nothing_loaded_is_no_split_and_an_error_propagates() {
        let m = mux(2, LoadPolicy::First, &[0, 0]);
        assert!(m.supplied_spans("r", 0).is_empty());
        assert!(m.supplied_spans("unknown", 16).is_empty());
        let m = mux(2, LoadPolicy::First, &[16, 0]);
        let err = m.hit_sources::<&str, _>("r", 16, |_, _| Err("boom"), |i| OWN[i]);
        assert_eq!(err, Err("boom"));
    }
}
