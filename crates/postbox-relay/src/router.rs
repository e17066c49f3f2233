//! Routing: which destinations an event goes to, and whether its aggregate's
//! events go out in order.
//!
//! A [`Router`] holds named destinations (each a [`Sink`]) and routes that map
//! event types — exact names or globs with `*` and `?` — to one or more of
//! them. An event goes to the union of the destinations of every route that
//! matches it; it is *ordered* when any matching route is, and its dead letter
//! blocks its aggregate when any matching ordered route's poison policy is
//! `block`. An event no route matches is dead-lettered (nothing is dropped
//! silently; fix the routes and replay it).
//!
//! Delivery to several destinations is tracked per destination (see
//! [`Round`]): a destination that took the event is never published to again,
//! and each destination has its own attempts, backoff and dead letter.

use crate::config::ConfigError;
use crate::shape::{Shape, Shaped};
use crate::sink::{Message, Outcome, Sink};
use postbox_store::{ClaimOrder, CursorStart, DeliveryState, DeliveryUpdate, GroupStart, Status};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The destination name used when the relay has a single sink (`--sink`).
pub const DEFAULT_DESTINATION: &str = "default";

/// An event-type pattern: an exact name, or a glob where `*` matches any run
/// of characters (dots included) and `?` exactly one character (as `%` and `_`
/// do in SQL `LIKE`, which the ordered claim uses: see [`Pattern::like`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Pattern(String);

impl Pattern {
    pub fn parse(pattern: &str) -> Result<Self, String> {
        if pattern.is_empty() || pattern.len() > postbox::MAX_NAME_BYTES {
            return Err("must be 1 to 255 bytes long".into());
        }
        if pattern.chars().any(char::is_control) {
            return Err("must not contain control characters".into());
        }
        Ok(Self(pattern.to_owned()))
    }

    pub fn matches(&self, event_type: &str) -> bool {
        postbox::glob::matches(&self.0, event_type)
    }

    /// The same pattern for SQL `LIKE` (with `\` as the escape character).
    pub fn like(&self) -> String {
        let mut out = String::with_capacity(self.0.len() + 4);
        for c in self.0.chars() {
            match c {
                '*' => out.push('%'),
                '?' => out.push('_'),
                '%' | '_' | '\\' => {
                    out.push('\\');
                    out.push(c);
                }
                c => out.push(c),
            }
        }
        out
    }
}

/// What happens to an ordered aggregate when one of its events becomes a dead letter.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PoisonPolicy {
    /// The aggregate waits until an operator replays or discards the dead letter.
    #[default]
    Block,
    /// The aggregate goes on; consumers see the gap in the sequence numbers.
    Skip,
}

/// One `[[routes]]` entry of the config file.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    /// Event types this route takes: exact names or globs (`order.*`, `*`).
    #[serde(rename = "match")]
    pub matches: Vec<String>,
    /// Names of the destinations (`[destinations.NAME]`) the events go to.
    pub to: Vec<String>,
    /// Deliver each aggregate's events one at a time, in sequence.
    #[serde(default)]
    pub ordered: bool,
    /// For ordered routes: `block` (default) or `skip`.
    #[serde(default)]
    pub poison: PoisonPolicy,
    /// A jq expression: the route carries an event to its destinations only
    /// when its first output is true (see [`crate::shape`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<String>,
    /// A jq expression whose first output is the payload this route's
    /// destinations receive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub transform: Option<String>,
    /// A jq expression whose first output (an object of strings) is the set
    /// of headers this route's destinations receive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub headers: Option<String>,
}

struct Route {
    /// `routes[i]`, as the configuration names it.
    name: String,
    patterns: Vec<Pattern>,
    to: Vec<usize>,
    ordered: bool,
    poison: PoisonPolicy,
    shape: Shape,
}

/// A named sink, with the expressions of its `[destinations.NAME]` section.
#[derive(Clone)]
pub struct Destination {
    pub name: String,
    pub sink: Arc<dyn Sink>,
    /// Its own filter, transform and headers (see [`crate::shape`]).
    pub shape: Shape,
    /// Where it starts (`start`; `None`: not configured). A time also keeps
    /// every event created before it from the destination, in every mode.
    pub start: Option<GroupStart>,
}

impl Destination {
    /// A destination without expressions of its own.
    pub fn new(name: impl Into<String>, sink: Arc<dyn Sink>) -> Self {
        Self {
            name: name.into(),
            sink,
            shape: Shape::default(),
            start: None,
        }
    }

    /// With these expressions.
    pub fn with_shape(mut self, shape: Shape) -> Self {
        self.shape = shape;
        self
    }

    /// Starting there.
    pub fn with_start(mut self, start: Option<GroupStart>) -> Self {
        self.start = start;
        self
    }

    /// Where a new log cursor of this destination starts: a time starts
    /// at the beginning, and the events before it are filtered out.
    pub fn cursor_start(&self) -> CursorStart {
        match self.start {
            None => CursorStart::Default,
            Some(GroupStart::Now) => CursorStart::Now,
            Some(GroupStart::Beginning | GroupStart::At(_)) => CursorStart::Beginning,
        }
    }

    /// The time before which it gets no event (`start` = a time).
    pub fn start_at(&self) -> Option<chrono::DateTime<chrono::Utc>> {
        match self.start {
            Some(GroupStart::At(t)) => Some(t),
            _ => None,
        }
    }
}

/// Destinations and the routes to them.
pub struct Router {
    destinations: Vec<Destination>,
    routes: Vec<Route>,
    /// The payload paths and headers redacted wherever an event is shown
    /// (`[redact]`): their values are masked in what a destination answers
    /// too, before it is stored or logged.
    redactor: Option<std::sync::Arc<crate::redact::PayloadRedactor>>,
    /// Per destination: whether any expression applies on the way there.
    shaped: Vec<bool>,
}

fn check_destination_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err("must be 1 to 64 characters of a-z, A-Z, 0-9, '_' or '-'".into())
    }
}

impl Router {
    /// One sink, named [`DEFAULT_DESTINATION`], taking every event.
    /// Mask the values `redactor` redacts (payload paths, headers) in every
    /// destination's answer, before it is stored in `last_error` or logged.
    pub fn with_redactor(mut self, redactor: crate::redact::PayloadRedactor) -> Self {
        self.redactor = (!redactor.is_empty()).then(|| std::sync::Arc::new(redactor));
        self
    }

    /// See [`Router::with_redactor`].
    pub fn redactor(&self) -> Option<&crate::redact::PayloadRedactor> {
        self.redactor.as_deref()
    }

    pub fn single(sink: Arc<dyn Sink>) -> Self {
        Self::single_shaped(sink, Shape::default())
    }

    /// One sink taking every event, through `shape` (the `[sink]` section's
    /// expressions).
    pub fn single_shaped(sink: Arc<dyn Sink>, shape: Shape) -> Self {
        let shaped = vec![!shape.is_empty()];
        Self {
            destinations: vec![Destination {
                name: DEFAULT_DESTINATION.to_owned(),
                sink,
                shape,
                start: None,
            }],
            routes: vec![Route {
                name: "routes[0]".into(),
                patterns: vec![Pattern("*".into())],
                to: vec![0],
                ordered: false,
                poison: PoisonPolicy::Block,
                shape: Shape::default(),
            }],
            redactor: None,
            shaped,
        }
    }

    /// Named destinations and routes; errors name the offending field
    /// (`destinations.NAME`, `routes[i].match`, `routes[i].to`).
    pub fn new(
        destinations: Vec<Destination>,
        routes: &[RouteConfig],
    ) -> Result<Self, ConfigError> {
        if destinations.is_empty() {
            return Err(ConfigError::new(
                "destinations",
                "at least one destination is needed",
            ));
        }
        let mut index = HashMap::new();
        for (i, d) in destinations.iter().enumerate() {
            check_destination_name(&d.name)
                .map_err(|reason| ConfigError::new(format!("destinations.{}", d.name), reason))?;
            if index.insert(d.name.clone(), i).is_some() {
                return Err(ConfigError::new(
                    format!("destinations.{}", d.name),
                    "is defined twice",
                ));
            }
        }
        if routes.is_empty() {
            return Err(ConfigError::new(
                "routes",
                "at least one route is needed (e.g. match = [\"*\"], to = [\"NAME\"])",
            ));
        }
        let mut built = Vec::with_capacity(routes.len());
        for (i, r) in routes.iter().enumerate() {
            let field = |f: &str| format!("routes[{i}].{f}");
            if r.matches.is_empty() {
                return Err(ConfigError::new(
                    field("match"),
                    "must name at least one event type or glob",
                ));
            }
            let patterns = r
                .matches
                .iter()
                .map(|p| {
                    Pattern::parse(p).map_err(|reason| {
                        ConfigError::new(field("match"), format!("{p:?} {reason}"))
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            if r.to.is_empty() {
                return Err(ConfigError::new(
                    field("to"),
                    "must name at least one destination",
                ));
            }
            let mut to = Vec::with_capacity(r.to.len());
            for name in &r.to {
                let Some(&d) = index.get(name) else {
                    let known: Vec<&str> = destinations.iter().map(|d| d.name.as_str()).collect();
                    return Err(ConfigError::new(
                        field("to"),
                        format!(
                            "unknown destination {name:?} (defined: {})",
                            known.join(", ")
                        ),
                    ));
                };
                if !to.contains(&d) {
                    to.push(d);
                }
            }
            let shape = Shape::compile(
                &format!("routes[{i}]"),
                r.filter.as_deref(),
                r.transform.as_deref(),
                r.headers.as_deref(),
            )?;
            built.push(Route {
                name: format!("routes[{i}]"),
                patterns,
                to,
                ordered: r.ordered,
                poison: r.poison,
                shape,
            });
        }
        for (i, d) in destinations.iter().enumerate() {
            if !built.iter().any(|r| r.to.contains(&i)) {
                tracing::warn!(destination = %d.name, "no route sends events to this destination");
            }
        }
        let shaped = (0..destinations.len())
            .map(|d| {
                !destinations[d].shape.is_empty()
                    || destinations[d].start_at().is_some()
                    || built
                        .iter()
                        .any(|r| r.to.contains(&d) && !r.shape.is_empty())
            })
            .collect();
        Ok(Self {
            destinations,
            routes: built,
            redactor: None,
            shaped,
        })
    }

    /// Whether any filter, transform or headers expression (or a start
    /// time) applies on the way to destination `d`.
    pub fn shapes(&self, d: usize) -> bool {
        self.shaped.get(d).copied().unwrap_or(false)
    }

    /// What destination `d` gets of `m` (see [`crate::shape::shape`]): the
    /// destination's expressions, then those of the routes that send `m`'s
    /// event type there, in configuration order; at most `steps` steps per
    /// expression.
    pub fn shape(&self, d: usize, m: &Message, steps: u64) -> Shaped {
        let destination = &self.destinations[d];
        let owner = if destination.name == DEFAULT_DESTINATION && self.destinations.len() == 1 {
            "sink".to_owned()
        } else {
            format!("destinations.{}", destination.name)
        };
        if destination.start_at().is_some_and(|t| m.created_at < t) {
            return Shaped::Filtered {
                by: format!("{owner}.start"),
            };
        }
        let routes: Vec<(&str, &Shape)> = self
            .routes
            .iter()
            .filter(|r| r.to.contains(&d) && r.patterns.iter().any(|p| p.matches(&m.event_type)))
            .map(|r| (r.name.as_str(), &r.shape))
            .collect();
        crate::shape::shape(m, &owner, &destination.shape, &routes, steps)
    }

    /// What every destination makes of `m`, in the order of
    /// [`Router::destinations`], without sending anything (`postbox route
    /// test`, the console's event page): `None` for a destination no route
    /// sends `m`'s event type to, else its [`Shaped`] answer, computed on
    /// the evaluator's threads as the relay computes it. `None` as a whole
    /// when no evaluator thread runs.
    pub async fn preview(self: &Arc<Self>, m: Message, steps: u64) -> Option<Vec<Option<Shaped>>> {
        let router = self.clone();
        crate::shape::on_pool(move || {
            let targets = router.targets(&m.event_type);
            (0..router.destinations.len())
                .map(|d| targets.contains(&d).then(|| router.shape(d, &m, steps)))
                .collect()
        })
        .await
    }

    /// For destination `d` alone, what each of `messages` becomes (`None`:
    /// its routes do not take that event type), on the evaluator's threads;
    /// `None` when they could not be started. For `postbox replay`.
    pub async fn shape_for(
        self: &Arc<Self>,
        d: usize,
        messages: Arc<Vec<Message>>,
        steps: u64,
    ) -> Option<Vec<Option<Shaped>>> {
        let router = self.clone();
        crate::shape::on_pool(move || {
            messages
                .iter()
                .map(|m| {
                    router
                        .targets(&m.event_type)
                        .contains(&d)
                        .then(|| router.shape(d, m, steps))
                })
                .collect()
        })
        .await
    }

    /// Make every route ordered (`postbox relay --ordered`) with `poison` as
    /// the policy of routes that were not ordered already.
    pub fn all_ordered(mut self, poison: PoisonPolicy) -> Self {
        for r in &mut self.routes {
            if !r.ordered {
                r.ordered = true;
                r.poison = poison;
            }
        }
        self
    }

    pub fn destinations(&self) -> &[Destination] {
        &self.destinations
    }

    /// Indices of the destinations `event_type` goes to (empty: no route).
    pub fn targets(&self, event_type: &str) -> Vec<usize> {
        let mut out = Vec::new();
        for r in &self.routes {
            if r.patterns.iter().any(|p| p.matches(event_type)) {
                for &d in &r.to {
                    if !out.contains(&d) {
                        out.push(d);
                    }
                }
            }
        }
        out
    }

    /// Whether `event_type` is ordered (some matching route is) and, if so,
    /// its poison policy: `Block` when any matching ordered route blocks.
    pub fn ordering(&self, event_type: &str) -> Option<PoisonPolicy> {
        let mut policy = None;
        for r in self.routes.iter().filter(|r| r.ordered) {
            if r.patterns.iter().any(|p| p.matches(event_type)) {
                if r.poison == PoisonPolicy::Block {
                    return Some(PoisonPolicy::Block);
                }
                policy = Some(PoisonPolicy::Skip);
            }
        }
        policy
    }

    /// The ordered claim's patterns, or `None` when no route is ordered (the
    /// relay then claims with the plain, fastest query).
    pub fn claim_order(&self) -> Option<ClaimOrder> {
        let mut order = ClaimOrder::default();
        for r in self.routes.iter().filter(|r| r.ordered) {
            for p in &r.patterns {
                order.ordered.push(p.like());
                if r.poison == PoisonPolicy::Block {
                    order.blocking.push(p.like());
                }
            }
        }
        (!order.ordered.is_empty()).then_some(order)
    }

    /// `name → description` of every destination, for logs.
    pub fn describe(&self) -> String {
        self.destinations
            .iter()
            .map(|d| format!("{}={}", d.name, d.sink.describe()))
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// How one outcome at one destination is settled: the budget and backoff that
/// apply to it.
#[derive(Clone, Copy, Debug)]
pub struct RetryPolicy {
    pub max_attempts: i32,
    pub backoff_base: Duration,
    pub backoff_max: Duration,
}

impl RetryPolicy {
    /// The delay before attempt `attempt + 1` after a retry outcome.
    pub fn delay(&self, attempt: i32, after: Option<Duration>) -> Duration {
        after
            .unwrap_or_else(|| {
                crate::backoff::full_jitter(attempt, self.backoff_base, self.backoff_max)
            })
            .min(self.backoff_max)
    }
}

/// One claimed batch as the router sees it: which messages go to which
/// destination this round, given what earlier rounds already did.
pub struct Round {
    /// Per message: its destinations.
    targets: Vec<Vec<usize>>,
    /// Per message: the stored state of each of its destinations, by index in
    /// `targets[i]` (`None`: no row, never attempted there as a fan-out).
    prior: Vec<Vec<Option<DeliveryState>>>,
    /// Per destination: indices of the messages to publish there now.
    pub batches: Vec<Vec<usize>>,
}

impl Round {
    /// Plan a round. `states` are the stored per-destination rows of the
    /// claimed events (`ids` parallel to `event_types`).
    pub fn plan(
        router: &Router,
        ids: &[i64],
        event_types: &[&str],
        states: Vec<DeliveryState>,
    ) -> Self {
        let mut by_event: HashMap<i64, Vec<DeliveryState>> = HashMap::new();
        for s in states {
            by_event.entry(s.outbox_id).or_default().push(s);
        }
        let mut batches = vec![Vec::new(); router.destinations.len()];
        let mut targets = Vec::with_capacity(ids.len());
        let mut prior = Vec::with_capacity(ids.len());
        for (i, (id, event_type)) in ids.iter().zip(event_types).enumerate() {
            let t = router.targets(event_type);
            let mut rows = by_event.remove(id).unwrap_or_default();
            let p: Vec<Option<DeliveryState>> = t
                .iter()
                .map(|&d| {
                    let name = &router.destinations[d].name;
                    rows.iter()
                        .position(|s| &s.destination == name)
                        .map(|k| rows.swap_remove(k))
                })
                .collect();
            for (&d, state) in t.iter().zip(&p) {
                let publish = match state {
                    None => true,
                    Some(s) => s.status == Status::Pending && s.due_in.is_zero(),
                };
                if publish {
                    batches[d].push(i);
                }
            }
            targets.push(t);
            prior.push(p);
        }
        Self {
            targets,
            prior,
            batches,
        }
    }

    /// Whether message `i` needs per-destination bookkeeping (several
    /// destinations, or rows from earlier rounds).
    fn tracked(&self, i: usize) -> bool {
        self.targets[i].len() > 1 || self.prior[i].iter().any(Option::is_some)
    }

    /// Combine the outcomes of every destination (`results[d]` parallel to
    /// `batches[d]`) into one outcome per event plus the per-destination rows
    /// to record. Returns `(outcomes, budgets, updates)`: an event outcome's
    /// budget is `policy.max_attempts` for a single-destination event and
    /// unlimited for a fan-out event (its destinations count their own).
    pub fn combine(
        &self,
        router: &Router,
        ids: &[i64],
        event_types: &[&str],
        results: Vec<Vec<Outcome>>,
        policy: &RetryPolicy,
    ) -> (Vec<Outcome>, Vec<i32>, Vec<DeliveryUpdate>) {
        let n = self.targets.len();
        // this_round[i][k]: the outcome at targets[i][k], if published now.
        let mut this_round: Vec<Vec<Option<Outcome>>> =
            self.targets.iter().map(|t| vec![None; t.len()]).collect();
        for (d, (batch, outcomes)) in self.batches.iter().zip(results).enumerate() {
            for (&i, outcome) in batch.iter().zip(outcomes) {
                if let Some(k) = self.targets[i].iter().position(|&x| x == d) {
                    this_round[i][k] = Some(outcome);
                }
            }
        }
        let mut outcomes = Vec::with_capacity(n);
        let mut budgets = Vec::with_capacity(n);
        let mut updates = Vec::new();
        for i in 0..n {
            if self.targets[i].is_empty() {
                outcomes.push(Outcome::reject(format!(
                    "no route matches event type {:?}; add a route and replay the event",
                    event_types[i]
                )));
                budgets.push(policy.max_attempts);
                continue;
            }
            if !self.tracked(i) {
                let outcome = this_round[i][0]
                    .take()
                    .unwrap_or_else(|| Outcome::retry("not published"));
                outcomes.push(outcome);
                budgets.push(policy.max_attempts);
                continue;
            }
            let mut pending: Option<Duration> = None;
            let mut errors = Vec::new();
            let mut all_sent = true;
            let mut mine = Vec::new();
            for (k, &d) in self.targets[i].iter().enumerate() {
                let name = &router.destinations[d].name;
                let prior = self.prior[i][k].as_ref();
                let attempts = prior.map_or(0, |s| s.attempts) + 1;
                match this_round[i][k].take() {
                    Some(Outcome::Delivered) => mine.push(DeliveryUpdate {
                        outbox_id: ids[i],
                        destination: name.clone(),
                        delivered: true,
                        dead: false,
                        attempts,
                        delay: Duration::ZERO,
                        error: None,
                    }),
                    Some(Outcome::Retry { error, after }) => {
                        let error = crate::redact::sanitize_error(&error);
                        let dead = attempts >= policy.max_attempts;
                        let delay = policy.delay(attempts, after);
                        all_sent = false;
                        if !dead {
                            pending = Some(pending.map_or(delay, |p| p.min(delay)));
                        }
                        errors.push(format!("{name}: {error}"));
                        mine.push(DeliveryUpdate {
                            outbox_id: ids[i],
                            destination: name.clone(),
                            delivered: false,
                            dead,
                            attempts,
                            delay,
                            error: Some(error),
                        });
                    }
                    Some(Outcome::Deferred { reason, after }) => {
                        // Not tried: no attempt counted, never dead.
                        let delay = after.unwrap_or(policy.backoff_base).min(policy.backoff_max);
                        all_sent = false;
                        pending = Some(pending.map_or(delay, |p| p.min(delay)));
                        mine.push(DeliveryUpdate {
                            outbox_id: ids[i],
                            destination: name.clone(),
                            delivered: false,
                            dead: false,
                            attempts: attempts - 1,
                            delay,
                            error: Some(crate::redact::sanitize_error(&reason)),
                        });
                    }
                    Some(Outcome::Reject { error }) => {
                        let error = crate::redact::sanitize_error(&error);
                        all_sent = false;
                        errors.push(format!("{name}: {error}"));
                        mine.push(DeliveryUpdate {
                            outbox_id: ids[i],
                            destination: name.clone(),
                            delivered: false,
                            dead: true,
                            attempts,
                            delay: Duration::ZERO,
                            error: Some(error),
                        });
                    }
                    None => match prior.map(|s| s.status) {
                        Some(Status::Sent) => {}
                        Some(Status::Failed) => {
                            all_sent = false;
                            errors.push(format!("{name}: dead letter"));
                        }
                        _ => {
                            all_sent = false;
                            let due = prior.map_or(Duration::ZERO, |s| s.due_in);
                            pending = Some(pending.map_or(due, |p| p.min(due)));
                        }
                    },
                }
            }
            let had_rows = self.prior[i].iter().any(Option::is_some);
            if all_sent {
                outcomes.push(Outcome::Delivered);
                if had_rows {
                    updates.extend(mine);
                }
            } else {
                updates.extend(mine);
                let error = if errors.is_empty() {
                    "waiting for a destination's retry".to_owned()
                } else {
                    errors.join("; ")
                };
                outcomes.push(match pending {
                    Some(after) => Outcome::Retry {
                        error,
                        after: Some(after),
                    },
                    None => Outcome::reject(error),
                });
            }
            budgets.push(i32::MAX);
        }
        (outcomes, budgets, updates)
    }

    /// Events whose stored state must be loaded before planning: every
    /// fan-out event (an earlier round, or a replay that reset its attempts,
    /// may have left rows). Single-destination events need none.
    pub fn needs_state(router: &Router, event_types: &[&str]) -> Vec<usize> {
        event_types
            .iter()
            .enumerate()
            .filter(|(_, t)| router.targets(t).len() > 1)
            .map(|(i, _)| i)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_like_their_sql_form() {
        let cases = [
            ("order.*", "order.created", true),
            ("order.*", "order.", true),
            ("order.*", "orders.created", false),
            ("*", "anything.at.all", true),
            ("*.created", "invoice.created", true),
            ("*.created", "invoice.created.v2", false),
            ("order.?", "order.x", true),
            ("order.?", "order.xy", false),
            ("a*b*c", "aXXbYYc", true),
            ("a*b*c", "aXXbYY", false),
            ("exact", "exact", true),
            ("exact", "exactly", false),
        ];
        for (p, t, want) in cases {
            assert_eq!(Pattern::parse(p).unwrap().matches(t), want, "{p} vs {t}");
        }
        assert_eq!(Pattern::parse("a_b%c*?").unwrap().like(), "a\\_b\\%c%_");
        assert!(Pattern::parse("").is_err());
        assert!(Pattern::parse("a\nb").is_err());
    }

    struct Nothing;
    #[async_trait::async_trait]
    impl Sink for Nothing {
        async fn publish(&self, batch: &[crate::Message]) -> Vec<Outcome> {
            vec![Outcome::Delivered; batch.len()]
        }
        async fn check(&self) -> Result<(), crate::SinkError> {
            Ok(())
        }
        fn describe(&self) -> String {
            "nothing".into()
        }
    }

    fn dest(name: &str) -> Destination {
        Destination::new(name, Arc::new(Nothing))
    }

    fn route(matches: &[&str], to: &[&str]) -> RouteConfig {
        RouteConfig {
            matches: matches.iter().map(|s| s.to_string()).collect(),
            to: to.iter().map(|s| s.to_string()).collect(),
            ..RouteConfig::default()
        }
    }

    #[test]
    fn a_route_s_expression_that_does_not_compile_names_its_field() {
        let mut r = route(&["*"], &["a"]);
        r.transform = Some("{a: .payload.".into());
        let err = Router::new(vec![dest("a")], &[route(&["x"], &["a"]), r])
            .err()
            .unwrap();
        assert_eq!(err.field, "routes[1].transform");
        assert!(err.reason.starts_with("at line 1, column"), "{err}");
    }

    #[test]
    fn routes_are_validated_with_the_field_named() {
        let err = Router::new(vec![dest("a")], &[route(&["*"], &["b"])])
            .err()
            .unwrap();
        assert_eq!(err.field, "routes[0].to");
        assert!(err.reason.contains("\"b\""), "{err}");
        let err = Router::new(vec![dest("a"), dest("a")], &[route(&["*"], &["a"])])
            .err()
            .unwrap();
        assert_eq!(err.field, "destinations.a");
        let err = Router::new(vec![dest("bad name")], &[route(&["*"], &["a"])])
            .err()
            .unwrap();
        assert_eq!(err.field, "destinations.bad name");
        let err = Router::new(vec![dest("a")], &[route(&[], &["a"])])
            .err()
            .unwrap();
        assert_eq!(err.field, "routes[0].match");
        let err = Router::new(vec![dest("a")], &[]).err().unwrap();
        assert_eq!(err.field, "routes");
    }

    #[test]
    fn targets_are_the_union_of_matching_routes() {
        let mut ordered = route(&["order.*"], &["a"]);
        ordered.ordered = true;
        ordered.poison = PoisonPolicy::Skip;
        let r = Router::new(
            vec![dest("a"), dest("b"), dest("c")],
            &[
                ordered,
                route(&["order.created", "invoice.*"], &["b", "a"]),
                route(&["audit.*"], &["c"]),
            ],
        )
        .unwrap();
        assert_eq!(r.targets("order.created"), vec![0, 1]);
        assert_eq!(r.targets("order.shipped"), vec![0]);
        assert_eq!(r.targets("invoice.paid"), vec![1, 0]);
        assert!(r.targets("user.created").is_empty());
        let order = r.claim_order().unwrap();
        assert_eq!(order.ordered, vec!["order.%"]);
        assert!(order.blocking.is_empty());
        let all = r.all_ordered(PoisonPolicy::Block).claim_order().unwrap();
        assert_eq!(all.ordered.len(), 4);
        assert_eq!(
            all.blocking.len(),
            3,
            "the route ordered before keeps its skip"
        );
    }

    fn state(id: i64, dest: &str, status: &str, attempts: i32, due_in: u64) -> DeliveryState {
        DeliveryState {
            outbox_id: id,
            destination: dest.into(),
            status: status.parse().unwrap(),
            attempts,
            due_in: Duration::from_secs(due_in),
        }
    }

    const POLICY: RetryPolicy = RetryPolicy {
        max_attempts: 3,
        backoff_base: Duration::from_secs(1),
        backoff_max: Duration::from_secs(60),
    };

    #[test]
    fn a_fan_out_round_publishes_only_where_due_and_not_done() {
        let r = Router::new(
            vec![dest("a"), dest("b"), dest("c")],
            &[route(&["*"], &["a", "b", "c"])],
        )
        .unwrap();
        let ids = [1, 2];
        let types = ["x", "x"];
        let round = Round::plan(
            &r,
            &ids,
            &types,
            vec![
                state(1, "a", "sent", 1, 0),
                state(1, "b", "pending", 1, 0),
                state(1, "c", "pending", 1, 30),
            ],
        );
        assert_eq!(round.batches, vec![vec![1], vec![0, 1], vec![1]]);
        let results = vec![
            vec![Outcome::Delivered],
            vec![Outcome::retry("boom"), Outcome::Delivered],
            vec![Outcome::Delivered],
        ];
        let (outcomes, budgets, updates) = round.combine(&r, &ids, &types, results, &POLICY);
        // Event 1: b failed again (attempt 2), c still waits 30 s: retry after min(delay_b, 30 s).
        match &outcomes[0] {
            Outcome::Retry { error, after } => {
                assert!(error.contains("b: boom"), "{error}");
                assert!(after.unwrap() <= Duration::from_secs(30));
            }
            other => panic!("{other:?}"),
        }
        // Event 2: delivered everywhere at once: no rows needed.
        assert_eq!(outcomes[1], Outcome::Delivered);
        assert_eq!(budgets, vec![i32::MAX, i32::MAX]);
        assert_eq!(updates.len(), 1);
        assert_eq!(
            (
                updates[0].outbox_id,
                updates[0].destination.as_str(),
                updates[0].attempts
            ),
            (1, "b", 2)
        );
        assert!(!updates[0].delivered && !updates[0].dead);
    }

    #[test]
    fn a_destination_out_of_attempts_dead_letters_once_the_others_are_done() {
        let r = Router::new(vec![dest("a"), dest("b")], &[route(&["*"], &["a", "b"])]).unwrap();
        let round = Round::plan(
            &r,
            &[7],
            &["x"],
            vec![state(7, "a", "sent", 1, 0), state(7, "b", "pending", 2, 0)],
        );
        let (outcomes, _, updates) = round.combine(
            &r,
            &[7],
            &["x"],
            vec![vec![], vec![Outcome::retry("down")]],
            &POLICY,
        );
        assert!(matches!(&outcomes[0], Outcome::Reject { error } if error.contains("b: down")));
        assert!(updates[0].dead);
        // A first round where one destination rejects and the other is fine.
        let round = Round::plan(&r, &[8], &["x"], vec![]);
        let (outcomes, _, updates) = round.combine(
            &r,
            &[8],
            &["x"],
            vec![vec![Outcome::Delivered], vec![Outcome::reject("HTTP 410")]],
            &POLICY,
        );
        assert!(matches!(&outcomes[0], Outcome::Reject { .. }));
        assert_eq!(
            updates.len(),
            2,
            "both destinations recorded: a must not be repeated on replay"
        );
        // No route: a dead letter that says so.
        let r = Router::new(vec![dest("a")], &[route(&["order.*"], &["a"])]).unwrap();
        let round = Round::plan(&r, &[9], &["user.created"], vec![]);
        let (outcomes, budgets, _) =
            round.combine(&r, &[9], &["user.created"], vec![vec![]], &POLICY);
        assert!(matches!(&outcomes[0], Outcome::Reject { error } if error.contains("no route")));
        assert_eq!(budgets, vec![3]);
    }
}
