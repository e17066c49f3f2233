//! `application/x-www-form-urlencoded` bodies and query strings, read by hand
//! so that repeated fields (checkboxes) keep every value; and the values of
//! forms that need reading (a time, a discard's reason).

use chrono::{DateTime, NaiveDate, NaiveDateTime, Utc};
use postbox_store::MAX_REASON_BYTES;

#[derive(Debug, Default)]
pub(crate) struct FormData {
    pairs: Vec<(String, String)>,
}

impl FormData {
    pub fn parse(bytes: &[u8]) -> Self {
        Self {
            pairs: url::form_urlencoded::parse(bytes).into_owned().collect(),
        }
    }

    /// The first value of `name`, trimmed; `None` when absent or blank.
    pub fn get(&self, name: &str) -> Option<&str> {
        self.pairs
            .iter()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.trim())
            .filter(|v| !v.is_empty())
    }

    /// Every value of `name`.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.pairs
            .iter()
            .filter(move |(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A time in a form: RFC 3339, `YYYY-MM-DD[THH:MM[:SS]]` in UTC, or a
/// duration meaning that long ago (`90min`, `2h`, `3days`).
pub(crate) fn parse_when(s: &str) -> Result<DateTime<Utc>, String> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    for fmt in [
        "%Y-%m-%dT%H:%M:%S",
        "%Y-%m-%dT%H:%M",
        "%Y-%m-%d %H:%M:%S",
        "%Y-%m-%d %H:%M",
    ] {
        if let Ok(t) = NaiveDateTime::parse_from_str(s, fmt) {
            return Ok(t.and_utc());
        }
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        if let Some(t) = d.and_hms_opt(0, 0, 0) {
            return Ok(t.and_utc());
        }
    }
    let bad = || {
        format!("“{s}” is neither a time (2026-05-01T12:00, UTC) nor a duration ago (2h, 3days).")
    };
    let ago = humantime::parse_duration(s).map_err(|_| bad())?;
    let ago = chrono::Duration::from_std(ago).map_err(|_| bad())?;
    Utc::now().checked_sub_signed(ago).ok_or_else(bad)
}

/// A discard's reason: required, at most [`MAX_REASON_BYTES`] bytes of text.
pub(crate) fn check_reason(reason: Option<&str>) -> Result<String, String> {
    match reason {
        None => Err("A reason is required to discard dead letters.".to_owned()),
        Some(r) if r.len() > MAX_REASON_BYTES || r.contains('\0') => {
            Err("The reason must be at most 2000 bytes of text.".to_owned())
        }
        Some(r) => Ok(r.to_owned()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_fields_keep_every_value() {
        let f = FormData::parse(b"ids=a&ids=b&csrf=x%20y&empty=+");
        assert_eq!(f.all("ids").collect::<Vec<_>>(), vec!["a", "b"]);
        assert_eq!(f.get("csrf"), Some("x y"));
        assert_eq!(f.get("empty"), None);
        assert_eq!(f.get("missing"), None);
    }

    #[test]
    fn times_are_read_as_utc_or_as_durations_ago() {
        assert_eq!(
            parse_when("2026-05-01T12:00").unwrap().to_rfc3339(),
            "2026-05-01T12:00:00+00:00"
        );
        assert_eq!(
            parse_when("2026-05-01").unwrap().to_rfc3339(),
            "2026-05-01T00:00:00+00:00"
        );
        let ago = Utc::now() - parse_when("2h").unwrap();
        assert!((ago.num_minutes() - 120).abs() <= 1);
        assert!(parse_when("<script>").is_err());
    }
}
