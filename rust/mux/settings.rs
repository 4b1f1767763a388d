//! The bounds of a child's numeric settings: its lookup and load deadlines
//! and its circuit breaker. One owner: kvmux's start-up check
//! (`python/kvmux/mux/config.py`, through `_core.check_deadline` and
//! `_core.check_breaker`) and the core's constructors (the bindings build
//! every deadline and breaker through [`deadline`] and [`breaker`];
//! [`SchedulerMux::with_breakers`](crate::mux::SchedulerMux::with_breakers)
//! checks with [`check_breaker`]) apply these rules and no other.

use std::fmt;
use std::time::Duration;

use crate::mux::breaker::BreakerConfig;

pub const LOOKUP_TIMEOUT: &str = "lookup_timeout_ms";
pub const LOAD_TIMEOUT: &str = "load_timeout_ms";
pub const BREAKER_FAILURES: &str = "breaker_failures";
pub const BREAKER_COOLDOWN: &str = "breaker_cooldown_ms";
pub const BREAKER_MAX_COOLDOWN: &str = "breaker_max_cooldown_ms";

/// Every millisecond setting is below this (about 11.6 days: a larger one
/// is a typo, and `Duration` arithmetic stays far from overflow).
pub const MAX_MS: f64 = 1e9;
/// A cooldown under a millisecond is no cooldown.
pub const MIN_COOLDOWN_MS: f64 = 1.0;
/// The core counts a breaker's consecutive failures in a `u32`.
pub const MAX_FAILURES: u64 = u32::MAX as u64;

/// A setting out of its bounds: which key, what it was given, and the rule
/// it breaks, worded for the user who sets it.
#[derive(Clone, Debug, PartialEq)]
pub struct BadSetting {
    pub key: &'static str,
    pub value: f64,
    pub rule: String,
}

impl fmt::Display for BadSetting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}={} is out of bounds: {}",
            self.key, self.value, self.rule
        )
    }
}

fn bad(key: &'static str, value: f64, rule: String) -> BadSetting {
    BadSetting { key, value, rule }
}

/// A deadline setting (`lookup_timeout_ms`, `load_timeout_ms`): more than 0
/// and below [`MAX_MS`] milliseconds.
pub fn deadline(key: &'static str, ms: f64) -> Result<Duration, BadSetting> {
    if ms > 0.0 && ms < MAX_MS {
        Ok(Duration::from_secs_f64(ms / 1000.0))
    } else {
        Err(bad(
            key,
            ms,
            format!("a number of milliseconds > 0 and below {MAX_MS:e}"),
        ))
    }
}

/// A breaker's settings: `failures` from 1 to [`MAX_FAILURES`], each
/// cooldown from [`MIN_COOLDOWN_MS`] to below [`MAX_MS`], and the longest
/// cooldown at least the first.
pub fn breaker(
    failures: u64,
    cooldown_ms: f64,
    max_cooldown_ms: f64,
) -> Result<BreakerConfig, BadSetting> {
    if !(1..=MAX_FAILURES).contains(&failures) {
        return Err(bad(
            BREAKER_FAILURES,
            failures as f64,
            format!("an int >= 1 and at most {MAX_FAILURES}"),
        ));
    }
    for (key, ms) in [
        (BREAKER_COOLDOWN, cooldown_ms),
        (BREAKER_MAX_COOLDOWN, max_cooldown_ms),
    ] {
        if !(MIN_COOLDOWN_MS..MAX_MS).contains(&ms) {
            return Err(bad(
                key,
                ms,
                format!(
                    "a number of milliseconds of at least {MIN_COOLDOWN_MS} and below {MAX_MS:e}"
                ),
            ));
        }
    }
    if max_cooldown_ms < cooldown_ms {
        return Err(bad(
            BREAKER_MAX_COOLDOWN,
            max_cooldown_ms,
            format!(
                "at least {BREAKER_COOLDOWN}={cooldown_ms} (the longest cooldown is at least \
                 the first)"
            ),
        ));
    }
    Ok(BreakerConfig {
        failures: failures as u32,
        cooldown: Duration::from_secs_f64(cooldown_ms / 1000.0),
        max_cooldown: Duration::from_secs_f64(max_cooldown_ms / 1000.0),
    })
}

/// The same rule over a breaker built in Rust (the core's own tests and
/// callers that hold durations).
pub fn check_breaker(b: &BreakerConfig) -> Result<(), BadSetting> {
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    breaker(u64::from(b.failures), ms(b.cooldown), ms(b.max_cooldown)).map(|_| ())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadlines_are_positive_and_below_the_bound() {
        assert_eq!(
            deadline(LOOKUP_TIMEOUT, 250.0),
            Ok(Duration::from_millis(250))
        );
        for ms in [0.0, -1.0, MAX_MS, f64::NAN, f64::INFINITY] {
            let e = deadline(LOAD_TIMEOUT, ms).unwrap_err();
            assert_eq!(e.key, LOAD_TIMEOUT);
            assert!(e.rule.contains("> 0"), "{e}");
        }
    }

    #[test]
    fn a_breaker_names_the_setting_out_of_bounds() {
        let b = breaker(3, 1000.0, 30000.0).unwrap();
        assert_eq!(b.failures, 3);
        assert_eq!(b.max_cooldown, Duration::from_secs(30));
        assert_eq!(
            breaker(0, 1000.0, 1000.0).unwrap_err().key,
            BREAKER_FAILURES
        );
        assert_eq!(
            breaker(MAX_FAILURES + 1, 1000.0, 1000.0).unwrap_err().key,
            BREAKER_FAILURES
        );
        assert!(breaker(MAX_FAILURES, 1.0, 1.0).is_ok());
        assert_eq!(breaker(1, 0.5, 10.0).unwrap_err().key, BREAKER_COOLDOWN);
        assert_eq!(
            breaker(1, 10.0, f64::NAN).unwrap_err().key,
            BREAKER_MAX_COOLDOWN
        );
        let e = breaker(1, 100.0, 50.0).unwrap_err();
        assert_eq!(e.key, BREAKER_MAX_COOLDOWN);
        assert!(e.rule.contains(BREAKER_COOLDOWN), "{e}");
        assert!(check_breaker(&b).is_ok());
    }
}
