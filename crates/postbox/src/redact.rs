//! Keeping secrets out of `last_error`, logs and whatever shows an event:
//! [`sanitize_error`] masks credentials in error texts, [`PayloadRedactor`]
//! masks configured JSON paths of payloads and named headers.

use serde_json::Value;

/// Longest error text stored in `last_error`.
pub const MAX_ERROR_BYTES: usize = 512;

/// Mask credentials in an error text and bound its length: URL user-info
/// (`scheme://user:pass@host` → `scheme://***@host`), `Bearer`/`Basic`
/// authorization values, `password=`/`token=`/`secret=`/`key=` style
/// parameters and `whsec_…` webhook secrets. Control characters become spaces.
pub fn sanitize_error(text: &str) -> String {
    let mut out = mask_secrets(text);
    if out.len() > MAX_ERROR_BYTES {
        let mut cut = MAX_ERROR_BYTES - 3;
        while !out.is_char_boundary(cut) {
            cut -= 1;
        }
        out.truncate(cut);
        out.push_str("...");
    }
    out
}

/// Mask credentials as [`sanitize_error`] does, without bounding the length.
pub fn mask_secrets(text: &str) -> String {
    let masked = mask_url_userinfo(text);
    mask_after_words(&masked)
        .chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

fn mask_url_userinfo(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find("://") {
        let (head, tail) = rest.split_at(pos + 3);
        out.push_str(head);
        let authority_end = tail
            .find(|c: char| {
                c == '/' || c == '?' || c == '#' || c.is_whitespace() || c == '"' || c == '\''
            })
            .unwrap_or(tail.len());
        let authority = &tail[..authority_end];
        match authority.rfind('@') {
            Some(at) => {
                out.push_str("***");
                out.push_str(&authority[at..]);
            }
            None => out.push_str(authority),
        }
        rest = &tail[authority_end..];
    }
    out.push_str(rest);
    out
}

fn mask_after_words(text: &str) -> String {
    const WORDS: [&str; 9] = [
        "bearer ",
        "basic ",
        "password=",
        "passwd=",
        "token=",
        "secret=",
        "key=",
        "authorization: ",
        // A Standard Webhooks signing secret (`whsec_<base64>`).
        "whsec_",
    ];
    let lower = text.to_ascii_lowercase();
    let mut out = String::with_capacity(text.len());
    let mut i = 0;
    while i < text.len() {
        let hit = WORDS.iter().find(|w| lower[i..].starts_with(*w));
        match hit {
            Some(w) if text.is_char_boundary(i) => {
                out.push_str(&text[i..i + w.len()]);
                out.push_str("***");
                let value_start = i + w.len();
                // An Authorization header's value runs to the end of the
                // field (scheme and credentials); other values end at a space.
                let whole_field = w.starts_with("authorization");
                let value_len = text[value_start..]
                    .find(|c: char| {
                        (c.is_whitespace() && !whole_field)
                            || matches!(c, '&' | ',' | ';' | '"' | '\'' | '\n' | '\r')
                    })
                    .unwrap_or(text.len() - value_start);
                i = value_start + value_len;
            }
            _ => {
                let ch = text[i..].chars().next().map_or(1, char::len_utf8);
                out.push_str(&text[i..i + ch]);
                i += ch;
            }
        }
    }
    out
}

/// What a masked value is replaced with.
pub const MASK: &str = "***";

/// A redaction path that cannot be parsed.
#[derive(Debug, thiserror::Error)]
#[error("redaction path {path:?}: {reason}")]
pub struct RedactPathError {
    pub path: String,
    pub reason: &'static str,
}

#[derive(Clone, Debug, PartialEq)]
enum Step {
    Key(String),
    Index(usize),
    /// `*` or `[*]`: every member of an object or element of an array.
    Any,
    /// `**`: zero or more levels.
    AnyDepth,
}

/// Masks configured JSON paths of event payloads, and named headers, wherever
/// postbox shows an event (`postbox dlq show`, the console). Deliveries are
/// never redacted: a sink sends what the producer wrote.
///
/// Paths are dot-separated keys from the payload's root, with an optional
/// `$.` in front: `card.number`, `items[*].ssn` (every element), `items[0]`,
/// `*.token` (every member), `**.password` (at any depth), `["a.b"]` (a key
/// holding a dot). The value found, whatever its type, becomes `"***"`.
/// Header names match case-insensitively.
#[derive(Clone, Debug, Default)]
pub struct PayloadRedactor {
    paths: Vec<Vec<Step>>,
    headers: Vec<String>,
}

impl PayloadRedactor {
    /// Parse `paths`; the first that cannot be parsed is the error.
    pub fn new(paths: &[String]) -> Result<Self, RedactPathError> {
        let paths = paths
            .iter()
            .map(|p| parse_path(p))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            paths,
            headers: Vec::new(),
        })
    }

    /// Also mask these headers' values (names compared case-insensitively).
    pub fn with_headers(mut self, names: &[String]) -> Self {
        self.headers = names.iter().map(|n| n.to_ascii_lowercase()).collect();
        self
    }

    /// Whether nothing is configured (then redaction is a no-op).
    pub fn is_empty(&self) -> bool {
        self.paths.is_empty() && self.headers.is_empty()
    }

    /// Mask every configured path in a payload, in place.
    pub fn redact(&self, payload: &mut Value) {
        for path in &self.paths {
            mask(payload, path);
        }
    }

    /// Mask the configured headers in an event's header object, in place.
    pub fn redact_headers(&self, headers: &mut Value) {
        if self.headers.is_empty() {
            return;
        }
        if let Value::Object(map) = headers {
            for (name, value) in map.iter_mut() {
                if self.headers.contains(&name.to_ascii_lowercase()) {
                    *value = Value::String(MASK.to_owned());
                }
            }
        }
    }
}

fn mask(value: &mut Value, steps: &[Step]) {
    let Some((step, rest)) = steps.split_first() else {
        *value = Value::String(MASK.to_owned());
        return;
    };
    match step {
        Step::Key(k) => {
            if let Some(child) = value.as_object_mut().and_then(|m| m.get_mut(k)) {
                mask(child, rest);
            }
        }
        Step::Index(i) => {
            if let Some(child) = value.as_array_mut().and_then(|a| a.get_mut(*i)) {
                mask(child, rest);
            }
        }
        Step::Any => for_each_child(value, |child| mask(child, rest)),
        Step::AnyDepth => {
            mask(value, rest);
            for_each_child(value, |child| mask(child, steps));
        }
    }
}

fn for_each_child(value: &mut Value, mut f: impl FnMut(&mut Value)) {
    match value {
        Value::Object(m) => m.values_mut().for_each(&mut f),
        Value::Array(a) => a.iter_mut().for_each(&mut f),
        _ => {}
    }
}

fn parse_path(path: &str) -> Result<Vec<Step>, RedactPathError> {
    let err = |reason| RedactPathError {
        path: path.to_owned(),
        reason,
    };
    let body = path
        .strip_prefix("$.")
        .or_else(|| path.strip_prefix('$'))
        .unwrap_or(path);
    if body.is_empty() {
        return Err(err("is empty; name a key, e.g. card.number"));
    }
    let mut steps = Vec::new();
    let mut chars = body.char_indices().peekable();
    // Whether the next token must be a separator ('.' or '[') or the end.
    let mut after_step = false;
    while let Some((i, c)) = chars.next() {
        match c {
            '.' if after_step => {
                after_step = false;
                if chars.peek().is_none() {
                    return Err(err("ends with '.'"));
                }
            }
            '.' => return Err(err("has an empty key between dots")),
            '[' => {
                let close = body[i..]
                    .find(']')
                    .map(|j| i + j)
                    .ok_or_else(|| err("has '[' without ']'"))?;
                let inner = &body[i + 1..close];
                let step = if inner == "*" || inner.is_empty() {
                    Step::Any
                } else if let Some(quoted) = inner
                    .strip_prefix('"')
                    .and_then(|s| s.strip_suffix('"'))
                    .filter(|_| inner.len() >= 2)
                {
                    Step::Key(quoted.to_owned())
                } else {
                    Step::Index(inner.parse().map_err(|_| {
                        err("has a bracket holding neither *, an index nor a \"quoted key\"")
                    })?)
                };
                steps.push(step);
                while chars.peek().is_some_and(|&(j, _)| j <= close) {
                    chars.next();
                }
                after_step = true;
            }
            _ if after_step => return Err(err("needs '.' between keys")),
            _ => {
                let end = body[i..].find(['.', '[']).map_or(body.len(), |j| i + j);
                let key = &body[i..end];
                steps.push(match key {
                    "*" => Step::Any,
                    "**" => Step::AnyDepth,
                    k => Step::Key(k.to_owned()),
                });
                while chars.peek().is_some_and(|&(j, _)| j < end) {
                    chars.next();
                }
                after_step = true;
            }
        }
    }
    if steps.last() == Some(&Step::AnyDepth) {
        return Err(err(
            "ends with '**'; name what to mask below it, e.g. **.password",
        ));
    }
    Ok(steps)
}

/// An error and its chain of causes on one line (`outer: cause: cause`),
/// leaving out a cause whose text the line already holds, with credentials
/// masked ([`mask_secrets`]): how a log line or a CLI shows an error.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let part = s.to_string();
        if !text.contains(&part) {
            text.push_str(": ");
            text.push_str(&part);
        }
        source = s.source();
    }
    mask_secrets(&text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn redactor(paths: &[&str]) -> PayloadRedactor {
        PayloadRedactor::new(&paths.iter().map(|p| p.to_string()).collect::<Vec<_>>()).unwrap()
    }

    #[test]
    fn masks_paths_of_every_kind() {
        let mut v = serde_json::json!({
            "card": {"number": "4111", "brand": "visa"},
            "items": [{"ssn": "1", "sku": "a"}, {"ssn": 2, "sku": "b"}],
            "a.b": "dotted",
            "deep": {"x": {"password": "p", "y": [{"password": "q"}]}},
            "tokens": {"one": "t1", "two": "t2"},
            "list": ["keep", "mask"]
        });
        redactor(&[
            "$.card.number",
            "items[*].ssn",
            "[\"a.b\"]",
            "**.password",
            "tokens.*",
            "list[1]",
            "missing.path",
        ])
        .redact(&mut v);
        assert_eq!(
            v,
            serde_json::json!({
                "card": {"number": "***", "brand": "visa"},
                "items": [{"ssn": "***", "sku": "a"}, {"ssn": "***", "sku": "b"}],
                "a.b": "***",
                "deep": {"x": {"password": "***", "y": [{"password": "***"}]}},
                "tokens": {"one": "***", "two": "***"},
                "list": ["keep", "***"]
            })
        );
    }

    #[test]
    fn masks_named_headers_case_insensitively() {
        let r = PayloadRedactor::new(&[])
            .unwrap()
            .with_headers(&["Authorization".into()]);
        let mut h = serde_json::json!({"authorization": "Bearer x", "x-trace": "1"});
        r.redact_headers(&mut h);
        assert_eq!(
            h,
            serde_json::json!({"authorization": "***", "x-trace": "1"})
        );
    }

    #[test]
    fn refuses_bad_paths_naming_them() {
        for bad in [
            "", "$", "a..b", "a.", "a[1", "a[x]", "a]b.**", "**", "a[0]b",
        ] {
            let e = PayloadRedactor::new(&[bad.to_string()]).unwrap_err();
            assert!(e.to_string().contains(&format!("{bad:?}")), "{e}");
        }
    }

    #[test]
    fn masks_url_credentials() {
        assert_eq!(
            sanitize_error("connect amqp://guest:s3cret@rabbit:5672/vhost failed"),
            "connect amqp://***@rabbit:5672/vhost failed"
        );
        assert_eq!(
            sanitize_error("redis://:pw@h:1 and https://example.com/x"),
            "redis://***@h:1 and https://example.com/x"
        );
    }

    #[test]
    fn masks_tokens_and_parameters() {
        let s = sanitize_error("401: Authorization: Bearer abc.def.ghi; retry with token=xyz&x=1");
        assert!(!s.contains("abc.def") && !s.contains("xyz"), "{s}");
        assert!(s.contains("x=1"), "{s}");
        let s = sanitize_error("host=db password=hunter2 user=app");
        assert_eq!(s, "host=db password=*** user=app");
    }

    #[test]
    fn bounds_length_and_strips_control_characters() {
        let s = sanitize_error(&"é".repeat(1000));
        assert!(s.len() <= MAX_ERROR_BYTES && s.ends_with("..."));
        assert_eq!(sanitize_error("a\nb\u{0}c"), "a b c");
    }
}
