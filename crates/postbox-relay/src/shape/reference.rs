//! The book's examples (`docs/filters-and-transforms.md`) through postbox's
//! evaluator and through the reference `jq`: both must give the answer the
//! book prints. The page's first `json` block is the event every example
//! reads; each `jq` block is an expression, and the `json` block right
//! after it its first output.

use super::expr::{self, Expr};
use std::io::Write;
use std::process::{Command, Stdio};

const PAGE: &str = include_str!("../../../../docs/filters-and-transforms.md");

/// The page's fenced blocks, in order: (language, text).
fn blocks(page: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut open: Option<(String, String)> = None;
    for line in page.lines() {
        match (&mut open, line.strip_prefix("```")) {
            (None, Some(lang)) => open = Some((lang.trim().to_owned(), String::new())),
            (Some(_), Some(_)) => out.extend(open.take()),
            (Some((_, text)), None) => {
                text.push_str(line);
                text.push('\n');
            }
            (None, None) => {}
        }
    }
    out
}

/// Numbers compared as numbers (`249950` and `249950.0` alike), objects
/// whatever their key order.
pub(super) fn normal(v: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match v {
        Value::Number(n) => n
            .as_f64()
            .and_then(serde_json::Number::from_f64)
            .map_or(Value::Null, Value::Number),
        Value::Array(a) => Value::Array(a.into_iter().map(normal).collect()),
        Value::Object(o) => Value::Object(o.into_iter().map(|(k, v)| (k, normal(v))).collect()),
        other => other,
    }
}

fn reference_jq(code: &str, input: &str) -> serde_json::Value {
    let mut child = Command::new("jq")
        .args(["-c", code])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run jq, the reference implementation (./test.sh installs it: apt-get install jq)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(input.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "jq {code}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
    let first = text.lines().next().unwrap_or("null");
    serde_json::from_str(first).unwrap()
}

#[test]
fn the_books_examples_give_the_same_answers_as_jq() {
    let blocks = blocks(PAGE);
    let (_, event) = blocks
        .iter()
        .find(|(lang, _)| lang == "json")
        .expect("the page shows its event");
    let input = expr::from_json(event).expect("the page's event is JSON");
    let mut checked = 0;
    for pair in blocks.windows(2) {
        let [(lang, code), (next, printed)] = pair else {
            continue;
        };
        if lang != "jq" {
            continue;
        }
        assert_eq!(next, "json", "the book prints the output of {code}");
        let ours = Expr::compile(code.trim())
            .unwrap_or_else(|e| panic!("{code}: {e}"))
            .first(&input, 100_000)
            .unwrap_or_else(|e| panic!("{code}: {e}"))
            .map(|v| expr::to_json(&v).unwrap())
            .unwrap_or_else(|| "null".into());
        let ours = normal(serde_json::from_str(&ours).unwrap());
        let theirs = normal(reference_jq(code.trim(), event));
        let printed = normal(serde_json::from_str(printed).unwrap());
        assert_eq!(ours, theirs, "postbox and jq differ on {code}");
        assert_eq!(ours, printed, "the book prints another output for {code}");
        checked += 1;
    }
    assert!(checked >= 8, "only {checked} examples found");
}
