//! Which outboxes a user's role applies to: a list of patterns, each
//! `SCHEMA_GLOB` (that schema in any database) or `DATABASE_GLOB/SCHEMA_GLOB`,
//! where `*` matches any run of characters and `?` exactly one. No pattern
//! (the default) is every outbox. Stored in the users table (migration 23),
//! whose constraint accepts the same syntax as [`OutboxPatterns::parse`].

use crate::ConsoleError;
use std::fmt;

/// At most this many patterns per user (the table's constraint agrees).
const MAX_PATTERNS: usize = 64;
/// A database or schema glob's length, in bytes (PostgreSQL's name limit).
const MAX_GLOB: usize = 63;

/// One pattern: a schema glob, and a database glob unless any database will do.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Pattern {
    database: Option<String>,
    schema: String,
}

impl Pattern {
    fn parse(s: &str) -> Result<Self, ConsoleError> {
        let invalid = |why: &'static str| ConsoleError::InvalidOutboxPattern {
            pattern: s.chars().filter(|c| !c.is_control()).take(80).collect(),
            why,
        };
        let (database, schema) = match s.split_once('/') {
            Some((d, sc)) => (Some(d), sc),
            None => (None, s),
        };
        if let Some(d) = database {
            if d.is_empty() || d.len() > MAX_GLOB {
                return Err(invalid("the database part must be 1 to 63 characters"));
            }
            if !d.chars().all(|c| {
                c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '$' | '-' | '*' | '?')
            }) {
                return Err(invalid(
                    "a database glob has letters, digits, '_', '.', '$', '-', '*' and '?' only (one '/' at most)",
                ));
            }
        }
        if schema.is_empty() || schema.len() > MAX_GLOB {
            return Err(invalid("the schema part must be 1 to 63 characters"));
        }
        if !schema
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '_' | '*' | '?'))
        {
            return Err(invalid(
                "a schema glob has lower-case letters, digits, '_', '*' and '?' only",
            ));
        }
        Ok(Self {
            database: database.map(str::to_owned),
            schema: schema.to_owned(),
        })
    }

    fn matches(&self, database: &str, schema: &str) -> bool {
        glob(&self.schema, schema) && self.database.as_deref().is_none_or(|d| glob(d, database))
    }

    /// Whether it matches every outbox (`*`, `*/*`).
    fn is_everything(&self) -> bool {
        self.schema == "*" && self.database.as_deref().is_none_or(|d| d == "*")
    }
}

impl fmt::Display for Pattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.database {
            Some(d) => write!(f, "{d}/{}", self.schema),
            None => f.write_str(&self.schema),
        }
    }
}

/// The outboxes a user's role applies to: every outbox (no pattern), or
/// those at least one pattern matches.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct OutboxPatterns(Vec<Pattern>);

impl OutboxPatterns {
    /// Every outbox.
    pub fn every() -> Self {
        Self::default()
    }

    /// A comma-separated list, as `postbox console add-user --outboxes`
    /// takes it: `tenant_a,tenant_b*`, `app_*/tenant_?`, `*` (every outbox,
    /// as is any list holding `*` or `*/*`). Spaces around a pattern are
    /// ignored; an empty list is refused (use `*`).
    pub fn parse(list: &str) -> Result<Self, ConsoleError> {
        let items: Vec<&str> = list.split(',').map(str::trim).collect();
        if items.iter().all(|i| i.is_empty()) {
            return Err(ConsoleError::InvalidOutboxPattern {
                pattern: String::new(),
                why: "name at least one outbox pattern, or '*' for every outbox",
            });
        }
        Self::from_items(items)
    }

    /// The patterns as stored (one per element); `Err` when one does not
    /// parse, which the table's constraint does not allow.
    pub(crate) fn from_stored(stored: &[String]) -> Result<Self, ConsoleError> {
        Self::from_items(stored.iter().map(String::as_str).collect())
    }

    fn from_items(items: Vec<&str>) -> Result<Self, ConsoleError> {
        let mut patterns = Vec::new();
        for item in items {
            let p = Pattern::parse(item)?;
            if !patterns.contains(&p) {
                patterns.push(p);
            }
        }
        if patterns.len() > MAX_PATTERNS {
            return Err(ConsoleError::InvalidOutboxPattern {
                pattern: String::new(),
                why: "at most 64 patterns: use globs to name many outboxes at once",
            });
        }
        if patterns.iter().any(Pattern::is_everything) {
            return Ok(Self::every());
        }
        Ok(Self(patterns))
    }

    /// Whether this is every outbox.
    pub fn is_every(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether the role applies to schema `schema` of database `database`.
    pub fn allows(&self, database: &str, schema: &str) -> bool {
        self.is_every() || self.0.iter().any(|p| p.matches(database, schema))
    }

    /// The patterns as the users table stores them (empty: every outbox).
    pub fn to_stored(&self) -> Vec<String> {
        self.0.iter().map(Pattern::to_string).collect()
    }
}

impl fmt::Display for OutboxPatterns {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_every() {
            return f.write_str("*");
        }
        f.write_str(&self.to_stored().join(","))
    }
}

/// `*` any run of characters, `?` exactly one; everything else itself.
fn glob(pattern: &str, text: &str) -> bool {
    postbox::glob::matches(pattern, text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs_match_whole_names() {
        assert!(glob("tenant_*", "tenant_a"));
        assert!(glob("tenant_*", "tenant_"));
        assert!(!glob("tenant_*", "tenant"));
        assert!(!glob("tenant_a", "tenant_ab"));
        assert!(glob("t?n*_b", "tenant_b"));
        assert!(glob("*", ""));
        assert!(glob("*a*b", "xxaxxb"));
        assert!(!glob("*a*b", "xxaxxbx"));
    }

    #[test]
    fn patterns_name_schemas_in_any_database_or_in_some() {
        let p = OutboxPatterns::parse("tenant_a, tenant_b*,db2/tenant_?").unwrap();
        assert!(!p.is_every());
        assert!(p.allows("db1", "tenant_a"));
        assert!(p.allows("any", "tenant_b"));
        assert!(p.allows("db1", "tenant_bcd"));
        assert!(!p.allows("db1", "tenant_c"));
        assert!(p.allows("db2", "tenant_c"));
        assert!(!p.allows("db3", "tenant_c"));
        assert_eq!(p.to_string(), "tenant_a,tenant_b*,db2/tenant_?");
        assert_eq!(
            OutboxPatterns::from_stored(&p.to_stored()).unwrap(),
            p,
            "what is stored reads back the same"
        );
    }

    #[test]
    fn every_outbox_is_no_pattern() {
        for all in ["*", "tenant_a,*", "*/*"] {
            let p = OutboxPatterns::parse(all).unwrap();
            assert!(p.is_every(), "{all}");
            assert!(p.to_stored().is_empty());
        }
        assert!(OutboxPatterns::from_stored(&[]).unwrap().allows("x", "y"));
        assert!(!OutboxPatterns::parse("app/*").unwrap().is_every());
    }

    #[test]
    fn malformed_patterns_are_refused_with_the_reason() {
        for bad in [
            "",
            " , ",
            "tenant_a,",
            "Tenant_A",
            "a/b/c",
            "/tenant",
            "db/",
            "ten ant",
            "tenant;drop",
            "db name/tenant",
        ] {
            let e = OutboxPatterns::parse(bad).unwrap_err();
            assert!(
                matches!(e, ConsoleError::InvalidOutboxPattern { .. }),
                "{bad:?}: {e}"
            );
        }
        let many: Vec<String> = (0..65).map(|i| format!("t{i}")).collect();
        assert!(OutboxPatterns::parse(&many.join(",")).is_err());
        assert!(OutboxPatterns::parse(&"a".repeat(64)).is_err());
        assert!(OutboxPatterns::parse(&"a".repeat(63)).is_ok());
    }
}
