//! Named SQL statements kept in `.sql` files.
//!
//! Every statement postbox runs lives in a `.sql` file of the crate that runs
//! it (`crates/*/sql/<area>.sql`), grouped per area, one entry per statement:
//!
//! ```sql
//! -- name: purge_sent
//! -- What the statement does, for the reader.
//! DELETE FROM {schema}.outbox WHERE …;
//! ```
//!
//! A crate embeds its files with `include_str!`, parses them into a
//! [`Catalog`] once, and takes each entry by name while it renders its
//! statements for a schema. Taking a name the file lacks panics (a programming
//! error the crate's own tests hit at once); [`Catalog::finish`] checks, in
//! debug builds, that no entry was left unused, so a file cannot keep a
//! statement nothing runs.
//!
//! Placeholders: `{schema}` (the quoted schema) and `{channel}` (the
//! NOTIFY channel literal) are filled by [`Catalog::render`]; a crate may use
//! others of its own and fill them with [`Catalog::render_with`].

use crate::Schema;
use std::collections::BTreeMap;

/// Hand a statement postbox composed itself to sqlx.
///
/// sqlx takes `&'static str` as SQL and asks any other string to be wrapped
/// in [`sqlx::AssertSqlSafe`](::sqlx::AssertSqlSafe), a marker that someone
/// checked it cannot carry an injection. Every statement postbox runs is such a string: a [`Catalog`]
/// entry (or a test's own text) rendered with [`Schema::quoted`] — a validated
/// identifier, double-quoted — and the `{channel}` literal derived from it.
/// Values are never spliced into the text; they are always bound (`$1`, …).
/// This is the one place that assertion is made, so a reader auditing the SQL
/// postbox sends looks here and at the `.sql` files:
///
/// ```ignore
/// sqlx::query(trusted(&self.sql.claim)).bind(limit).fetch_all(&mut *tx).await?;
/// ```
///
/// Never pass text that holds a value from outside (an event field, a request,
/// a configuration string other than a validated schema or role name).
#[cfg(feature = "sqlx")]
pub fn trusted(statement: &str) -> ::sqlx::AssertSqlSafe<&str> {
    ::sqlx::AssertSqlSafe(statement)
}

/// The parsed entries of one `.sql` file.
#[derive(Debug)]
pub struct Catalog {
    file: &'static str,
    entries: BTreeMap<&'static str, Entry>,
}

#[derive(Debug)]
struct Entry {
    sql: String,
    taken: bool,
}

/// Why a `.sql` file could not be read as a catalog.
#[derive(Debug, thiserror::Error)]
#[error("{file}: {reason}")]
pub struct CatalogError {
    file: &'static str,
    reason: String,
}

impl Catalog {
    /// Parse `text` (the contents of `file`, named in errors).
    ///
    /// Text before the first `-- name:` line may hold only comments. Each
    /// entry's statement is its non-comment lines, trimmed, without a
    /// trailing `;`.
    pub fn parse(file: &'static str, text: &'static str) -> Result<Self, CatalogError> {
        let error = |reason: String| CatalogError { file, reason };
        let mut entries = BTreeMap::new();
        let mut current: Option<(&'static str, Vec<&'static str>)> = None;
        let close = |entry: Option<(&'static str, Vec<&'static str>)>,
                     entries: &mut BTreeMap<&'static str, Entry>|
         -> Result<(), CatalogError> {
            let Some((name, lines)) = entry else {
                return Ok(());
            };
            let sql = lines.join("\n");
            let sql = sql.trim().trim_end_matches(';').trim_end().to_owned();
            if sql.is_empty() {
                return Err(error(format!("entry {name:?} has no statement")));
            }
            if entries.insert(name, Entry { sql, taken: false }).is_some() {
                return Err(error(format!("entry {name:?} is defined twice")));
            }
            Ok(())
        };
        for (number, line) in text.lines().enumerate() {
            let trimmed = line.trim();
            if let Some(name) = trimmed.strip_prefix("-- name:") {
                let name = name.trim();
                if name.is_empty()
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                {
                    return Err(error(format!(
                        "line {}: entry names are lower-case letters, digits and '_'",
                        number + 1
                    )));
                }
                close(current.take(), &mut entries)?;
                current = Some((name, Vec::new()));
            } else if trimmed.starts_with("--") || trimmed.is_empty() {
                // Comments and blank lines are for the reader.
            } else if let Some((_, lines)) = current.as_mut() {
                lines.push(line);
            } else {
                return Err(error(format!(
                    "line {}: a statement before the first '-- name:' line",
                    number + 1
                )));
            }
        }
        close(current.take(), &mut entries)?;
        Ok(Self { file, entries })
    }

    /// The statement named `name`, as written (placeholders unfilled).
    ///
    /// # Panics
    /// When the file has no such entry: the calling crate and its `.sql` file
    /// disagree, which its tests catch on the first run.
    pub fn take(&mut self, name: &str) -> &str {
        let file = self.file;
        let entry = self
            .entries
            .get_mut(name)
            .unwrap_or_else(|| panic!("{file} has no statement named {name:?}"));
        entry.taken = true;
        &entry.sql
    }

    /// The statement named `name` with `{schema}` and `{channel}` filled in.
    pub fn render(&mut self, name: &str, schema: &Schema) -> String {
        schema.render(self.take(name))
    }

    /// Like [`Catalog::render`], then each `{key}` of `extra` replaced by its value.
    pub fn render_with(&mut self, name: &str, schema: &Schema, extra: &[(&str, &str)]) -> String {
        let mut sql = self.render(name, schema);
        for (key, value) in extra {
            sql = sql.replace(&format!("{{{key}}}"), value);
        }
        sql
    }

    /// Every entry's name, in order.
    pub fn names(&self) -> impl Iterator<Item = &'static str> + '_ {
        self.entries.keys().copied()
    }

    /// Done taking: in debug builds, panic if an entry was never taken (a
    /// statement nothing runs should leave its file).
    pub fn finish(self) {
        let unused: Vec<_> = self
            .entries
            .iter()
            .filter(|(_, e)| !e.taken)
            .map(|(name, _)| *name)
            .collect();
        debug_assert!(
            unused.is_empty(),
            "{}: statements nothing takes: {unused:?}",
            self.file
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r"-- The header says what the file holds.

-- name: first
-- One row.
SELECT 1
  FROM {schema}.outbox;

-- name: second
NOTIFY {channel};
";

    #[test]
    fn entries_are_taken_by_name_and_rendered() {
        let mut catalog = Catalog::parse("test.sql", FILE).unwrap();
        assert_eq!(catalog.names().collect::<Vec<_>>(), ["first", "second"]);
        let schema = Schema::new("shop").unwrap();
        assert_eq!(
            catalog.render("first", &schema),
            "SELECT 1\n  FROM \"shop\".outbox"
        );
        assert_eq!(catalog.render("second", &schema), "NOTIFY 'postbox_shop'");
        catalog.finish();
    }

    #[test]
    fn extra_placeholders_are_filled() {
        let mut catalog =
            Catalog::parse("x.sql", "-- name: a\nSELECT {limit} FROM {schema}.t").unwrap();
        let sql = catalog.render_with("a", &Schema::default(), &[("limit", "10")]);
        assert_eq!(sql, "SELECT 10 FROM \"postbox\".t");
    }

    #[test]
    fn malformed_files_are_refused() {
        for (text, reason) in [
            ("SELECT 1", "before the first"),
            ("-- name: a\n-- name: b\nSELECT 1", "no statement"),
            ("-- name: a\nSELECT 1\n-- name: a\nSELECT 2", "twice"),
            ("-- name: Bad-Name\nSELECT 1", "lower-case"),
        ] {
            let err = Catalog::parse("bad.sql", text).unwrap_err().to_string();
            assert!(err.contains(reason), "{text:?}: {err}");
            assert!(err.starts_with("bad.sql: "), "{err}");
        }
    }

    #[test]
    #[should_panic(expected = "no statement named")]
    fn taking_a_missing_name_panics() {
        Catalog::parse("x.sql", "-- name: a\nSELECT 1")
            .unwrap()
            .take("b");
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "statements nothing takes")]
    fn unused_entries_are_caught() {
        Catalog::parse("x.sql", "-- name: a\nSELECT 1")
            .unwrap()
            .finish();
    }
}
