//! The outbox directory: where a process serving many outboxes finds them.
//! The relay, the console, `migrate`, `status` and `dlq` all name their
//! outboxes as [`Source`]s (a listed outbox, or schema and database name
//! patterns) and list them with [`list`]; each keeps its own pools (a relay
//! adds a LISTEN connection per database, the console smaller pools) through
//! the `pool` function it passes in.

use crate::discovery;
use postbox::Schema;
use sqlx::postgres::PgConnectOptions;
use sqlx::PgPool;
use std::collections::HashMap;

/// A pattern over schema or database names (`--schemas`, `--databases`):
/// `*` any run of characters, `?` one character. Not the router's
/// event-type pattern, though it matches the same way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamePattern(String);

impl NamePattern {
    /// A pattern of 1 to 255 bytes without control characters.
    pub fn parse(glob: &str) -> Result<Self, String> {
        if glob.is_empty() || glob.len() > postbox::MAX_NAME_BYTES {
            return Err("must be 1 to 255 bytes long".into());
        }
        if glob.chars().any(char::is_control) {
            return Err("must not contain control characters".into());
        }
        Ok(Self(glob.to_owned()))
    }

    pub fn matches(&self, name: &str) -> bool {
        postbox::glob::matches(&self.0, name)
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Where outboxes come from. `T` is what the caller keeps with a listed
/// outbox (the relay: the outbox's own router; the console: nothing).
#[derive(Clone, Debug)]
pub enum Source<T = ()> {
    /// One outbox: `schema` in the database `connect` points to.
    Outbox {
        connect: PgConnectOptions,
        schema: Schema,
        with: T,
    },
    /// Every schema `schemas` matches, in the database `connect` points to
    /// or, with `databases`, in every database of that server it matches
    /// (`connect`'s own database is then only used to list them).
    Discover {
        connect: PgConnectOptions,
        databases: Option<NamePattern>,
        schemas: NamePattern,
    },
}

impl<T> Source<T> {
    /// The same source keeping `f(with)` instead.
    pub fn map<U>(self, f: impl FnOnce(T) -> U) -> Source<U> {
        match self {
            Source::Outbox {
                connect,
                schema,
                with,
            } => Source::Outbox {
                connect,
                schema,
                with: f(with),
            },
            Source::Discover {
                connect,
                databases,
                schemas,
            } => Source::Discover {
                connect,
                databases,
                schemas,
            },
        }
    }
}

/// Which schemas a discovery lists.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schemas {
    /// Those holding a migrated outbox (serving, showing).
    Migrated,
    /// Every schema but the system's (`migrate --schemas`).
    All,
}

/// Whether a listed outbox's schema was found in its database.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Presence {
    Present,
    /// A [`Source::Outbox`] whose schema is not there (or not migrated).
    Missing,
    /// Its database could not be listed (see [`Listing::unlisted`]).
    Unknown,
}

/// An outbox a listing found (or, for [`Source::Outbox`], looked for).
#[derive(Debug)]
pub struct Found<'a, T> {
    /// The index of the source that named it.
    pub source: usize,
    /// The database's name and its pool-directory key (`host:port/name`).
    pub database: String,
    pub key: String,
    pub pool: PgPool,
    pub schema: Schema,
    /// A listed outbox's `with`; `None` for a discovered one.
    pub with: Option<&'a T>,
    pub presence: Presence,
}

impl<T> Found<'_, T> {
    /// `<database>/<schema>`: how the outbox is named in labels and pages.
    pub fn name(&self) -> String {
        format!("{}/{}", self.database, self.schema.name())
    }
}

/// What could not be listed.
#[derive(Debug)]
pub struct Unlisted {
    pub source: usize,
    /// The database that could not be listed, and its key: its schemas, or
    /// with `server`, the server's databases (read through this one).
    pub database: String,
    pub key: String,
    /// The server's list of databases could not be read.
    pub server: bool,
    /// What it was, for messages: `database app_1`, `the server of database postgres`.
    pub what: String,
    pub error: sqlx::Error,
}

/// One listing of every source.
#[derive(Debug)]
pub struct Listing<'a, T> {
    /// Listed outboxes first, then discovered ones, each in source order; an
    /// outbox named by two sources is found once, as the first names it.
    pub found: Vec<Found<'a, T>>,
    pub unlisted: Vec<Unlisted>,
}

/// The database `connect` points to (PostgreSQL's default: the user's name).
pub fn database_of(connect: &PgConnectOptions) -> String {
    connect
        .get_database()
        .unwrap_or_else(|| connect.get_username())
        .to_owned()
}

/// The pool-directory key of the database `connect` points to.
pub fn key_of(connect: &PgConnectOptions) -> String {
    format!(
        "{}:{}/{}",
        connect.get_host(),
        connect.get_port(),
        database_of(connect)
    )
}

/// List every source's outboxes; `pool(key, connect)` gives the pool of the
/// database `connect` points to (the caller's directory of pools, keyed by
/// [`key_of`]). Each database is listed once per call.
pub async fn list<'a, T>(
    sources: &'a [Source<T>],
    which: Schemas,
    pool: &mut (dyn FnMut(&str, &PgConnectOptions) -> PgPool + Send),
) -> Listing<'a, T> {
    let mut listing = Listing {
        found: Vec::new(),
        unlisted: Vec::new(),
    };
    let mut listed: HashMap<String, Option<Vec<String>>> = HashMap::new();
    let mut seen = std::collections::HashSet::new();
    // Listed outboxes first: one a pattern also matches keeps the listing's
    // `with` (the relay: the outbox's own routes).
    let listed_first = sources
        .iter()
        .enumerate()
        .filter(|(_, s)| matches!(s, Source::Outbox { .. }))
        .chain(
            sources
                .iter()
                .enumerate()
                .filter(|(_, s)| matches!(s, Source::Discover { .. })),
        );
    for (i, source) in listed_first {
        let (targets, wanted, with) = match source {
            Source::Outbox {
                connect,
                schema,
                with,
            } => (vec![connect.clone()], Wanted::One(schema), Some(with)),
            Source::Discover {
                connect,
                databases,
                schemas,
            } => {
                let targets = match databases {
                    None => vec![connect.clone()],
                    Some(pattern) => {
                        let server = pool(&key_of(connect), connect);
                        match discovery::databases(&server).await {
                            Ok(names) => names
                                .iter()
                                .filter(|n| pattern.matches(n))
                                .map(|n| connect.clone().database(n))
                                .collect(),
                            Err(error) => {
                                listing.unlisted.push(Unlisted {
                                    source: i,
                                    database: database_of(connect),
                                    key: key_of(connect),
                                    server: true,
                                    what: format!(
                                        "the server of database {}",
                                        database_of(connect)
                                    ),
                                    error,
                                });
                                continue;
                            }
                        }
                    }
                };
                (targets, Wanted::Matching(schemas), None)
            }
        };
        for target in targets {
            let key = key_of(&target);
            let database = database_of(&target);
            let db_pool = pool(&key, &target);
            if !listed.contains_key(&key) {
                let names = match which {
                    Schemas::Migrated => discovery::outbox_schemas(&db_pool).await,
                    Schemas::All => discovery::all_schemas(&db_pool).await,
                };
                let names = match names {
                    Ok(names) => Some(names),
                    Err(error) => {
                        listing.unlisted.push(Unlisted {
                            source: i,
                            database: database.clone(),
                            key: key.clone(),
                            server: false,
                            what: format!("database {database}"),
                            error,
                        });
                        None
                    }
                };
                listed.insert(key.clone(), names);
            }
            let names = listed.get(&key).and_then(Option::as_ref);
            let mut found = |schema: Schema, presence: Presence| {
                if seen.insert((key.clone(), schema.name().to_owned())) {
                    listing.found.push(Found {
                        source: i,
                        database: database.clone(),
                        key: key.clone(),
                        pool: db_pool.clone(),
                        schema,
                        with,
                        presence,
                    });
                }
            };
            match wanted {
                Wanted::One(schema) => {
                    let presence = match names {
                        None => Presence::Unknown,
                        Some(n) if n.iter().any(|s| s == schema.name()) => Presence::Present,
                        Some(_) => Presence::Missing,
                    };
                    found(schema.clone(), presence);
                }
                Wanted::Matching(pattern) => {
                    for name in names.into_iter().flatten() {
                        if !pattern.matches(name) {
                            continue;
                        }
                        // A name postbox could not have created: not an outbox of ours.
                        if let Ok(schema) = Schema::new(name) {
                            found(schema, Presence::Present);
                        }
                    }
                }
            }
        }
    }
    listing
}

enum Wanted<'a> {
    One(&'a Schema),
    Matching(&'a NamePattern),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn name_patterns_are_bounded_and_match_globs() {
        assert!(NamePattern::parse("").is_err());
        assert!(NamePattern::parse("a\nb").is_err());
        assert!(NamePattern::parse(&"x".repeat(256)).is_err());
        let p = NamePattern::parse("tenant_*").unwrap();
        assert!(p.matches("tenant_a") && !p.matches("other"));
    }
}
