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
pub use crate::group_reader::{GroupReader, Handed};
use crate::supervisor::RelayCommand;
use crate::{lock, AnyError};
use postbox::Schema;
use postbox_proxy::FaultProxy;
use postbox_store::{Groups, NewGroup};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

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

/// A reader's way to the group, and how long what it takes stays hidden.
pub struct PullReader {
    pub reader: GroupReader,
    pub visibility: Duration,
}

/// How long a receive waits for events before it answers empty.
const WAIT: Duration = Duration::from_millis(500);

impl PullReader {
    pub async fn receive(&self, max: usize) -> Result<Vec<Handed>, AnyError> {
        self.reader.receive(max, self.visibility, WAIT).await
    }

    pub async fn ack(&self, receipts: &[String]) -> Result<(), AnyError> {
        self.reader.ack(receipts).await.map(drop)
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
        let client = crate::group_reader::http_client(Duration::from_secs(15))?;
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
