//! `postbox route test`: for one event, which destinations of the
//! configuration get it and the exact body and headers each receives,
//! through the relay's own routes, filters and transforms; nothing is sent.
//! The console's event page shows the same ([`Preview`] is its
//! `RoutePreview`).

use crate::config::FileConfig;
use crate::context::{AnyError, Settings};
use crate::output::outln;
use clap::{Args, Subcommand};
use futures::future::BoxFuture;
use postbox_console::preview::{DestinationPreview, RoutePreview, StoredEvent, Verdict};
use postbox_relay::shape::Shaped;
use postbox_relay::{Message, Outcome, Router, Sink, SinkError, Store};
use serde::Deserialize;
use serde_json::value::RawValue;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use uuid::Uuid;

#[derive(Args, Debug)]
pub struct RouteArgs {
    #[command(subcommand)]
    pub command: RouteCommand,
}

#[derive(Subcommand, Debug)]
pub enum RouteCommand {
    /// Show which destinations get one event, and the exact body and
    /// headers each would receive (nothing is sent); exit 1 when an
    /// expression fails on it
    Test(TestArgs),
}

#[derive(Args, Debug)]
pub struct TestArgs {
    /// The event as a JSON file ('-': standard input): {"event_type": …,
    /// "aggregate_type": …, "aggregate_id": …, "payload": …, "headers": {…}};
    /// "id", "sequence", "schema_version" and "created_at" are optional
    #[arg(
        value_name = "EVENT.json",
        required_unless_present = "event_id",
        conflicts_with = "event_id"
    )]
    pub event: Option<PathBuf>,
    /// Read the event from the database instead: the outbox table, the
    /// log's retained segments or the archive (needs DATABASE_URL)
    #[arg(long, value_name = "ID")]
    pub event_id: Option<Uuid>,
    /// CloudEvents source attribute [default: each destination's `source`, or postbox]
    #[arg(long, env = "POSTBOX_SOURCE")]
    pub source: Option<String>,
    /// Print JSON: the event, then one object per destination
    #[arg(long)]
    pub json: bool,
}

pub async fn run(settings: &Settings, args: RouteArgs) -> Result<ExitCode, AnyError> {
    let RouteCommand::Test(args) = args.command;
    let preview = Preview::from_file(&settings.file, args.source.clone())?;
    let (event, redacted) = match (&args.event, args.event_id) {
        (_, Some(id)) => {
            let pool = settings.pool("postbox-route").await?;
            let store = Store::new(pool, settings.schema.clone());
            let mut found = store.events().find(id).await?.ok_or_else(|| {
                format!(
                    "no event {id} in schema {}: neither the outbox table, the log nor the archive holds it",
                    settings.schema.name()
                )
            })?;
            // A stored event is shown as `dlq show` and the console show
            // one: what [redact] names is masked before the expressions
            // see it, so no masked value reaches the output.
            let redactor = settings.file.redact.redactor()?;
            settings.warn_if_unredacted("`postbox route test --event-id`");
            if !redactor.is_empty() {
                let mut payload: serde_json::Value = serde_json::from_str(&found.payload)?;
                redactor.redact(&mut payload);
                found.payload = payload.to_string();
                redactor.redact_headers(&mut found.headers);
            }
            (found, !redactor.is_empty())
        }
        (Some(path), None) => (read_event(path)?, false),
        (None, None) => {
            return Err("give an event file (EVENT.json, or - for stdin) or --event-id".into())
        }
    };
    let lines = preview.of(&event).await;
    let fails = lines
        .iter()
        .any(|l| matches!(l.verdict, Verdict::Fails { .. }));
    if args.json {
        let doc = serde_json::json!({
            "event": event,
            "found_in": event.place,
            "redacted": redacted,
            "destinations": lines,
        });
        outln!("{}", serde_json::to_string_pretty(&doc)?);
    } else {
        print_text(&event, &lines);
        if redacted {
            outln!();
            outln!("(previewed from the event with [redact]'s paths and headers masked)");
        }
    }
    Ok(if fails {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

fn print_text(event: &StoredEvent, lines: &[DestinationPreview]) {
    outln!(
        "event {} ({}, {}/{}){}",
        event.event_id,
        event.event_type,
        event.aggregate_type,
        event.aggregate_id,
        match event.place.as_str() {
            "file" => String::new(),
            place => format!(", from the {place}"),
        }
    );
    for line in lines {
        outln!();
        match &line.verdict {
            Verdict::Sends { body, headers, by } => {
                outln!(
                    "{}: gets it{}",
                    line.destination,
                    by.as_deref()
                        .map(|b| format!(" (shaped by {b})"))
                        .unwrap_or_default()
                );
                outln!("  body: {body}");
                if headers.is_empty() {
                    outln!("  headers: none");
                } else {
                    outln!("  headers:");
                    for (k, v) in headers {
                        outln!("    {k}: {v}");
                    }
                }
            }
            Verdict::Filtered { by } => {
                outln!("{}: filtered out by the filter of {by}", line.destination);
            }
            Verdict::NotRouted => {
                outln!(
                    "{}: no route sends {} here",
                    line.destination,
                    event.event_type
                );
            }
            Verdict::Fails { error } => {
                outln!(
                    "{}: dead letter of this destination: {error}",
                    line.destination
                );
            }
        }
    }
}

/// The event file's fields: the same names expressions read.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct EventFile {
    id: Option<Uuid>,
    event_type: String,
    #[serde(default = "unknown")]
    aggregate_type: String,
    #[serde(default = "unknown")]
    aggregate_id: String,
    #[serde(default = "one")]
    schema_version: i32,
    sequence: Option<i64>,
    created_at: Option<chrono::DateTime<chrono::Utc>>,
    #[serde(default = "null")]
    payload: Box<RawValue>,
    #[serde(default)]
    headers: BTreeMap<String, String>,
}

fn unknown() -> String {
    "unknown".to_owned()
}

fn null() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

fn one() -> i32 {
    1
}

fn read_event(path: &std::path::Path) -> Result<StoredEvent, AnyError> {
    let shown = path.display();
    let text = if path.as_os_str() == "-" {
        std::io::read_to_string(std::io::stdin())
            .map_err(|e| format!("cannot read the event from standard input: {e}"))?
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("cannot read {shown}: {e}"))?
    };
    let e: EventFile = serde_json::from_str(&text).map_err(|e| format!("{shown}: {e}"))?;
    Ok(StoredEvent {
        event_id: e.id.unwrap_or_else(Uuid::now_v7),
        event_type: e.event_type,
        aggregate_type: e.aggregate_type,
        aggregate_id: e.aggregate_id,
        schema_version: e.schema_version,
        sequence: e.sequence,
        created_at: e.created_at.unwrap_or_else(chrono::Utc::now),
        payload: e.payload.get().to_owned(),
        headers: serde_json::to_value(e.headers)?,
        place: "file".to_owned(),
    })
}

/// The configuration's destinations and routes with their expressions,
/// over sinks that send nothing.
pub struct Preview {
    router: Arc<Router>,
    steps: u64,
    /// Each destination's CloudEvents source, in the router's order.
    sources: Vec<String>,
}

impl std::fmt::Debug for Preview {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Preview")
            .field("destinations", &self.router.destinations().len())
            .field("steps", &self.steps)
            .finish()
    }
}

impl Preview {
    /// The configuration's routes (`[sink]`, or `[destinations.*]` with
    /// `[[routes]]`; without either, one destination taking every event),
    /// expressions compiled; `source` overrides every destination's.
    pub fn from_file(file: &FileConfig, source: Option<String>) -> Result<Self, AnyError> {
        let placeholder = file.destinations.is_empty() && file.sink.url.is_none();
        let router = super::relay::router_of(file, placeholder.then_some("none"), &|_, _, _| {
            Ok(Arc::new(Unsent) as Arc<dyn Sink>)
        })?;
        // One destination: `[sink]`'s; else each `[destinations.NAME]`'s.
        let sources = router
            .destinations()
            .iter()
            .map(|d| {
                let section = file.destinations.get(&d.name).unwrap_or(&file.sink);
                section.sink_options(source.clone()).source
            })
            .collect();
        Ok(Self {
            router: Arc::new(router),
            steps: file.relay.expression_steps,
            sources,
        })
    }

    /// What each destination makes of `event`.
    pub async fn of(&self, event: &StoredEvent) -> Vec<DestinationPreview> {
        let names = self.router.destinations().iter().map(|d| d.name.clone());
        let m = match postbox_relay::replay::stored_message(event) {
            Ok(m) => m,
            Err(error) => {
                return names
                    .map(|destination| DestinationPreview {
                        destination,
                        verdict: Verdict::Fails {
                            error: error.clone(),
                        },
                    })
                    .collect()
            }
        };
        let answers = self.router.preview(m.clone(), self.steps).await;
        let Some(answers) = answers else {
            return names
                .map(|destination| DestinationPreview {
                    destination,
                    verdict: Verdict::Fails {
                        error: "the expression evaluator did not answer".into(),
                    },
                })
                .collect();
        };
        names
            .zip(answers)
            .zip(&self.sources)
            .map(|((destination, answer), source)| DestinationPreview {
                destination,
                verdict: verdict(&m, answer, source),
            })
            .collect()
    }
}

impl RoutePreview for Preview {
    fn preview<'a>(&'a self, event: &'a StoredEvent) -> BoxFuture<'a, Vec<DestinationPreview>> {
        Box::pin(self.of(event))
    }
}

fn verdict(m: &Message, answer: Option<Shaped>, source: &str) -> Verdict {
    match answer {
        None => Verdict::NotRouted,
        Some(Shaped::Filtered { by }) => Verdict::Filtered { by },
        Some(failed @ Shaped::Failed { .. }) => Verdict::Fails {
            error: failed.error().unwrap_or_default(),
        },
        Some(Shaped::Send {
            payload,
            headers,
            by,
        }) => {
            let sent = postbox_relay::shape::reshaped(m, payload, headers);
            Verdict::Sends {
                body: postbox_relay::cloudevents::to_json(&sent, source),
                headers: sent.headers,
                by,
            }
        }
    }
}

/// The sink of a previewed destination: never called (the preview only
/// shapes events), and sends nothing if it were.
pub(crate) struct Unsent;

#[async_trait::async_trait]
impl Sink for Unsent {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        vec![Outcome::retry("a preview sends nothing"); batch.len()]
    }
    async fn check(&self) -> Result<(), SinkError> {
        Ok(())
    }
    fn describe(&self) -> String {
        "preview (sends nothing)".into()
    }
}
