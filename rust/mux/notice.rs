//! What the scheduler side tells the operator: a child's failure it
//! contained, a breaker's transition, a clash it resolved. The core returns
//! each as a [`Notice`] with its level and its whole text; the bindings hand
//! it to the `kvmux` logger as it is.

use std::fmt::{Display, Write};

use super::hook;
use super::Contained;
use crate::error::ChildFault;
use crate::mux::breaker::{State, Transition};
use crate::mux::merge::{Clash, KeyRule};

/// A notice's log level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    Debug,
    Info,
    Warning,
}

impl Level {
    /// The level's number in Python's `logging`.
    pub fn number(self) -> u8 {
        match self {
            Level::Debug => 10,
            Level::Info => 20,
            Level::Warning => 30,
        }
    }
}

/// What a [`Notice`] tells of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A child failed in a finish hook on a request it never took part in.
    Contained,
    /// A child's lookup raised (it has a breaker): a miss for the request.
    LookupMiss,
    BreakerOpened,
    BreakerHalfOpen,
    BreakerClosed,
    /// Two sources returned one `kv_transfer_params` key; resolved.
    Clash,
}

/// One thing to log, decided by the core: what, how loud, the whole text.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Notice {
    pub kind: Kind,
    pub level: Level,
    pub text: String,
}

/// Said of a failure logged loudly once per child, quietly after.
const ONCE_PER_CHILD: &str = " (warned once per child; later ones at debug level)";

/// Loud the first time, at debug level after.
fn once(first: bool) -> (Level, &'static str) {
    if first {
        (Level::Warning, ONCE_PER_CHILD)
    } else {
        (Level::Debug, "")
    }
}

/// What a child did wrong in `hook`, for a message: what it raised, or what
/// it answered and what it must answer instead.
pub fn fault_detail<E: Display>(hook: &str, fault: &ChildFault<E>) -> String {
    match fault {
        ChildFault::Raised(e) | ChildFault::Interrupt(e) => e.to_string(),
        ChildFault::Malformed(why) => format!("{why}; it must return {}", hook::contract(hook)),
    }
}

/// A contained failure of a child (`name`) on request `req_id`: a lookup's
/// is a miss counted by its breaker; a finish hook's is a failure on a
/// request the child never took part in.
pub fn contained<E: Display>(name: &str, req_id: &str, c: &Contained<E>) -> Notice {
    let (level, suffix) = once(c.first);
    let cause = fault_detail(c.hook, &c.fault);
    let (child, hook, req) = (py_repr(name), c.hook, py_repr(req_id));
    let (kind, text) = if c.hook == hook::LOOKUP {
        (
            Kind::LookupMiss,
            format!(
            "kvmux: child {child} failed in {hook} for request {req}; contained as a miss (the \
             request goes on without it), counted in its lookup_errors and its \
             breaker{suffix}. Cause: {cause}"
        ),
        )
    } else {
        (
            Kind::Contained,
            format!(
            "kvmux: child {child} failed in {hook} for request {req}, which it never took part \
             in (it ended before the child looked it up); contained: no async save, no params \
             from this child, counted in its contained_errors{suffix}. Cause: {cause}"
        ),
        )
    };
    Notice { kind, level, text }
}

/// A breaker's transition of child `name`: opening is a warning, the probe
/// and closing are news.
pub fn transition(name: &str, t: &Transition) -> Notice {
    let child = py_repr(name);
    match t.to {
        State::Open => Notice {
            kind: Kind::BreakerOpened,
            level: Level::Warning,
            text: format!(
                "kvmux: breaker of child {child} opened after {} failed lookup(s) (deadline \
                 missed or raised); it is not asked for {:.1} s, then one request probes it \
                 (breaker_failures, breaker_cooldown_ms)",
                t.failures,
                t.cooldown.map_or(0.0, |d| d.as_secs_f64()),
            ),
        },
        State::HalfOpen => Notice {
            kind: Kind::BreakerHalfOpen,
            level: Level::Info,
            text: format!(
                "kvmux: breaker of child {child} half open: request {} probes it",
                py_repr(t.probe.as_deref().unwrap_or_default())
            ),
        },
        State::Closed => Notice {
            kind: Kind::BreakerClosed,
            level: Level::Info,
            text: format!(
                "kvmux: breaker of child {child} closed: its probe was answered; it is asked again"
            ),
        },
    }
}

/// A clash resolved on a key never warned about: how it was resolved.
/// `name(i)` names source i (a child, or the multiplexer itself).
pub fn clash<'a>(c: &Clash, policy: &str, name: impl Fn(usize) -> &'a str) -> Notice {
    let how = match c.rule {
        KeyRule::Policy => format!("clash_policy {policy:?} keeps one"),
        KeyRule::PerSource => "the request asked for it, so it is answered with each child's \
                               value, keyed by child name"
            .to_owned(),
        KeyRule::Own(_) => "it is kvmux's own key, so kvmux's value is kept".to_owned(),
    };
    Notice {
        kind: Kind::Clash,
        level: Level::Warning,
        text: format!(
            "kvmux: {} and {} both return kv_transfer_params key {}; {how} (warned once per key)",
            py_repr(name(c.first)),
            py_repr(name(c.second)),
            py_repr(&c.key),
        ),
    }
}

/// A str as Python's `repr` writes it (names and request ids in kvmux's
/// messages read as in every Python message): single quotes unless the text
/// holds one and no double quote; backslashes, the quote and control
/// characters escaped.
pub fn py_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for ch in s.chars() {
        match ch {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn reprs_read_as_pythons() {
        assert_eq!(py_repr("lmcache"), "'lmcache'");
        assert_eq!(py_repr("it's"), "\"it's\"");
        assert_eq!(py_repr("a'b\"c"), "'a\\'b\"c'");
        assert_eq!(py_repr("x\ny\\\u{1}"), "'x\\ny\\\\\\x01'");
        assert_eq!(py_repr("é"), "'é'");
    }

    #[test]
    fn a_first_contained_failure_warns_and_later_ones_are_debug() {
        let c = |first| Contained {
            child: 0,
            hook: hook::FINISHED,
            first,
            fault: ChildFault::Raised("KeyError: 'r'".to_owned()),
        };
        let n = contained("lm", "r1", &c(true));
        assert_eq!((n.kind, n.level), (Kind::Contained, Level::Warning));
        assert!(n.text.starts_with(
            "kvmux: child 'lm' failed in request_finished for request 'r1', which it never took"
        ));
        assert!(n.text.ends_with(
            "contained_errors (warned once per child; later ones at debug level). Cause: \
             KeyError: 'r'"
        ));
        let later = contained("lm", "r2", &c(false));
        assert_eq!(later.level, Level::Debug);
        assert!(later
            .text
            .ends_with("contained_errors. Cause: KeyError: 'r'"));
    }

    #[test]
    fn a_contained_lookup_failure_is_a_miss_counted_by_the_breaker() {
        let c = Contained {
            child: 1,
            hook: hook::LOOKUP,
            first: true,
            fault: ChildFault::<String>::Malformed("returned None".into()),
        };
        let n = contained("x", "r", &c);
        assert_eq!(n.kind, Kind::LookupMiss);
        assert!(n.text.contains("contained as a miss"));
        assert!(n
            .text
            .ends_with("Cause: returned None; it must return (int >= 0 or None, bool)"));
    }

    #[test]
    fn breaker_transitions_open_loudly_and_probe_and_close_as_news() {
        let t = |to, probe: Option<&str>| Transition {
            child: 0,
            from: State::Closed,
            to,
            cooldown: Some(Duration::from_millis(2500)),
            probe: probe.map(str::to_owned),
            failures: 3,
        };
        let open = transition("lm", &t(State::Open, None));
        assert_eq!(
            (open.kind, open.level),
            (Kind::BreakerOpened, Level::Warning)
        );
        assert!(open.text.contains("opened after 3 failed lookup(s)"));
        assert!(open.text.contains("not asked for 2.5 s"));
        let half = transition("lm", &t(State::HalfOpen, Some("r9")));
        assert_eq!(
            (half.level, half.text.as_str()),
            (
                Level::Info,
                "kvmux: breaker of child 'lm' half open: request 'r9' probes it"
            )
        );
        assert_eq!(transition("lm", &t(State::Closed, None)).level, Level::Info);
    }

    #[test]
    fn a_clash_notice_says_how_it_was_resolved() {
        let names = ["a", "b", "kvmux"];
        let c = |rule| Clash {
            key: "k".into(),
            first: 0,
            second: 1,
            rule,
        };
        let by_policy = clash(&c(KeyRule::Policy), "first", |i| names[i]);
        assert_eq!(
            by_policy.text,
            "kvmux: 'a' and 'b' both return kv_transfer_params key 'k'; clash_policy \"first\" \
             keeps one (warned once per key)"
        );
        assert!(clash(&c(KeyRule::PerSource), "error", |i| names[i])
            .text
            .contains("keyed by child name"));
        assert!(clash(&c(KeyRule::Own(2)), "error", |i| names[i])
            .text
            .contains("kvmux's own key"));
    }
}
