//! Save admission ([`crate::mux::admit`]) applied to requests: each child's
//! `save_policy`, the request's decision at its first answered lookup
//! ([`SchedulerMux::admit_saves`]), the requests a child must not see in
//! `build_connector_meta` ([`SchedulerMux::save_declined`]), and the
//! finish, where a declined child's async save is not waited for.
//!
//! How a child is told to skip a save: it gets, in `build_connector_meta`,
//! a view of vLLM's scheduler output without the request (the bindings
//! build it), so it plans no save of it, while every other hook (lookup,
//! allocation, finish) still sees the request. A child that loads the
//! request (a hit) always sees it. A declined child's `request_finished`
//! may still answer "saving asynchronously" (LMCache's always does): that
//! answer is not counted ([`SchedulerMux::finish`]), so vLLM frees the
//! blocks at once and the child's completion, if it reports one, is a
//! stray the workers drop.

use super::*;
use crate::mux::admit::{Declined, Policy, SaveTable, DEFAULT_CAPACITY};

/// The scheduler side's save admission (present when a child has a
/// threshold).
#[derive(Debug)]
pub(super) struct Saves {
    /// Per child: its reuse threshold (None: every save).
    thresholds: Vec<Option<u32>>,
    table: Mutex<SaveTable>,
}

/// One request's part: its block hashes and what was decided.
#[derive(Debug, Default)]
pub(crate) struct RequestSaves {
    /// Each child's hit at the first answered lookup (None: not known).
    hits: PerChild<Option<u64>>,
    hashes: Vec<u64>,
    decided: bool,
    /// Bit i: child i does not see the request's saves.
    pub(super) declined: u64,
    /// Per child: why, for the timeline.
    pub(super) why: PerChild<Option<Declined>>,
}

impl SchedulerMux {
    /// Give child i the save policy `policies[i]` ([`Policy`]);
    /// `transports[i]`: child i is no storage tier (a P/D transport; empty:
    /// none is). With every child saving everything (`always`, or `auto`
    /// with one tier) nothing is counted.
    pub fn with_save_policies<E>(
        mut self,
        policies: Vec<Policy>,
        transports: &[bool],
        capacity: Option<usize>,
    ) -> Result<Self, MuxError<E>> {
        self.one_per_child("save policy", policies.len())?;
        let thresholds = Policy::thresholds(&policies, transports);
        self.saves = thresholds.iter().any(Option::is_some).then(|| {
            Box::new(Saves {
                thresholds,
                table: Mutex::new(SaveTable::new(capacity.unwrap_or(DEFAULT_CAPACITY))),
            })
        });
        Ok(self)
    }

    /// Whether any child's saves are admitted by the rule.
    pub fn admitting(&self) -> bool {
        self.saves.is_some()
    }

    /// Blocks the admission table knows (0 when admission is off).
    pub fn save_table_len(&self) -> usize {
        self.saves.as_ref().map_or(0, |s| lock(&s.table).len())
    }

    /// A lookup's answers (`lookup_plain`, `lookup_full`): each child's hit
    /// at the request's first answered lookup, for [`SchedulerMux::admit_saves`].
    pub(super) fn note_hits(&self, req_id: &str, matches: &[ChildMatch], asked: u64) {
        if self.saves.is_none() {
            return;
        }
        self.table.with_mut(req_id, |r| {
            let s = r.saves.get_or_insert_with(Box::default);
            if s.decided || !s.hits.is_empty() {
                return;
            }
            s.hits = matches
                .iter()
                .enumerate()
                .map(|(i, m)| m.tokens.filter(|_| asked & (1u64 << i) != 0))
                .collect();
        });
    }

    /// Whether [`SchedulerMux::admit_saves`] is due for `req_id` (its lookup
    /// answered and nothing is decided yet): the caller reads the request's
    /// block hashes only then.
    pub fn admission_due(&self, req_id: &str) -> bool {
        self.saves.is_some()
            && self
                .table
                .with(req_id, |r| {
                    r.saves
                        .as_deref()
                        .is_some_and(|s| !s.decided && !s.hits.is_empty())
                })
                .unwrap_or(false)
    }

    /// Decide `req_id`'s saves, once, at its first answered lookup: it is
    /// seen with `hashes` (its full blocks' hashes), and each child with a
    /// threshold saves it only when the rule admits it ([`SaveTable::admit`]).
    /// `asked`: the request's `kv_transfer_params` ask for a save (P/D's
    /// `do_remote_decode`): then every child sees it. Returns the children
    /// declined (bits).
    pub fn admit_saves(&self, req_id: &str, hashes: Vec<u64>, asked: bool) -> u64 {
        let Some(saves) = self.saves.as_deref() else {
            return 0;
        };
        let n = self.names.len();
        let bs = self.block_size;
        let Some(hits) = self
            .table
            .with_mut(req_id, |r| {
                let s = r.saves.get_or_insert_with(Box::default);
                if s.decided {
                    return None;
                }
                s.decided = true;
                Some(std::mem::take(&mut s.hits))
            })
            .flatten()
        else {
            return 0;
        };
        let held: PerChild<Option<usize>> = (0..n)
            .map(|i| {
                hits.get(i)
                    .copied()
                    .flatten()
                    .map(|t| ((t / bs) as usize).min(hashes.len()))
            })
            .collect();
        let mut declined = 0u64;
        let mut why: PerChild<Option<Declined>> = smallvec::smallvec![None; n];
        {
            let mut table = lock(&saves.table);
            table.seen(&hashes, &held);
            if !asked {
                for (i, k) in saves.thresholds.iter().enumerate() {
                    let Some(k) = *k else { continue };
                    if let Err(w) = table.admit(&hashes, i, k) {
                        declined |= 1u64 << i;
                        why[i] = Some(w);
                    }
                }
            }
        }
        self.table.with_mut(req_id, |r| {
            let s = r.saves.get_or_insert_with(Box::default);
            s.declined = declined;
            s.why = why;
            s.hashes = hashes;
        });
        declined
    }

    /// The children that must not see `req_id`'s saves now (bits): declined
    /// and not loading it.
    pub fn save_declined(&self, req_id: &str) -> u64 {
        if self.saves.is_none() {
            return 0;
        }
        self.table
            .with(req_id, |r| r.saves.as_deref().map_or(0, |s| s.declined))
            .unwrap_or(0)
    }

    /// An allocation gave child j `given[j]` tokens to load: those blocks
    /// are read back from its tier, and a loading child sees the request.
    pub(super) fn saves_allocated(&self, req_id: &str, given: &[u64]) {
        let Some(saves) = self.saves.as_deref() else {
            return;
        };
        if given.iter().all(|&g| g == 0) {
            return;
        }
        let bs = self.block_size;
        let read = self.table.with_mut(req_id, |r| {
            let local = r.state.local_hit_tokens;
            let s = r.saves.as_deref_mut()?;
            let mut read = Vec::new();
            let mut at = local;
            for (j, &g) in given.iter().enumerate() {
                if g == 0 {
                    continue;
                }
                s.declined &= !(1u64 << j);
                if let Some(w) = s.why.get_mut(j) {
                    *w = None;
                }
                let first = ((at / bs) as usize).min(s.hashes.len());
                let end = (((at + g) / bs) as usize).min(s.hashes.len());
                read.push((j, s.hashes[first..end].to_vec()));
                if self.load == LoadPolicy::Compose {
                    at += g;
                }
            }
            Some(read)
        });
        if let Some(Some(read)) = read {
            let mut table = lock(&saves.table);
            for (j, hashes) in read {
                table.read_back(&hashes, j);
            }
        }
    }

    /// The finish: which children's saves were declined (their async-save
    /// answers are not counted), counted once per child and written in the
    /// request's timeline.
    pub(super) fn saves_finished(&self, r: &mut Request) -> u64 {
        let Some(s) = r.saves.as_deref() else {
            return 0;
        };
        let mut bits = s.declined;
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            self.counters.child(i, Child::DeclinedSaves, 1);
            if let Some(c) = r
                .timeline
                .as_deref_mut()
                .and_then(|t| t.children.get_mut(i))
            {
                c.save_declined = s.why.get(i).copied().flatten();
            }
            bits &= bits - 1;
        }
        s.declined
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
mod tests {
    use super::super::test_support::*;
    use super::*;
    use crate::mux::admit::Policy;

    fn admitting() -> SchedulerMux {
        mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_save_policies::<String>(vec![Policy::Auto, Policy::Auto], &[], Some(1024))
            .unwrap()
    }

    fn look(m: &SchedulerMux, r: &str, hits: [u64; 2]) {
        m.lookup(r, 0, |i, _| hit(hits[i])).unwrap();
    }

    #[test]
    fn a_prefix_seen_once_goes_to_the_first_child_only_twice_to_both() {
        let m = admitting();
        look(&m, "a", [0, 0]);
        assert!(m.admission_due("a"));
        assert_eq!(m.admit_saves("a", vec![1, 2, 3], false), 0b10);
        assert!(!m.admission_due("a"), "decided once");
        assert_eq!(m.save_declined("a"), 0b10);
        // The child's async save is not waited for; counted declined.
        let got = finish_with(&m, "a", false, vec![done(false, None), done(true, None)]).unwrap();
        assert!(
            !got.async_save,
            "the declined child's async save is not pending"
        );
        assert!(m.take_outbox().saves.is_empty());
        assert_eq!(m.snapshot().children[1][Child::DeclinedSaves as usize], 1);
        assert_eq!(m.snapshot().children[0][Child::DeclinedSaves as usize], 0);
        assert_eq!(m.live_requests(), 0, "nothing left in the request table");
        // Seen a second time: admitted to both.
        look(&m, "b", [48, 0]);
        assert_eq!(m.admit_saves("b", vec![1, 2, 3], false), 0);
        let got = finish_with(&m, "b", false, vec![done(false, None), done(true, None)]).unwrap();
        assert!(got.async_save);
        // A third time: child 1 holds it (kvmux let it save): declined.
        look(&m, "c", [48, 48]);
        assert_eq!(m.admit_saves("c", vec![1, 2, 3], false), 0b10);
    }

    #[test]
    fn a_save_the_request_asks_for_and_a_loading_child_are_never_declined() {
        let m = admitting();
        look(&m, "p", [0, 0]);
        assert_eq!(m.admit_saves("p", vec![5, 6], true), 0);
        // Child 1 hits and loads: it sees the request.
        let m = admitting();
        m.lookup("h", 0, |i, _| hit([0, 32][i])).unwrap();
        assert_eq!(m.admit_saves("h", vec![5, 6, 7], false), 0b10);
        m.allocated::<String>("h", 32, |_| Ok(Vec::new()), |_, _| Ok(()))
            .unwrap();
        assert_eq!(m.save_declined("h"), 0, "a loading child sees it");
    }

    #[test]
    fn always_everywhere_counts_nothing() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_save_policies::<String>(vec![Policy::Always, Policy::Always], &[], None)
            .unwrap();
        assert!(!m.admitting());
        look(&m, "a", [0, 0]);
        assert!(!m.admission_due("a"));
        assert_eq!(m.admit_saves("a", vec![1], false), 0);
        assert_eq!(m.save_table_len(), 0);
        // A threshold of 1 on the first child too: what it lacks is saved.
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_save_policies::<String>(vec![Policy::Reuse(1), Policy::Reuse(3)], &[], None)
            .unwrap();
        for (r, want) in [("a", 0b10), ("b", 0b10), ("c", 0)] {
            look(&m, r, [0, 0]);
            assert_eq!(m.admit_saves(r, vec![1, 2], false), want, "{r}");
        }
    }
}
