//! The least-privilege roles of `postbox migrate --create-roles`.

use crate::catalog;
use postbox::statements::trusted;
use postbox::Schema;

/// The roles `create_roles` makes for one schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    /// Can only enqueue.
    pub producer: String,
    /// What the relay needs on postbox's tables.
    pub relay: String,
    /// Read-only.
    pub monitor: String,
    /// Reads consumer groups (receive, ack, nack) and nothing else.
    pub consumer: String,
}

/// The schema name is too long to derive role names from it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("schema name {schema:?} is too long for role names: `{schema}_producer` must fit in 63 bytes (use a schema name of at most 54 bytes)")]
pub struct RoleNameError {
    pub schema: String,
}

impl Roles {
    /// `<schema>_producer`, `<schema>_relay`, `<schema>_monitor`,
    /// `<schema>_consumer`.
    pub fn for_schema(schema: &Schema) -> Result<Self, RoleNameError> {
        let name = schema.name();
        if name.len() + "_producer".len() > 63 {
            return Err(RoleNameError {
                schema: name.to_owned(),
            });
        }
        Ok(Self {
            producer: format!("{name}_producer"),
            relay: format!("{name}_relay"),
            monitor: format!("{name}_monitor"),
            consumer: format!("{name}_consumer"),
        })
    }

    /// The idempotent script creating the roles and their grants, for
    /// `postbox migrate --create-roles` (and `--print-sql`). Schema names are
    /// restricted to `[a-z0-9_]`, so the role names need no quoting.
    pub fn sql(&self, schema: &Schema) -> String {
        let mut file = catalog("roles.sql", include_str!("../sql/roles.sql"));
        let script = file.render_with(
            "create_roles",
            schema,
            &[
                ("producer", &self.producer),
                ("relay", &self.relay),
                ("monitor", &self.monitor),
                ("consumer", &self.consumer),
            ],
        );
        file.finish();
        script
    }
}

/// `create_roles` failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CreateRolesError {
    #[error(transparent)]
    Name(#[from] RoleNameError),
    #[error(
        "cannot create the roles (the user needs CREATEROLE and the right to grant on the schema)"
    )]
    Database(#[from] sqlx::Error),
}

impl crate::Store {
    /// Create the least-privilege roles (idempotent). Needs a user allowed to
    /// create roles and to grant on postbox's schema.
    pub async fn create_roles(&self) -> Result<Roles, CreateRolesError> {
        let roles = Roles::for_schema(&self.schema)?;
        sqlx::raw_sql(trusted(&roles.sql(&self.schema)))
            .execute(&self.pool)
            .await?;
        Ok(roles)
    }
}
