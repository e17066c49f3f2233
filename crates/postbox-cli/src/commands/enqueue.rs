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
    let outbox = Outbox::new(settings.schema.clone());
    let pool = settings.pool("postbox-enqueue").await?;
    let mut tx = pool.begin().await?;
    let id = postbox::sqlx::enqueue(&outbox, &mut tx, &event).await?;
    tx.commit().await?;
    outln!("{id}");
    Ok(ExitCode::SUCCESS)
}
