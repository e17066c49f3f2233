//! A pull run of the checker (`--sink group:sql` or `--sink group:http`):
//! no relay and no broker. Producers write into the log; readers of one
//! consumer group apply each event through the inbox and acknowledge it,
//! over SQL (`receive`/`ack` through the database's fault proxy) or over
//! HTTP (`postbox group serve` children, each behind a fault proxy of its
//! own, SIGKILLed and stalled by the fault schedule as relays are). The
//! `kill` fault also kills readers: a reader's task is aborted wherever it
//! is — receiving, applying, acknowledging — and a new one starts; what it
//! held comes back when its visibility ends.

use super::consumer::{Consumer, Seen, Source};
use crate::supervisor::RelayCommand;
use crate::{lock, AnyError};
use postbox::Schema;
use postbox_proxy::FaultProxy;
use postbox_store::{Groups, NewGroup};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// The run's consumer group.
pub const GROUP: &str = "verify";

/// How the readers reach the group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pull {
    /// `receive`/`ack` over SQL, through the database's fault proxy.
    Sql,
    /// `postbox group serve`'s HTTP API, each server behind a fault proxy.
    Http,
}

impl Pull {
    /// The pull run `--sink` names (`group:sql`, `group:http`), if it names one.
    pub fn from_sink(sink: &str) -> Option<Result<Pull, AnyError>> {
        let rest = sink.strip_prefix("group:")?;
        Some(match rest {
            "sql" => Ok(Pull::Sql),
            "http" => Ok(Pull::Http),
            other => Err(format!(
                "--sink group:{other}: a consumer group is read over group:sql or group:http"
            )
            .into()),
        })
    }
}

/// One handed-out event, as the consumer needs it.
pub struct Handed {
    pub receipt: String,
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    pub sequence: i64,
    pub attempts: i32,
}

/// A reader's way to the group.
pub enum GroupReader {
    Sql {
        groups: Groups,
        visibility: Duration,
    },
    Http {
        client: reqwest::Client,
        /// `http://127.0.0.1:PORT/groups/verify` (a fault proxy's port).
        base: String,
        token: String,
        visibility: Duration,
    },
}

/// How long a receive waits for events before it answers empty.
const WAIT: Duration = Duration::from_millis(500);

#[derive(serde::Deserialize)]
struct Answer {
    events: Vec<AnswerEvent>,
}

#[derive(serde::Deserialize)]
struct AnswerEvent {
    receipt: String,
    attempts: i32,
    event: CloudEvent,
}

#[derive(serde::Deserialize)]
struct CloudEvent {
    id: Uuid,
    aggregatetype: String,
    subject: String,
    sequence: Option<i64>,
}

impl GroupReader {
    pub async fn receive(&self, max: usize) -> Result<Vec<Handed>, AnyError> {
        let max = i32::try_from(max.min(1000)).unwrap_or(1000);
        match self {
            GroupReader::Sql { groups, visibility } => Ok(groups
                .receive(GROUP, max, *visibility, WAIT)
                .await?
                .into_iter()
                .map(|r| Handed {
                    receipt: r.receipt,
                    event_id: r.event_id,
                    aggregate_type: r.aggregate_type,
                    aggregate_id: r.aggregate_id,
                    sequence: r.sequence.unwrap_or(0),
                    attempts: r.attempts,
                })
                .collect()),
            GroupReader::Http { visibility, .. } => {
                let answer: Answer = self
                    .post(
                        "receive",
                        serde_json::json!({
                            "max_events": max,
                            "visibility_seconds": visibility.as_secs_f64().max(1.0),
                            "wait_seconds": WAIT.as_secs_f64(),
                        }),
                    )
                    .await?;
                Ok(answer
                    .events
                    .into_iter()
                    .map(|e| Handed {
                        receipt: e.receipt,
                        event_id: e.event.id,
                        aggregate_type: e.event.aggregatetype,
                        aggregate_id: e.event.subject,
                        sequence: e.event.sequence.unwrap_or(0),
                        attempts: e.attempts,
                    })
                    .collect())
            }
        }
    }

    pub async fn ack(&self, receipts: &[String]) -> Result<(), AnyError> {
        if receipts.is_empty() {
            return Ok(());
        }
        match self {
            GroupReader::Sql { groups, .. } => {
                groups.ack(GROUP, receipts).await?;
            }
            GroupReader::Http { .. } => {
                let _: serde_json::Value = self
                    .post("ack", serde_json::json!({ "receipts": receipts }))
                    .await?;
            }
        }
        Ok(())
    }

    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        call: &str,
        body: serde_json::Value,
    ) -> Result<T, AnyError> {
        let GroupReader::Http {
            client,
            base,
            token,
            ..
        } = self
        else {
            return Err("not an HTTP reader".into());
        };
        let response = client
            .post(format!("{base}/{call}"))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await?;
        let status = response.status();
        let bytes = response.bytes().await?;
        if !status.is_success() {
            return Err(format!(
                "{call} answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            )
            .into());
        }
        Ok(serde_json::from_slice(&bytes)?)
    }
}

/// Create the run's group: every event from now on (before any producer
/// commits), in order when the run is ordered, and never a dead letter.
pub async fn create_group(groups: &Groups, ordered: bool) -> Result<(), AnyError> {
    groups
        .create(&NewGroup {
            ordered,
            max_attempts: 1000,
            ..NewGroup::new(GROUP)
        })
        .await?;
    Ok(())
}

/// The HTTP side of a pull run: one `postbox group serve` per slot on a
/// port of its own, each behind a fault proxy, and the group's token.
pub struct HttpSide {
    pub commands: Vec<RelayCommand>,
    pub proxies: Vec<FaultProxy>,
    pub token: String,
    pub client: reqwest::Client,
}

impl HttpSide {
    pub async fn prepare(
        servers: usize,
        database_url: &str,
        schema: &Schema,
        groups: &Groups,
    ) -> Result<Self, AnyError> {
        let (_, token) = groups
            .create_token(GROUP, Some("postbox verify"), "postbox verify")
            .await?;
        let mut commands = Vec::with_capacity(servers);
        let mut proxies = Vec::with_capacity(servers);
        for _ in 0..servers {
            // A port free now, kept by the server across its restarts.
            let port = std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port();
            let listen = format!("127.0.0.1:{port}");
            proxies.push(FaultProxy::start(&listen).await?);
            commands.push(RelayCommand::group_server(database_url, schema, &listen)?);
        }
        // reqwest (rustls without a provider of its own) needs one, even
        // for plain HTTP.
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(15))
            .build()?;
        Ok(Self {
            commands,
            proxies,
            token,
            client,
        })
    }
}

/// Makes the reader of slot `i` (a fresh one after a kill).
pub type ReaderFactory = Arc<dyn Fn(usize) -> ReaderParts + Send + Sync>;

/// A reader about to run: the consumer and where it reads.
pub struct ReaderParts {
    pub consumer: Consumer,
    pub source: Source,
}

/// The group's readers: each a task, killed (aborted wherever it is) and
/// started again by the fault schedule.
pub struct Readers {
    seen: Arc<Seen>,
    stop: CancellationToken,
    factory: ReaderFactory,
    tasks: Vec<Mutex<JoinHandle<()>>>,
}

impl Readers {
    pub fn start(
        n: usize,
        seen: Arc<Seen>,
        stop: CancellationToken,
        factory: ReaderFactory,
    ) -> Self {
        let tasks = (0..n)
            .map(|i| Mutex::new(spawn(&factory, i, &seen, &stop)))
            .collect();
        Self {
            seen,
            stop,
            factory,
            tasks,
        }
    }

    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    pub fn seen(&self) -> &Seen {
        &self.seen
    }

    pub fn seen_arc(&self) -> Arc<Seen> {
        self.seen.clone()
    }

    /// Abort reader `i` wherever it is and start a new one in its place.
    pub fn kill(&self, i: usize) {
        let mut task = lock(&self.tasks[i]);
        task.abort();
        *task = spawn(&self.factory, i, &self.seen, &self.stop);
    }

    /// Stop every reader (their `stop` was cancelled) and wait for them.
    pub async fn join(self) {
        self.stop.cancel();
        for t in self.tasks {
            let t = t.into_inner().unwrap_or_else(|p| p.into_inner());
            let _ = t.await;
        }
    }
}

fn spawn(
    factory: &ReaderFactory,
    i: usize,
    seen: &Arc<Seen>,
    stop: &CancellationToken,
) -> JoinHandle<()> {
    let ReaderParts { consumer, source } = factory(i);
    let (seen, stop) = (seen.clone(), stop.clone());
    tokio::spawn(async move { consumer.run(source, &seen, stop).await })
}
