//! Dead letters for operators: list, show, replay and discard them, each action
//! recorded in the audit log (`<schema>.audit_log`) in the same transaction.
//!
//! A dead letter is an outbox row with status `failed` and no resolution. Replay
//! under the same id makes it `pending` again (attempts 0, due now). Replay with
//! a new id inserts a pending copy with a fresh UUIDv7 (`replay_of` names the
//! original) and resolves the original as `replaced`. Discard resolves it as
//! `discarded` with a reason. Nothing is deleted: resolved rows keep status
//! `failed`, their payload and last error, until retention removes them.
//!
//! Bulk actions run in batches of bounded size, one transaction each: a batch's
//! rows are locked, changed and audited together, so the audit log never claims
//! more or less than what was committed.

use crate::catalog;
use crate::events::{EventRecord, Events};
use chrono::{DateTime, Utc};
use postbox::statements::trusted;
use postbox::Schema;
use serde::Serialize;
use serde_json::Value;
use sqlx::{PgPool, Row};
use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use uuid::Uuid;

/// Longest accepted actor name and discard reason.
pub const MAX_ACTOR_BYTES: usize = 255;
pub const MAX_REASON_BYTES: usize = 2000;
/// The largest batch one transaction may change.
pub const MAX_BATCH: i64 = 10_000;

/// Audit actions written by this module.
pub const ACTION_REPLAY: &str = "dlq.replay";
pub const ACTION_REPLAY_NEW_ID: &str = "dlq.replay_new_id";
pub const ACTION_DISCARD: &str = "dlq.discard";

struct Queries {
    list: String,
    count: String,
    pick: String,
    replay: String,
    replay_new_id: String,
    discard: String,
    notify: String,
    audit: AuditQueries,
}

impl Queries {
    fn new(schema: &Schema) -> Self {
        let mut file = catalog("dead_letters.sql", include_str!("../sql/dead_letters.sql"));
        let queries = Self {
            list: file.render("list", schema),
            count: file.render("count", schema),
            pick: file.render("pick", schema),
            replay: file.render("replay", schema),
            replay_new_id: file.render("replay_new_id", schema),
            discard: file.render("discard", schema),
            notify: file.render("notify", schema),
            audit: AuditQueries::new(schema),
        };
        file.finish();
        queries
    }
}

/// The audit log's statements (written by the dead letters' actions and the
/// console, read by `postbox dlq audit` and the console's audit pages).
pub(crate) struct AuditQueries {
    pub insert: String,
    pub list: String,
    pub page: String,
}

impl AuditQueries {
    pub fn new(schema: &Schema) -> Self {
        let mut file = catalog("audit.sql", include_str!("../sql/audit.sql"));
        let queries = Self {
            insert: file.render("insert", schema),
            list: file.render("list", schema),
            page: file.render("page", schema),
        };
        file.finish();
        queries
    }
}

/// What went wrong with a dead-letter operation.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DlqError {
    /// The actor name is empty or too long.
    #[error("invalid actor: {0}")]
    InvalidActor(&'static str),
    /// A discard needs a reason of reasonable length.
    #[error("invalid reason: {0}")]
    InvalidReason(&'static str),
    /// The batch size is out of range.
    #[error("invalid batch size {0}: must be between 1 and {MAX_BATCH}")]
    InvalidBatch(i64),
    /// The database refused or failed a statement.
    #[error("database error")]
    Database(#[from] sqlx::Error),
}

/// Which dead letters an operation concerns.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Filter {
    /// Only this event type.
    #[serde(rename = "type", skip_serializing_if = "Option::is_none")]
    pub event_type: Option<String>,
    /// Only events created at or after this time.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since: Option<DateTime<Utc>>,
}

/// The rows a bulk action applies to.
#[derive(Clone, Debug, PartialEq)]
pub enum Selection {
    /// These event ids (those that are not unresolved dead letters are skipped and reported).
    Ids(Vec<Uuid>),
    /// Every unresolved dead letter matching the filter.
    All(Filter),
}

impl Selection {
    /// The selection as recorded in the audit log.
    pub fn to_json(&self) -> Value {
        match self {
            Selection::Ids(ids) => serde_json::json!({ "ids": ids }),
            Selection::All(f) => {
                let mut v = serde_json::json!({ "all": true });
                if let (Value::Object(map), Ok(Value::Object(extra))) =
                    (&mut v, serde_json::to_value(f))
                {
                    map.extend(extra);
                }
                v
            }
        }
    }

    fn ids(&self) -> Option<&[Uuid]> {
        match self {
            Selection::Ids(ids) => Some(ids),
            Selection::All(_) => None,
        }
    }

    fn filter(&self) -> Filter {
        match self {
            Selection::Ids(_) => Filter::default(),
            Selection::All(f) => f.clone(),
        }
    }
}

/// What to do with the selected dead letters.
#[derive(Clone, Debug, PartialEq)]
pub enum Action {
    /// Deliver again under the same event id (the same logical effect).
    Replay,
    /// Deliver a copy under a fresh event id (a new operation); resolve the original as replaced.
    ReplayAsNew,
    /// Give up on them, with a reason; they stay in the table, resolved as discarded.
    Discard { reason: String },
}

impl Action {
    /// The audit log's name for this action.
    pub fn name(&self) -> &'static str {
        match self {
            Action::Replay => ACTION_REPLAY,
            Action::ReplayAsNew => ACTION_REPLAY_NEW_ID,
            Action::Discard { .. } => ACTION_DISCARD,
        }
    }
}

/// One dead letter, as listed.
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct DeadLetter {
    pub event_id: Uuid,
    pub event_type: String,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub schema_version: i32,
    pub attempts: i32,
    pub created_at: DateTime<Utc>,
    pub last_error: Option<String>,
}

/// One audit log entry.
#[derive(Clone, Debug, PartialEq, Serialize, sqlx::FromRow)]
pub struct AuditEntry {
    pub id: i64,
    pub at: DateTime<Utc>,
    pub actor: String,
    pub action: String,
    #[sqlx(json)]
    pub selection: Value,
    pub count: i64,
    pub reason: Option<String>,
    #[sqlx(json)]
    pub details: Value,
}

/// Progress of a bulk action, reported after each committed batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Progress {
    /// Events changed so far (committed).
    pub done: u64,
    /// Events that matched when the action started.
    pub total: u64,
}

/// The result of a bulk action.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Applied {
    /// Events changed.
    pub count: u64,
    /// Committed batches (= audit entries written).
    pub batches: u64,
    /// For [`Action::ReplayAsNew`]: (original, copy) event ids.
    pub new_ids: Vec<(Uuid, Uuid)>,
    /// For [`Selection::Ids`]: ids that were not unresolved dead letters, untouched.
    pub skipped: Vec<Uuid>,
}

/// Dead-letter operations on one schema. Get one with [`crate::Store::dead_letters`].
#[derive(Clone)]
pub struct DeadLetters {
    pool: PgPool,
    sql: Arc<Queries>,
    events: Events,
    /// Recorded as `outbox` in each audit entry's selection (see
    /// [`DeadLetters::naming`]).
    outbox: Option<String>,
}

impl DeadLetters {
    pub fn new(pool: PgPool, schema: &Schema) -> Self {
        Self {
            events: Events::new(pool.clone(), schema),
            pool,
            sql: Arc::new(Queries::new(schema)),
            outbox: None,
        }
    }

    /// The same operations, each audit entry naming `outbox` (e.g.
    /// `<database>/<schema>`) in its selection, for a reader of many
    /// outboxes' logs.
    pub fn naming(mut self, outbox: impl Into<String>) -> Self {
        self.outbox = Some(outbox.into());
        self
    }

    /// Unresolved dead letters matching `filter`, oldest first, at most `limit`.
    pub async fn list(&self, filter: &Filter, limit: i64) -> Result<Vec<DeadLetter>, DlqError> {
        Ok(sqlx::query_as(trusted(&self.sql.list))
            .bind(filter.event_type.as_deref())
            .bind(filter.since)
            .bind(None::<Vec<Uuid>>)
            .bind(0_i64)
            .bind(limit.max(0))
            .fetch_all(&self.pool)
            .await?)
    }

    /// How many unresolved dead letters match `filter`.
    pub async fn count(&self, filter: &Filter) -> Result<u64, DlqError> {
        let n: i64 = sqlx::query_scalar(trusted(&self.sql.count))
            .bind(filter.event_type.as_deref())
            .bind(filter.since)
            .bind(None::<Vec<Uuid>>)
            .fetch_one(&self.pool)
            .await?;
        Ok(u64::try_from(n).unwrap_or_default())
    }

    /// One event by id (any status), or `None` if there is no such event
    /// (see [`Events::show`]).
    pub async fn show(&self, event_id: Uuid) -> Result<Option<EventRecord>, DlqError> {
        Ok(self.events.show(event_id).await?)
    }

    /// The newest audit entries, at most `limit`; only those touching `event_id` when given.
    pub async fn audit_log(
        &self,
        limit: i64,
        event_id: Option<Uuid>,
    ) -> Result<Vec<AuditEntry>, DlqError> {
        Ok(sqlx::query_as(trusted(&self.sql.audit.list))
            .bind(limit.max(0))
            .bind(event_id)
            .fetch_all(&self.pool)
            .await?)
    }

    /// Apply `action` to the selected dead letters in batches of `batch` rows,
    /// one transaction and one audit entry per batch, calling `progress` after
    /// each commit.
    pub async fn apply(
        &self,
        selection: &Selection,
        action: &Action,
        actor: &str,
        batch: i64,
        progress: impl FnMut(Progress),
    ) -> Result<Applied, DlqError> {
        self.apply_until(selection, action, actor, batch, progress, || false)
            .await
    }

    /// [`DeadLetters::apply`], asking `stop` before each batch: once it
    /// answers true no further batch starts (committed batches stay, each
    /// with its audit entry), and the result counts what was committed.
    pub async fn apply_until(
        &self,
        selection: &Selection,
        action: &Action,
        actor: &str,
        batch: i64,
        mut progress: impl FnMut(Progress),
        stop: impl Fn() -> bool,
    ) -> Result<Applied, DlqError> {
        check_actor(actor)?;
        if let Action::Discard { reason } = action {
            check_reason(reason)?;
        }
        if !(1..=MAX_BATCH).contains(&batch) {
            return Err(DlqError::InvalidBatch(batch));
        }
        let filter = selection.filter();
        let mut applied = Applied::default();
        let mut found = HashSet::new();
        let total = match selection {
            Selection::Ids(ids) => {
                let mut unique = ids.clone();
                unique.sort();
                unique.dedup();
                let n: i64 = sqlx::query_scalar(trusted(&self.sql.count))
                    .bind(None::<&str>)
                    .bind(None::<DateTime<Utc>>)
                    .bind(&unique)
                    .fetch_one(&self.pool)
                    .await?;
                u64::try_from(n).unwrap_or_default()
            }
            Selection::All(f) => self.count(f).await?,
        };
        let mut selection_json = selection.to_json();
        if let (Some(name), Value::Object(map)) = (&self.outbox, &mut selection_json) {
            map.insert("outbox".to_owned(), Value::String(name.clone()));
        }
        let selection_json = selection_json.to_string();
        let mut after = 0_i64;
        loop {
            if stop() {
                break;
            }
            let mut tx = self.pool.begin().await?;
            let rows = sqlx::query(trusted(&self.sql.pick))
                .bind(filter.event_type.as_deref())
                .bind(filter.since)
                .bind(selection.ids())
                .bind(after)
                .bind(batch)
                .fetch_all(&mut *tx)
                .await?;
            let Some(last) = rows.last() else {
                tx.rollback().await?;
                break;
            };
            after = last.try_get("id")?;
            let mut ids = Vec::with_capacity(rows.len());
            let mut picked = Vec::with_capacity(rows.len());
            for r in &rows {
                ids.push(r.try_get::<i64, _>("id")?);
                let event_id: Uuid = r.try_get("event_id")?;
                let last_error: Option<String> = r.try_get("last_error")?;
                found.insert(event_id);
                picked.push((event_id, last_error));
            }
            let mut copies = HashMap::new();
            let (count, reason) = match action {
                Action::Replay => {
                    let changed: Vec<Uuid> = sqlx::query_scalar(trusted(&self.sql.replay))
                        .bind(&ids)
                        .fetch_all(&mut *tx)
                        .await?;
                    (changed.len(), None)
                }
                Action::ReplayAsNew => {
                    let pairs = sqlx::query(trusted(&self.sql.replay_new_id))
                        .bind(&ids)
                        .fetch_all(&mut *tx)
                        .await?;
                    for p in &pairs {
                        let original: Uuid = p.try_get("original")?;
                        let copy: Uuid = p.try_get("copy")?;
                        applied.new_ids.push((original, copy));
                        copies.insert(original, copy);
                    }
                    (pairs.len(), None)
                }
                Action::Discard { reason } => {
                    let changed: Vec<Uuid> = sqlx::query_scalar(trusted(&self.sql.discard))
                        .bind(&ids)
                        .bind(reason)
                        .fetch_all(&mut *tx)
                        .await?;
                    (changed.len(), Some(reason.as_str()))
                }
            };
            let details: Vec<Value> = picked
                .into_iter()
                .map(|(event_id, last_error)| {
                    let mut d =
                        serde_json::json!({ "event_id": event_id, "last_error": last_error });
                    if let Some(copy) = copies.get(&event_id) {
                        d["new_event_id"] = Value::String(copy.to_string());
                    }
                    d
                })
                .collect();
            let count_i64 = i64::try_from(count).unwrap_or(i64::MAX);
            sqlx::query(trusted(&self.sql.audit.insert))
                .bind(actor)
                .bind(action.name())
                .bind(&selection_json)
                .bind(count_i64)
                .bind(reason)
                .bind(Value::Array(details).to_string())
                .execute(&mut *tx)
                .await?;
            if matches!(action, Action::Replay) {
                sqlx::query(trusted(&self.sql.notify))
                    .execute(&mut *tx)
                    .await?;
            }
            tx.commit().await?;
            applied.count += count as u64;
            applied.batches += 1;
            progress(Progress {
                done: applied.count,
                total,
            });
        }
        if let Selection::Ids(ids) = selection {
            let mut seen = HashSet::new();
            applied.skipped = ids
                .iter()
                .filter(|id| !found.contains(*id) && seen.insert(**id))
                .copied()
                .collect();
        }
        Ok(applied)
    }
}

fn check_actor(actor: &str) -> Result<(), DlqError> {
    if actor.trim().is_empty() {
        return Err(DlqError::InvalidActor("must not be empty"));
    }
    if actor.len() > MAX_ACTOR_BYTES {
        return Err(DlqError::InvalidActor("must be at most 255 bytes"));
    }
    if actor.contains('\0') {
        return Err(DlqError::InvalidActor("must not contain NUL characters"));
    }
    Ok(())
}

fn check_reason(reason: &str) -> Result<(), DlqError> {
    if reason.trim().is_empty() {
        return Err(DlqError::InvalidReason("must not be empty"));
    }
    if reason.len() > MAX_REASON_BYTES {
        return Err(DlqError::InvalidReason("must be at most 2000 bytes"));
    }
    if reason.contains('\0') {
        return Err(DlqError::InvalidReason("must not contain NUL characters"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn selections_are_recorded_as_given() {
        let id = Uuid::nil();
        assert_eq!(
            Selection::Ids(vec![id]).to_json(),
            serde_json::json!({"ids": [id]})
        );
        let f = Filter {
            event_type: Some("order.created".into()),
            since: None,
        };
        assert_eq!(
            Selection::All(f).to_json(),
            serde_json::json!({"all": true, "type": "order.created"})
        );
    }

    #[test]
    fn actors_and_reasons_are_checked() {
        assert!(check_actor("").is_err());
        assert!(check_actor(&"a".repeat(256)).is_err());
        assert!(check_actor("alice").is_ok());
        assert!(check_reason("  ").is_err());
        assert!(check_reason("poison payload").is_ok());
    }
}
