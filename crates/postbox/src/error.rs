/// Everything that can go wrong in the postbox library.
///
/// Messages name the field or step at fault and never contain connection
/// strings or other secrets.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The schema name cannot be used.
    #[error("invalid schema name {name:?}: {reason}")]
    InvalidSchema { name: String, reason: String },

    /// An event field is empty, too long or holds a character Postgres cannot store.
    #[error("invalid event: {field} {reason}")]
    InvalidEvent { field: &'static str, reason: String },

    /// The payload could not be serialized to JSON.
    #[error("invalid event: payload could not be serialized to JSON")]
    Payload(#[source] serde_json::Error),

    /// A consumer name is empty or too long.
    #[error("invalid consumer name: {reason}")]
    InvalidConsumer { reason: String },

    /// A migration that is already applied differs from the one in this binary.
    #[error(
        "migration {version} ({name}) was applied with different contents \
         (database checksum {applied}, this binary {expected}); \
         migrations must never be edited once released"
    )]
    MigrationChanged {
        version: i32,
        name: &'static str,
        applied: String,
        expected: String,
    },

    /// The database holds migrations newer than this binary knows.
    #[error(
        "schema {schema} is at migration {found}, newer than this binary's latest ({latest}); \
         upgrade postbox"
    )]
    SchemaTooNew {
        schema: String,
        found: i32,
        latest: i32,
    },

    /// A migration failed to apply; nothing of it was committed.
    #[error("migration {version} ({name}) failed")]
    Migration {
        version: i32,
        name: &'static str,
        #[source]
        source: Box<Error>,
    },

    /// An error from sqlx. Its text is the source's (`Error::source`), not
    /// repeated in this message, so error reporters that print the chain
    /// (anyhow, eyre) show it once.
    #[cfg(feature = "sqlx")]
    #[error("database error")]
    Sqlx(#[source] ::sqlx::Error),

    /// An error from tokio-postgres (its text is the source's, as for `Sqlx`).
    #[cfg(feature = "tokio-postgres")]
    #[error("database error")]
    Postgres(#[source] ::tokio_postgres::Error),
}

impl Error {
    /// The SQLSTATE code when the database rejected a statement.
    pub fn sqlstate(&self) -> Option<String> {
        match self {
            #[cfg(feature = "sqlx")]
            Error::Sqlx(e) => e
                .as_database_error()
                .and_then(|d| d.code())
                .map(|c| c.into_owned()),
            #[cfg(feature = "tokio-postgres")]
            Error::Postgres(e) => e.code().map(|c| c.code().to_owned()),
            Error::Migration { source, .. } => source.sqlstate(),
            _ => None,
        }
    }
}

#[cfg(feature = "sqlx")]
impl From<::sqlx::Error> for Error {
    fn from(e: ::sqlx::Error) -> Self {
        Error::Sqlx(e)
    }
}

#[cfg(feature = "tokio-postgres")]
impl From<::tokio_postgres::Error> for Error {
    fn from(e: ::tokio_postgres::Error) -> Self {
        Error::Postgres(e)
    }
}
