//! Keeping secrets out of `last_error`, logs and whatever shows an event:
//! [`sanitize_error`] masks credentials in error texts by their shape,
//! [`Secrets`] masks the literal secrets a sink holds (in every encoding it
//! sends them), [`display_url`] shows a URL without its secrets, and
//! [`PayloadRedactor`] masks configured JSON paths of payloads and named headers.

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

/// Secrets shorter than this are masked only where they stand alone (not
/// inside a longer word): masking every `ab` in a text would make it
/// unreadable, and a secret that short is no secret.
const SHORT_SECRET: usize = 4;

/// The literal secrets one component holds (a sink's password, token, API
/// key headers…), to mask wherever error text is kept or shown.
///
/// Shape-based masking ([`sanitize_error`]) only finds credentials behind a
/// known prefix (`Bearer `, `password=`, `user:pass@`); an endpoint that
/// echoes a credential in its answer (`{"error":"bad key sk_live_…"}`) is
/// not caught by it. `Secrets` replaces every occurrence of each literal, in
/// each encoding it travels in: as given, percent-encoded (as in a URL),
/// JSON-escaped, and for HTTP Basic credentials the base64 of `user:password`.
/// Occurrences become [`MASK`].
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Secrets {
    /// Longest first, so a secret containing another is masked whole.
    literals: Vec<String>,
    /// The secrets as given (long enough to look for), for the last check
    /// of [`sanitize`](Self::sanitize): whatever encoding an answer used.
    raw: Vec<String>,
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Secrets({} literals)", self.literals.len())
    }
}

impl Secrets {
    /// No secrets: masking only by shape.
    pub const NONE: Secrets = Secrets {
        literals: Vec::new(),
        raw: Vec::new(),
    };

    /// Nothing to mask.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether no secret is held.
    pub fn is_empty(&self) -> bool {
        self.literals.is_empty()
    }

    /// Hold `secret` (empty ones are ignored), in the forms endpoints echo
    /// it: as given, percent-encoded, JSON-escaped (with and without `\/`),
    /// HTML-escaped (named, decimal and hexadecimal entities), base64
    /// (standard and URL-safe, with and without padding) and hex — each
    /// matched whatever its letters' case — and the pieces of it between
    /// quotes, backslashes, commas, semicolons, spaces and angle brackets
    /// (an endpoint that splits a header value echoes a piece) of at least
    /// eight bytes.
    pub fn add(&mut self, secret: &str) -> &mut Self {
        if secret.is_empty() {
            return self;
        }
        self.add_forms(secret);
        if secret.len() >= PIECE && !self.raw.iter().any(|r| r == secret) {
            self.raw.push(secret.to_owned());
        }
        for piece in secret.split(['"', '\'', '\\', ',', ';', ' ', '<', '>', '&']) {
            if piece.len() >= PIECE && piece != secret {
                self.add_forms(piece);
            }
        }
        self
    }

    fn add_forms(&mut self, secret: &str) {
        self.push(secret.to_owned());
        self.push(percent_encode(secret));
        let json = serde_json::to_string(secret).unwrap_or_default();
        if let Some(inner) = json.strip_prefix('"').and_then(|j| j.strip_suffix('"')) {
            self.push(inner.replace('/', "\\/"));
            self.push(inner.to_owned());
        }
        for html in html_escapes(secret) {
            self.push(html);
        }
        if secret.len() >= PIECE {
            let standard = base64(secret.as_bytes());
            let url_safe = standard.replace('+', "-").replace('/', "_");
            self.push(standard.trim_end_matches('=').to_owned());
            self.push(standard);
            self.push(url_safe.trim_end_matches('=').to_owned());
            self.push(url_safe);
            self.push(secret.bytes().map(|b| format!("{b:02x}")).collect());
        }
    }

    /// Hold HTTP Basic credentials: the password in its forms (see
    /// [`add`](Self::add)), and `base64(user:password)` as the
    /// `Authorization: Basic` header carries it (standard and URL-safe
    /// alphabets, with or without padding).
    pub fn add_basic(&mut self, user: &str, password: Option<&str>) -> &mut Self {
        if let Some(password) = password {
            self.add(password);
        }
        let pair = format!("{user}:{}", password.unwrap_or(""));
        if pair.len() > 1 {
            let standard = base64(pair.as_bytes());
            let trimmed = standard.trim_end_matches('=').to_owned();
            let url_safe = standard.replace('+', "-").replace('/', "_");
            self.push(url_safe.trim_end_matches('=').to_owned());
            self.push(url_safe);
            self.push(trimmed);
            self.push(standard);
        }
        self
    }

    /// Hold the secrets a URL carries: the password of its user-info (and
    /// the Basic credential made of it; a user name without a password too
    /// when `user_is_secret`, as for a NATS token), every query value, and every path segment
    /// [`display_url`] would mask — each as written and percent-decoded.
    pub fn add_url(&mut self, raw: &str, user_is_secret: bool) -> &mut Self {
        self.add_userinfo(raw, user_is_secret);
        let Some((_, rest)) = raw.split_once("://").or_else(|| raw.split_once(':')) else {
            return self;
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let tail = &rest[end..];
        let (path, query) = match tail.find(['?', '#']) {
            Some(i) => (&tail[..i], tail[i..].strip_prefix('?')),
            None => (tail, None),
        };
        // Short numbers stay readable (a status code is no secret).
        let number = |s: &str| s.len() < 6 && s.bytes().all(|b| b.is_ascii_digit());
        for segment in path.split('/').filter(|s| !plain_segment(s) && !number(s)) {
            self.add(segment);
            self.add(&decode(segment));
        }
        let query = query.map(|q| q.split('#').next().unwrap_or(""));
        for pair in query.unwrap_or("").split('&') {
            if let Some((_, value)) = pair.split_once('=') {
                self.add(value);
                self.add(&decode(&value.replace('+', " ")));
            }
        }
        self
    }

    /// Hold only the credentials of a URL's user-info: the password and the
    /// Basic credential made of it, and a user name without a password when
    /// `user_is_secret` (a NATS token). For broker URLs, whose query and path are settings.
    pub fn add_userinfo(&mut self, raw: &str, user_is_secret: bool) -> &mut Self {
        let Some((_, rest)) = raw.split_once("://") else {
            return self;
        };
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        if let Some((userinfo, _)) = rest[..end].rsplit_once('@') {
            let (user, password) = match userinfo.split_once(':') {
                Some((u, p)) => (u, Some(p)),
                None => (userinfo, None),
            };
            let (user, password) = (decode(user), password.map(decode));
            if user_is_secret && password.is_none() {
                self.add(&user);
            }
            self.add_basic(&user, password.as_deref());
        }
        self
    }

    /// Hold everything `other` holds.
    pub fn extend(&mut self, other: &Secrets) -> &mut Self {
        for literal in &other.literals {
            self.push(literal.clone());
        }
        for raw in &other.raw {
            if !self.raw.contains(raw) {
                self.raw.push(raw.clone());
            }
        }
        self
    }

    fn push(&mut self, literal: String) {
        if literal.is_empty() || self.literals.contains(&literal) {
            return;
        }
        let at = self
            .literals
            .iter()
            .position(|l| l.len() < literal.len())
            .unwrap_or(self.literals.len());
        self.literals.insert(at, literal);
    }

    /// `text` with every held secret replaced by [`MASK`] (a secret of
    /// [`SHORT_SECRET`] bytes or more wherever it stands, in any ASCII case).
    pub fn mask(&self, text: &str) -> String {
        let mut out = text.to_owned();
        for literal in &self.literals {
            if literal.len() >= SHORT_SECRET {
                out = replace_ignoring_case(&out, literal);
            } else {
                out = replace_standalone(&out, literal);
            }
        }
        out
    }

    /// `text` masked as [`mask`](Self::mask) and then [`sanitize_error`]:
    /// what may be stored in `last_error` or logged. When a held secret can
    /// still be read in what is left once HTML entities, JSON escapes and
    /// percent-encoding are undone and case is folded (an encoding postbox
    /// does not mask in place), the answer is withheld: only its first
    /// words before a colon (an HTTP status line, say) are kept.
    pub fn sanitize(&self, text: &str) -> String {
        let masked = self.mask(text);
        if !self.raw.is_empty() {
            let plain = canonical(&masked);
            if self.raw.iter().any(|r| plain.contains(&canonical(r))) {
                let head = masked
                    .split_once(": ")
                    .map(|(h, _)| h)
                    .filter(|h| {
                        h.len() <= 64
                            && !self
                                .raw
                                .iter()
                                .any(|r| canonical(h).contains(&canonical(r)))
                    })
                    .unwrap_or("the destination answered");
                return sanitize_error(&format!(
                    "{head}: (the answer was withheld: it held a configured secret)"
                ));
            }
        }
        sanitize_error(&masked)
    }
}

/// Pieces of a secret shorter than this are not held on their own, nor
/// looked for by the last check (too likely to occur by chance).
const PIECE: usize = 8;

/// `secret` HTML-escaped: named entities for `&<>"'`, and every character
/// but letters and digits as decimal and as hexadecimal entities.
fn html_escapes(secret: &str) -> Vec<String> {
    if secret.chars().all(char::is_alphanumeric) {
        return Vec::new();
    }
    let named: String = secret
        .chars()
        .map(|c| match c {
            '&' => "&amp;".to_owned(),
            '<' => "&lt;".to_owned(),
            '>' => "&gt;".to_owned(),
            '"' => "&quot;".to_owned(),
            '\'' => "&#39;".to_owned(),
            c => c.to_string(),
        })
        .collect();
    let numeric = |hex: bool| -> String {
        secret
            .chars()
            .map(|c| {
                if c.is_alphanumeric() {
                    c.to_string()
                } else if hex {
                    format!("&#x{:x};", u32::from(c))
                } else {
                    format!("&#{};", u32::from(c))
                }
            })
            .collect()
    };
    vec![named, numeric(false), numeric(true)]
}

/// `text` with every occurrence of `literal`, in any ASCII case, replaced
/// by [`MASK`].
fn replace_ignoring_case(text: &str, literal: &str) -> String {
    let haystack = text.to_ascii_lowercase();
    let needle = literal.to_ascii_lowercase();
    if !haystack.contains(&needle) {
        return text.to_owned();
    }
    // ASCII case folding keeps every byte where it was.
    let mut out = String::with_capacity(text.len());
    let mut at = 0;
    while let Some(pos) = haystack[at..].find(&needle) {
        let start = at + pos;
        out.push_str(&text[at..start]);
        out.push_str(MASK);
        at = start + needle.len();
    }
    out.push_str(&text[at..]);
    out
}

/// `text` with HTML entities, JSON escapes and percent-encoding undone and
/// ASCII case folded: what [`Secrets::sanitize`] looks for secrets in.
fn canonical(text: &str) -> String {
    let mut s = text.to_owned();
    for _ in 0..2 {
        s = decode(&json_unescape(&html_unescape(&s)));
    }
    s.to_ascii_lowercase()
}

fn html_unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(pos) = rest.find('&') {
        out.push_str(&rest[..pos]);
        let tail = &rest[pos..];
        let end = tail.find(';').filter(|&e| e <= 10);
        let decoded = end.and_then(|e| {
            let name = &tail[1..e];
            let c = match name {
                "amp" => Some('&'),
                "lt" => Some('<'),
                "gt" => Some('>'),
                "quot" => Some('"'),
                "apos" => Some('\''),
                _ => name
                    .strip_prefix("#x")
                    .or_else(|| name.strip_prefix("#X"))
                    .and_then(|h| u32::from_str_radix(h, 16).ok())
                    .or_else(|| name.strip_prefix('#').and_then(|d| d.parse().ok()))
                    .and_then(char::from_u32),
            };
            c.map(|c| (c, e))
        });
        match decoded {
            Some((c, e)) => {
                out.push(c);
                rest = &tail[e + 1..];
            }
            None => {
                out.push('&');
                rest = &tail[1..];
            }
        }
    }
    out.push_str(rest);
    out
}

fn json_unescape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('u') => {
                let hex: String = chars.by_ref().take(4).collect();
                match u32::from_str_radix(&hex, 16).ok().and_then(char::from_u32) {
                    Some(c) => out.push(c),
                    None => {
                        out.push_str("\\u");
                        out.push_str(&hex);
                    }
                }
            }
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

/// Replace occurrences of `literal` not adjacent to an alphanumeric character.
fn replace_standalone(text: &str, literal: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    let mut prev: Option<char> = None;
    while let Some(pos) = rest.find(literal) {
        let before = rest[..pos].chars().next_back().or(prev);
        let after = rest[pos + literal.len()..].chars().next();
        let alone =
            !before.is_some_and(char::is_alphanumeric) && !after.is_some_and(char::is_alphanumeric);
        out.push_str(&rest[..pos]);
        out.push_str(if alone { MASK } else { literal });
        prev = literal.chars().next_back();
        rest = &rest[pos + literal.len()..];
    }
    out.push_str(rest);
    out
}

/// Percent-decode (invalid escapes and invalid UTF-8 are kept as they are).
fn decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = |b: u8| (b as char).to_digit(16);
        match (bytes[i], bytes.get(i + 1), bytes.get(i + 2)) {
            (b'%', Some(&h), Some(&l)) if hex(h).is_some() && hex(l).is_some() => {
                out.push((hex(h).unwrap_or(0) * 16 + hex(l).unwrap_or(0)) as u8);
                i += 3;
            }
            (b, _, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).unwrap_or_else(|_| s.to_owned())
}

/// Percent-encode everything but unreserved URL characters.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// Standard base64 with padding.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, &b)| n | (u32::from(b) << (16 - 8 * i)));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// A URL as it may be shown in logs, metrics and status: scheme, host and
/// port; user-info never; the query as `?…`; and each path segment as it is
/// only when it looks like a plain name (lowercase letters, with `-`, `_` or
/// `.` between words and up to two trailing digits, e.g. `hooks`, `v2`,
/// `order-events`), otherwise `***` — so tokens carried in a path
/// (`/services/T000/B000/XXXX`) are never printed. Text that is not a URL
/// with a host is masked by shape ([`sanitize_error`]).
pub fn display_url(raw: &str) -> String {
    let Some((scheme, rest)) = raw.split_once("://") else {
        return sanitize_error(raw);
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = &rest[..end];
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    let tail = &rest[end..];
    let (path, query) = match tail.find(['?', '#']) {
        Some(i) => (&tail[..i], tail[i..].starts_with('?')),
        None => (tail, false),
    };
    let mut out = format!("{scheme}://{host}");
    for segment in path.split('/').skip(1) {
        out.push('/');
        if plain_segment(segment) {
            out.push_str(segment);
        } else {
            out.push_str(MASK);
        }
    }
    if query {
        out.push_str("?…");
    }
    sanitize_error(&out)
}

/// Whether a path segment reads as a name rather than a token.
fn plain_segment(segment: &str) -> bool {
    if segment.is_empty() {
        return true;
    }
    let body = segment.trim_end_matches(|c: char| c.is_ascii_digit());
    let digits = segment.len() - body.len();
    segment.len() <= 40
        && digits <= 2
        && body.starts_with(|c: char| c.is_ascii_lowercase())
        && body.split(['-', '_', '.']).all(|word| {
            !word.is_empty() && word.len() <= 16 && word.bytes().all(|b| b.is_ascii_lowercase())
        })
}

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

    /// The values an event's configured paths and headers hold, as
    /// [`Secrets`]: what a destination's answer must not bring back (an
    /// endpoint that echoes the body it was sent).
    pub fn secrets_of<'a>(
        &self,
        payload: &Value,
        headers: impl IntoIterator<Item = (&'a String, &'a String)>,
    ) -> Secrets {
        let mut values = Vec::new();
        for path in &self.paths {
            collect(payload, path, &mut values);
        }
        for (name, value) in headers {
            if self.headers.contains(&name.to_ascii_lowercase()) {
                values.push(value.clone());
            }
        }
        let mut secrets = Secrets::new();
        for v in &values {
            secrets.add(v);
        }
        secrets
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

/// The values at `steps` in `value`: every string, number and boolean under
/// them (an object or array as its JSON too).
fn collect(value: &Value, steps: &[Step], out: &mut Vec<String>) {
    let Some((step, rest)) = steps.split_first() else {
        leaves(value, out);
        return;
    };
    let children: Vec<&Value> = match (step, value) {
        (Step::Key(k), Value::Object(m)) => m.get(k).into_iter().collect(),
        (Step::Index(i), Value::Array(a)) => a.get(*i).into_iter().collect(),
        (Step::Any | Step::AnyDepth, Value::Object(m)) => m.values().collect(),
        (Step::Any | Step::AnyDepth, Value::Array(a)) => a.iter().collect(),
        _ => Vec::new(),
    };
    if let Step::AnyDepth = step {
        collect(value, rest, out);
        for child in children {
            collect(child, steps, out);
        }
    } else {
        for child in children {
            collect(child, rest, out);
        }
    }
}

fn leaves(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::String(s) => out.push(s.clone()),
        Value::Number(n) => out.push(n.to_string()),
        Value::Bool(_) | Value::Null => {}
        Value::Object(m) => {
            out.push(value.to_string());
            m.values().for_each(|v| leaves(v, out));
        }
        Value::Array(a) => {
            out.push(value.to_string());
            a.iter().for_each(|v| leaves(v, out));
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
    fn secrets_are_masked_in_every_encoding() {
        let mut secrets = Secrets::new();
        secrets
            .add("k3y/with+\"odd\" chars")
            .add_basic("app", Some("pa ss:w0rd"));
        let text = format!(
            "raw k3y/with+\"odd\" chars, url k3y%2Fwith%2B%22odd%22%20chars, json {}, \
             basic {}, url-safe {}, password pa ss:w0rd, encoded pa%20ss%3Aw0rd",
            serde_json::to_string("k3y/with+\"odd\" chars").unwrap(),
            base64(b"app:pa ss:w0rd"),
            base64(b"app:pa ss:w0rd")
                .replace('+', "-")
                .replace('/', "_"),
        );
        let masked = secrets.sanitize(&text);
        for leak in ["k3y", "w0rd", "YXBwOnBh", "odd"] {
            assert!(!masked.contains(leak), "{leak} in {masked}");
        }
        assert!(masked.starts_with("raw ***, url ***"), "{masked}");
        // Nothing held, nothing changed (beyond shape-based masking).
        assert_eq!(Secrets::NONE.mask("a b"), "a b");
        assert_eq!(
            format!("{secrets:?}"),
            format!("Secrets({} literals)", secrets.literals.len())
        );
    }

    /// What a hostile endpoint echoed into `last_error` (issue 35, defect 5):
    /// each form is masked or the answer withheld; none leaks.
    #[test]
    fn echoed_secrets_never_come_back_whatever_the_encoding() {
        let key = "HdrKey/9+z\"q";
        let header = "tok_\"abcdefgh1234";
        let path_token = "T0ABCDEF/XXXXSECRETXXXX";
        let mut secrets = Secrets::new();
        secrets
            .add(key)
            .add(header)
            .add_url(
                &format!("https://hooks.example/services/{path_token}"),
                false,
            )
            .add_basic("app", Some("s3cret pass"));
        let basic = base64(b"app:s3cret pass");
        let echoes = [
            "HTTP 400: key HdrKey/9+z&quot;q refused".to_owned(),
            "HTTP 400: {\"key\":\"HdrKey\\/9+z\\\"q\"}".to_owned(),
            "HTTP 400: <p>HdrKey&#x2f;9&#x2b;z&#x22;q</p>".to_owned(),
            "HTTP 400: header value abcdefgh1234 after its quote".to_owned(),
            "HTTP 404: no route /services/t0abcdef/xxxxsecretxxxx".to_owned(),
            format!(
                "HTTP 401: Authorization: Basic {}",
                basic.replace('=', "&#x3D;")
            ),
            format!("HTTP 400: echoed {}", base64(key.as_bytes())),
            // Percent-encoded twice: no form held matches; the last check does.
            "HTTP 400: HdrKey%252F9%252Bz%2522q".to_owned(),
        ];
        for echo in &echoes {
            let stored = secrets.sanitize(echo);
            let plain = canonical(&stored);
            for leak in ["hdrkey", "abcdefgh1234", "xxxxsecretxxxx", "s3cret"] {
                assert!(
                    !plain.contains(leak),
                    "{leak} leaked from {echo:?} as {stored:?}"
                );
            }
            assert!(
                stored.starts_with("HTTP 40"),
                "the status stays: {stored:?}"
            );
        }
        assert_eq!(
            secrets.sanitize("HTTP 400: HdrKey%252F9%252Bz%2522q"),
            "HTTP 400: (the answer was withheld: it held a configured secret)"
        );
        // What holds no secret is left as it was.
        assert_eq!(secrets.sanitize("HTTP 503: busy"), "HTTP 503: busy");
    }

    #[test]
    fn redacted_payload_values_are_secrets_of_the_event() {
        let redactor = redactor(&["card.number", "**.cvv"]).with_headers(&["X-Api-Key".to_owned()]);
        let payload = serde_json::json!({
            "card": {"number": "4111111111111111", "cvv": 737},
            "items": [{"cvv": "0042"}], "total": 5
        });
        let headers = [("x-api-key".to_owned(), "hdr-secret-1".to_owned())];
        let secrets = redactor.secrets_of(&payload, headers.iter().map(|(k, v)| (k, v)));
        let echo = r#"HTTP 400: {"card": {"number": "4111111111111111", "cvv": 737}, "items": [{"cvv": "0042"}], "total": 5, "h": "hdr-secret-1"}"#;
        let stored = secrets.sanitize(echo);
        for leak in ["4111111111111111", "737", "0042", "hdr-secret-1"] {
            assert!(!stored.contains(leak), "{leak} in {stored}");
        }
        assert!(stored.contains("\"total\": 5"), "{stored}");
    }

    #[test]
    fn url_secrets_are_held() {
        let mut secrets = Secrets::new();
        secrets.add_url(
            "https://app:p%40ss-word@hooks.example/services/T0AB1/XXXXSECRET?api_key=k%2By&mode=x",
            false,
        );
        let text = "p@ss-word p%40ss-word app T0AB1 XXXXSECRET k+y k%2By services hooks.example";
        assert_eq!(
            secrets.mask(text),
            "*** *** app *** *** *** *** services hooks.example"
        );
        let mut nats = Secrets::new();
        nats.add_url("nats://s3cr3t-token@127.0.0.1:4222", true);
        assert_eq!(nats.mask("bad token s3cr3t-token"), "bad token ***");
        // Basic credentials from the user-info, in base64.
        assert_eq!(secrets.mask(&base64(b"app:p@ss-word")), "***");
    }

    #[test]
    fn short_secrets_are_masked_only_standing_alone() {
        let mut secrets = Secrets::new();
        secrets.add("ab");
        assert_eq!(
            secrets.mask("ab cab ab, abc (ab)"),
            "*** cab ***, abc (***)"
        );
    }

    #[test]
    fn base64_matches_the_standard() {
        assert_eq!(base64(b""), "");
        assert_eq!(base64(b"f"), "Zg==");
        assert_eq!(base64(b"fo"), "Zm8=");
        assert_eq!(base64(b"foo"), "Zm9v");
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(&[0xfb, 0xff]), "+/8=");
    }

    #[test]
    fn urls_are_displayed_without_secrets() {
        assert_eq!(
            display_url("https://hooks.example/services/T000/B000/XXXXSECRETXXXX"),
            "https://hooks.example/services/***/***/***"
        );
        assert_eq!(
            display_url("https://u:p@api.example.com:8443/v2/order-events/hook?token=abc#f"),
            "https://api.example.com:8443/v2/order-events/hook?…"
        );
        assert_eq!(
            display_url("https://discord.example/api/webhooks/123456789012/aBcD-eFgH_iJkL"),
            "https://discord.example/api/webhooks/***/***"
        );
        assert_eq!(display_url("http://h/"), "http://h/");
        assert_eq!(display_url("http://h"), "http://h");
        assert_eq!(display_url("nope password=x"), "nope password=***");
    }

    #[test]
    fn bounds_length_and_strips_control_characters() {
        let s = sanitize_error(&"é".repeat(1000));
        assert!(s.len() <= MAX_ERROR_BYTES && s.ends_with("..."));
        assert_eq!(sanitize_error("a\nb\u{0}c"), "a b c");
    }
}
