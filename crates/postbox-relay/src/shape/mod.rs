//! Filters and transforms: what a destination gets of an event.
//!
//! A route and a destination may each carry up to three jq expressions
//! ([`Shape`]), all of which see the same input, the event as an object
//! ([`input`]):
//!
//! - `filter` — the event goes to the destination only when its first
//!   output is true (anything but `false` and `null`; no output is false);
//! - `transform` — its first output is the payload the destination
//!   receives (the CloudEvents `data`; the rest of the envelope, the event
//!   id above all, stays);
//! - `headers` — its first output, an object of strings, is the set of
//!   headers the destination receives instead of the producer's.
//!
//! On the way to one destination ([`shape`]), the destination's own filter
//! applies first; then the routes that send the event there, in the order
//! of the configuration: the first whose filter passes (or that has none)
//! carries it, with its transform and headers, or the destination's where
//! it has none. When every such route's filter says no, the destination
//! does not get the event. An expression that fails on an event makes it a
//! dead letter of that destination only ([`Shaped::Failed`]).
//!
//! **Boundary:** this module imports nothing of the engine, the modes, the
//! tasks, the router or the tenants layer (`.ci/layers`); the router holds
//! the compiled shapes, and the engine's publish path runs them on the
//! evaluator's threads ([`pool`]).

mod bounds;
pub mod expr;
mod fast;
pub(crate) mod pool;
#[cfg(test)]
mod reference;

use crate::config::ConfigError;
use crate::sink::Message;
use chrono::SecondsFormat;
pub use expr::{CompileError, Expr, Fault};
use jaq_json::Val;
use serde_json::value::RawValue;
use std::collections::BTreeMap;

pub use crate::config::DEFAULT_EXPRESSION_STEPS as DEFAULT_STEPS;

/// The expressions of one route or destination.
#[derive(Clone, Debug, Default)]
pub struct Shape {
    pub filter: Option<Expr>,
    pub transform: Option<Expr>,
    pub headers: Option<Expr>,
}

/// Which of a shape's expressions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Which {
    Filter,
    Transform,
    Headers,
}

impl Which {
    pub fn as_str(self) -> &'static str {
        match self {
            Which::Filter => "filter",
            Which::Transform => "transform",
            Which::Headers => "headers",
        }
    }
}

impl Shape {
    /// Compile the expressions of `owner` (`routes[2]`, `destinations.billing`);
    /// an error names the field and the position (`routes[2].filter: at line 1,
    /// column 9: …`).
    pub fn compile(
        owner: &str,
        filter: Option<&str>,
        transform: Option<&str>,
        headers: Option<&str>,
    ) -> Result<Self, ConfigError> {
        let one = |which: Which, code: Option<&str>| -> Result<Option<Expr>, ConfigError> {
            code.map(|code| {
                Expr::compile(code).map_err(|e| {
                    ConfigError::new(format!("{owner}.{}", which.as_str()), e.to_string())
                })
            })
            .transpose()
        };
        Ok(Self {
            filter: one(Which::Filter, filter)?,
            transform: one(Which::Transform, transform)?,
            headers: one(Which::Headers, headers)?.map(Expr::for_headers),
        })
    }

    pub fn is_empty(&self) -> bool {
        self.filter.is_none() && self.transform.is_none() && self.headers.is_none()
    }
}

/// What the expressions make of one event for one destination.
#[derive(Clone, Debug)]
pub enum Shaped {
    /// Send it: with this payload and these headers where an expression
    /// made them (`None`: the event's own).
    Send {
        payload: Option<Box<RawValue>>,
        headers: Option<BTreeMap<String, String>>,
        /// The route or destination whose expressions shaped it, if any.
        by: Option<String>,
    },
    /// A filter said no: the destination does not get it.
    Filtered {
        /// The filter's owner (`destinations.NAME`, or the last route tried).
        by: String,
    },
    /// An expression failed on this event: a dead letter of the destination.
    Failed {
        /// `filter of routes[1]`, …
        expression: String,
        fault: Fault,
    },
}

impl Shaped {
    /// The error a dead letter keeps.
    pub fn error(&self) -> Option<String> {
        match self {
            Shaped::Failed { expression, fault } => Some(format!("{expression} failed: {fault}")),
            _ => None,
        }
    }
}

/// The object every expression reads: the event's fields by the names its
/// producer gave them.
///
/// ```json
/// {"id": "0190…", "event_type": "order.placed", "aggregate_type": "order",
///  "aggregate_id": "42", "sequence": 3, "schema_version": 1,
///  "created_at": "2026-12-04T10:00:00.000000Z", "headers": {…}, "payload": {…}}
/// ```
pub fn input(m: &Message) -> Result<Val, Fault> {
    let payload = expr::from_json(m.payload.get())?;
    let headers = Val::obj(
        m.headers
            .iter()
            .map(|(k, v)| (expr::string(k), expr::string(v)))
            .collect(),
    );
    Ok(expr::object([
        ("id", expr::string(&m.event_id.hyphenated().to_string())),
        ("event_type", expr::string(&m.event_type)),
        ("aggregate_type", expr::string(&m.aggregate_type)),
        ("aggregate_id", expr::string(&m.aggregate_id)),
        (
            "sequence",
            m.sequence.map_or(Val::Null, |s| Val::from(s as isize)),
        ),
        ("schema_version", Val::from(m.schema_version as isize)),
        (
            "created_at",
            expr::string(&m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true)),
        ),
        ("headers", headers),
        ("payload", payload),
    ]))
}

/// Whether a header name is one a transport can carry.
fn header_name_ok(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 255
        && name
            .bytes()
            .all(|b| b.is_ascii_graphic() && b != b':' && b != b'"')
}

fn headers_of(v: &Val) -> Result<BTreeMap<String, String>, Fault> {
    let not = || Fault::Output("is not an object of strings".into());
    let mut out = BTreeMap::new();
    for (k, v) in expr::entries(v).ok_or_else(not)? {
        let name = expr::as_string(k).ok_or_else(not)?;
        if !header_name_ok(&name) {
            return Err(Fault::Output(format!(
                "names a header {:?} that is not a valid header name",
                name.chars().take(64).collect::<String>()
            )));
        }
        match v {
            Val::Null => {}
            v => {
                let value = expr::as_string(v).ok_or_else(not)?;
                if value.chars().any(|c| c.is_control() && c != '\t') {
                    return Err(Fault::Output(format!(
                        "gives header {name:?} a value with control characters"
                    )));
                }
                out.insert(name, value);
            }
        }
    }
    Ok(out)
}

/// One event through the expressions on its way to one destination (see
/// the module's doc): `own` is the destination's shape (`owner` its name in
/// the configuration), `routes` the shapes of the routes that send this
/// event there, in configuration order, each with its name (`routes[1]`).
pub fn shape(
    m: &Message,
    owner: &str,
    own: &Shape,
    routes: &[(&str, &Shape)],
    steps: u64,
) -> Shaped {
    if own.is_empty() && routes.iter().all(|(_, s)| s.is_empty()) {
        return Shaped::Send {
            payload: None,
            headers: None,
            by: None,
        };
    }
    let failed = |which: Which, by: &str, fault: Fault| Shaped::Failed {
        expression: format!("{} of {by}", which.as_str()),
        fault,
    };
    // The event as jq's value, built only when an expression needs jaq
    // (the direct evaluator reads the event itself).
    let built = std::cell::OnceCell::new();
    let jaq_input = || {
        built
            .get_or_init(|| input(m))
            .as_ref()
            .map_err(Clone::clone)
    };
    // What the direct evaluator has parsed of the payload, for the next
    // expression of this event.
    let reading = std::cell::RefCell::new(fast::Reading::new(m));
    let passes = |e: &Expr| -> Result<bool, Fault> {
        if let Some(yes) = e.plan().and_then(|p| p.test_in(&mut reading.borrow_mut())) {
            return Ok(yes);
        }
        Ok(e.first(jaq_input()?, steps)?
            .as_ref()
            .is_some_and(expr::truthy))
    };
    if let Some(f) = &own.filter {
        match passes(f) {
            Ok(true) => {}
            Ok(false) => {
                return Shaped::Filtered {
                    by: owner.to_owned(),
                }
            }
            Err(fault) => return failed(Which::Filter, owner, fault),
        }
    }
    let mut carrier: Option<(&str, &Shape)> = None;
    for &(name, route) in routes {
        match route.filter.as_ref().map(passes) {
            None | Some(Ok(true)) => {
                carrier = Some((name, route));
                break;
            }
            Some(Ok(false)) => {}
            Some(Err(fault)) => return failed(Which::Filter, name, fault),
        }
    }
    let Some((route, carried)) = carrier.or(routes.is_empty().then_some((owner, own))) else {
        let by = routes.last().map_or(owner, |(name, _)| name).to_owned();
        return Shaped::Filtered { by };
    };
    // The route's transform and headers, else the destination's.
    let pick = |mine: &Option<Expr>, theirs: &Option<Expr>, name: &str| -> Option<(Expr, String)> {
        match (mine, theirs) {
            (Some(e), _) => Some((e.clone(), name.to_owned())),
            (None, Some(e)) => Some((e.clone(), owner.to_owned())),
            (None, None) => None,
        }
    };
    let mut by = None;
    let payload = match pick(&carried.transform, &own.transform, route) {
        None => None,
        Some((e, name)) => {
            let text = match e.plan().and_then(|p| p.json_in(&mut reading.borrow_mut())) {
                Some(text) => Ok(text),
                None => jaq_input()
                    .and_then(|input| e.first(input, steps))
                    .and_then(|v| v.ok_or_else(|| Fault::Output("is empty (no value)".into())))
                    .and_then(|v| expr::to_json(&v)),
            };
            let out = text.and_then(|text| {
                RawValue::from_string(text).map_err(|e| Fault::Output(format!("is not JSON: {e}")))
            });
            match out {
                Ok(p) => {
                    by = Some(name);
                    Some(p)
                }
                Err(fault) => return failed(Which::Transform, &name, fault),
            }
        }
    };
    let headers = match pick(&carried.headers, &own.headers, route) {
        None => None,
        Some((e, name)) => {
            let out = match e
                .plan()
                .and_then(|p| p.headers_in(&mut reading.borrow_mut()))
            {
                Some(headers) => Ok(headers),
                None => jaq_input()
                    .and_then(|input| e.first(input, steps))
                    .and_then(|v| v.ok_or_else(|| Fault::Output("is empty (no value)".into())))
                    .and_then(|v| headers_of(&v)),
            };
            match out {
                Ok(h) => {
                    by.get_or_insert(name);
                    Some(h)
                }
                Err(fault) => return failed(Which::Headers, &name, fault),
            }
        }
    };
    Shaped::Send {
        payload,
        headers,
        by,
    }
}

/// `m` as a destination receives it after [`Shaped::Send`]: with the
/// payload and headers the expressions made, where they made them.
pub fn reshaped(
    m: &Message,
    payload: Option<Box<RawValue>>,
    headers: Option<BTreeMap<String, String>>,
) -> Message {
    Message {
        event_id: m.event_id,
        event_type: m.event_type.clone(),
        aggregate_type: m.aggregate_type.clone(),
        aggregate_id: m.aggregate_id.clone(),
        schema_version: m.schema_version,
        payload: payload.unwrap_or_else(|| m.payload.clone()),
        headers: headers.unwrap_or_else(|| m.headers.clone()),
        created_at: m.created_at,
        attempt: m.attempt,
        sequence: m.sequence,
        source: m.source.clone(),
    }
}

/// The fewest items a batch is split into per evaluator thread: below
/// this, handing work to another thread costs more than it saves.
const MIN_CHUNK: usize = 64;

/// `f` over `items` on the evaluator's threads, the batch split between
/// them (one chunk per thread, of at least [`MIN_CHUNK`] items), answers in
/// the order of `items`; `None` when the evaluator did not answer.
pub(crate) async fn map_on_pool<I, T, F>(mut items: Vec<I>, f: F) -> Option<Vec<T>>
where
    I: Send + 'static,
    T: Send + 'static,
    F: Fn(&I) -> T + Send + Sync + 'static,
{
    let n = items.len();
    let chunk = n.div_ceil(pool::threads().max(1)).max(MIN_CHUNK);
    let f = std::sync::Arc::new(f);
    let mut jobs = Vec::with_capacity(n.div_ceil(chunk));
    while !items.is_empty() {
        let rest = items.split_off(chunk.min(items.len()));
        let part = std::mem::replace(&mut items, rest);
        let f = f.clone();
        jobs.push(pool::run(move || {
            part.iter().map(|i| f(i)).collect::<Vec<T>>()
        }));
    }
    let mut out = Vec::with_capacity(n);
    for part in futures::future::join_all(jobs).await {
        out.extend(part?);
    }
    Some(out)
}

/// Run [`shape`] for a batch on the evaluator's threads (`None` when they
/// could not be started).
pub(crate) async fn on_pool<T, F>(f: F) -> Option<T>
where
    T: Send + 'static,
    F: FnOnce() -> T + Send + 'static,
{
    pool::run(f).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(payload: &str) -> Message {
        Message {
            event_id: uuid::Uuid::nil(),
            event_type: "order.placed".into(),
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            schema_version: 1,
            payload: RawValue::from_string(payload.into()).unwrap(),
            headers: BTreeMap::from([("tenant".into(), "acme".into())]),
            created_at: chrono::DateTime::UNIX_EPOCH,
            attempt: 1,
            sequence: Some(3),
            source: None,
        }
    }

    fn shape_of(filter: Option<&str>, transform: Option<&str>, headers: Option<&str>) -> Shape {
        Shape::compile("t", filter, transform, headers).unwrap()
    }

    #[test]
    fn the_first_route_whose_filter_passes_carries_the_event() {
        let m = message(r#"{"total": 2500, "card": "4111"}"#);
        let own = shape_of(None, Some(".payload | del(.card)"), None);
        let big = shape_of(Some(".payload.total > 10000"), Some("\"big\""), None);
        let any = shape_of(
            None,
            None,
            Some(".headers + {\"x-sequence\": (.sequence | tostring)}"),
        );
        match shape(
            &m,
            "destinations.d",
            &own,
            &[("routes[0]", &big), ("routes[1]", &any)],
            1000,
        ) {
            Shaped::Send {
                payload, headers, ..
            } => {
                assert_eq!(payload.unwrap().get(), r#"{"total":2500}"#);
                let h = headers.unwrap();
                assert_eq!(h["x-sequence"], "3");
                assert_eq!(h["tenant"], "acme");
            }
            other => panic!("{other:?}"),
        }
        // No route's filter passes: not sent.
        assert!(matches!(
            shape(&m, "destinations.d", &own, &[("routes[0]", &big)], 1000),
            Shaped::Filtered { by } if by == "routes[0]"
        ));
        // The destination's filter comes first.
        let strict = shape_of(Some(".aggregate_id == \"7\""), None, None);
        assert!(matches!(
            shape(&m, "destinations.d", &strict, &[("routes[1]", &any)], 1000),
            Shaped::Filtered { by } if by == "destinations.d"
        ));
    }

    #[test]
    fn a_failing_expression_names_itself() {
        let m = message(r#"{"total": "lots"}"#);
        let bad = shape_of(None, Some(".payload.total + 1"), None);
        let s = shape(
            &m,
            "destinations.d",
            &Shape::default(),
            &[("routes[4]", &bad)],
            1000,
        );
        let error = s.error().unwrap();
        assert!(
            error.starts_with("transform of routes[4] failed: "),
            "{error}"
        );
        let heads = shape_of(None, None, Some("{\"a\": 1}"));
        let s = shape(&m, "destinations.d", &heads, &[], 1000);
        assert!(
            s.error().unwrap().contains("headers of destinations.d"),
            "{s:?}"
        );
        let spin = shape_of(Some("last(repeat(1))"), None, None);
        let s = shape(&m, "destinations.d", &spin, &[], 1000);
        assert!(
            matches!(
                s,
                Shaped::Failed {
                    fault: Fault::Steps(1000),
                    ..
                }
            ),
            "{s:?}"
        );
    }
}
