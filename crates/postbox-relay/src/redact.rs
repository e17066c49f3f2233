//! Keeping secrets out of `last_error` and logs.

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

#[cfg(test)]
mod tests {
    use super::*;

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
