//! The hybrid KV cache manager (HMA): which finish hook each child gets
//! when vLLM finishes a request with its blocks per KV cache group
//! (`request_finished_all_groups`), and the refusal of a request kvmux
//! cannot finish without losing KV.

use super::hook;
use super::notice::py_repr;

/// How to run a multi-group model with children that lack HMA: the fix
/// every refusal names (at start-up, per request, and `doctor`'s).
pub const FIX: &str = "either pass --disable-hybrid-kv-cache-manager (VllmConfig: \
     scheduler_config.disable_hybrid_kv_cache_manager=True), or name the connector \
     \"MultiConnector\" with kv_connector_module_path \"kvmux\" so vLLM turns the hybrid \
     manager off by itself";

/// Which children support HMA (take every group). The one owner of the
/// HMA rules and their refusals' words.
#[derive(Debug, Clone)]
pub struct Hma {
    per_child: Vec<bool>,
    all: bool,
}

/// How a finish of one request fans out: child i gets [`Route::hook`],
/// with the block ids as vLLM passed them, or with only the one group's
/// ([`Route::as_passed`] false: a child without HMA).
#[derive(Debug, Clone, Copy)]
pub enum Route<'a> {
    /// vLLM's `request_finished`: every child gets it, blocks as passed.
    Plain,
    /// Every child supports HMA: every child gets
    /// `request_finished_all_groups` with every group.
    AllGroups,
    /// One group, some children without HMA (`false` in the flags): they
    /// get `request_finished` with that group's blocks.
    Mixed(&'a [bool]),
}

impl Route<'_> {
    /// The hook child `i` gets.
    pub fn hook(&self, i: usize) -> &'static str {
        if self.all_groups_hook(i) {
            hook::FINISHED_ALL_GROUPS
        } else {
            hook::FINISHED
        }
    }

    /// True when child `i` gets `request_finished_all_groups` (false:
    /// `request_finished`).
    #[inline]
    pub fn all_groups_hook(&self, i: usize) -> bool {
        match self {
            Route::Plain => false,
            Route::AllGroups => true,
            Route::Mixed(_) => self.as_passed(i),
        }
    }

    /// True when child `i` gets the block ids as vLLM passed them; false
    /// when it gets the one group's (it lacks HMA).
    pub fn as_passed(&self, i: usize) -> bool {
        match self {
            Route::Plain | Route::AllGroups => true,
            Route::Mixed(h) => h.get(i).copied().unwrap_or(true),
        }
    }
}

/// A request with several KV cache groups that children without HMA
/// cannot be given: refused, never silently truncated to one group.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TooManyGroups {
    pub groups: usize,
    /// The children that lack HMA.
    pub children: Vec<usize>,
}

impl Hma {
    /// `per_child[i]`: child i supports HMA.
    pub fn new(per_child: Vec<bool>) -> Self {
        Self {
            all: per_child.iter().all(|&h| h),
            per_child,
        }
    }

    /// The start-up refusal, with the hybrid KV cache manager on, of a
    /// model with `groups` KV cache groups (None: vLLM gave no
    /// `KVCacheConfig`, so the count is unknown): None when every child can
    /// follow it (all support HMA, or one group, where a child without HMA
    /// sees what it would with the manager off); else the message naming
    /// the group count, the children that lack HMA, and the fixes.
    pub fn start_refusal<'a>(
        &self,
        groups: Option<usize>,
        name: impl Fn(usize) -> &'a str,
    ) -> Option<String> {
        if self.all || groups == Some(1) {
            return None;
        }
        let held = match groups {
            Some(g) => format!(
                "the model's KV cache has {g} KV cache groups (a hybrid model: sliding-window, \
                 chunked-local or state-space layers beside full attention)"
            ),
            None => "vLLM gave kvmux no KVCacheConfig, so the number of KV cache groups is \
                     unknown"
                .to_owned(),
        };
        Some(format!(
            "the hybrid KV cache manager (HMA) is on and {held}, but child connector(s) [{}] \
             do not support HMA and can follow only one group; {FIX}",
            self.lacking(name)
        ))
    }

    /// The children that lack HMA, as a Python list of their names reads.
    fn lacking<'a>(&self, name: impl Fn(usize) -> &'a str) -> String {
        let names: Vec<String> = (0..self.per_child.len())
            .filter(|&i| !self.per_child[i])
            .map(|i| py_repr(name(i)))
            .collect();
        names.join(", ")
    }

    /// vLLM's `request_finished_all_groups` of a request holding KV in
    /// `groups` KV cache groups: with every child supporting HMA, each gets
    /// every group; otherwise only one group is legal, and then a child
    /// with HMA gets it through `request_finished_all_groups`, a child
    /// without through `request_finished`.
    pub fn route(&self, groups: usize) -> Result<Route<'_>, TooManyGroups> {
        if self.all {
            return Ok(Route::AllGroups);
        }
        if groups != 1 {
            return Err(TooManyGroups {
                groups,
                children: (0..self.per_child.len())
                    .filter(|&i| !self.per_child[i])
                    .collect(),
            });
        }
        Ok(Route::Mixed(&self.per_child))
    }

    /// The refusal's message (for `KvmuxConfigError`): the request, the
    /// group count, the children that lack HMA, and the fixes.
    pub fn refusal<'a>(
        &self,
        req_id: &str,
        e: &TooManyGroups,
        name: impl Fn(usize) -> &'a str,
    ) -> String {
        let names: Vec<String> = e.children.iter().map(|&i| py_repr(name(i))).collect();
        format!(
            "request '{req_id}' holds KV in {} cache groups but children [{}] do not support \
             the hybrid KV cache manager and can be given only one (they would lose the \
             others); {FIX}, or use only HMA-capable children",
            e.groups,
            names.join(", "),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_every_child_hma_capable_each_gets_every_group() {
        let hma = Hma::new(vec![true, true]);
        for groups in [1, 2, 5] {
            let r = hma.route(groups).unwrap();
            assert!((0..2).all(|i| r.as_passed(i) && r.hook(i) == hook::FINISHED_ALL_GROUPS));
        }
    }

    #[test]
    fn one_group_goes_to_a_child_without_hma_through_request_finished() {
        let hma = Hma::new(vec![true, false]);
        let r = hma.route(1).unwrap();
        assert_eq!(r.hook(0), hook::FINISHED_ALL_GROUPS);
        assert!(r.as_passed(0));
        assert_eq!(r.hook(1), hook::FINISHED);
        assert!(!r.as_passed(1));
        // vLLM's plain request_finished: every child, blocks as passed.
        assert!((0..2).all(|i| Route::Plain.hook(i) == hook::FINISHED && Route::Plain.as_passed(i)));
    }

    #[test]
    fn several_groups_with_a_child_without_hma_are_refused_naming_it() {
        let hma = Hma::new(vec![true, false, false]);
        let e = hma.route(2).unwrap_err();
        assert_eq!(
            e,
            TooManyGroups {
                groups: 2,
                children: vec![1, 2]
            }
        );
        let names = ["host", "example", "it's"];
        let msg = hma.refusal("r1", &e, |i| names[i]);
        assert_eq!(
            msg,
            format!(
                "request 'r1' holds KV in 2 cache groups but children ['example', \"it's\"] do not \
             support the hybrid KV cache manager and can be given only one (they would lose \
             the others); {FIX}, or use only HMA-capable children"
            )
        );
        // Zero groups is not one group either.
        assert!(hma.route(0).is_err());
    }

    #[test]
    fn the_start_up_refusal_names_the_groups_the_children_and_the_fix() {
        let names = ["host", "example", "it's"];
        let some_lack = Hma::new(vec![true, false, false]);
        assert_eq!(some_lack.start_refusal(Some(1), |i| names[i]), None);
        assert_eq!(
            Hma::new(vec![true; 3]).start_refusal(Some(3), |i| names[i]),
            None
        );
        let msg = some_lack.start_refusal(Some(3), |i| names[i]).unwrap();
        assert!(msg.contains("has 3 KV cache groups"), "{msg}");
        assert!(
            msg.contains("child connector(s) ['example', \"it's\"] do not"),
            "{msg}"
        );
        assert!(msg.ends_with(FIX), "{msg}");
        let unknown = some_lack.start_refusal(None, |i| names[i]).unwrap();
        assert!(unknown.contains("no KVCacheConfig"), "{unknown}");
    }
}
