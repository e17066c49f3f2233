//! `postbox enqueue`: one event, in its own transaction.

use crate::context::{AnyError, Settings};
use crate::output::outln;
use clap::Args;
use postbox::{NewEvent, Outbox};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct EnqueueArgs {
    /// Event type, e.g. order.created
    #[arg(long = "type", value_name = "TYPE")]
    pub event_type: String,
    /// Aggregate type, e.g. order
    #[arg(long)]
    pub aggregate_type: String,
    /// Aggregate id, e.g. 42
    #[arg(long)]
    pub aggregate_id: String,
    /// Payload as JSON
    #[arg(long)]
    pub payload: String,
    /// Header NAME=VALUE, forwarded by transports with headers (repeatable)
    #[arg(long = "header", value_name = "NAME=VALUE")]
    pub headers: Vec<String>,
    /// Payload schema version
    #[arg(long, default_value_t = 1)]
    pub schema_version: i32,
    /// Deliver no earlier than TIME (RFC 3339, e.g. 2030-01-31T09:00:00Z)
    #[arg(long, value_name = "TIME", value_parser = parse_time, conflicts_with = "deliver_after")]
    pub deliver_at: Option<chrono::DateTime<chrono::Utc>>,
    /// Deliver no earlier than DURATION from now (e.g. 90s, 10m, 2h), by the database's clock
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub deliver_after: Option<std::time::Duration>,
}

fn parse_time(text: &str) -> Result<chrono::DateTime<chrono::Utc>, String> {
    chrono::DateTime::parse_from_rfc3339(text)
        .map(|t| t.with_timezone(&chrono::Utc))
        .map_err(|e| format!("{e}: expected an RFC 3339 time such as 2030-01-31T09:00:00Z"))
}

/// `--payload` is not JSON.
#[derive(Debug, thiserror::Error)]
#[error("--payload could not be parsed as JSON (line {line}, column {column})")]
pub struct PayloadError {
    line: usize,
    column: usize,
    #[source]
    source: serde_json::Error,
}

pub async fn run(settings: &Settings, args: EnqueueArgs) -> Result<ExitCode, AnyError> {
    let mut headers = Vec::new();
    for h in &args.headers {
        let (name, value) = h
            .split_once('=')
            .ok_or_else(|| format!("--header {h:?}: expected NAME=VALUE"))?;
        headers.push((name.to_owned(), value.to_owned()));
    }
    // Parse first, to say where the JSON breaks (the library only says that it does).
    if let Err(source) = serde_json::from_str::<serde::de::IgnoredAny>(&args.payload) {
        return Err(PayloadError {
            line: source.line(),
            column: source.column(),
            source,
        }
        .into());
    }
    let event = NewEvent::from_json(
        args.event_type,
        args.aggregate_type,
        args.aggregate_id,
        args.payload,
    )?
    .schema_version(args.schema_version)?
    .headers(headers)?;
    let event = match (args.deliver_at, args.deliver_after) {
        (Some(at), _) => event.deliver_at(at)?,
        (None, Some(after)) => event.deliver_after(after)?,
        (None, None) => event,
    };
    let outbox = Outbox::new(settings.schema.clone());
    let pool = settings.pool("postbox-enqueue").await?;
    let mut tx = pool.begin().await?;
    let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
    tx.commit().await?;
    outln!("{id}");
    Ok(ExitCode::SUCCESS)
}
