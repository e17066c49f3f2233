//! Logical mode over the streaming replication protocol
//! (`relay.logical_transport = "stream"`, the default).
//!
//! The reader holds the slot's advisory lock on an ordinary connection (one
//! reader per slot, standbys wait, as with the SQL transport), creates the
//! slot through SQL when it is missing, then opens a replication connection
//! (`pgwire-replication`) and runs `START_REPLICATION SLOT … LOGICAL` with
//! pgoutput (`proto_version '1'`, the slot's publication, `messages
//! 'true'`). The server pushes each transaction as it commits, decoded once;
//! the reader publishes events in batches (`batch_size` pending, or as soon
//! as the stream has nothing more ready), reading on into the next batch
//! while one is checked and published (two batches in memory at most),
//! hands what a destination did not take to the outbox, and only then
//! raises the position it reports in its standby status updates
//! (`confirmed_flush_lsn`) to the last commit whose events were all
//! published or handed off. A server keepalive read while no
//! transaction is open and nothing is pending confirms up to its WAL
//! position, so the slot follows the WAL while only other writes happen.
//! A relay crash redelivers at most what was read since the last
//! confirmation; a server crash, at most what was confirmed since the last
//! read note (the session moves the slot up to the note, see `open`).

use super::{
    open, publish_batch, Batches, Ended, Failures, Note, Opened, ReadError, Settled, SlotWatch,
    READ_NOTE, SLOT_CHECK,
};
use crate::engine::{RunMode, Shared};
use crate::redact::sanitize_error;
use futures::FutureExt;
use percent_encoding::percent_decode_str;
use pgwire_replication::{
    PgWireError, ReplicationClient, ReplicationConfig, ReplicationEvent, SslMode, TlsConfig,
};
use postbox_store::{decode_or_refuse, Logical, LogicalEvent, Lsn, Refusal};
use sqlx::postgres::{PgConnectOptions, PgSslMode};
use sqlx::ConnectOptions;
use std::time::{Duration, Instant};

/// How soon a raised confirmation is sent to the server (standby status
/// update), at most: a batch confirmed is reported within this.
const STATUS_INTERVAL: Duration = Duration::from_millis(100);
/// How often a status update is sent while the stream is idle.
const IDLE_STATUS: Duration = Duration::from_secs(1);
/// On shutdown, how long the last confirmation may take to reach the server.
const FINAL_STATUS_WAIT: Duration = Duration::from_secs(2);
/// Draining: stop when nothing arrived for this long (the server sends a
/// keepalive as soon as it has caught up, so this is only a safety net).
const DRAIN_IDLE: Duration = Duration::from_secs(5);
/// How long an idle reader waits before its periodic chores (slot gauges,
/// read notes).
const CHORES: Duration = Duration::from_secs(1);

/// Hold the slot, stream it until shutdown (draining: until it has read up
/// to the WAL's flush position at the start).
pub(super) async fn session(
    shared: &Shared,
    logical: &Logical,
    batches: &Batches,
    slot: &str,
    mode: RunMode,
    failures: &mut Failures,
) -> Result<Ended, ReadError> {
    let Some(Opened {
        mut conn,
        confirmed,
        mut watch,
    }) = open(shared, logical, slot).await?
    else {
        return Ok(Ended::Standby);
    };
    failures.opened(slot, confirmed)?;
    let upto = match mode {
        RunMode::Drain => Some(logical.flush_lsn(&mut conn).await?),
        _ => None,
    };
    if upto.is_some_and(|upto| confirmed >= upto) {
        return Ok(Ended::Drained);
    }
    // A reader still failing notes its read once it has recovered
    // (`Failures`): noting it now would wipe the failures the schema shows.
    if !failures.failing() {
        logical.read_now(&mut conn, slot, confirmed).await?;
    }
    let config = replication_config(
        shared.store.pool().connect_options().as_ref(),
        slot,
        batch_buffer(shared),
    )?;
    let mut client = ReplicationClient::connect(config)
        .await
        .map_err(refused_or_stream)?;
    client.wait_started().await.map_err(refused_or_stream)?;
    tracing::info!(%slot, transport = "stream", "reading the replication slot");
    let mut reader = Reader {
        shared,
        logical,
        batches,
        prefix: logical.prefix().to_owned(),
        client,
        pending: Vec::with_capacity(shared.config.batch_size as usize),
        refused: Vec::new(),
        in_txn: false,
        last_commit: None,
        confirmed,
        raised: false,
        note: Note::new(confirmed),
    };
    let ended = reader
        .run(&mut conn, slot, upto, &mut watch, failures)
        .await;
    // A session that ends well notes where it got to: a server restart
    // before the slot's position is saved then delivers nothing again.
    if matches!(ended, Ok(Ended::Shutdown | Ended::Drained)) && !failures.failing() {
        if let Err(e) = reader.note(&mut conn, slot).await {
            tracing::debug!(error = %sanitize_error(&e.to_string()), "could not note the last position read");
        }
    }
    reader.close().await;
    drop(conn);
    ended
}

/// The replication client's buffer: a few batches, so the socket is read
/// while a batch publishes, and never a whole large transaction.
fn batch_buffer(shared: &Shared) -> usize {
    (shared.config.batch_size as usize)
        .saturating_mul(4)
        .clamp(256, 8192)
}

struct Reader<'a> {
    shared: &'a Shared,
    logical: &'a Logical,
    batches: &'a Batches,
    prefix: String,
    client: ReplicationClient,
    /// Events read and not yet published.
    pending: Vec<LogicalEvent>,
    /// Messages read under the prefix that are not events, to set aside.
    refused: Vec<(Lsn, Refusal)>,

    /// Inside a transaction (Begin read, its Commit not yet).
    in_txn: bool,
    /// The end of the last commit read.
    last_commit: Option<Lsn>,
    /// What the status updates report (raised only past published events).
    confirmed: Lsn,
    /// Whether this session raised it (then closing waits for it to be sent).
    raised: bool,
    /// When the reader last noted its read (and where it confirmed the slot
    /// up to) in the schema.
    note: Note,
}

impl Reader<'_> {
    async fn run(
        &mut self,
        conn: &mut sqlx::PgConnection,
        slot: &str,
        upto: Option<Lsn>,
        watch: &mut SlotWatch,
        failures: &mut Failures,
    ) -> Result<Ended, ReadError> {
        let batch = self.shared.config.batch_size as usize;
        let mut last_arrival = Instant::now();
        loop {
            // Take what is ready without waiting; when nothing is, settle
            // what is pending (latency first) before waiting.
            let next = match self.client.recv().now_or_never() {
                Some(next) => next,
                None => {
                    if let Settled::Stopped = self.settle().await? {
                        return Ok(Ended::Shutdown);
                    }
                    if !self.in_txn {
                        watch.caught_up = Instant::now();
                    }
                    if upto.is_some_and(|upto| self.confirmed >= upto) {
                        return Ok(Ended::Drained);
                    }
                    if watch.last.elapsed() >= SLOT_CHECK {
                        let at = watch.check(self.logical, slot).await?;
                        if failures.recovers_at(at) {
                            failures
                                .recovered(self.shared, self.logical, conn, slot, self.confirmed)
                                .await?;
                        }
                    }
                    // Caught up, and this session has read for READ_NOTE
                    // without failing: a reader still counted as failing
                    // (the slot idle, so it has not moved) has recovered.
                    if failures.failing() {
                        if self.note.age() >= READ_NOTE {
                            failures
                                .recovered(self.shared, self.logical, conn, slot, self.confirmed)
                                .await?;
                            self.note.noted(self.confirmed);
                        }
                    } else if self.note.due(self.confirmed) {
                        self.note(conn, slot).await?;
                    }
                    if upto.is_some() && last_arrival.elapsed() >= DRAIN_IDLE {
                        return Ok(Ended::Drained);
                    }
                    tokio::select! {
                        next = self.client.recv() => next,
                        _ = tokio::time::sleep(CHORES) => continue,
                        _ = self.shared.shutdown.cancelled() => return Ok(Ended::Shutdown),
                    }
                }
            };
            last_arrival = Instant::now();
            let event = received(next)?;
            if failures.recovers_on_read() {
                failures
                    .recovered(self.shared, self.logical, conn, slot, self.confirmed)
                    .await?;
                self.note.noted(self.confirmed);
            }
            self.take(event, false);
            self.refuse_read().await;
            while self.pending.len() >= batch {
                if let Settled::Stopped = self.publish().await? {
                    return Ok(Ended::Shutdown);
                }
            }
            // A stream that is never idle notes its position all the same.
            if !failures.failing() && self.note.due(self.confirmed) {
                self.note(conn, slot).await?;
            }
            if self.shared.shutdown.is_cancelled() {
                return Ok(Ended::Shutdown);
            }
            // Draining a database that keeps committing: stop once past
            // the flush position seen at the start, even if more is ready.
            if upto.is_some_and(|upto| self.pending.is_empty() && self.confirmed >= upto) {
                return Ok(Ended::Drained);
            }
        }
    }

    /// Take one message read. While a batch is publishing (`in_flight`)
    /// nothing is confirmed: the commits read belong after it.
    fn take(&mut self, event: ReplicationEvent, in_flight: bool) {
        match event {
            ReplicationEvent::Begin { .. } => self.in_txn = true,
            ReplicationEvent::Message {
                transactional: true,
                prefix,
                content,
                lsn,
            } if prefix == self.prefix => {
                let at = Lsn(lsn.as_u64());
                match decode_or_refuse(&content) {
                    Ok(mut event) => {
                        event.at = at;
                        self.pending.push(event);
                    }
                    Err(refusal) => self.refused.push((at, refusal)),
                }
            }
            ReplicationEvent::Commit { end_lsn, .. } => {
                self.in_txn = false;
                self.last_commit = Some(Lsn(end_lsn.as_u64()));
                if !in_flight && self.pending.is_empty() {
                    self.confirm(Lsn(end_lsn.as_u64()));
                }
            }
            ReplicationEvent::KeepAlive { wal_end, .. } => {
                // Everything the server sent before this keepalive was
                // read: with no transaction open and nothing pending or
                // publishing, nothing before its position is left to deliver.
                if !in_flight && !self.in_txn && self.pending.is_empty() {
                    self.confirm(Lsn(wal_end.as_u64()));
                }
            }
            ReplicationEvent::StoppedAt { .. }
            | ReplicationEvent::Message { .. }
            | ReplicationEvent::XLogData { .. } => {}
        }
    }

    /// Set aside the messages read that are not events (before the slot is
    /// confirmed past them).
    async fn refuse_read(&mut self) {
        for (at, refusal) in std::mem::take(&mut self.refused) {
            self.batches.refuse(at, &refusal).await;
        }
    }

    /// Publish what is pending and confirm up to the last commit read.
    async fn settle(&mut self) -> Result<Settled, ReadError> {
        if self.pending.is_empty() {
            return Ok(Settled::Done);
        }
        self.publish().await
    }

    /// Publish the pending events (hand off what a destination did not
    /// take), reading on into the next batch meanwhile; then every commit
    /// read before it was taken is settled, and every commit read at all
    /// once nothing new is pending. Stopped: nothing was published, nothing
    /// confirmed.
    async fn publish(&mut self) -> Result<Settled, ReadError> {
        let batch = self.shared.config.batch_size as usize;
        let events = std::mem::replace(&mut self.pending, Vec::with_capacity(batch));
        let settles = self.last_commit;
        let (shared, batches) = (self.shared, self.batches);
        let publishing = publish_batch(shared, batches, &events);
        tokio::pin!(publishing);
        // The next batch is read while this one is checked and published,
        // up to a batch (what is in memory stays at two batches).
        let published = loop {
            if self.pending.len() >= batch || shared.shutdown.is_cancelled() {
                break publishing.await;
            }
            tokio::select! {
                biased;
                published = &mut publishing => break published,
                next = self.client.recv() => self.take(received(next)?, true),
            }
        };
        if let Settled::Stopped = published? {
            return Ok(Settled::Stopped);
        }
        self.refuse_read().await;
        if let Some(commit) = settles {
            self.confirm(commit);
        }
        if let (true, Some(commit)) = (self.pending.is_empty(), self.last_commit) {
            self.confirm(commit);
        }
        self.note.published();
        Ok(Settled::Done)
    }

    /// Note in the schema that the slot was read, and where it is
    /// confirmed up to: after a server crash moves the slot back, the next
    /// session moves it up to there again (see `open`).
    async fn note(&mut self, conn: &mut sqlx::PgConnection, slot: &str) -> Result<(), ReadError> {
        self.logical.read_now(conn, slot, self.confirmed).await?;
        self.note.noted(self.confirmed);
        Ok(())
    }

    /// Report `lsn` as flushed in the next status update.
    fn confirm(&mut self, lsn: Lsn) {
        if lsn > self.confirmed {
            self.confirmed = lsn;
            self.raised = true;
            self.client
                .update_applied_lsn(pgwire_replication::Lsn::from_u64(lsn.0));
        }
    }

    /// Let the last confirmation reach the server (briefly), then end the
    /// stream.
    async fn close(mut self) {
        let want = pgwire_replication::Lsn::from_u64(self.confirmed.0);
        let metrics = self.client.metrics();
        let deadline = Instant::now() + FINAL_STATUS_WAIT;
        while self.raised
            && metrics.last_applied_lsn() < want
            && self.client.is_running()
            && Instant::now() < deadline
        {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        if let Err(e) = self.client.shutdown().await {
            tracing::debug!(error = %sanitize_error(&e.to_string()), "closing the replication stream");
        }
    }
}

/// The next message, or why the stream ended.
fn received(
    next: Result<Option<ReplicationEvent>, PgWireError>,
) -> Result<ReplicationEvent, ReadError> {
    match next {
        Ok(Some(event)) => Ok(event),
        Ok(None) => Err(ReadError::Stream(
            "the server ended the replication stream".to_owned(),
        )),
        Err(e) => Err(refused_or_stream(e)),
    }
}

/// A replication connection's error: what to set when the server refused
/// it, otherwise the stream's error.
fn refused_or_stream(e: PgWireError) -> ReadError {
    let error = sanitize_error(&e.to_string());
    let lower = error.to_lowercase();
    let what = if lower.contains("pg_hba.conf") {
        Some(
            "add a `replication` entry for the relay's role and address to pg_hba.conf (`all` in the \
             database column does not cover replication connections), e.g. `host replication \
             <role> <address> scram-sha-256`, then reload PostgreSQL; or set \
             relay.logical_transport = \"sql\"",
        )
    } else if lower.contains("replication role")
        || lower.contains("permission denied to start walsender")
        || lower.contains("must be superuser or replication")
        || lower.contains("replication attribute")
    {
        Some(
            "give the relay's login role the REPLICATION role attribute (a superuser grants it), \
             or set relay.logical_transport = \"sql\"",
        )
    } else if lower.contains("max_wal_senders") {
        Some(
            "raise max_wal_senders (each streaming relay takes one; it takes a restart), or set \
             relay.logical_transport = \"sql\"",
        )
    } else {
        None
    };
    match what {
        Some(what) => ReadError::Refused {
            error,
            what: what.to_owned(),
        },
        None => ReadError::Stream(error),
    }
}

/// The replication connection's settings, from the pool's: the same server,
/// role, password, database and TLS settings.
fn replication_config(
    options: &PgConnectOptions,
    slot: &str,
    buffer: usize,
) -> Result<ReplicationConfig, ReadError> {
    // The only way to the password sqlx holds (parsed from the URL or
    // PGPASSWORD); the URL is never logged.
    let url = options.to_url_lossy();
    let password = url
        .password()
        .map(|p| percent_decode_str(p).decode_utf8_lossy().into_owned())
        .unwrap_or_default();
    let user = options.get_username();
    let database = options.get_database().unwrap_or(user);
    let config = match options.get_socket() {
        Some(dir) => ReplicationConfig::unix(
            dir.to_string_lossy(),
            options.get_port(),
            user,
            password,
            database,
            slot,
            slot,
        ),
        None => ReplicationConfig::new(options.get_host(), user, password, database, slot, slot)
            .with_port(options.get_port())
            .with_tls(tls_config(options, &url)?),
    };
    Ok(config
        .with_application_name(format!("postbox relay {slot}"))
        .with_status_interval(STATUS_INTERVAL)
        .with_wakeup_interval(IDLE_STATUS)
        .with_buffer_size(buffer))
}

/// sqlx's `sslmode`, `sslrootcert`, `sslcert` and `sslkey` for the
/// replication connection (certificates as files).
fn tls_config(options: &PgConnectOptions, url: &url::Url) -> Result<TlsConfig, ReadError> {
    let param = |name: &str| -> Result<Option<std::path::PathBuf>, ReadError> {
        let Some((_, value)) = url.query_pairs().find(|(k, _)| k == name) else {
            return Ok(None);
        };
        match value.strip_prefix("file: ") {
            Some(path) => Ok(Some(path.into())),
            None => Err(ReadError::Stream(format!(
                "the streaming replication connection takes {name} as a file path, not inline \
                 PEM: give the database URL a file, or set relay.logical_transport = \"sql\""
            ))),
        }
    };
    let ca = param("sslrootcert")?;
    let mut tls = match options.get_ssl_mode() {
        PgSslMode::Disable => TlsConfig::disabled(),
        PgSslMode::Allow | PgSslMode::Prefer => TlsConfig {
            mode: SslMode::Prefer,
            ..TlsConfig::disabled()
        },
        PgSslMode::Require => TlsConfig::require(),
        PgSslMode::VerifyCa => TlsConfig::verify_ca(ca),
        PgSslMode::VerifyFull => TlsConfig::verify_full(ca),
    };
    if let (Some(cert), Some(key)) = (param("sslcert")?, param("sslkey")?) {
        tls = tls.with_client_cert(cert, key);
    }
    Ok(tls)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::str::FromStr;

    #[test]
    fn the_replication_connection_follows_the_database_url() {
        let options = PgConnectOptions::from_str(
            "postgres://app%40x:p%3Ass%20w@db.example:6543/shop?sslmode=verify-full&sslrootcert=/etc/ca.pem",
        )
        .unwrap();
        let config = replication_config(&options, "postbox_s", 1000).unwrap();
        assert_eq!(config.host, "db.example");
        assert_eq!(config.port, 6543);
        assert_eq!(config.user, "app@x");
        assert_eq!(config.password, "p:ss w");
        assert_eq!(config.database, "shop");
        assert_eq!(config.slot, "postbox_s");
        assert_eq!(config.tls.mode, SslMode::VerifyFull);
        assert_eq!(
            config.tls.ca_pem_path.as_deref(),
            Some(std::path::Path::new("/etc/ca.pem"))
        );
        let plain =
            PgConnectOptions::from_str("postgres://postgres@127.0.0.1/postgres?sslmode=disable")
                .unwrap();
        let config = replication_config(&plain, "s", 10).unwrap();
        assert_eq!(config.tls.mode, SslMode::Disable);
        assert_eq!(config.password, "");
    }

    #[test]
    fn a_refused_connection_says_what_to_set() {
        let hba = refused_or_stream(PgWireError::Server(
            "no pg_hba.conf entry for replication connection from host \"10.0.0.1\", user \"relay\", no encryption (SQLSTATE 28000)".into(),
        ));
        assert!(
            matches!(&hba, ReadError::Refused { what, .. } if what.contains("host replication"))
        );
        let role = refused_or_stream(PgWireError::Server(
            "must be superuser or replication role to start walsender (SQLSTATE 42501)".into(),
        ));
        assert!(matches!(&role, ReadError::Refused { what, .. } if what.contains("REPLICATION")));
        let senders = refused_or_stream(PgWireError::Server(
            "number of requested standby connections exceeds max_wal_senders (currently 10) (SQLSTATE 53300)".into(),
        ));
        assert!(
            matches!(&senders, ReadError::Refused { what, .. } if what.contains("max_wal_senders"))
        );
        assert!(matches!(
            refused_or_stream(PgWireError::Protocol("x".into())),
            ReadError::Stream(_)
        ));
    }
}
