//! Clash-checked merge of the `kv_transfer_params` dicts that several child
//! connectors return for one finished request.
//!
//! The merge is generic over the value type: the core never sees a Python
//! object. The bindings supply a value type whose equality is Python's `==`.

use std::fmt;
use std::str::FromStr;

/// What to do when two children return the same key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClashPolicy {
    /// Different values for one key are an error; equal values merge.
    Error,
    /// Any key returned by two children is an error (vLLM's upstream rule).
    Strict,
    /// Keep the value of the earlier child (config order); count the clash.
    First,
    /// Keep the value of the later child; count the clash.
    Last,
}

impl ClashPolicy {
    pub const ALL: [&'static str; 4] = ["error", "strict", "first", "last"];

    pub fn as_str(self) -> &'static str {
        match self {
            ClashPolicy::Error => "error",
            ClashPolicy::Strict => "strict",
            ClashPolicy::First => "first",
            ClashPolicy::Last => "last",
        }
    }
}

impl FromStr for ClashPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "error" => Ok(ClashPolicy::Error),
            "strict" => Ok(ClashPolicy::Strict),
            "first" => Ok(ClashPolicy::First),
            "last" => Ok(ClashPolicy::Last),
            other => Err(format!(
                "unknown clash_policy {other:?}; use one of {:?}",
                ClashPolicy::ALL
            )),
        }
    }
}

/// How a key that several sources return is merged, decided per key (and
/// asked only when a key is returned twice).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeyRule {
    /// Under the [`ClashPolicy`].
    Policy,
    /// Every source's value is kept, by source ([`Merged::others`]): the key
    /// was asked for by the request itself (a client chose it, so a clash on
    /// it is never an error, whatever the policy).
    PerSource,
    /// The value of this source wins (the multiplexer's own keys).
    Own(usize),
}

/// A key returned by two sources: refused by the policy (an error), or
/// resolved (by the policy or by its [`KeyRule`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clash {
    pub key: String,
    /// Index of the source that returned the key first (config order).
    pub first: usize,
    /// Index of the source that returned it again.
    pub second: usize,
    /// The rule that resolved it ([`KeyRule::Policy`] for a refusal).
    pub rule: KeyRule,
}

impl fmt::Display for Clash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "key {:?} returned by sources {} and {}",
            self.key, self.first, self.second
        )
    }
}

/// One merged entry: the key, the value kept and the source it came from.
#[derive(Clone, Debug, PartialEq)]
pub struct Merged<V> {
    pub key: String,
    pub value: V,
    pub source: usize,
    /// Under [`KeyRule::PerSource`], the later sources' values of the key
    /// (`value` is the first one's); empty otherwise.
    pub others: Vec<(usize, V)>,
}

/// The outcome of a successful merge.
#[derive(Debug, PartialEq)]
pub struct MergeOutcome<V> {
    /// Merged entries in first-seen order.
    pub entries: Vec<Merged<V>>,
    /// Keys that clashed but were resolved: by `first`/`last`, or by their
    /// [`KeyRule`] (once per key). With `error`, equal values under the
    /// policy are not clashes and never appear here.
    pub resolved: Vec<Clash>,
}

/// Value equality that may fail (Python's `__eq__` can raise).
pub trait ValueEq {
    type Error;
    fn value_eq(&self, other: &Self) -> Result<bool, Self::Error>;
}

/// Why a merge stopped.
#[derive(Debug, PartialEq)]
pub enum MergeError<E> {
    Clash(Clash),
    Compare(E),
}

/// Merge `sources` (each an index and its key/value pairs, in config order)
/// under `policy`.
///
/// Entries keep the order in which keys were first seen. The number of keys
/// per request is small (a handful), so a linear scan beats hashing.
pub fn merge<V, K, I, S>(
    policy: ClashPolicy,
    sources: S,
) -> Result<MergeOutcome<V>, MergeError<V::Error>>
where
    V: ValueEq,
    K: AsRef<str>,
    I: IntoIterator<Item = (K, V)>,
    S: IntoIterator<Item = (usize, I)>,
{
    merge_by(policy, sources, |_| KeyRule::Policy)
}

/// [`merge`], with `rule(key)` saying how a key returned twice is merged
/// (asked once per clash, never on the usual path of distinct keys).
pub fn merge_by<V, K, I, S>(
    policy: ClashPolicy,
    sources: S,
    rule: impl Fn(&str) -> KeyRule,
) -> Result<MergeOutcome<V>, MergeError<V::Error>>
where
    V: ValueEq,
    K: AsRef<str>,
    I: IntoIterator<Item = (K, V)>,
    S: IntoIterator<Item = (usize, I)>,
{
    let mut entries: Vec<Merged<V>> = Vec::new();
    let mut resolved = Vec::new();
    for (source, pairs) in sources {
        for (key, value) in pairs {
            let key = key.as_ref();
            let Some(slot) = entries.iter_mut().find(|e| e.key == key) else {
                entries.push(Merged {
                    key: key.to_owned(),
                    value,
                    source,
                    others: Vec::new(),
                });
                continue;
            };
            let mut clash = Clash {
                key: key.to_owned(),
                first: slot.source,
                second: source,
                rule: KeyRule::Policy,
            };
            match rule(key) {
                KeyRule::Policy => {}
                KeyRule::PerSource => {
                    clash.rule = KeyRule::PerSource;
                    if slot.others.is_empty() {
                        resolved.push(clash);
                    }
                    slot.others.push((source, value));
                    continue;
                }
                KeyRule::Own(own) => {
                    clash.rule = KeyRule::Own(own);
                    if source == own {
                        slot.value = value;
                        slot.source = own;
                    }
                    resolved.push(clash);
                    continue;
                }
            }
            match policy {
                ClashPolicy::Strict => return Err(MergeError::Clash(clash)),
                ClashPolicy::Error => {
                    if !slot.value.value_eq(&value).map_err(MergeError::Compare)? {
                        return Err(MergeError::Clash(clash));
                    }
                }
                ClashPolicy::First => resolved.push(clash),
                ClashPolicy::Last => {
                    slot.value = value;
                    slot.source = source;
                    resolved.push(clash);
                }
            }
        }
    }
    Ok(MergeOutcome { entries, resolved })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::convert::Infallible;

    impl ValueEq for i64 {
        type Error = Infallible;
        fn value_eq(&self, other: &Self) -> Result<bool, Infallible> {
            Ok(self == other)
        }
    }

    fn run(
        policy: ClashPolicy,
        srcs: &[&[(&str, i64)]],
    ) -> Result<MergeOutcome<i64>, MergeError<Infallible>> {
        merge(
            policy,
            srcs.iter()
                .enumerate()
                .map(|(i, s)| (i, s.iter().map(|&(k, v)| (k, v)))),
        )
    }

    #[test]
    fn disjoint_keys_merge_in_order() {
        let out = run(ClashPolicy::Error, &[&[("a", 1)], &[("b", 2), ("c", 3)]]).unwrap();
        let keys: Vec<_> = out.entries.iter().map(|e| e.key.as_str()).collect();
        assert_eq!(keys, ["a", "b", "c"]);
        assert_eq!(out.entries[1].source, 1);
        assert!(out.resolved.is_empty());
    }

    #[test]
    fn error_policy_merges_equal_and_refuses_different() {
        let out = run(ClashPolicy::Error, &[&[("a", 1)], &[("a", 1)]]).unwrap();
        assert_eq!(out.entries.len(), 1);
        let err = run(ClashPolicy::Error, &[&[("x", 1)], &[], &[("x", 2)]]).unwrap_err();
        assert_eq!(
            err,
            MergeError::Clash(Clash {
                key: "x".into(),
                first: 0,
                second: 2,
                rule: KeyRule::Policy,
            })
        );
    }

    #[test]
    fn strict_refuses_equal_values_too() {
        assert!(matches!(
            run(ClashPolicy::Strict, &[&[("a", 1)], &[("a", 1)]]),
            Err(MergeError::Clash(_))
        ));
    }

    #[test]
    fn first_and_last_keep_one_and_report() {
        let first = run(ClashPolicy::First, &[&[("a", 1)], &[("a", 2)]]).unwrap();
        assert_eq!((first.entries[0].value, first.entries[0].source), (1, 0));
        assert_eq!(first.resolved.len(), 1);
        let last = run(ClashPolicy::Last, &[&[("a", 1)], &[("a", 2)]]).unwrap();
        assert_eq!((last.entries[0].value, last.entries[0].source), (2, 1));
        assert_eq!(last.resolved[0].first, 0);
    }

    fn run_by(
        policy: ClashPolicy,
        srcs: &[&[(&str, i64)]],
        rule: impl Fn(&str) -> KeyRule,
    ) -> MergeOutcome<i64> {
        merge_by(
            policy,
            srcs.iter()
                .enumerate()
                .map(|(i, s)| (i, s.iter().map(|&(k, v)| (k, v)))),
            rule,
        )
        .unwrap()
    }

    #[test]
    fn a_key_the_request_asked_for_is_kept_per_source_under_every_policy() {
        let asked = |k: &str| {
            if k == "stats" {
                KeyRule::PerSource
            } else {
                KeyRule::Policy
            }
        };
        for policy in [
            ClashPolicy::Error,
            ClashPolicy::Strict,
            ClashPolicy::First,
            ClashPolicy::Last,
        ] {
            let out = run_by(
                policy,
                &[&[("stats", 1), ("a", 7)], &[("stats", 2)], &[("stats", 3)]],
                asked,
            );
            let e = &out.entries[0];
            assert_eq!((e.key.as_str(), e.value, e.source), ("stats", 1, 0));
            assert_eq!(e.others, vec![(1, 2), (2, 3)], "{policy:?}");
            // Counted (and warned) once per key, as resolved by its rule.
            assert_eq!(out.resolved.len(), 1);
            assert_eq!(out.resolved[0].rule, KeyRule::PerSource);
            assert!(out.entries[1].others.is_empty());
        }
        // A key nobody asked for still follows the policy.
        assert!(merge_by(
            ClashPolicy::Strict,
            [(0, [("a", 1)]), (1, [("a", 1)])],
            asked
        )
        .is_err());
    }

    #[test]
    fn an_own_key_takes_the_owners_value_under_every_policy() {
        for policy in [ClashPolicy::Error, ClashPolicy::Strict, ClashPolicy::First] {
            let out = run_by(policy, &[&[("n", 5)], &[("m", 1)], &[("n", 9)]], |k| {
                if k == "n" {
                    KeyRule::Own(2)
                } else {
                    KeyRule::Policy
                }
            });
            assert_eq!((out.entries[0].value, out.entries[0].source), (9, 2));
            assert_eq!(out.resolved[0].rule, KeyRule::Own(2));
        }
    }

    #[test]
    fn policy_parses_and_names_choices_on_error() {
        for name in ClashPolicy::ALL {
            assert_eq!(name.parse::<ClashPolicy>().unwrap().as_str(), name);
        }
        let err = "loud".parse::<ClashPolicy>().unwrap_err();
        assert!(err.contains("loud") && err.contains("strict"));
    }

    proptest! {
        /// Under `first`/`last` every key appears exactly once and its value
        /// is the first/last one any source gave it.
        #[test]
        fn first_last_keep_the_right_value(
            srcs in proptest::collection::vec(
                proptest::collection::vec((0u8..6, any::<i64>()), 0..5), 0..5)
        ) {
            for policy in [ClashPolicy::First, ClashPolicy::Last] {
                let out = merge(policy, srcs.iter().enumerate().map(|(i, s)| {
                    (i, s.iter().map(|&(k, v)| (k.to_string(), v)))
                })).unwrap();
                let all: Vec<(String, i64, usize)> = srcs.iter().enumerate()
                    .flat_map(|(i, s)| s.iter().map(move |&(k, v)| (k.to_string(), v, i)))
                    .collect();
                for e in &out.entries {
                    let mut seen = all.iter().filter(|(k, _, _)| *k == e.key);
                    let want = if policy == ClashPolicy::First { seen.next() } else { seen.next_back() };
                    let (_, v, s) = want.unwrap();
                    prop_assert_eq!((e.value, e.source), (*v, *s));
                }
                let mut keys: Vec<_> = all.iter().map(|(k, _, _)| k.clone()).collect();
                keys.sort();
                keys.dedup();
                prop_assert_eq!(keys.len(), out.entries.len());
                prop_assert_eq!(out.resolved.len(), all.len() - keys.len());
            }
        }

        /// `error` succeeds exactly when no key has two different values.
        #[test]
        fn error_policy_fails_iff_values_differ(
            srcs in proptest::collection::vec(
                proptest::collection::vec((0u8..4, 0i64..3), 0..4), 0..4)
        ) {
            let res = merge(ClashPolicy::Error, srcs.iter().enumerate().map(|(i, s)| {
                (i, s.iter().map(|&(k, v)| (k.to_string(), v)))
            }));
            let mut conflicting = false;
            let flat: Vec<_> = srcs.iter().flatten().collect();
            for i in 0..flat.len() {
                for j in i + 1..flat.len() {
                    if flat[i].0 == flat[j].0 && flat[i].1 != flat[j].1 { conflicting = true; }
                }
            }
            prop_assert_eq!(res.is_err(), conflicting);
        }
    }
}
