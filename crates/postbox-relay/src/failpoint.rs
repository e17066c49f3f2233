//! Failpoints: named places in the relay (and in `postbox verify`'s producer)
//! where a test can make the process crash, stall or take a failure path, to
//! prove that the delivery contract survives it.
//!
//! They exist only with the cargo feature `failpoints` (off by default);
//! without it [`hit`] is an `async fn` that returns `false` and the compiler
//! removes every call.
//!
//! Configuration: the environment variable `POSTBOX_FAILPOINTS` (read once,
//! at the first hit) or [`configure`], a list of `NAME=[P%]ACTION` separated
//! by `,` or `;`:
//!
//! - `exit`: the process ends at once (exit status 86), without releasing its
//!   leases or closing its connections cleanly, as from a crash;
//! - `sleep(MS)`: the task waits MS milliseconds (a stall);
//! - `fail`: the place takes its failure path (see [`points`]);
//! - `off`: nothing.
//!
//! `P%` (0–100, decimals allowed) fires the action on that share of hits
//! only; without it every hit fires. Example:
//! `POSTBOX_FAILPOINTS="after_publish_before_ack=2%exit,during_ack=5%fail"`.

/// Whether this build has failpoints.
pub const ENABLED: bool = cfg!(feature = "failpoints");

/// The environment variable holding the failpoint list.
pub const ENV: &str = "POSTBOX_FAILPOINTS";

/// Exit status of the `exit` action.
pub const EXIT_STATUS: i32 = 86;

/// The failpoints and what `fail` does at each.
pub mod points {
    /// The claimer, right after a claim committed (the batch is leased, not published).
    pub const AFTER_CLAIM_COMMIT: &str = "after_claim_commit";
    /// The settler, after the sinks answered and before the batch is settled.
    pub const AFTER_PUBLISH_BEFORE_ACK: &str = "after_publish_before_ack";
    /// Right after the acknowledgement statement returned. `fail`: the relay
    /// sees an error although the rows were marked sent, and retries.
    pub const DURING_ACK: &str = "during_ack";
    /// A planted bug, for proving that `postbox verify` catches one. `fail`:
    /// the publisher acknowledges the claimed batch and never publishes it.
    pub const ACK_BEFORE_PUBLISH: &str = "ack_before_publish";
    /// `postbox verify`'s producer, at its commit. `fail`: the commit's outcome
    /// is lost (the transaction commits, or is dropped, and the producer sees
    /// an error either way).
    pub const PRODUCER_COMMIT: &str = "producer_commit";
    /// A planted bug, for proving that `postbox verify --replay` catches
    /// one. `fail`: the replay runner moves its job past a page without
    /// sending it.
    pub const REPLAY_SKIP_PAGE: &str = "replay_skip_page";

    /// Every name above.
    pub const ALL: [&str; 6] = [
        AFTER_CLAIM_COMMIT,
        AFTER_PUBLISH_BEFORE_ACK,
        DURING_ACK,
        ACK_BEFORE_PUBLISH,
        PRODUCER_COMMIT,
        REPLAY_SKIP_PAGE,
    ];
}

/// What a failpoint does when it fires.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Action {
    Off,
    Exit,
    Sleep(std::time::Duration),
    Fail,
}

/// One configured failpoint.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Rule {
    /// Share of hits that fire, 0.0–1.0.
    pub probability: f64,
    pub action: Action,
}

/// A failpoint list that does not parse; the message names the entry.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("failpoints: {0}")]
pub struct SpecError(pub String);

/// Parse a failpoint list (`NAME=[P%]ACTION`, separated by `,` or `;`).
/// Unknown names are refused, so a typo cannot silently disable a fault.
pub fn parse(spec: &str) -> Result<Vec<(String, Rule)>, SpecError> {
    let mut rules = Vec::new();
    for entry in spec
        .split([',', ';'])
        .map(str::trim)
        .filter(|e| !e.is_empty())
    {
        let (name, rest) = entry
            .split_once('=')
            .ok_or_else(|| SpecError(format!("{entry:?}: expected NAME=[P%]ACTION")))?;
        let name = name.trim();
        if !points::ALL.contains(&name) {
            return Err(SpecError(format!(
                "unknown failpoint {name:?}; known: {}",
                points::ALL.join(", ")
            )));
        }
        let rest = rest.trim();
        let (probability, action) = match rest.split_once('%') {
            Some((p, action)) => {
                let p: f64 = p
                    .trim()
                    .parse()
                    .ok()
                    .filter(|p: &f64| (0.0..=100.0).contains(p))
                    .ok_or_else(|| {
                        SpecError(format!("{name}: {p:?} is not a percentage (0-100)"))
                    })?;
                (p / 100.0, action.trim())
            }
            None => (1.0, rest),
        };
        let action = match action {
            "off" => Action::Off,
            "exit" => Action::Exit,
            "fail" => Action::Fail,
            other => {
                let ms = other
                    .strip_prefix("sleep(")
                    .and_then(|s| s.strip_suffix(')'))
                    .and_then(|ms| ms.trim().parse::<u64>().ok())
                    .ok_or_else(|| {
                        SpecError(format!(
                            "{name}: unknown action {other:?}; expected off, exit, fail or sleep(MS)"
                        ))
                    })?;
                Action::Sleep(std::time::Duration::from_millis(ms))
            }
        };
        rules.push((
            name.to_owned(),
            Rule {
                probability,
                action,
            },
        ));
    }
    Ok(rules)
}

#[cfg(feature = "failpoints")]
mod active {
    use super::{parse, Action, Rule, SpecError, ENV, EXIT_STATUS};
    use std::collections::HashMap;
    use std::sync::{OnceLock, RwLock};

    static RULES: OnceLock<RwLock<HashMap<String, Rule>>> = OnceLock::new();

    fn rules() -> &'static RwLock<HashMap<String, Rule>> {
        RULES.get_or_init(|| {
            let spec = std::env::var(ENV).unwrap_or_default();
            let rules = match parse(&spec) {
                Ok(r) => r,
                Err(e) => {
                    // A test asked for faults it will not get: make that loud.
                    eprintln!("{ENV}: {e}");
                    std::process::exit(2);
                }
            };
            if !rules.is_empty() {
                tracing::warn!(failpoints = %spec, "failpoints are armed");
            }
            RwLock::new(rules.into_iter().collect())
        })
    }

    pub async fn hit(name: &str) -> bool {
        let rule = match rules().read() {
            Ok(map) => map.get(name).copied(),
            Err(poisoned) => poisoned.into_inner().get(name).copied(),
        };
        let Some(rule) = rule else { return false };
        if rule.probability < 1.0 && rand::random::<f64>() >= rule.probability {
            return false;
        }
        match rule.action {
            Action::Off => false,
            Action::Exit => {
                eprintln!("failpoint {name}: exit");
                std::process::exit(EXIT_STATUS);
            }
            Action::Sleep(d) => {
                tokio::time::sleep(d).await;
                false
            }
            Action::Fail => true,
        }
    }

    pub fn configure(spec: &str) -> Result<(), SpecError> {
        let parsed = parse(spec)?;
        let mut map = match rules().write() {
            Ok(map) => map,
            Err(poisoned) => poisoned.into_inner(),
        };
        *map = parsed.into_iter().collect();
        Ok(())
    }
}

/// Pass failpoint `name`: runs its action if it is configured and fires, and
/// returns `true` when the caller is to take its failure path (`fail`).
#[cfg(feature = "failpoints")]
pub async fn hit(name: &str) -> bool {
    active::hit(name).await
}

/// Without the `failpoints` feature: nothing, ever.
#[cfg(not(feature = "failpoints"))]
#[inline(always)]
pub async fn hit(_name: &str) -> bool {
    false
}

/// Replace this process's failpoints (instead of `POSTBOX_FAILPOINTS`).
#[cfg(feature = "failpoints")]
pub fn configure(spec: &str) -> Result<(), SpecError> {
    active::configure(spec)
}

/// Without the `failpoints` feature there is nothing to configure: an empty
/// list is accepted, anything else is refused.
#[cfg(not(feature = "failpoints"))]
pub fn configure(spec: &str) -> Result<(), SpecError> {
    if parse(spec)?.is_empty() {
        Ok(())
    } else {
        Err(SpecError(
            "this binary was built without failpoints (cargo feature `failpoints` of postbox-relay; \
             `cargo build -p postbox-cli --features failpoints`)"
                .into(),
        ))
    }
}

/// The planted bug behind [`points::ACK_BEFORE_PUBLISH`]: mark a claimed
/// batch sent without publishing it. Exists only to be caught.
#[cfg(feature = "failpoints")]
pub async fn ack_without_publishing(store: &crate::Store, token: uuid::Uuid, ids: &[i64]) {
    match store.ack_delivered(token, ids).await {
        Ok(acked) => tracing::warn!(
            events = acked.len(),
            "failpoint ack_before_publish: acknowledged a batch and dropped its publish"
        ),
        Err(e) => tracing::warn!(
            error = %crate::redact::sanitize_error(&e.to_string()),
            "failpoint ack_before_publish: the acknowledgement failed"
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn parses_lists() {
        let rules = parse(
            "after_claim_commit=exit; during_ack=2.5%fail,after_publish_before_ack=sleep(300)",
        )
        .unwrap();
        assert_eq!(rules.len(), 3);
        assert_eq!(
            rules[0].1,
            Rule {
                probability: 1.0,
                action: Action::Exit
            }
        );
        assert_eq!(rules[1].1.action, Action::Fail);
        assert!((rules[1].1.probability - 0.025).abs() < 1e-9);
        assert_eq!(rules[2].1.action, Action::Sleep(Duration::from_millis(300)));
        assert!(parse("").unwrap().is_empty());
    }

    #[test]
    fn refuses_what_it_does_not_know() {
        for (spec, want) in [
            ("after_claim=exit", "unknown failpoint"),
            ("during_ack", "expected NAME=[P%]ACTION"),
            ("during_ack=explode", "unknown action"),
            ("during_ack=120%fail", "not a percentage"),
            ("during_ack=sleep(x)", "unknown action"),
        ] {
            let err = parse(spec).unwrap_err().to_string();
            assert!(err.contains(want), "{spec}: {err}");
        }
    }
}
