use crate::Error;
use std::fmt;

/// A validated Postgres schema name for postbox's tables (default `postbox`).
///
/// Names are restricted to lower-case ASCII letters, digits and `_`, starting
/// with a letter or `_`, at most 63 bytes: they can be used unquoted from any
/// client, and no SQL can hide in them.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Schema(String);

impl Schema {
    /// Validate `name` as a schema name.
    pub fn new(name: &str) -> Result<Self, Error> {
        let invalid = |reason: &str| Error::InvalidSchema {
            name: name.chars().take(80).collect(),
            reason: reason.to_owned(),
        };
        if name.is_empty() {
            return Err(invalid("it is empty"));
        }
        if name.len() > 63 {
            return Err(invalid("it is longer than 63 bytes"));
        }
        let mut chars = name.chars();
        if !chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_')
        {
            return Err(invalid("it must start with a lower-case letter or '_'"));
        }
        if !name
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
        {
            return Err(invalid(
                "only lower-case ASCII letters, digits and '_' are allowed",
            ));
        }
        if name.starts_with("pg_") {
            return Err(invalid(
                "names starting with 'pg_' are reserved by PostgreSQL",
            ));
        }
        Ok(Self(name.to_owned()))
    }

    /// The bare name.
    pub fn name(&self) -> &str {
        &self.0
    }

    /// The name quoted as an SQL identifier.
    pub fn quoted(&self) -> String {
        format!("\"{}\"", self.0)
    }

    /// The LISTEN/NOTIFY channel on which inserts into this schema's outbox are announced.
    pub fn notify_channel(&self) -> String {
        format!("postbox_{}", self.0)
    }

    /// Substitute `{schema}` (quoted identifier) and `{channel}` (string literal)
    /// in a SQL template. Safe because the name is validated.
    pub fn render(&self, template: &str) -> String {
        template
            .replace("{schema}", &self.quoted())
            .replace("{channel}", &format!("'{}'", self.notify_channel()))
    }
}

impl Default for Schema {
    fn default() -> Self {
        Self("postbox".to_owned())
    }
}

impl fmt::Display for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Schema {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Schema({})", self.0)
    }
}

impl std::str::FromStr for Schema {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self, Error> {
        Self::new(s)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_plain_names() {
        for ok in ["postbox", "_x", "a1_b2", "t_0123456789abcdef"] {
            assert_eq!(Schema::new(ok).unwrap().name(), ok);
        }
    }

    #[test]
    fn rejects_names_that_would_need_quoting() {
        for bad in [
            "",
            "Postbox",
            "1abc",
            "a-b",
            "a\"b",
            "a;drop",
            "pg_x",
            &"a".repeat(64),
        ] {
            let err = Schema::new(bad).unwrap_err().to_string();
            assert!(err.contains("invalid schema name"), "{bad}: {err}");
        }
    }

    #[test]
    fn renders_templates() {
        let s = Schema::new("abc").unwrap();
        assert_eq!(
            s.render("SELECT * FROM {schema}.outbox; NOTIFY {channel}"),
            "SELECT * FROM \"abc\".outbox; NOTIFY 'postbox_abc'"
        );
    }
}
