//! How a hook fans out over the children. What the host knows of each
//! child's hook is a [`Fact`] (it lacks the hook, the hook only returns a
//! constant, or it does something); the rule of who is called is here.
//!
//! A child whose hook only returns a constant (vLLM's base-class defaults,
//! `pass`, `return 0, False`) has no effect when called and always gives
//! the same answer, so it is never called: its answer is known. That is
//! most hooks of most children, and the multiplexer runs in every step.

/// What the host knows of one child's hook.
#[derive(Debug, Clone, PartialEq)]
pub enum Fact<M, T> {
    /// The child has no such hook (`request_finished_all_groups` of a
    /// child without HMA support).
    Missing,
    /// The hook only returns this answer (`Err`: an answer the hook's
    /// contract does not allow, reported when the child is asked).
    Constant(Result<T, String>),
    /// The hook does something: it is called (`M`: how to call it).
    Works(M),
}

/// One hook of every child: whom to call, and every other child's answer.
#[derive(Debug, Clone)]
pub struct Fanout<M, T> {
    calls: Vec<Option<M>>,
    answers: Vec<Result<T, String>>,
}

impl<M, T> Fanout<M, T> {
    /// The plan for `facts` (one per child, in config order): a child whose
    /// hook works is called; one whose hook is constant answers it without
    /// a call; one that lacks the hook answers `default()`.
    pub fn decide(facts: Vec<Fact<M, T>>, default: impl Fn() -> T) -> Self {
        let mut calls = Vec::with_capacity(facts.len());
        let mut answers = Vec::with_capacity(facts.len());
        for fact in facts {
            match fact {
                Fact::Missing => {
                    calls.push(None);
                    answers.push(Ok(default()));
                }
                Fact::Constant(a) => {
                    calls.push(None);
                    answers.push(a);
                }
                Fact::Works(m) => {
                    calls.push(Some(m));
                    answers.push(Ok(default()));
                }
            }
        }
        Self { calls, answers }
    }

    /// A plan where no child is called and each answers `default` (a hook
    /// the host told nothing of).
    pub fn none(n: usize, default: impl Fn() -> T) -> Self {
        Self {
            calls: (0..n).map(|_| None).collect(),
            answers: (0..n).map(|_| Ok(default())).collect(),
        }
    }

    /// How many children the plan covers.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// Child `i` is to be called with this; None: take [`Fanout::answer`].
    #[inline]
    pub fn call(&self, i: usize) -> Option<&M> {
        self.calls[i].as_ref()
    }

    /// The children to call, in config order.
    pub fn active(&self) -> impl Iterator<Item = (usize, &M)> {
        self.calls
            .iter()
            .enumerate()
            .filter_map(|(i, c)| c.as_ref().map(|m| (i, m)))
    }

    /// True when some child is called.
    pub fn any_active(&self) -> bool {
        self.calls.iter().any(Option::is_some)
    }

    /// Every child's constant answer (the default for a child called).
    pub fn answers(&self) -> &[Result<T, String>] {
        &self.answers
    }
}

impl<M, T: Clone> Fanout<M, T> {
    /// Child `i`'s answer when it is not called.
    pub fn answer(&self, i: usize) -> Result<T, String> {
        self.answers[i].clone()
    }
}

/// The workers' metadata of one step holds one entry per child (in config
/// order); each child called for `update_connector_output` sees its own.
/// `entries`: how many the metadata holds (None: the workers sent none).
/// Returns, per child called, the entry it sees (None: no metadata), or
/// why the metadata is not kvmux's of this configuration.
pub fn worker_meta_entries<M, T>(
    plan: &Fanout<M, T>,
    entries: Option<usize>,
) -> Result<Vec<(usize, Option<usize>)>, String> {
    if let Some(got) = entries.filter(|&got| got != plan.len()) {
        return Err(format!(
            "kvmux got worker metadata for {got} children, not {}; the workers must run the \
             same KvmuxConnector configuration",
            plan.len()
        ));
    }
    Ok(plan
        .active()
        .map(|(i, _)| (i, entries.map(|_| i)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn plan() -> Fanout<&'static str, u32> {
        Fanout::decide(
            vec![
                Fact::Works("call 0"),
                Fact::Constant(Ok(7)),
                Fact::Missing,
                Fact::Constant(Err("returned a list".into())),
                Fact::Works("call 4"),
            ],
            || 0,
        )
    }

    #[test]
    fn a_working_hook_is_called_and_a_constant_or_missing_one_answered_without_a_call() {
        let p = plan();
        assert_eq!(p.call(0), Some(&"call 0"));
        assert_eq!(p.call(1), None);
        assert_eq!(p.answer(1), Ok(7));
        assert_eq!(p.call(2), None);
        assert_eq!(p.answer(2), Ok(0), "a missing hook answers the default");
        assert_eq!(p.answer(3), Err("returned a list".into()));
        let active: Vec<usize> = p.active().map(|(i, _)| i).collect();
        assert_eq!(active, [0, 4]);
        assert!(p.any_active());
        assert!(!Fanout::<(), u32>::none(3, || 0).any_active());
    }

    #[test]
    fn each_child_called_sees_its_own_entry_of_the_workers_metadata() {
        let p = plan();
        assert_eq!(
            worker_meta_entries(&p, Some(5)).unwrap(),
            [(0, Some(0)), (4, Some(4))]
        );
        assert_eq!(
            worker_meta_entries(&p, None).unwrap(),
            [(0, None), (4, None)]
        );
        let e = worker_meta_entries(&p, Some(2)).unwrap_err();
        assert!(e.contains("for 2 children, not 5"), "{e}");
    }
}
