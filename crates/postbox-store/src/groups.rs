//! Consumer groups (migration 26): readers that pull events from the log,
//! each group once, over SQL. The reading calls are the schema's own
//! functions (`receive`, `ack`, `nack`), so this is what any driver does;
//! the CLI, the status views and the tests use it.

use crate::catalog;
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::Schema;
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

/// Where a new group starts reading.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GroupStart {
    /// Events committed from now on.
    Now,
    /// Everything the log still retains.
    Beginning,
    /// Retained events created at or after this time.
    At(DateTime<Utc>),
}

impl GroupStart {
    fn as_sql(&self) -> String {
        match self {
            GroupStart::Now => "now".to_owned(),
            GroupStart::Beginning => "beginning".to_owned(),
            GroupStart::At(t) => t.to_rfc3339(),
        }
    }
}

impl std::str::FromStr for GroupStart {
    type Err = String;

    /// `now`, `beginning`, or an RFC 3339 time (`2026-12-01T00:00:00Z`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "now" => Ok(GroupStart::Now),
            "beginning" => Ok(GroupStart::Beginning),
            other => DateTime::parse_from_rfc3339(other)
                .map(|t| GroupStart::At(t.with_timezone(&Utc)))
                .map_err(|_| {
                    format!(
                        "{other:?} is not a start: use now, beginning or an RFC 3339 time \
                         such as 2026-12-01T00:00:00Z"
                    )
                }),
        }
    }
}

/// A group to create.
#[derive(Clone, Debug)]
pub struct NewGroup {
    pub name: String,
    pub start: GroupStart,
    /// Event-type globs the group reads (`None`: every type).
    pub types: Option<Vec<String>>,
    /// Never hand out an aggregate's event while an earlier one is in flight.
    pub ordered: bool,
    /// Hand-outs before an event becomes a dead letter (1 to 1000).
    pub max_attempts: i32,
}

impl NewGroup {
    /// A group reading every type from now on, unordered, 5 attempts.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            start: GroupStart::Now,
            types: None,
            ordered: false,
            max_attempts: 5,
        }
    }
}

/// One group as `status`, metrics and the console show it.
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct GroupStatus {
    pub name: String,
    pub types: Option<Vec<String>>,
    pub ordered: bool,
    pub max_attempts: i32,
    /// Hand-outs so far, redeliveries included.
    pub received: i64,
    /// Events that became dead letters so far.
    pub dead_lettered: i64,
    pub created_at: DateTime<Utc>,
    /// The last `receive` call.
    pub read_at: Option<DateTime<Utc>>,
    /// Committed events of its types the group has not read yet.
    pub unread: i64,
    /// Handed out, not acknowledged, visibility not over.
    pub in_flight: i64,
    /// Read and waiting to be handed out (again).
    pub waiting: i64,
    pub dead_letters: i64,
    /// Readers seen in the last minute.
    pub readers: i64,
    /// Age of its oldest event not acknowledged (`None`: none).
    pub lag_seconds: Option<f64>,
}

impl GroupStatus {
    /// Whether the group has events to hand out (or in flight) and no
    /// reader has called `receive` on it for longer than `bound`: it keeps
    /// the log's segments from being truncated.
    pub fn unread_longer_than(&self, bound: Duration) -> bool {
        let busy = self.unread > 0 || self.in_flight > 0 || self.waiting > 0;
        let since = self.read_at.unwrap_or(self.created_at);
        let idle = (Utc::now() - since).to_std().unwrap_or_default();
        busy && idle > bound
    }
}

/// An event handed out by `receive`.
#[derive(Clone, Debug, PartialEq, sqlx::FromRow)]
pub struct Received {
    /// Acknowledges (or nacks) this hand-out of the event.
    pub receipt: String,
    /// The event's id in the log.
    pub id: i64,
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub sequence: Option<i64>,
    pub schema_version: i32,
    pub payload: serde_json::Value,
    pub headers: serde_json::Value,
    pub created_at: DateTime<Utc>,
    /// 1 on the first hand-out.
    pub attempts: i32,
}

/// One of a group's dead letters.
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct GroupDeadLetter {
    pub id: i64,
    pub event_id: Uuid,
    pub event_type: Option<String>,
    pub aggregate_type: Option<String>,
    pub aggregate_id: Option<String>,
    pub attempts: i32,
    pub last_error: Option<String>,
    pub dead_at: DateTime<Utc>,
}

/// One of a group's HTTP bearer tokens, as `group token list` shows it
/// (never the token, which only its creator saw once).
#[derive(Clone, Debug, PartialEq, serde::Serialize, sqlx::FromRow)]
pub struct GroupToken {
    pub id: i64,
    pub group_name: String,
    pub label: Option<String>,
    pub created_by: String,
    pub created_at: DateTime<Utc>,
    /// Renewed at most once a minute.
    pub last_used_at: Option<DateTime<Utc>>,
}

/// What every group token starts with, so that secret scanners and people
/// can tell one when they see it.
pub const TOKEN_PREFIX: &str = "pbg_";

/// A new token: the prefix and 32 random bytes, hex.
fn new_token() -> String {
    use rand::RngCore;
    let mut bytes = [0_u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    let mut token = String::with_capacity(TOKEN_PREFIX.len() + 64);
    token.push_str(TOKEN_PREFIX);
    for b in bytes {
        token.push_str(&format!("{b:02x}"));
    }
    token
}

/// Whether `token` has the shape of a group token (the prefix and 64 hex
/// digits), so that a request with anything else is refused without a
/// database round trip.
pub fn is_token_shaped(token: &str) -> bool {
    token.strip_prefix(TOKEN_PREFIX).is_some_and(|rest| {
        rest.len() == 64 && rest.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    })
}

/// The SHA-256 of a token: what is stored and looked up.
pub fn token_hash(token: &str) -> [u8; 32] {
    use sha2::Digest;
    sha2::Sha256::digest(token.as_bytes()).into()
}

/// The action recorded in the audit log when a group is dropped.
pub const ACTION_DROP_GROUP: &str = "group_drop";
/// …and when a group's dead letters are replayed.
pub const ACTION_REPLAY_GROUP_DEAD: &str = "group_replay_dead";
/// …and when a group's HTTP token is made, or revoked.
pub const ACTION_CREATE_GROUP_TOKEN: &str = "group_token_create";
pub const ACTION_REVOKE_GROUP_TOKEN: &str = "group_token_revoke";

struct Queries {
    create: String,
    drop: String,
    receive: String,
    ack: String,
    nack: String,
    status: String,
    dead_letters: String,
    replay_dead: String,
    token_create: String,
    token_list: String,
    token_revoke: String,
    token_group: String,
    pending: String,
    audit_insert: String,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        let mut file = catalog("groups.sql", include_str!("../sql/groups.sql"));
        let queries = Self {
            create: file.render("create", schema),
            drop: file.render("drop", schema),
            receive: file.render("receive", schema),
            ack: file.render("ack", schema),
            nack: file.render("nack", schema),
            status: file.render("status", schema),
            dead_letters: file.render("dead_letters", schema),
            replay_dead: file.render("replay_dead", schema),
            token_create: file.render("token_create", schema),
            token_list: file.render("token_list", schema),
            token_revoke: file.render("token_revoke", schema),
            token_group: file.render("token_group", schema),
            pending: file.render("pending", schema),
            audit_insert: crate::dead_letters::AuditQueries::new(schema).insert,
        };
        file.finish();
        queries
    }
}

/// The consumer groups of one schema.
#[derive(Clone)]
pub struct Groups {
    pool: PgPool,
    sql: Arc<Queries>,
}

impl Groups {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            pool,
            sql: Arc::new(Queries::new(schema)),
        }
    }

    /// Create a group (the schema's owner: `create_group` is not granted to
    /// any role). A name taken already is SQLSTATE 42710; a bad name,
    /// start, type list or attempt count 22023.
    pub async fn create(&self, group: &NewGroup) -> Result<(), sqlx::Error> {
        sqlx::query(trusted(&self.sql.create))
            .bind(&group.name)
            .bind(group.start.as_sql())
            .bind(&group.types)
            .bind(group.ordered)
            .bind(group.max_attempts)
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    /// Drop a group with everything it holds, recorded in the audit log in
    /// the same transaction. False when there was no such group.
    pub async fn drop_group(
        &self,
        name: &str,
        actor: &str,
        reason: Option<&str>,
    ) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let existed: bool = sqlx::query_scalar(trusted(&self.sql.drop))
            .bind(name)
            .fetch_one(&mut *tx)
            .await?;
        if !existed {
            tx.rollback().await?;
            return Ok(false);
        }
        let selection = serde_json::json!({ "group": name });
        sqlx::query(trusted(&self.sql.audit_insert))
            .bind(actor)
            .bind(ACTION_DROP_GROUP)
            .bind(selection.to_string())
            .bind(1_i64)
            .bind(reason)
            .bind("[]")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    /// Every group with its counts.
    pub async fn status(&self) -> Result<Vec<GroupStatus>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.status))
            .fetch_all(&self.pool)
            .await
    }

    /// Up to `max` events of `group`, hidden from its other readers for
    /// `visibility`; waits up to `wait` for the log to grow when there is
    /// nothing to hand out.
    pub async fn receive(
        &self,
        group: &str,
        max: i32,
        visibility: Duration,
        wait: Duration,
    ) -> Result<Vec<Received>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.receive))
            .bind(group)
            .bind(max)
            .bind(visibility.as_secs_f64())
            .bind(wait.as_secs_f64())
            .fetch_all(&self.pool)
            .await
    }

    /// Acknowledge hand-outs; returns how many were still in flight.
    pub async fn ack(&self, group: &str, receipts: &[String]) -> Result<i32, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.ack))
            .bind(group)
            .bind(receipts)
            .fetch_one(&self.pool)
            .await
    }

    /// Give a hand-out back, to come again after `delay`; false when its
    /// receipt no longer names an event in flight.
    pub async fn nack(
        &self,
        group: &str,
        receipt: &str,
        delay: Duration,
        error: Option<&str>,
    ) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.nack))
            .bind(group)
            .bind(receipt)
            .bind(delay.as_secs_f64())
            .bind(error)
            .fetch_one(&self.pool)
            .await
    }

    /// Give `group`'s dead letters (those of `event_ids`, or all) back to
    /// it, to be handed out again with a fresh attempt count; recorded in
    /// the audit log in the same transaction. Returns how many.
    pub async fn replay_dead(
        &self,
        group: &str,
        event_ids: Option<&[Uuid]>,
        actor: &str,
        reason: Option<&str>,
    ) -> Result<i32, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let replayed: i32 = sqlx::query_scalar(trusted(&self.sql.replay_dead))
            .bind(group)
            .bind(event_ids)
            .fetch_one(&mut *tx)
            .await?;
        let selection = serde_json::json!({ "group": group, "event_ids": event_ids });
        sqlx::query(trusted(&self.sql.audit_insert))
            .bind(actor)
            .bind(ACTION_REPLAY_GROUP_DEAD)
            .bind(selection.to_string())
            .bind(i64::from(replayed))
            .bind(reason)
            .bind("[]")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(replayed)
    }

    /// A group's dead letters after log id `after`, oldest first.
    pub async fn dead_letters(
        &self,
        group: &str,
        after: i64,
        limit: i64,
    ) -> Result<Vec<GroupDeadLetter>, sqlx::Error> {
        let mut dead: Vec<GroupDeadLetter> = sqlx::query_as(trusted(&self.sql.dead_letters))
            .bind(group)
            .bind(after)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?;
        // A reader's `nack` error is its own text, stored as it came: masked
        // (URL passwords, tokens, secrets, control characters) before any
        // view shows it, as every error postbox stores itself is.
        for d in &mut dead {
            if let Some(error) = &d.last_error {
                d.last_error = Some(postbox::redact::sanitize_error(error));
            }
        }
        Ok(dead)
    }

    /// Make a bearer token for `group`'s HTTP API, recorded in the audit log
    /// in the same transaction; returns its id and the token, which is
    /// stored only as its hash (show it once). A group that does not exist
    /// is SQLSTATE 23503.
    pub async fn create_token(
        &self,
        group: &str,
        label: Option<&str>,
        actor: &str,
    ) -> Result<(i64, String), sqlx::Error> {
        let token = new_token();
        let mut tx = self.pool.begin().await?;
        let id: i64 = sqlx::query_scalar(trusted(&self.sql.token_create))
            .bind(group)
            .bind(token_hash(&token).as_slice())
            .bind(label)
            .bind(actor)
            .fetch_one(&mut *tx)
            .await?;
        self.audit_token(&mut tx, ACTION_CREATE_GROUP_TOKEN, group, id, actor)
            .await?;
        tx.commit().await?;
        Ok((id, token))
    }

    /// The tokens of `group` (or of every group), never the tokens themselves.
    pub async fn tokens(&self, group: Option<&str>) -> Result<Vec<GroupToken>, sqlx::Error> {
        sqlx::query_as(trusted(&self.sql.token_list))
            .bind(group)
            .fetch_all(&self.pool)
            .await
    }

    /// Revoke token `id` of `group` (audited); false when it had no such token.
    pub async fn revoke_token(
        &self,
        group: &str,
        id: i64,
        actor: &str,
    ) -> Result<bool, sqlx::Error> {
        let mut tx = self.pool.begin().await?;
        let gone = sqlx::query(trusted(&self.sql.token_revoke))
            .bind(group)
            .bind(id)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if gone == 0 {
            tx.rollback().await?;
            return Ok(false);
        }
        self.audit_token(&mut tx, ACTION_REVOKE_GROUP_TOKEN, group, id, actor)
            .await?;
        tx.commit().await?;
        Ok(true)
    }

    async fn audit_token(
        &self,
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        action: &str,
        group: &str,
        id: i64,
        actor: &str,
    ) -> Result<(), sqlx::Error> {
        let selection = serde_json::json!({ "group": group, "token_id": id });
        sqlx::query(trusted(&self.sql.audit_insert))
            .bind(actor)
            .bind(action)
            .bind(selection.to_string())
            .bind(1_i64)
            .bind(None::<&str>)
            .bind("[]")
            .execute(&mut **tx)
            .await?;
        Ok(())
    }

    /// The group `token` opens, if any (the consumer role may ask). A token
    /// not shaped like one is answered `None` without a query.
    pub async fn group_of_token(&self, token: &str) -> Result<Option<String>, sqlx::Error> {
        Ok(self.token_of(token).await?.map(|(group, _)| group))
    }

    /// The group `token` opens and the token's id (which `group token
    /// list` shows), if any. A token not shaped like one is answered
    /// `None` without a query.
    pub async fn token_of(&self, token: &str) -> Result<Option<(String, i64)>, sqlx::Error> {
        if !is_token_shaped(token) {
            return Ok(None);
        }
        sqlx::query_as(trusted(&self.sql.token_group))
            .bind(token_hash(token).as_slice())
            .fetch_optional(&self.pool)
            .await
    }

    /// Whether `group` has anything to hand out now: read only, no lock
    /// (false for an unknown group). `receive` takes the group's row; a
    /// waiting long poll asks this first.
    pub async fn pending(&self, group: &str) -> Result<bool, sqlx::Error> {
        sqlx::query_scalar(trusted(&self.sql.pending))
            .bind(group)
            .fetch_one(&self.pool)
            .await
    }
}

impl crate::Store {
    /// The schema's consumer groups.
    pub fn groups(&self) -> Groups {
        Groups::new(self.pool.clone(), &self.schema)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_parse() {
        assert_eq!("now".parse::<GroupStart>(), Ok(GroupStart::Now));
        assert_eq!("beginning".parse::<GroupStart>(), Ok(GroupStart::Beginning));
        let at: GroupStart = "2026-12-01T00:00:00Z".parse().unwrap();
        assert_eq!(at.as_sql(), "2026-12-01T00:00:00+00:00");
        assert!("yesterday".parse::<GroupStart>().is_err());
    }

    #[test]
    fn tokens_are_shaped_and_distinct() {
        let (a, b) = (new_token(), new_token());
        assert_ne!(a, b);
        assert!(is_token_shaped(&a), "{a}");
        assert!(!is_token_shaped(&a[..a.len() - 1]));
        assert!(!is_token_shaped(&a.to_uppercase()));
        assert!(!is_token_shaped(&a.replacen(TOKEN_PREFIX, "pbx_", 1)));
        assert_ne!(token_hash(&a), token_hash(&b));
    }
}
