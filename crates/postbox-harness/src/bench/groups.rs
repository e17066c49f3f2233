//! `postbox bench --only groups`: consumer groups read over SQL — `receive`
//! a batch, `ack` its receipts, one transaction each — and over HTTP
//! (`postbox group serve`'s API, served in this process on a port of
//! 127.0.0.1), by one reader and by four sharing a group, against PgQ's
//! consumer API (`next_batch`, `get_batch_events`, `finish_batch` in one
//! transaction) on the same server with `--peers pgq`. No sink: what is
//! measured is the reading. The log is seeded once; each run reads it
//! through a group of its own created at its beginning. Two rounds, the
//! order of the readers reversed in the second. Then the latency from
//! commit to one long-polling reader, over SQL and over HTTP, with
//! producers committing one event per transaction at `--rate`.

use super::report::{Groups, GroupsRow, Latency};
use super::{pgq, Bench, Peer};
use crate::group_reader::GroupReader;
use crate::{lock, AnyError};
use postbox_store::{GroupStart, Groups as StoreGroups, NewGroup, ProducerTarget, Store};
use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;
use uuid::Uuid;

/// How long a hand-out stays hidden: far longer than a run.
const VISIBILITY: Duration = Duration::from_secs(600);

/// How long the HTTP latency reader's long polls wait: the API's longest.
const LONG_POLL: Duration = Duration::from_secs(20);
/// …and the SQL reader's: short, since a SQL call is never cancelled
/// half-way (its connection would go back to the pool mid-query); the
/// reader sees its stop between two polls.
const SQL_LONG_POLL: Duration = Duration::from_secs(2);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Reader {
    Sql(usize),
    Http(usize),
    Pgq,
}

impl Reader {
    fn label(self) -> String {
        match self {
            Reader::Sql(1) => "SQL receive + ack, 1 reader".to_owned(),
            Reader::Sql(n) => format!("SQL receive + ack, {n} readers"),
            Reader::Http(1) => "HTTP receive + ack, 1 reader".to_owned(),
            Reader::Http(n) => format!("HTTP receive + ack, {n} readers"),
            Reader::Pgq => "PgQ consumer API, 1 reader".to_owned(),
        }
    }

    fn readers(self) -> usize {
        match self {
            Reader::Sql(n) | Reader::Http(n) => n,
            Reader::Pgq => 1,
        }
    }
}

impl Bench<'_> {
    pub(super) async fn groups(&self) -> Result<Groups, AnyError> {
        let events = self.options.events;
        let batch = i32::try_from(self.options.batch_size.clamp(1, 1000))?;
        self.store.reset().await?;
        crate::progressln!("groups: seeding {events} events into the log…");
        self.store.seed_log(events, self.options.aggregates).await?;
        let groups = StoreGroups::new(self.pool.clone(), &self.schema);

        let mut pgq_skipped = None;
        let peer = if self.options.peers.contains(&Peer::Pgq) {
            let queue = format!("{}_pgq", self.schema.name());
            match pgq::PgqPeer::open(self.pool.clone(), &queue).await? {
                Ok(peer) => Some(peer),
                Err(why) => {
                    crate::errln!("groups: PgQ skipped: {why}");
                    pgq_skipped = Some(why);
                    None
                }
            }
        } else {
            None
        };
        let http = HttpGroups::start(self).await?;
        let mut order = vec![
            Reader::Sql(1),
            Reader::Http(1),
            Reader::Sql(4),
            Reader::Http(4),
        ];
        if peer.is_some() {
            order.insert(1, Reader::Pgq);
        }
        let mut rates: Vec<(Reader, Vec<f64>)> = order.iter().map(|&r| (r, Vec::new())).collect();
        let measured = async {
            for round in 0..2 {
                let this_round: Vec<Reader> = if round == 0 {
                    order.clone()
                } else {
                    order.iter().rev().copied().collect()
                };
                for reader in this_round {
                    crate::progressln!("groups: {} (round {})…", reader.label(), round + 1);
                    let elapsed = match (reader, &peer) {
                        (Reader::Sql(n), _) => {
                            let name = format!("bench-{round}-{n}");
                            read_group(&groups, None, &name, n, batch, events).await?
                        }
                        (Reader::Http(n), _) => {
                            let name = format!("bench-http-{round}-{n}");
                            read_group(&groups, Some(&http), &name, n, batch, events).await?
                        }
                        (Reader::Pgq, Some(peer)) => {
                            peer.seed(events, i64::from(batch)).await?;
                            peer.drain(None, events).await?.elapsed
                        }
                        (Reader::Pgq, None) => unreachable!("PgQ runs only when it opened"),
                    };
                    let rate = events as f64 / elapsed.as_secs_f64();
                    if let Some((_, r)) = rates.iter_mut().find(|(r, _)| *r == reader) {
                        r.push(rate);
                    }
                }
            }
            Ok::<_, AnyError>(())
        }
        .await;
        if let Some(peer) = peer {
            peer.close().await?;
        }
        if let Err(e) = measured {
            http.stop().await;
            return Err(e);
        }
        let latency = self.long_poll_latency(&groups, &http).await;
        http.stop().await;
        let latency = latency?;
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        let pgq_rate = rates
            .iter()
            .find(|(r, _)| *r == Reader::Pgq)
            .map(|(_, v)| mean(v));
        Ok(Groups {
            events,
            batch_size: batch,
            rows: rates
                .iter()
                .map(|(reader, v)| GroupsRow {
                    reader: reader.label(),
                    readers: reader.readers(),
                    rounds_events_per_s: v.iter().map(|r| r.round()).collect(),
                    events_per_s: mean(v).round(),
                    vs_pgq: pgq_rate.map(|p| super::round2(mean(v) / p)),
                })
                .collect(),
            pgq_skipped,
            latency,
        })
    }

    /// Commit → one long-polling reader of a group created now, over SQL
    /// and over HTTP, with producers committing one event per transaction
    /// at `--rate` for `--duration`.
    async fn long_poll_latency(
        &self,
        groups: &StoreGroups,
        http: &HttpGroups,
    ) -> Result<Vec<Latency>, AnyError> {
        Store::new(self.pool.clone(), self.schema.clone())
            .log()
            .set_producer_target(ProducerTarget::Log)
            .await?;
        let mut rows = Vec::new();
        for over_http in [false, true] {
            let name = if over_http {
                "latency-http"
            } else {
                "latency-sql"
            };
            let mode = if over_http {
                "HTTP long poll (20 s)"
            } else {
                "SQL long poll (2 s)"
            };
            crate::progressln!(
                "groups: commit → {mode} at {} events/s for {}…",
                self.options.rate,
                humantime::format_duration(self.options.duration)
            );
            groups.create(&NewGroup::new(name)).await?;
            let reader = reader_of(groups, over_http.then_some(http), name).await?;
            let wait = if over_http { LONG_POLL } else { SQL_LONG_POLL };
            let arrived: Arc<Mutex<Vec<(Uuid, Instant)>>> = Arc::default();
            let stop = CancellationToken::new();
            let reader = {
                let (arrived, stop) = (arrived.clone(), stop.clone());
                tokio::spawn(async move {
                    while !stop.is_cancelled() {
                        // An HTTP poll is let go at the stop (the server
                        // holds no database connection while it waits); a
                        // SQL call is never cancelled half-way, or its
                        // connection would go back to the pool mid-query.
                        let polled = if over_http {
                            tokio::select! {
                                () = stop.cancelled() => break,
                                got = reader.receive(1000, VISIBILITY, wait) => got?,
                            }
                        } else {
                            reader.receive(1000, VISIBILITY, wait).await?
                        };
                        let now = Instant::now();
                        lock(&arrived).extend(polled.iter().map(|h| (h.event_id, now)));
                        let receipts: Vec<String> = polled.into_iter().map(|h| h.receipt).collect();
                        reader.ack(&receipts).await?;
                    }
                    Ok::<_, AnyError>(())
                })
            };
            let committed = self.produce_steadily(false).await;
            let all_in = async {
                let committed = committed.as_ref().map_err(|e| e.to_string())?;
                let deadline = Instant::now() + Duration::from_secs(30);
                while lock(&arrived).len() < committed.len() && Instant::now() < deadline {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                Ok::<_, String>(())
            }
            .await;
            stop.cancel();
            let read = reader.await;
            groups.drop_group(name, "postbox bench", None).await?;
            let committed = committed?;
            all_in?;
            read??;
            let arrived = std::mem::take(&mut *lock(&arrived));
            rows.push(super::latency::measure(
                mode.to_owned(),
                self.options.rate,
                self.options.duration,
                &committed,
                &arrived,
            )?);
        }
        Ok(rows)
    }
}

/// `postbox group serve`'s API in this process, on a free port of
/// 127.0.0.1, and an HTTP client for it.
struct HttpGroups {
    client: reqwest::Client,
    /// `http://127.0.0.1:PORT`.
    base: String,
    stop: CancellationToken,
}

impl HttpGroups {
    async fn start(bench: &Bench<'_>) -> Result<Self, AnyError> {
        let stop = CancellationToken::new();
        let api = postbox_pull::PullApi::new(
            bench.pool.clone(),
            &bench.schema,
            postbox_pull::PullOptions::default(),
            stop.clone(),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        tokio::spawn(api.clone().wake_on_notifications(stop.clone()));
        tokio::spawn({
            let stop = stop.clone();
            async move {
                let limits = postbox::serve::Limits {
                    max_connections: 64,
                    ..postbox::serve::Limits::default()
                };
                if let Err(e) =
                    postbox::serve::serve(listener, api.router(), limits, stop.cancelled_owned())
                        .await
                {
                    crate::errln!("groups: the HTTP API stopped: {e}");
                }
            }
        });
        let client = crate::group_reader::http_client(LONG_POLL + Duration::from_secs(15))?;
        Ok(Self { client, base, stop })
    }

    async fn stop(&self) {
        self.stop.cancel();
    }
}

/// A reader of group `name`: over SQL, or over `http` with a token made now.
async fn reader_of(
    groups: &StoreGroups,
    http: Option<&HttpGroups>,
    name: &str,
) -> Result<GroupReader, AnyError> {
    Ok(match http {
        None => GroupReader::Sql {
            groups: groups.clone(),
            group: name.to_owned(),
        },
        Some(http) => GroupReader::Http {
            client: http.client.clone(),
            base: format!("{}/groups/{name}", http.base),
            token: groups
                .create_token(name, Some("bench"), "postbox bench")
                .await?
                .1,
        },
    })
}

/// Create group `name` at the log's beginning and let `readers` readers
/// (over SQL, or over `http`) receive and acknowledge all `events` of it;
/// the time they took.
async fn read_group(
    groups: &StoreGroups,
    http: Option<&HttpGroups>,
    name: &str,
    readers: usize,
    batch: i32,
    events: i64,
) -> Result<Duration, AnyError> {
    groups
        .create(&NewGroup {
            start: GroupStart::Beginning,
            ..NewGroup::new(name)
        })
        .await?;
    let reader = reader_of(groups, http, name).await?;
    let batch = usize::try_from(batch).unwrap_or(1000);
    let done = Arc::new(AtomicI64::new(0));
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(readers);
    for _ in 0..readers {
        let (reader, done) = (reader.clone(), done.clone());
        tasks.push(tokio::spawn(async move {
            while done.load(Ordering::Relaxed) < events {
                let got = reader.receive(batch, VISIBILITY, Duration::ZERO).await?;
                if got.is_empty() {
                    // The rest is in another reader's hands.
                    tokio::time::sleep(Duration::from_millis(1)).await;
                    continue;
                }
                let receipts: Vec<String> = got.into_iter().map(|h| h.receipt).collect();
                done.fetch_add(reader.ack(&receipts).await?, Ordering::Relaxed);
            }
            Ok::<_, AnyError>(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let elapsed = started.elapsed();
    groups.drop_group(name, "postbox bench", None).await?;
    Ok(elapsed)
}
