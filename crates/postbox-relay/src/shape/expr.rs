//! jq expressions, run in-process by jaq in a sandbox.
//!
//! What an expression can do: read its input (the event), compute, and
//! yield values. What it cannot: read the environment (`env`, `$ENV`),
//! files (`import`, `include`, `input`, `inputs`), the clock (`now`), write
//! anything (`debug`, `stderr` are errors here) or end the process
//! (`halt`, `halt_error` are errors here). Every evaluation step costs one
//! unit of a per-event budget (`relay.expression_steps`); an evaluation that
//! spends it all, or recurses deeper than its thread's stack allows, stops
//! with a [`Fault`] instead of running on. `range/3` is redefined in jq so
//! that each number it yields costs steps too. A value is turned into JSON
//! only up to [`MAX_OUTPUT_BYTES`] and [`MAX_DEPTH`].
//!
//! What a budget does not cover: a single native operation that makes a huge
//! value from one number — `"x" * $n` with `$n` from the event — allocates
//! before the output bound sees it. Expressions are configuration; the book
//! says to bound such numbers in the expression.

use jaq_core::data::HasLut;
use jaq_core::load::{Arena, File, Loader};
use jaq_core::{Ctx, DataT, Lut, Native, Vars};
use jaq_json::Val;
use std::cell::Cell;
use std::sync::Arc;

pub use super::bounds::{MAX_DEPTH, MAX_OUTPUT_BYTES};
/// Stack an evaluation may use before it stops with [`Fault::Depth`] on the
/// evaluator's threads, which have [`super::pool::STACK_BYTES`].
pub(crate) const MAX_STACK_BYTES: usize = 192 << 20;
/// The same anywhere else (a runtime worker, a test's thread: 2 MiB stacks).
const OTHER_THREAD_STACK_BYTES: usize = 256 << 10;

thread_local! {
    /// Stack an evaluation on this thread may use.
    static STACK_ALLOWED: Cell<usize> = const { Cell::new(OTHER_THREAD_STACK_BYTES) };
}

/// Let evaluations on this thread use up to [`MAX_STACK_BYTES`] of stack
/// (the evaluator's threads, whose stacks are that large).
pub(crate) fn allow_deep_stack() {
    STACK_ALLOWED.with(|s| s.set(MAX_STACK_BYTES));
}

/// Natives left out: they read the world outside the event.
const LEFT_OUT: [&str; 5] = ["env", "now", "input", "inputs", "range"];
/// Natives that stay defined (the standard definitions call them) but fail.
const FAILING: [&str; 3] = ["halt", "debug_empty", "stderr_empty"];
/// `range/3` in jq, so that every number it yields costs steps (the native
/// one yields any count of numbers in one step). `[][]` yields nothing
/// (`empty` is defined after this).
const PRELUDE: &str = "def range($from; $upto; $by): \
    if ($by > 0 and $from < $upto) or ($by < 0 and $from > $upto) \
    then $from, range($from + $by; $upto; $by) else [][] end;";

/// A compiled jq program.
#[derive(Clone)]
pub struct Expr {
    code: Arc<str>,
    program: Arc<jaq_core::Filter<Metered>>,
    /// The direct evaluator's plan, when the expression is in its subset.
    plan: Option<Arc<super::fast::Plan>>,
}

impl std::fmt::Debug for Expr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Expr").field(&self.code).finish()
    }
}

/// An expression that does not compile: where, and why.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("at line {line}, column {column}: {message}")]
pub struct CompileError {
    /// 1-based.
    pub line: usize,
    /// 1-based, in characters.
    pub column: usize,
    pub message: String,
}

/// Why an evaluation gave no result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Fault {
    /// The expression raised an error (`error(…)`, a wrong type, …).
    #[error("{0}")]
    Error(String),
    /// It used its whole budget of steps.
    #[error("stopped after {0} steps (relay.expression_steps)")]
    Steps(u64),
    /// It recursed too deep.
    #[error("stopped: recursion too deep")]
    Depth,
    /// Its output is not JSON, or too large or too deep to be sent.
    #[error("its output {0}")]
    Output(String),
    /// The evaluator itself failed (a bug in it, never the event's fault).
    #[error("the expression evaluator failed")]
    Internal,
}

/// The marker an evaluation unwinds with when it must stop.
enum Stop {
    Steps,
    Depth,
}

/// jaq's data kind for postbox: values are `jaq_json::Val`, and every
/// evaluation step asks for the lookup table through [`Meter`], which
/// charges the step.
pub(crate) struct Metered;

impl DataT for Metered {
    type V<'a> = Val;
    type Data<'a> = Meter<'a>;
}

/// The budget of one evaluation, consulted at every step.
#[derive(Clone)]
pub(crate) struct Meter<'a> {
    lut: &'a Lut<Metered>,
    steps: &'a Cell<u64>,
    /// The address of a local of the evaluation's first frame: how deep the
    /// stack is, measured from there.
    base: usize,
    /// How deep it may go.
    allowed: usize,
}

fn stack_address() -> usize {
    let here = 0u8;
    std::hint::black_box(std::ptr::addr_of!(here)) as usize
}

impl<'a> HasLut<'a, Metered> for Meter<'a> {
    fn lut(&self) -> &'a Lut<Metered> {
        let left = self.steps.get();
        if left == 0 {
            std::panic::resume_unwind(Box::new(Stop::Steps));
        }
        self.steps.set(left - 1);
        if self.base.abs_diff(stack_address()) > self.allowed {
            std::panic::resume_unwind(Box::new(Stop::Depth));
        }
        self.lut
    }
}

fn failing_native() -> Native<Metered> {
    Native::new(|_cv| {
        jaq_core::box_iter::box_once(Err(jaq_core::Exn::from(jaq_core::Error::str(
            "not available in postbox expressions",
        ))))
    })
}

/// Line and column (1-based) of byte `offset` of `code`.
fn position(code: &str, offset: usize) -> (usize, usize) {
    let before = &code[..offset.min(code.len())];
    let line = before.matches('\n').count() + 1;
    let column = before.rsplit('\n').next().map_or(0, |l| l.chars().count()) + 1;
    (line, column)
}

/// Where `part`, a slice jaq took from `code`, starts (the end when it is
/// not one: an error at the end of the input).
fn offset_in(code: &str, part: &str) -> usize {
    let (start, at) = (code.as_ptr() as usize, part.as_ptr() as usize);
    if at >= start && at <= start + code.len() {
        at - start
    } else {
        code.len()
    }
}

fn compile_error(code: &str, part: &str, message: String) -> CompileError {
    let (line, column) = position(code, offset_in(code, part));
    CompileError {
        line,
        column,
        message,
    }
}

impl Expr {
    /// Compile `code`; an error says where and what.
    pub fn compile(code: &str) -> Result<Self, CompileError> {
        if code.trim().is_empty() {
            return Err(CompileError {
                line: 1,
                column: 1,
                message: "the expression is empty".into(),
            });
        }
        let prelude = jaq_core::load::parse(PRELUDE, |p| p.defs()).unwrap_or_default();
        let defs = prelude
            .into_iter()
            .chain(jaq_core::defs())
            .chain(jaq_std::defs())
            .chain(jaq_json::defs());
        let funs = jaq_core::funs::<Metered>()
            .chain(jaq_std::funs())
            .chain(jaq_json::funs())
            .filter(|(name, _, _)| !LEFT_OUT.contains(name))
            .map(|(name, args, native)| {
                if FAILING.contains(&name) {
                    (name, args, failing_native())
                } else {
                    (name, args, native)
                }
            });
        let arena = Arena::default();
        let modules = Loader::new(defs)
            .load(&arena, File { code, path: () })
            .map_err(|errors| {
                let Some((_, error)) = errors.into_iter().next() else {
                    return compile_error(code, "", "does not parse".into());
                };
                match error {
                    jaq_core::load::Error::Io(io) => {
                        let part = io.first().map_or("", |(p, _)| *p);
                        compile_error(
                            code,
                            part,
                            "modules (import, include) are not available".into(),
                        )
                    }
                    jaq_core::load::Error::Lex(lex) => {
                        let (expect, part) = lex
                            .into_iter()
                            .next()
                            .map_or(("token", ""), |(e, p)| (lex_expect(&e), p));
                        compile_error(code, part, format!("expected {expect}"))
                    }
                    jaq_core::load::Error::Parse(parse) => {
                        let (expect, found) = parse
                            .into_iter()
                            .next()
                            .map_or(("term", ""), |(e, found)| (e.as_str(), found));
                        let message = if found.is_empty() {
                            format!("expected {expect} at the end")
                        } else {
                            format!("expected {expect}, found {found:?}")
                        };
                        compile_error(code, found, message)
                    }
                }
            })?;
        let program = jaq_core::Compiler::default()
            .with_funs(funs)
            .compile(modules)
            .map_err(|errors| {
                let first = errors
                    .into_iter()
                    .find(|(file, _)| std::ptr::eq(file.code, code))
                    .and_then(|(_, errors)| errors.into_iter().next());
                match first {
                    Some((name, undefined)) => {
                        let what = undefined.as_str();
                        let hint = if LEFT_OUT.contains(&name) || name == "$ENV" {
                            " (expressions see only the event: no environment, input or clock)"
                        } else {
                            ""
                        };
                        compile_error(code, name, format!("undefined {what} {name}{hint}"))
                    }
                    None => compile_error(code, "", "does not compile".into()),
                }
            })?;
        Ok(Self {
            code: code.into(),
            program: Arc::new(program),
            plan: super::fast::Plan::compile(code).map(Arc::new),
        })
    }

    /// The same expression, planned as a headers expression (whose top may
    /// also be `.headers + {…}`).
    pub(crate) fn for_headers(mut self) -> Self {
        self.plan = super::fast::Plan::compile_headers(&self.code).map(Arc::new);
        self
    }

    /// The direct evaluator's plan (see [`super::fast`]), if it has one.
    pub(crate) fn plan(&self) -> Option<&super::fast::Plan> {
        self.plan.as_deref()
    }

    /// Whether the expression runs on the direct evaluator (it falls back
    /// to jaq, per event, wherever jq would raise an error).
    pub fn is_direct(&self) -> bool {
        self.plan.is_some()
    }

    /// The expression's text, as configured.
    pub fn code(&self) -> &str {
        &self.code
    }

    /// The first value the expression yields for `input` (`None`: it yields
    /// nothing), within `steps` evaluation steps.
    pub(crate) fn first(&self, input: &Val, steps: u64) -> Result<Option<Val>, Fault> {
        let budget = Cell::new(steps);
        let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let meter = Meter {
                lut: &self.program.lut,
                steps: &budget,
                base: stack_address(),
                allowed: STACK_ALLOWED.with(Cell::get),
            };
            let ctx = Ctx::<Metered>::new(meter, Vars::new([]));
            let mut out = self.program.id.run((ctx, input.clone()));
            match out.next() {
                None => Ok(None),
                Some(Ok(v)) => Ok(Some(v)),
                Some(Err(exn)) => match exn.get_err() {
                    Ok(error) => Err(Fault::Error(error.to_string())),
                    Err(_) => Err(Fault::Error("the expression stopped".into())),
                },
            }
        }));
        match run {
            Ok(result) => result,
            Err(stop) => Err(match stop.downcast_ref::<Stop>() {
                Some(Stop::Steps) => Fault::Steps(steps),
                Some(Stop::Depth) => Fault::Depth,
                None => Fault::Internal,
            }),
        }
    }
}

fn lex_expect(e: &jaq_core::load::lex::Expect<&str>) -> &'static str {
    use jaq_core::load::lex::Expect;
    match e {
        Expect::Delim("(") => "a closing parenthesis",
        Expect::Delim("[") => "a closing bracket",
        Expect::Delim("{") => "a closing brace",
        Expect::Delim(_) => "a closing quote",
        Expect::Digit => "a digit",
        Expect::Ident => "an identifier",
        Expect::Escape => "a string escape sequence",
        Expect::Unicode => "a 4-digit hexadecimal code point",
        _ => "a token",
    }
}

/// jq's truth: anything but `false` and `null`.
pub(crate) fn truthy(v: &Val) -> bool {
    !matches!(v, Val::Null | Val::Bool(false))
}

/// A JSON text as a jq value (serde_json's parser, with its nesting limit).
pub(crate) fn from_json(text: &str) -> Result<Val, Fault> {
    serde_json::from_str(text).map_err(|e| Fault::Error(format!("the input is not JSON: {e}")))
}

/// A jq value as JSON text: numbers that are not finite as jq writes them
/// (NaN as null, ±infinity as the largest finite number), text strings
/// as UTF-8 (invalid bytes replaced); byte strings and non-string object
/// keys are not JSON and fail, as do outputs over [`MAX_OUTPUT_BYTES`] or
/// nested deeper than [`MAX_DEPTH`].
pub(crate) fn to_json(v: &Val) -> Result<String, Fault> {
    let mut out = String::new();
    write_json(&mut out, v, 0)?;
    Ok(out)
}

fn write_json(out: &mut String, v: &Val, depth: usize) -> Result<(), Fault> {
    use std::fmt::Write as _;
    if out.len() > MAX_OUTPUT_BYTES {
        return Err(Fault::Output(format!(
            "is larger than {MAX_OUTPUT_BYTES} bytes"
        )));
    }
    match v {
        Val::Null => out.push_str("null"),
        Val::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Val::Num(n) => match n {
            jaq_json::Num::Float(x) if x.is_nan() => out.push_str("null"),
            jaq_json::Num::Float(x) if x.is_infinite() => {
                let max = if *x > 0.0 { f64::MAX } else { f64::MIN };
                let _ = write!(out, "{}", jaq_json::Num::Float(max));
            }
            n => {
                let _ = write!(out, "{n}");
            }
        },
        Val::TStr(s) => write_str(out, &String::from_utf8_lossy(s)),
        Val::BStr(_) => {
            return Err(Fault::Output(
                "holds a byte string, which is not JSON".into(),
            ))
        }
        Val::Arr(items) => {
            if depth >= MAX_DEPTH {
                return Err(Fault::Output(format!("is nested deeper than {MAX_DEPTH}")));
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_json(out, item, depth + 1)?;
            }
            out.push(']');
        }
        Val::Obj(map) => {
            if depth >= MAX_DEPTH {
                return Err(Fault::Output(format!("is nested deeper than {MAX_DEPTH}")));
            }
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                let Val::TStr(key) = k else {
                    return Err(Fault::Output(
                        "has an object key that is not a string".into(),
                    ));
                };
                write_str(out, &String::from_utf8_lossy(key));
                out.push(':');
                write_json(out, item, depth + 1)?;
            }
            out.push('}');
        }
    }
    Ok(())
}

fn write_str(out: &mut String, s: &str) {
    // Serializing a string into JSON cannot fail.
    if let Ok(quoted) = serde_json::to_string(s) {
        out.push_str(&quoted);
    }
}

/// A text as a jq string value.
pub(crate) fn string(s: &str) -> Val {
    Val::utf8_str(s.as_bytes().to_vec())
}

/// A jq value as text when it is a string.
pub(crate) fn as_string(v: &Val) -> Option<String> {
    match v {
        Val::TStr(s) => Some(String::from_utf8_lossy(s).into_owned()),
        _ => None,
    }
}

/// An object's entries, when `v` is one.
pub(crate) fn entries(v: &Val) -> Option<impl Iterator<Item = (&Val, &Val)>> {
    match v {
        Val::Obj(map) => Some(map.iter()),
        _ => None,
    }
}

/// An object from entries.
pub(crate) fn object(entries: impl IntoIterator<Item = (&'static str, Val)>) -> Val {
    Val::obj(
        entries
            .into_iter()
            .map(|(k, v)| (Val::utf8_str(bytes::Bytes::from_static(k.as_bytes())), v))
            .collect(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(code: &str, input: &str) -> Result<Option<String>, Fault> {
        let e = Expr::compile(code).unwrap_or_else(|e| panic!("{code}: {e}"));
        e.first(&from_json(input).unwrap(), 100_000)?
            .map(|v| to_json(&v))
            .transpose()
    }

    #[test]
    fn compiles_and_runs_what_the_book_shows() {
        let ev =
            r#"{"type":"order.placed","payload":{"total":2500,"card":"4111","items":["a","b"]}}"#;
        assert_eq!(
            run(r#".type == "order.placed" and .payload.total > 100"#, ev).unwrap(),
            Some("true".into())
        );
        assert_eq!(
            run(".payload | del(.card)", ev).unwrap(),
            Some(r#"{"total":2500,"items":["a","b"]}"#.into())
        );
        assert_eq!(run("empty", ev).unwrap(), None);
        assert_eq!(
            run("[range(0; 10; 3)]", ev).unwrap(),
            Some("[0,3,6,9]".into())
        );
        assert_eq!(run("[range(3)]", ev).unwrap(), Some("[0,1,2]".into()));
        assert_eq!(run("nan", ev).unwrap(), Some("null".into()));
    }

    #[test]
    fn errors_name_the_position() {
        let e = Expr::compile(".a |\n  .b[").unwrap_err();
        assert_eq!((e.line, e.column), (2, 6), "{e}");
        let e = Expr::compile(".a | nope").unwrap_err();
        assert_eq!((e.line, e.column), (1, 6), "{e}");
        assert!(e.message.contains("nope"), "{e}");
        for outside in ["env", "$ENV", "input", "inputs", "now"] {
            let e = Expr::compile(outside).unwrap_err();
            assert!(e.message.contains("undefined"), "{outside}: {e}");
        }
        let e = Expr::compile(r#"import "x" as x; ."#).unwrap_err();
        assert!(e.message.contains("modules"), "{e}");
        assert!(Expr::compile("  ").is_err());
    }

    #[test]
    fn an_evaluation_stops_within_its_budget() {
        for code in [
            "def f: f; f",
            "def f: 1 + f; f",
            "last(repeat(1))",
            "[range(1e12)]",
            "[limit(1e9; repeat(.))] | length",
            "reduce range(1e9) as $i (0; . + 1)",
        ] {
            let r = run(code, "{}");
            assert!(
                matches!(r, Err(Fault::Steps(_)) | Err(Fault::Depth)),
                "{code}: {r:?}"
            );
        }
        for code in ["debug", "stderr", "halt", "halt_error"] {
            assert!(matches!(run(code, "1"), Err(Fault::Error(_))), "{code}");
        }
        assert!(matches!(run("error(\"no\")", "1"), Err(Fault::Error(e)) if e.contains("no")));
        assert!(matches!(
            run("reduce range(200) as $i (.; [.])", "1"),
            Err(Fault::Output(_))
        ));
    }

    /// On the evaluator's threads an expression may recurse deep (their
    /// stacks are large), and is still stopped before their end.
    #[tokio::test]
    async fn deep_recursion_on_the_evaluator_stops_without_a_crash() {
        let e = Expr::compile("def f: 1 + f; f").unwrap();
        let deep =
            Expr::compile("def f($n): if $n == 0 then 0 else 1 + f($n - 1) end; f(2000)").unwrap();
        let (spin, counted) = super::super::pool::run(move || {
            let input = Val::Null;
            let json = |r: Result<Option<Val>, Fault>| r.map(|v| v.map(|v| to_json(&v)));
            (
                json(e.first(&input, 1_000_000)),
                json(deep.first(&input, 10_000_000)),
            )
        })
        .await
        .unwrap();
        assert!(
            matches!(spin, Err(Fault::Steps(_)) | Err(Fault::Depth)),
            "{spin:?}"
        );
        assert_eq!(counted, Ok(Some(Ok("2000".into()))));
    }
}
