//! Glob matching, the one matcher postbox's own crates share (the router's
//! event-type patterns, the outbox directory's schema and database names):
//! `*` matches any run of characters (none included), `?` exactly one, every
//! other character itself. Public for postbox's own crates; no promise to
//! applications.

/// Whether `text` matches the glob `pattern`.
pub fn matches(pattern: &str, text: &str) -> bool {
    if pattern.is_ascii() && text.is_ascii() {
        match_slices(pattern.as_bytes(), text.as_bytes(), b'*', b'?')
    } else {
        let pattern: Vec<char> = pattern.chars().collect();
        let text: Vec<char> = text.chars().collect();
        match_slices(&pattern, &text, '*', '?')
    }
}

/// Linear-time glob matching with one backtracking point (the last `*`).
fn match_slices<T: Copy + PartialEq>(pattern: &[T], text: &[T], any_run: T, any_one: T) -> bool {
    let (mut p, mut t) = (0, 0);
    let mut star: Option<(usize, usize)> = None;
    while t < text.len() {
        if p < pattern.len() && pattern[p] == any_run {
            star = Some((p, t));
            p += 1;
        } else if p < pattern.len() && (pattern[p] == any_one || pattern[p] == text[t]) {
            p += 1;
            t += 1;
        } else if let Some((sp, st)) = star {
            p = sp + 1;
            t = st + 1;
            star = Some((sp, st + 1));
        } else {
            return false;
        }
    }
    pattern[p..].iter().all(|&c| c == any_run)
}

#[cfg(test)]
mod tests {
    use super::matches;

    #[test]
    fn stars_and_question_marks() {
        assert!(matches("tenant_*", "tenant_a"));
        assert!(matches("tenant_*", "tenant_"));
        assert!(!matches("tenant_*", "tenants"));
        assert!(matches("t?n*_x", "tenant_x"));
        assert!(matches("*", ""));
        assert!(!matches("a", "ab"));
        assert!(matches("order.*", "order.created.v2"));
        assert!(matches("é*", "été"));
        assert!(!matches("?", "éé"));
    }
}
