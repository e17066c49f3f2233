//! The direct evaluator: the common shapes of filters and transforms,
//! evaluated on the event's JSON text without building jq values.
//!
//! Most expressions users write pick fields, compare them with constants and
//! build a smaller object: `.payload.currency == "EUR"`, `{order:
//! .payload.order_id, items: [.payload.items[] | {sku, qty}]}`,
//! `.payload | del(.card)`. Run by jaq, each such expression first turns the
//! whole event into jq values and then allocates at every step; here it is
//! compiled once into a [`Plan`] that reads only the fields it names, straight
//! from the payload's text, and writes its output as JSON text.
//!
//! A plan covers a subset of jq ([`Plan::compile`] says which); an
//! expression outside it has no plan and runs on jaq alone. A plan gives an
//! answer only where it is sure to be jq's: wherever jq would raise an error
//! (indexing a number, iterating `null`), compare containers, or meet input
//! it does not handle (duplicate keys, output over the bounds), the plan
//! answers `None` and the caller runs jaq on the same event, so the error
//! (and its message) is jaq's. The answers are the same JSON values as
//! jaq's (a unit test compares the two on generated events); scalars are
//! copied as the producer wrote them (`1.50` stays `1.50`, `"\u00e9"`
//! stays escaped), spacing is removed.
//!
//! Nothing here loops over anything but the event's own arrays and objects,
//! so a plan needs no step budget.

use super::bounds::{MAX_DEPTH, MAX_OUTPUT_BYTES};
use crate::sink::Message;
use chrono::SecondsFormat;
use jaq_core::load::lex::StrPart;
use jaq_core::load::parse::{BinaryOp, Term};
use jaq_core::ops::Cmp;
use jaq_core::path::{Opt, Part};
use serde::de::{DeserializeSeed, Deserializer, MapAccess, Visitor};
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::cmp::Ordering;
use std::collections::BTreeMap;

/// A compiled expression of the covered subset.
#[derive(Clone, Debug)]
pub(crate) struct Plan(Node);

#[derive(Clone, Debug)]
enum Node {
    /// `.`
    Id,
    /// A constant scalar.
    Lit(Scalar<'static>),
    /// `f.key`
    Get(Box<Node>, Box<str>),
    /// `f[]` (arrays only; anything else falls back)
    Each(Box<Node>),
    /// `f | g`
    Pipe(Box<Node>, Box<Node>),
    /// `{key: f, …}`: keys written as JSON text, values single.
    Obj(Vec<(Box<str>, Node)>),
    /// `[f]`
    Arr(Option<Box<Node>>),
    Cmp(Cmp, Box<Node>, Box<Node>),
    And(Box<Node>, Box<Node>),
    Or(Box<Node>, Box<Node>),
    /// `f // g`
    Alt(Box<Node>, Box<Node>),
    /// `not`
    Not,
    /// `startswith("…")`, `endswith("…")`
    Starts(Box<str>),
    Ends(Box<str>),
    /// `tostring`
    ToString,
    /// `del(.a, .b)`
    Del(Vec<Box<str>>),
    /// `f + {…}` where `f` is an object (merging, the right side wins)
    Merge(Box<Node>, Box<Node>),
}

impl Node {
    /// Whether a merge (`f + {…}`, only evaluated at the top of a
    /// headers expression) is in the node.
    fn merges(&self) -> bool {
        match self {
            Node::Merge(..) => true,
            Node::Get(f, _) | Node::Each(f) | Node::Arr(Some(f)) => f.merges(),
            Node::Pipe(f, g)
            | Node::Cmp(_, f, g)
            | Node::And(f, g)
            | Node::Or(f, g)
            | Node::Alt(f, g) => f.merges() || g.merges(),
            Node::Obj(entries) => entries.iter().any(|(_, f)| f.merges()),
            _ => false,
        }
    }

    /// Whether the node yields exactly one value (or an error) per input.
    fn single(&self) -> bool {
        match self {
            Node::Each(_) => false,
            Node::Get(f, _) => f.single(),
            Node::Pipe(f, g) => f.single() && g.single(),
            _ => true,
        }
    }
}

/// A JSON scalar, as jq compares them.
#[derive(Clone, Debug)]
enum Scalar<'a> {
    Null,
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(Cow<'a, str>),
}

impl Scalar<'_> {
    /// jq's order of kinds: null < false < true < numbers < strings.
    fn rank(&self) -> u8 {
        match self {
            Scalar::Null => 0,
            Scalar::Bool(false) => 1,
            Scalar::Bool(true) => 2,
            Scalar::Int(_) | Scalar::Float(_) => 3,
            Scalar::Str(_) => 4,
        }
    }

    /// jq's order; `None` where this evaluator is not sure of it (an
    /// integer too large for a double to hold exactly, against a double).
    fn compare(&self, other: &Scalar<'_>) -> Option<Ordering> {
        const EXACT: i64 = 1 << 53;
        match (self, other) {
            (Scalar::Int(a), Scalar::Int(b)) => Some(a.cmp(b)),
            (Scalar::Int(i), Scalar::Float(f)) if i.abs() <= EXACT => (*i as f64).partial_cmp(f),
            (Scalar::Float(f), Scalar::Int(i)) if i.abs() <= EXACT => f.partial_cmp(&(*i as f64)),
            (Scalar::Float(a), Scalar::Float(b)) => a.partial_cmp(b),
            (Scalar::Int(_), Scalar::Float(_)) | (Scalar::Float(_), Scalar::Int(_)) => None,
            (Scalar::Str(a), Scalar::Str(b)) => Some(a.as_bytes().cmp(b.as_bytes())),
            (a, b) => Some(a.rank().cmp(&b.rank())),
        }
    }
}

/// A number's text as a scalar (`None`: not one this evaluator handles).
fn number(text: &str) -> Option<Scalar<'static>> {
    if text.bytes().any(|b| matches!(b, b'.' | b'e' | b'E')) {
        let f: f64 = text.parse().ok()?;
        f.is_finite().then_some(Scalar::Float(f))
    } else {
        text.parse().ok().map(Scalar::Int)
    }
}

/// A value met while evaluating: a part of the event, or one the plan made.
#[derive(Clone, Debug)]
enum V<'a> {
    /// The event as jq sees it (see [`super::input`]).
    Event,
    /// The event's headers.
    Headers,
    /// A part of the payload, as its JSON text.
    Raw(&'a RawValue),
    Scalar(Scalar<'a>),
    /// An object or array the plan built, as compact JSON text, and how
    /// deep it nests.
    Made(String, usize),
}

impl<'a> V<'a> {
    fn text(&self) -> Option<&'a str> {
        match self {
            V::Raw(raw) => Some(raw.get().trim_start()),
            _ => None,
        }
    }

    /// The value as a scalar (`None` for containers).
    fn scalar(&self) -> Option<Scalar<'a>> {
        match self {
            V::Scalar(s) => Some(s.clone()),
            V::Raw(_) => {
                let text = self.text()?;
                match text.as_bytes().first()? {
                    b'n' => Some(Scalar::Null),
                    b't' => Some(Scalar::Bool(true)),
                    b'f' => Some(Scalar::Bool(false)),
                    b'"' => {
                        let s = match serde_json::from_str::<&str>(text) {
                            Ok(s) => Cow::Borrowed(s),
                            Err(_) => Cow::Owned(serde_json::from_str::<String>(text).ok()?),
                        };
                        Some(Scalar::Str(s))
                    }
                    b'-' | b'0'..=b'9' => number(text.trim_end()),
                    _ => None,
                }
            }
            _ => None,
        }
    }

    /// jq's truth: anything but `null` and `false`.
    fn truthy(&self) -> bool {
        match self {
            V::Scalar(Scalar::Null | Scalar::Bool(false)) => false,
            V::Raw(raw) => !matches!(raw.get().trim_start().as_bytes().first(), Some(b'n' | b'f')),
            _ => true,
        }
    }
}

/// An object's entries, borrowed from its text where its keys have no
/// escapes.
struct Entries<'a>(Vec<(Cow<'a, str>, &'a RawValue)>);

struct Key;

impl<'de> DeserializeSeed<'de> for Key {
    type Value = Cow<'de, str>;
    fn deserialize<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        d.deserialize_str(Key)
    }
}

impl<'de> Visitor<'de> for Key {
    type Value = Cow<'de, str>;
    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a string")
    }
    fn visit_borrowed_str<E>(self, s: &'de str) -> Result<Self::Value, E> {
        Ok(Cow::Borrowed(s))
    }
    fn visit_str<E>(self, s: &str) -> Result<Self::Value, E> {
        Ok(Cow::Owned(s.to_owned()))
    }
}

impl<'de> serde::Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Each;
        impl<'de> Visitor<'de> for Each {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<M: MapAccess<'de>>(self, mut map: M) -> Result<Self::Value, M::Error> {
                let mut out = Vec::new();
                while let Some(key) = map.next_key_seed(Key)? {
                    out.push((key, map.next_value::<&'de RawValue>()?));
                }
                Ok(Entries(out))
            }
        }
        d.deserialize_map(Each)
    }
}

impl Entries<'_> {
    /// Whether two entries share a key (jq keeps the last; copying the
    /// text would keep both, so the plan does not).
    fn has_duplicates(&self) -> bool {
        let keys = &self.0;
        if keys.len() <= 16 {
            keys.iter()
                .enumerate()
                .any(|(i, (k, _))| keys[..i].iter().any(|(j, _)| j == k))
        } else {
            let mut seen = std::collections::HashSet::with_capacity(keys.len());
            keys.iter().any(|(k, _)| !seen.insert(k.as_ref()))
        }
    }
}

/// One evaluation: the event, and the objects of its payload already read.
struct Eval<'a> {
    m: &'a Message,
    read: Vec<(*const u8, std::rc::Rc<Entries<'a>>)>,
}

/// What the plan's caller does with one value: `None` stops and falls back.
type Sink<'s, 'a> = &'s mut dyn FnMut(&mut Eval<'a>, V<'a>) -> Option<()>;

impl<'a> Eval<'a> {
    fn entries(&mut self, raw: &'a RawValue) -> Option<std::rc::Rc<Entries<'a>>> {
        let at = raw.get().as_ptr();
        if let Some((_, e)) = self.read.iter().find(|(p, _)| *p == at) {
            return Some(e.clone());
        }
        let e = std::rc::Rc::new(serde_json::from_str::<Entries<'a>>(raw.get()).ok()?);
        self.read.push((at, e.clone()));
        Some(e)
    }

    /// `v.key`, as jq: `null` for a missing key or a `null` input; anything
    /// but an object or `null` is jq's error, so `None`.
    fn get(&mut self, v: V<'a>, key: &str) -> Option<V<'a>> {
        let m = self.m;
        let s = |s: &'a str| Some(V::Scalar(Scalar::Str(Cow::Borrowed(s))));
        match v {
            V::Event => match key {
                "id" => Some(V::Scalar(Scalar::Str(Cow::Owned(
                    m.event_id.hyphenated().to_string(),
                )))),
                "event_type" => s(&m.event_type),
                "aggregate_type" => s(&m.aggregate_type),
                "aggregate_id" => s(&m.aggregate_id),
                "sequence" => Some(V::Scalar(m.sequence.map_or(Scalar::Null, Scalar::Int))),
                "schema_version" => Some(V::Scalar(Scalar::Int(m.schema_version.into()))),
                "created_at" => Some(V::Scalar(Scalar::Str(Cow::Owned(
                    m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
                )))),
                "headers" => Some(V::Headers),
                "payload" => Some(V::Raw(&m.payload)),
                _ => Some(V::Scalar(Scalar::Null)),
            },
            V::Headers => Some(m.headers.get(key).map_or(V::Scalar(Scalar::Null), |v| {
                V::Scalar(Scalar::Str(Cow::Borrowed(v)))
            })),
            V::Scalar(Scalar::Null) => Some(V::Scalar(Scalar::Null)),
            V::Raw(raw) => match raw.get().trim_start().as_bytes().first()? {
                b'n' => Some(V::Scalar(Scalar::Null)),
                b'{' => {
                    let entries = self.entries(raw)?;
                    let found = entries.0.iter().rev().find(|(k, _)| k == key);
                    Some(found.map_or(V::Scalar(Scalar::Null), |(_, v)| V::Raw(v)))
                }
                _ => None,
            },
            _ => None,
        }
    }

    /// Every value `node` yields for `input`, to `out`.
    fn run(&mut self, node: &Node, input: V<'a>, out: Sink<'_, 'a>) -> Option<()> {
        match node {
            Node::Each(f) => self.run(f, input, &mut |ev, v| {
                let text = v.text()?;
                if !text.starts_with('[') {
                    return None;
                }
                for item in serde_json::from_str::<Vec<&'a RawValue>>(text).ok()? {
                    out(ev, V::Raw(item))?;
                }
                Some(())
            }),
            Node::Get(f, key) => self.run(f, input, &mut |ev, v| {
                let got = ev.get(v, key)?;
                out(ev, got)
            }),
            Node::Pipe(f, g) => self.run(f, input, &mut |ev, v| ev.run(g, v, out)),
            _ => {
                let v = self.one(node, input)?;
                out(self, v)
            }
        }
    }

    /// The one value a single node yields for `input`.
    fn one(&mut self, node: &Node, input: V<'a>) -> Option<V<'a>> {
        match node {
            Node::Id => Some(input),
            Node::Lit(s) => Some(V::Scalar(s.clone())),
            Node::Get(f, key) => {
                let v = self.one(f, input)?;
                self.get(v, key)
            }
            Node::Pipe(f, g) => {
                let v = self.one(f, input)?;
                self.one(g, v)
            }
            Node::Each(_) => None,
            Node::Obj(entries) => {
                let (mut text, mut height) = (String::from("{"), 0);
                for (i, (key, f)) in entries.iter().enumerate() {
                    if i > 0 {
                        text.push(',');
                    }
                    text.push_str(key);
                    text.push(':');
                    let v = self.one(f, input.clone())?;
                    height = height.max(self.write(&mut text, &v, 1)?);
                }
                text.push('}');
                Some(V::Made(text, height + 1))
            }
            Node::Arr(None) => Some(V::Made("[]".into(), 1)),
            Node::Arr(Some(f)) => {
                let (mut text, mut height) = (String::from("["), 0);
                let mut first = true;
                self.run(f, input, &mut |ev, v| {
                    if !std::mem::take(&mut first) {
                        text.push(',');
                    }
                    height = height.max(ev.write(&mut text, &v, 1)?);
                    Some(())
                })?;
                text.push(']');
                Some(V::Made(text, height + 1))
            }
            Node::Cmp(op, f, g) => {
                let a = self.one(f, input.clone())?.scalar()?;
                let b = self.one(g, input)?.scalar()?;
                let order = a.compare(&b)?;
                Some(V::Scalar(Scalar::Bool(match op {
                    Cmp::Eq => order.is_eq(),
                    Cmp::Ne => order.is_ne(),
                    Cmp::Lt => order.is_lt(),
                    Cmp::Le => order.is_le(),
                    Cmp::Gt => order.is_gt(),
                    Cmp::Ge => order.is_ge(),
                })))
            }
            Node::And(f, g) => {
                let yes = self.one(f, input.clone())?.truthy() && self.one(g, input)?.truthy();
                Some(V::Scalar(Scalar::Bool(yes)))
            }
            Node::Or(f, g) => {
                let yes = self.one(f, input.clone())?.truthy() || self.one(g, input)?.truthy();
                Some(V::Scalar(Scalar::Bool(yes)))
            }
            Node::Alt(f, g) => {
                let v = self.one(f, input.clone())?;
                if v.truthy() {
                    Some(v)
                } else {
                    self.one(g, input)
                }
            }
            Node::Not => Some(V::Scalar(Scalar::Bool(!input.truthy()))),
            Node::Starts(s) | Node::Ends(s) => match input.scalar()? {
                Scalar::Str(text) => Some(V::Scalar(Scalar::Bool(
                    if matches!(node, Node::Starts(_)) {
                        text.starts_with(&**s)
                    } else {
                        text.ends_with(&**s)
                    },
                ))),
                _ => None,
            },
            Node::ToString => match input.scalar()? {
                s @ Scalar::Str(_) => Some(V::Scalar(s)),
                Scalar::Int(i) => Some(V::Scalar(Scalar::Str(Cow::Owned(i.to_string())))),
                Scalar::Null => Some(V::Scalar(Scalar::Str(Cow::Borrowed("null")))),
                Scalar::Bool(b) => Some(V::Scalar(Scalar::Str(Cow::Borrowed(if b {
                    "true"
                } else {
                    "false"
                })))),
                Scalar::Float(_) => None,
            },
            Node::Del(keys) => {
                let raw = match input {
                    V::Scalar(Scalar::Null) => return Some(input),
                    V::Raw(raw) if raw.get().trim_start().starts_with('{') => raw,
                    _ => return None,
                };
                let entries = self.entries(raw)?;
                if entries.has_duplicates() {
                    return None;
                }
                let (mut text, mut height) = (String::from("{"), 0);
                let mut first = true;
                for (k, v) in entries
                    .0
                    .iter()
                    .filter(|(k, _)| !keys.iter().any(|d| **d == **k))
                {
                    if !std::mem::take(&mut first) {
                        text.push(',');
                    }
                    write_str(&mut text, k);
                    text.push(':');
                    height = height.max(self.write(&mut text, &V::Raw(v), 1)?);
                }
                text.push('}');
                Some(V::Made(text, height + 1))
            }
            // Only for headers (see [`Plan::headers`]).
            Node::Merge(..) => None,
        }
    }

    /// `v` as compact JSON at nesting `depth` (how many containers hold
    /// it), and how deep `v` itself nests; `None` where jq would write
    /// another value (duplicate keys) or fail (the output's bounds).
    fn write(&mut self, out: &mut String, v: &V<'a>, depth: usize) -> Option<usize> {
        let height = match v {
            V::Event => return None,
            V::Headers => {
                out.push('{');
                for (i, (k, v)) in self.m.headers.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_str(out, k);
                    out.push(':');
                    write_str(out, v);
                }
                out.push('}');
                1
            }
            V::Made(text, height) => {
                out.push_str(text);
                *height
            }
            V::Scalar(s) => {
                write_scalar(out, s);
                0
            }
            V::Raw(raw) => {
                let text = raw.get().trim();
                match text.as_bytes().first()? {
                    b'{' => {
                        let entries = self.entries(raw)?;
                        if entries.has_duplicates() {
                            return None;
                        }
                        let mut height = 0;
                        out.push('{');
                        for (i, (k, v)) in entries.0.iter().enumerate() {
                            if i > 0 {
                                out.push(',');
                            }
                            write_str(out, k);
                            out.push(':');
                            height = height.max(self.write(out, &V::Raw(v), depth + 1)?);
                        }
                        out.push('}');
                        height + 1
                    }
                    b'[' => {
                        let mut height = 0;
                        out.push('[');
                        let items = serde_json::from_str::<Vec<&'a RawValue>>(text).ok()?;
                        for (i, item) in items.into_iter().enumerate() {
                            if i > 0 {
                                out.push(',');
                            }
                            height = height.max(self.write(out, &V::Raw(item), depth + 1)?);
                        }
                        out.push(']');
                        height + 1
                    }
                    b'-' | b'0'..=b'9' => {
                        // jq writes numbers it reads; one a double cannot hold
                        // (1e400) it writes otherwise.
                        number(text)?;
                        out.push_str(text);
                        0
                    }
                    _ => {
                        out.push_str(text);
                        0
                    }
                }
            }
        };
        (depth + height <= MAX_DEPTH && out.len() <= MAX_OUTPUT_BYTES).then_some(height)
    }
}

fn write_str(out: &mut String, s: &str) {
    // Serializing a string into JSON cannot fail.
    if let Ok(quoted) = serde_json::to_string(s) {
        out.push_str(&quoted);
    }
}

fn write_scalar(out: &mut String, s: &Scalar<'_>) {
    match s {
        Scalar::Null => out.push_str("null"),
        Scalar::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Scalar::Int(i) => out.push_str(&i.to_string()),
        Scalar::Float(f) => out.push_str(
            &serde_json::Number::from_f64(*f).map_or_else(|| "null".to_owned(), |n| n.to_string()),
        ),
        Scalar::Str(s) => write_str(out, s),
    }
}

/// A string literal without interpolation.
fn literal(term: &Term<&str>) -> Option<String> {
    let Term::Str(None, parts) = term else {
        return None;
    };
    let mut s = String::new();
    for part in parts {
        match part {
            StrPart::Str(text) => s.push_str(text),
            StrPart::Char(c) => s.push(*c),
            StrPart::Term(_) => return None,
        }
    }
    Some(s)
}

/// `.a` (one key of the input), as in `del(.a)`.
fn top_key(term: &Term<&str>) -> Option<Box<str>> {
    match term {
        Term::Path(head, path) if matches!(**head, Term::Id) => match path.0.as_slice() {
            [(Part::Index(key), Opt::Essential)] => literal(key).map(Into::into),
            _ => None,
        },
        _ => None,
    }
}

fn keys_of(term: &Term<&str>, out: &mut Vec<Box<str>>) -> Option<()> {
    match term {
        Term::BinOp(l, BinaryOp::Comma, r) => {
            keys_of(l, out)?;
            keys_of(r, out)
        }
        t => {
            out.push(top_key(t)?);
            Some(())
        }
    }
}

fn single(node: Node) -> Option<Box<Node>> {
    node.single().then(|| Box::new(node))
}

fn node(term: &Term<&str>) -> Option<Node> {
    Some(match term {
        Term::Id => Node::Id,
        Term::Num(text) => Node::Lit(number(text)?),
        Term::Neg(t) => match &**t {
            Term::Num(text) => Node::Lit(match number(text)? {
                Scalar::Int(i) => Scalar::Int(-i),
                Scalar::Float(f) => Scalar::Float(-f),
                _ => return None,
            }),
            _ => return None,
        },
        Term::Str(..) => Node::Lit(Scalar::Str(Cow::Owned(literal(term)?))),
        Term::Arr(None) => Node::Arr(None),
        Term::Arr(Some(t)) => Node::Arr(Some(Box::new(node(t)?))),
        Term::Obj(entries) => {
            let mut out: Vec<(Box<str>, Node)> = Vec::with_capacity(entries.len());
            for (key, value) in entries {
                let name = literal(key)?;
                let value = match value {
                    Some(v) => *single(node(v)?)?,
                    None => Node::Get(Box::new(Node::Id), name.clone().into()),
                };
                let key: Box<str> = serde_json::to_string(&name).ok()?.into();
                if out.iter().any(|(k, _)| *k == key) {
                    return None;
                }
                out.push((key, value));
            }
            Node::Obj(out)
        }
        Term::BinOp(l, op, r) => {
            let (l, r) = (node(l)?, node(r)?);
            match op {
                BinaryOp::Pipe(None) => Node::Pipe(Box::new(l), Box::new(r)),
                BinaryOp::And => Node::And(single(l)?, single(r)?),
                BinaryOp::Or => Node::Or(single(l)?, single(r)?),
                BinaryOp::Alt => Node::Alt(single(l)?, single(r)?),
                BinaryOp::Cmp(c) => Node::Cmp(*c, single(l)?, single(r)?),
                BinaryOp::Math(jaq_core::ops::Math::Add) if matches!(r, Node::Obj(_)) => {
                    Node::Merge(single(l)?, Box::new(r))
                }
                _ => return None,
            }
        }
        Term::Call(name, args) => match (*name, args.as_slice()) {
            ("true", []) => Node::Lit(Scalar::Bool(true)),
            ("false", []) => Node::Lit(Scalar::Bool(false)),
            ("null", []) => Node::Lit(Scalar::Null),
            ("not", []) => Node::Not,
            ("tostring", []) => Node::ToString,
            ("startswith", [s]) => Node::Starts(literal(s)?.into()),
            ("endswith", [s]) => Node::Ends(literal(s)?.into()),
            ("map", [f]) => Node::Arr(Some(Box::new(Node::Pipe(
                Box::new(Node::Each(Box::new(Node::Id))),
                Box::new(node(f)?),
            )))),
            ("del", [paths]) => {
                let mut keys = Vec::new();
                keys_of(paths, &mut keys)?;
                Node::Del(keys)
            }
            _ => return None,
        },
        Term::Path(head, path) => {
            let mut at = node(head)?;
            for (part, opt) in &path.0 {
                if !matches!(opt, Opt::Essential) {
                    return None;
                }
                at = match part {
                    Part::Index(key) => Node::Get(Box::new(at), literal(key)?.into()),
                    Part::Range(None, None) => Node::Each(Box::new(at)),
                    Part::Range(..) => return None,
                };
            }
            at
        }
        _ => return None,
    })
}

impl Plan {
    /// The plan of `code` when the whole expression is in the subset:
    /// `.`, paths of keys (`.a.b`, `.["a"]`), `[]` over arrays, literals,
    /// `|`, `{…}` with constant keys (and `{a}` for `{a: .a}`), `[…]`,
    /// comparisons, `and`, `or`, `//`, `not`, `startswith`, `endswith`,
    /// `tostring`, `map`, `del` of keys of the input, and (for headers)
    /// `f + {…}`. Functions defined in the expression, variables, `?`,
    /// slices, indices, arithmetic, string interpolation and everything else
    /// leave it to jaq.
    pub(crate) fn compile(code: &str) -> Option<Plan> {
        let term = jaq_core::load::parse(code, |p| p.term())?;
        let node = node(&term)?;
        (node.single() && !node.merges()).then_some(Plan(node))
    }

    /// The same for a headers expression, where the top may also be
    /// `f + {…}` (the event's headers and some more).
    pub(crate) fn compile_headers(code: &str) -> Option<Plan> {
        fn top(node: &Node) -> bool {
            match node {
                Node::Merge(l, r) => top(l) && top(r),
                node => !node.merges(),
            }
        }
        let term = jaq_core::load::parse(code, |p| p.term())?;
        let node = node(&term)?;
        (node.single() && top(&node)).then_some(Plan(node))
    }

    /// The filter's verdict on `m` (`None`: ask jaq).
    #[cfg(test)]
    pub(crate) fn test(&self, m: &Message) -> Option<bool> {
        self.test_in(&mut Reading::new(m))
    }

    /// The transform's output for `m`, as JSON text (`None`: ask jaq).
    #[cfg(test)]
    pub(crate) fn json(&self, m: &Message) -> Option<String> {
        self.json_in(&mut Reading::new(m))
    }

    /// The headers expression's output for `m` (see [`Plan::headers_in`]).
    #[cfg(test)]
    pub(crate) fn headers(&self, m: &Message) -> Option<BTreeMap<String, String>> {
        self.headers_in(&mut Reading::new(m))
    }

    /// [`Plan::test`] of the event `reading` reads.
    pub(crate) fn test_in(&self, reading: &mut Reading<'_>) -> Option<bool> {
        Some(reading.0.one(&self.0, V::Event)?.truthy())
    }

    /// [`Plan::json`] of the event `reading` reads.
    pub(crate) fn json_in(&self, reading: &mut Reading<'_>) -> Option<String> {
        let ev = &mut reading.0;
        let v = ev.one(&self.0, V::Event)?;
        let mut out = String::new();
        ev.write(&mut out, &v, 0)?;
        Some(out)
    }

    /// The headers expression's output for the event `reading` reads
    /// (`None`: ask jaq): an object of strings; `null` values leave the
    /// header out, as with jaq.
    pub(crate) fn headers_in(&self, reading: &mut Reading<'_>) -> Option<BTreeMap<String, String>> {
        fn fill<'a>(
            ev: &mut Eval<'a>,
            node: &Node,
            out: &mut BTreeMap<String, Option<String>>,
        ) -> Option<()> {
            match node {
                Node::Merge(l, r) => {
                    fill(ev, l, out)?;
                    fill(ev, r, out)
                }
                Node::Obj(entries) => {
                    for (key, f) in entries {
                        let name: String = serde_json::from_str(key).ok()?;
                        let value = match ev.one(f, V::Event)?.scalar()? {
                            Scalar::Str(s) => Some(s.into_owned()),
                            Scalar::Null => None,
                            _ => return None,
                        };
                        out.insert(name, value);
                    }
                    Some(())
                }
                node => match ev.one(node, V::Event)? {
                    V::Headers => {
                        out.extend(
                            ev.m.headers
                                .iter()
                                .map(|(k, v)| (k.clone(), Some(v.clone()))),
                        );
                        Some(())
                    }
                    _ => None,
                },
            }
        }
        let mut out = BTreeMap::new();
        fill(&mut reading.0, &self.0, &mut out)?;
        let mut headers = BTreeMap::new();
        for (name, value) in out {
            let Some(value) = value else { continue };
            if !super::header_name_ok(&name) || value.chars().any(|c| c.is_control() && c != '\t') {
                return None;
            }
            headers.insert(name, value);
        }
        Some(headers)
    }
}

/// One event as the plans read it: the objects of its payload that one
/// plan parsed are there for the next (a destination's filter, then its
/// transform and headers, read the payload once).
pub(crate) struct Reading<'a>(Eval<'a>);

impl<'a> Reading<'a> {
    pub(crate) fn new(m: &'a Message) -> Self {
        Reading(Eval {
            m,
            read: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    //! The direct evaluator against jaq: wherever a plan answers, its
    //! answer is jaq's (the same JSON value), on generated events.
    use super::super::reference::normal;
    use super::super::{expr, headers_of, input, Expr};
    use super::*;
    use proptest::prelude::*;

    const FILTERS: [&str; 9] = [
        r#".event_type == "order.created" and .payload.currency == "EUR""#,
        r#".payload.total >= 1000 and .headers.region == "eu""#,
        r#"(.payload.priority // "normal") == "high""#,
        r#".event_type | startswith("order.") and (endswith(".draft") | not)"#,
        r#".payload.a == null or .payload.total < 1.5"#,
        r#".payload.a != .payload.b"#,
        r#".payload.customer > "m""#,
        r#".payload.items"#,
        r#".sequence >= 2 and .schema_version == 1"#,
    ];

    const TRANSFORMS: [&str; 10] = [
        "{order: .payload.order_id, customer: .payload.customer, amount_cents: .payload.total_cents, items: [.payload.items[] | {sku, qty}]}",
        ".payload | del(.card)",
        ".payload | del(.card, .note)",
        ".payload.items | map({sku, qty})",
        "[.payload.items[] | .sku]",
        ".payload",
        "{id, type: .event_type, at: .created_at, h: .headers, n: null, t: true, x: 1.5, y: -2}",
        "{a: {b: {c: .payload.customer}}}",
        ".payload.customer // .payload.total",
        "{t: .payload.total, a: .aggregate_id, s: .sequence}",
    ];

    const HEADERS: [&str; 3] = [
        r#"{"x-event-type": .event_type, "x-sequence": (.sequence | tostring)}"#,
        r#".headers + {"x-tenant": .payload.customer, "x-none": null}"#,
        r#"{"x-total": (.payload.total | tostring), "region": .headers.region}"#,
    ];

    fn message(payload: String, region: &str, sequence: Option<i64>) -> Message {
        Message {
            event_id: uuid::Uuid::from_u128(0x0190_0000_0000_7000_8000_0000_0000_0001),
            event_type: "order.created".into(),
            aggregate_type: "order".into(),
            aggregate_id: "42".into(),
            schema_version: 1,
            payload: RawValue::from_string(payload).unwrap(),
            headers: BTreeMap::from([
                ("region".into(), region.into()),
                ("tenant".into(), "acme".into()),
            ]),
            created_at: chrono::DateTime::UNIX_EPOCH,
            attempt: 1,
            sequence,
            source: None,
        }
    }

    fn same_json(a: &str, b: &str) -> bool {
        let parse = |t: &str| serde_json::from_str::<serde_json::Value>(t).map(normal);
        matches!((parse(a), parse(b)), (Ok(x), Ok(y)) if x == y)
    }

    /// Checks every expression on `m`; counts the plan's answers.
    fn check(m: &Message) -> usize {
        let jaq = input(m);
        let mut answered = 0;
        let run = |e: &Expr| jaq.clone().and_then(|i| e.first(&i, 100_000));
        for code in FILTERS {
            let e = Expr::compile(code).unwrap();
            let plan = e.plan().unwrap_or_else(|| panic!("no plan for {code}"));
            if let Some(ours) = plan.test(m) {
                let theirs = run(&e).map(|v| v.as_ref().is_some_and(expr::truthy));
                assert_eq!(Ok(ours), theirs, "{code} on {}", m.payload.get());
                answered += 1;
            }
        }
        for code in TRANSFORMS {
            let e = Expr::compile(code).unwrap();
            let plan = e.plan().unwrap_or_else(|| panic!("no plan for {code}"));
            if let Some(ours) = plan.json(m) {
                let theirs = run(&e).and_then(|v| expr::to_json(&v.unwrap()));
                let theirs = theirs.unwrap_or_else(|f| {
                    panic!(
                        "{code} on {}: jaq failed ({f}), the plan gave {ours}",
                        m.payload.get()
                    )
                });
                assert!(
                    same_json(&ours, &theirs),
                    "{code} on {}: {ours} against jaq's {theirs}",
                    m.payload.get()
                );
                answered += 1;
            }
        }
        for code in HEADERS {
            let e = Expr::compile(code).unwrap().for_headers();
            let plan = e.plan().unwrap_or_else(|| panic!("no plan for {code}"));
            if let Some(ours) = plan.headers(m) {
                let theirs = run(&e).and_then(|v| headers_of(&v.unwrap()));
                assert_eq!(Ok(ours), theirs, "{code} on {}", m.payload.get());
                answered += 1;
            }
        }
        // One reading of the event for every expression, as a destination's
        // filter, transform and headers share it: the same answers as a
        // reading of its own for each.
        let mut shared = Reading::new(m);
        for code in FILTERS {
            let plan = Expr::compile(code).unwrap().plan().cloned().unwrap();
            assert_eq!(plan.test_in(&mut shared), plan.test(m), "{code}");
        }
        for code in TRANSFORMS {
            let plan = Expr::compile(code).unwrap().plan().cloned().unwrap();
            assert_eq!(plan.json_in(&mut shared), plan.json(m), "{code}");
        }
        for code in HEADERS {
            let e = Expr::compile(code).unwrap().for_headers();
            let plan = e.plan().cloned().unwrap();
            assert_eq!(plan.headers_in(&mut shared), plan.headers(m), "{code}");
        }
        answered
    }

    fn json() -> impl Strategy<Value = serde_json::Value> {
        use serde_json::{json, Value};
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i32>().prop_map(|i| json!(i)),
            any::<i64>().prop_map(|i| json!(i)),
            (-1e6f64..1e6).prop_map(|f| json!(f)),
            prop::sample::select(vec!["EUR", "high", "", "é\"\\\n", "order.created", "zz"])
                .prop_map(|s| json!(s)),
        ];
        let keys = prop::sample::select(vec![
            "a",
            "b",
            "total",
            "currency",
            "items",
            "sku",
            "qty",
            "card",
            "customer",
            "id",
            "priority",
            "note",
            "order_id",
            "total_cents",
            "x y",
            "é",
        ]);
        leaf.prop_recursive(4, 40, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::vec((keys.clone(), inner), 0..7).prop_map(|kv| Value::Object(
                    kv.into_iter().map(|(k, v)| (k.to_owned(), v)).collect()
                )),
            ]
        })
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(400))]
        #[test]
        fn the_plan_answers_as_jaq_does(
            payload in json(),
            pretty in any::<bool>(),
            region in prop::sample::select(vec!["eu", "us"]),
            sequence in prop::option::of(0i64..5),
        ) {
            let text = if pretty {
                serde_json::to_string_pretty(&payload).unwrap()
            } else {
                serde_json::to_string(&payload).unwrap()
            };
            check(&message(text, region, sequence));
        }
    }

    #[test]
    fn the_plan_answers_for_typical_events_and_steps_aside_where_jq_fails() {
        let typical = r#"{"order_id": 7, "customer": "c-1", "currency": "EUR", "total": 2500,
            "total_cents": 250000, "items": [{"sku": "S-1", "qty": 2, "x": 1}], "card": "4111",
            "note": "n", "priority": "high", "a": null, "b": 1.50}"#;
        let m = message(typical.into(), "eu", Some(3));
        assert_eq!(check(&m), FILTERS.len() + TRANSFORMS.len() + HEADERS.len());
        let plan = Plan::compile(TRANSFORMS[0]).unwrap();
        assert_eq!(
            plan.json(&m).unwrap(),
            r#"{"order":7,"customer":"c-1","amount_cents":250000,"items":[{"sku":"S-1","qty":2}]}"#
        );
        // Where jq raises an error, or the text is not what jaq would read,
        // the plan gives no answer.
        for (payload, code) in [
            (r#"{"items": 3}"#, "[.payload.items[] | .sku]"),
            (r#"{"items": [1]}"#, "[.payload.items[] | .sku]"),
            (
                r#"{"customer": {"id": 1}}"#,
                r#".payload.customer.id.x == 1"#,
            ),
            (r#"{"card": 1, "card": 2}"#, ".payload | del(.note)"),
            (r#"{"total": 12345678901234567890}"#, ".payload.total"),
            (r#"{"total": [1]}"#, ".payload.total > 1"),
            (
                r#"{"total": 9007199254740993}"#,
                ".payload.total == 9007199254740992.0",
            ),
        ] {
            let m = message(payload.into(), "eu", None);
            let plan = Plan::compile(code).unwrap();
            assert!(plan.json(&m).is_none(), "{code} on {payload}");
        }
        // A value nested deeper than the output may be is left to jaq.
        let deep = format!("{}1{}", "[".repeat(100), "]".repeat(100));
        let m = message(deep, "eu", None);
        let wrap = format!("{}.payload{}", "[".repeat(40), "]".repeat(40));
        assert!(Plan::compile(&wrap).unwrap().json(&m).is_none());
        assert!(Plan::compile("[[.payload]]").unwrap().json(&m).is_some());
    }

    #[test]
    fn expressions_outside_the_subset_have_no_plan() {
        for code in [
            ".payload.items[]",
            ".payload.total * 100 | round",
            r#""\(.aggregate_type)/\(.aggregate_id)""#,
            "def f: .; f",
            ".payload.a?",
            ".payload.items[0]",
            ".payload as $p | $p",
            ".payload | .customer.email = \"redacted\"",
            ".payload + {a: 1}",
            "{(.event_type): 1}",
        ] {
            assert!(Plan::compile(code).is_none(), "{code}");
        }
        assert!(Plan::compile_headers(".headers + {a: .event_type}").is_some());
    }
}
