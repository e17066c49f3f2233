//! Throwaway PostgreSQL cluster for `postbox demo`, `bench` and `verify` when
//! no `DATABASE_URL` is given.
//!
//! [`TempCluster::start`] runs the system's own `initdb` and `postgres` binaries
//! against a fresh temporary directory, waits until the server accepts
//! connections and hands out a connection URL. [`TempCluster::stop`] performs a
//! fast shutdown and deletes the directory; dropping the value without calling
//! `stop` kills the server and deletes the directory on a best-effort basis.
//!
//! PostgreSQL refuses to run as root. When the current process is root, both
//! binaries are started as an unprivileged system user (`postgres` if it
//! exists, else `nobody`) by setting the child's uid/gid before `exec`; the
//! temporary directory is chowned to that user.

use crate::os::{self, Signal, User};
use crate::process::{ChildProcess, Exit};
use postbox::statements::trusted;
use std::ffi::OsStr;
use std::fs::{self, DirBuilder, File};
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, TcpListener};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::{Duration, Instant};

use sqlx::{Connection, PgConnection, Row};

/// Role created by `initdb` (superuser, trust authentication).
const SUPERUSER: &str = "postbox";
/// How long the server may take to accept connections after being spawned.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// Pause between readiness probes.
const POLL_INTERVAL: Duration = Duration::from_millis(75);
/// Upper bound for a single connection attempt while probing.
const PROBE_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a fast shutdown (SIGINT) may take before the server is killed.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(15);
/// How long to wait for the process to disappear after SIGKILL.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);
/// Attempts at starting the server on a fresh port when the port was taken.
const PORT_ATTEMPTS: u32 = 3;
/// Number of log/output lines quoted in error messages.
const TAIL_LINES: usize = 20;
/// Directory holding one directory per installed major version on Debian/Ubuntu.
const VERSIONED_ROOT: &str = "/usr/lib/postgresql";

const INSTALL_HINT: &str = "install the PostgreSQL server package \
     (Debian/Ubuntu: `apt-get install postgresql`; Fedora: `dnf install postgresql-server`; \
     macOS: `brew install postgresql`) or set DATABASE_URL to an existing database";

/// Errors from starting or stopping a [`TempCluster`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClusterError {
    /// No `initdb`/`postgres` pair was found.
    #[error(
        "PostgreSQL server binaries (initdb, postgres) not found (looked at `pg_config --bindir`, \
         {VERSIONED_ROOT}/*/bin and PATH); to run without DATABASE_URL, {INSTALL_HINT}"
    )]
    BinariesNotFound,

    /// Running as root, but there is no unprivileged user to run PostgreSQL as.
    #[error(
        "running as root, but PostgreSQL refuses to run as root and neither a `postgres` nor a \
         `nobody` user exists; create one (e.g. `useradd --system postgres`), run postbox as a \
         non-root user, or set DATABASE_URL to an existing database"
    )]
    NoUnprivilegedUser,

    /// The temporary directory could not be created or prepared.
    #[error("could not prepare temporary directory {path} for PostgreSQL (set TMPDIR to a writable directory)")]
    TempDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The temporary directory could not be handed over to the unprivileged user.
    #[error("could not give {path} to user `{user}` (uid {uid}, gid {gid})")]
    Chown {
        path: PathBuf,
        user: String,
        uid: u32,
        gid: u32,
        #[source]
        source: io::Error,
    },

    /// A PostgreSQL binary could not be executed.
    #[error("could not run {what}{hint}")]
    Spawn {
        what: String,
        hint: String,
        #[source]
        source: io::Error,
    },

    /// `initdb` ran but failed.
    #[error("initdb failed ({status}); last lines of its output:\n{output}")]
    InitDb { status: ExitStatus, output: String },

    /// No free TCP port could be reserved on 127.0.0.1.
    #[error("could not find a free TCP port on 127.0.0.1")]
    Port {
        #[source]
        source: io::Error,
    },

    /// Every attempt to start the server hit a port that was already in use.
    #[error(
        "PostgreSQL could not listen on 127.0.0.1 after {attempts} attempts (port already in use); \
         last lines of the server log:\n{log_tail}"
    )]
    PortsExhausted { attempts: u32, log_tail: String },

    /// The server process exited before accepting connections.
    #[error("PostgreSQL server exited during startup ({status}); last lines of the server log:\n{log_tail}")]
    ServerExited {
        status: ExitStatus,
        log_tail: String,
    },

    /// The server did not accept connections in time.
    #[error(
        "PostgreSQL server did not accept connections on port {port} within {timeout:?}; \
         last lines of the server log:\n{log_tail}"
    )]
    StartTimeout {
        port: u16,
        timeout: Duration,
        log_tail: String,
        /// The last connection error seen while probing, if any.
        #[source]
        source: Option<sqlx::Error>,
    },

    /// Checking on, signalling or waiting for the server process failed.
    #[error("could not {action} the PostgreSQL server process (pid {pid})")]
    Process {
        action: &'static str,
        pid: u32,
        #[source]
        source: io::Error,
    },

    /// `pg_ctl restart -m immediate` on a server verify does not own failed.
    #[error(
        "`pg_ctl restart -m immediate -D {data_dir}` failed ({status}); its output:\n{output}"
    )]
    ExternalRestart {
        data_dir: PathBuf,
        status: ExitStatus,
        output: String,
    },

    /// The data directory of a server to crash could not be read.
    #[error("cannot read the PostgreSQL data directory {path} (pass the server's PGDATA)")]
    DataDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },

    /// The temporary directory could not be deleted after shutdown.
    #[error("PostgreSQL was stopped but its temporary directory {path} could not be removed; delete it manually")]
    Cleanup {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// A PostgreSQL cluster living in a temporary directory, for demos and tests.
#[derive(Debug)]
pub struct TempCluster {
    /// Temporary directory holding `data/`, the socket and `postgres.log`.
    root: PathBuf,
    data_dir: PathBuf,
    log_path: PathBuf,
    port: u16,
    url: String,
    /// The postmaster; `None` once it has been reaped.
    child: Option<ChildProcess>,
    /// Set once `root` has been deleted.
    removed: bool,
    /// What started the server, to start it again after a crash.
    bins: Option<PgBinaries>,
    run_as: Option<RunAs>,
    /// How much the server's commits survive.
    durability: Durability,
}

/// How durable a throwaway cluster's commits are.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// `fsync`, `synchronous_commit` and `full_page_writes` off: fast, and a
    /// crash of the server may forget the newest commits.
    Fast,
    /// `synchronous_commit` on, `fsync` off: a crash of PostgreSQL (not of
    /// the machine) loses exactly what a production server's crash loses.
    CrashableCommits,
    /// A production server's settings: `fsync`, `synchronous_commit` and
    /// `full_page_writes` on.
    Production,
}

impl Durability {
    /// How it reads in a report's first line.
    pub fn describe(self) -> &'static str {
        match self {
            Durability::Fast => "fsync off, synchronous_commit off: faster than any durable server",
            Durability::CrashableCommits => "fsync off, synchronous_commit on",
            Durability::Production => {
                "fsync on, synchronous_commit on: a production server's durability"
            }
        }
    }
}

/// What a crash of the cluster ([`TempCluster::crash_and_restart`]) took.
#[derive(Clone, Copy, Debug)]
pub struct Crash {
    /// From the immediate stop to accepting connections again (crash recovery included).
    pub downtime: Duration,
}

impl TempCluster {
    /// Start a new cluster in a fresh temporary directory; resolves when it
    /// accepts connections. Built for speed: `fsync`, `synchronous_commit`
    /// and `full_page_writes` are off, so a crash of the server may forget
    /// the newest commits (see [`TempCluster::start_crashable`]).
    pub async fn start() -> Result<TempCluster, ClusterError> {
        Self::start_with(Durability::Fast).await
    }

    /// Like [`TempCluster::start`], with a production server's durability
    /// (`fsync`, `synchronous_commit` and `full_page_writes` on): what
    /// `postbox bench` measures by default, so its figures are the ones
    /// users' servers see.
    pub async fn start_durable() -> Result<TempCluster, ClusterError> {
        Self::start_with(Durability::Production).await
    }

    /// Like [`TempCluster::start`], but every commit is written to the WAL
    /// before it returns (`synchronous_commit = on`, the server's default),
    /// so [`TempCluster::crash_and_restart`] loses exactly what a PostgreSQL
    /// crash loses: WAL not yet written, i.e. only commits that did not wait
    /// for it. `fsync` stays off: the crash is of PostgreSQL, not of the
    /// machine, so what was written survives in the kernel's cache.
    pub async fn start_crashable() -> Result<TempCluster, ClusterError> {
        Self::start_with(Durability::CrashableCommits).await
    }

    /// A cluster of the given durability.
    pub async fn start_with(durability: Durability) -> Result<TempCluster, ClusterError> {
        let bins = find_binaries().await?;
        let run_as = run_as()?;
        let root = create_temp_root(run_as.as_ref())?;
        // From here on, dropping `cluster` (including via `?`) kills the
        // server, if any, and deletes the directory.
        let mut cluster = TempCluster {
            data_dir: root.join("data"),
            log_path: root.join("postgres.log"),
            root,
            port: 0,
            url: String::new(),
            child: None,
            removed: false,
            bins: None,
            run_as: None,
            durability,
        };
        cluster.initdb(&bins, run_as.as_ref()).await?;

        let mut log_tail = String::new();
        for attempt in 1..=PORT_ATTEMPTS {
            let port = free_port().map_err(|source| ClusterError::Port { source })?;
            let log_offset = cluster.spawn_server(&bins, run_as.as_ref(), port)?;
            match cluster.wait_ready(log_offset).await? {
                Readiness::Ready => {
                    tracing::info!(
                        data_dir = %cluster.data_dir.display(),
                        port,
                        pid = cluster.child.as_ref().map(ChildProcess::id),
                        user = run_as.as_ref().map(|u| u.name.as_str()),
                        "started temporary PostgreSQL cluster"
                    );
                    cluster.bins = Some(bins);
                    cluster.run_as = run_as;
                    return Ok(cluster);
                }
                Readiness::PortInUse(tail) => {
                    tracing::debug!(port, attempt, "port already in use; retrying");
                    log_tail = tail;
                }
            }
        }
        Err(ClusterError::PortsExhausted {
            attempts: PORT_ATTEMPTS,
            log_tail,
        })
    }

    /// A connection URL (e.g. `postgres://postbox@127.0.0.1:PORT/postgres`) usable by sqlx.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// TCP port the server listens on (127.0.0.1 only).
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The cluster's data directory (inside the temporary directory).
    pub fn data_dir(&self) -> &Path {
        &self.data_dir
    }

    /// Crash the server as `pg_ctl stop -m immediate` does (SIGQUIT to the
    /// postmaster: every server process quits at once, no checkpoint, WAL
    /// buffers not written are lost), then start it again on the same port
    /// and data directory; resolves once crash recovery is over and it
    /// accepts connections. Every open connection is broken.
    pub async fn crash_and_restart(&mut self) -> Result<Crash, ClusterError> {
        let started = Instant::now();
        if let Some(child) = self.child.take() {
            let pid = child.id();
            if child.try_exit().is_none() {
                child.signal(Signal::Quit);
                match child.wait_for(SHUTDOWN_TIMEOUT).await {
                    Some(ended) => {
                        ended.map_err(|source| ClusterError::Process {
                            action: "wait for",
                            pid,
                            source,
                        })?;
                    }
                    None => {
                        child.signal_group(Signal::Kill);
                        if let Some(Err(source)) = child.wait_for(KILL_TIMEOUT).await {
                            return Err(ClusterError::Process {
                                action: "kill",
                                pid,
                                source,
                            });
                        }
                    }
                }
            }
        }
        let (Some(bins), run_as) = (self.bins.clone(), self.run_as.clone()) else {
            return Err(ClusterError::BinariesNotFound);
        };
        let port = self.port;
        let log_offset = self.spawn_server(&bins, run_as.as_ref(), port)?;
        match self.wait_ready(log_offset).await? {
            Readiness::Ready => Ok(Crash {
                downtime: started.elapsed(),
            }),
            Readiness::PortInUse(log_tail) => Err(ClusterError::PortsExhausted {
                attempts: 1,
                log_tail,
            }),
        }
    }

    /// Stop the server (fast shutdown) and delete the directory.
    pub async fn stop(mut self) -> Result<(), ClusterError> {
        if let Some(child) = self.child.as_ref() {
            let pid = child.id();
            shutdown(child)
                .await
                .map_err(|(action, source)| ClusterError::Process {
                    action,
                    pid,
                    source,
                })?;
            self.child = None;
        }
        match tokio::fs::remove_dir_all(&self.root).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(ClusterError::Cleanup {
                    path: self.root.clone(),
                    source,
                })
            }
        }
        self.removed = true;
        tracing::info!(port = self.port, "stopped temporary PostgreSQL cluster");
        Ok(())
    }

    async fn initdb(&self, bins: &PgBinaries, run_as: Option<&RunAs>) -> Result<(), ClusterError> {
        let mut cmd = tokio::process::Command::new(&bins.initdb);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .args([
                "--auth=trust",
                "-U",
                SUPERUSER,
                "--encoding=UTF8",
                "--locale=C",
                "--no-sync",
            ])
            .stdin(Stdio::null())
            .current_dir(&self.root)
            .env("LC_ALL", "C")
            .kill_on_drop(true);
        if let Some(user) = run_as {
            cmd.uid(user.uid).gid(user.gid).env("HOME", &self.root);
        }
        let output = cmd
            .output()
            .await
            .map_err(|source| spawn_error(&bins.initdb, run_as, &self.root, source))?;
        if output.status.success() {
            return Ok(());
        }
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        Err(ClusterError::InitDb {
            status: output.status,
            output: tail(&text, TAIL_LINES),
        })
    }

    /// Spawns the postmaster on `port`; returns the log length before the
    /// spawn so that only this attempt's log lines are inspected.
    fn spawn_server(
        &mut self,
        bins: &PgBinaries,
        run_as: Option<&RunAs>,
        port: u16,
    ) -> Result<u64, ClusterError> {
        let temp_err = |source| ClusterError::TempDir {
            path: self.log_path.clone(),
            source,
        };
        let log = File::options()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .map_err(temp_err)?;
        let offset = log.metadata().map_err(temp_err)?.len();
        let log_err = log.try_clone().map_err(temp_err)?;

        let mut cmd = std::process::Command::new(&bins.postgres);
        cmd.arg("-D")
            .arg(&self.data_dir)
            .arg("-p")
            .arg(port.to_string())
            .arg("-k")
            .arg(&self.root)
            .args(["-c", "listen_addresses=127.0.0.1"])
            .args(match self.durability {
                Durability::Fast => [
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=off",
                    "-c",
                    "full_page_writes=off",
                ],
                Durability::CrashableCommits => [
                    "-c",
                    "fsync=off",
                    "-c",
                    "synchronous_commit=on",
                    "-c",
                    "full_page_writes=off",
                ],
                Durability::Production => [
                    "-c",
                    "fsync=on",
                    "-c",
                    "synchronous_commit=on",
                    "-c",
                    "full_page_writes=on",
                ],
            })
            // Logical mode (emit, replication slots) runs on it too; its
            // replication connections are admitted by the `replication`
            // lines initdb writes into pg_hba.conf (trust, local and
            // loopback) and the default max_wal_senders (10).
            .args(["-c", "wal_level=logical"])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .current_dir(&self.root)
            .env("LC_ALL", "C")
            // Own process group: a terminal Ctrl-C reaches postbox (which then
            // calls stop()) rather than the server, and kill(-pid) reaches
            // every server process at once.
            .process_group(0);
        if let Some(user) = run_as {
            cmd.uid(user.uid).gid(user.gid).env("HOME", &self.root);
        }
        let child = ChildProcess::spawn(&mut cmd)
            .map_err(|source| spawn_error(&bins.postgres, run_as, &self.root, source))?;
        self.port = port;
        self.url = format!("postgres://{SUPERUSER}@127.0.0.1:{port}/postgres");
        self.child = Some(child);
        Ok(offset)
    }

    async fn wait_ready(&mut self, log_offset: u64) -> Result<Readiness, ClusterError> {
        let deadline = Instant::now() + READY_TIMEOUT;
        let expected_dir = self.data_dir.to_string_lossy().into_owned();
        let mut last_error = None;
        loop {
            let Some(child) = self.child.as_ref() else {
                // Not reachable: spawn_server always sets the child.
                return Ok(Readiness::PortInUse(String::new()));
            };
            let exited = child
                .try_exit()
                .transpose()
                .map_err(|source| ClusterError::Process {
                    action: "check on",
                    pid: child.id(),
                    source,
                })?;
            if let Some(Exit { status, .. }) = exited {
                self.child = None;
                let log = read_log_from(&self.log_path, log_offset);
                let log_tail = tail(&log, TAIL_LINES);
                if is_port_collision(&log) {
                    return Ok(Readiness::PortInUse(log_tail));
                }
                return Err(ClusterError::ServerExited { status, log_tail });
            }

            match tokio::time::timeout(PROBE_TIMEOUT, probe(&self.url)).await {
                Ok(Ok(dir)) if dir == expected_dir => return Ok(Readiness::Ready),
                // Some other server owns the port; ours will fail to bind and
                // exit, which the next iteration turns into a retry.
                Ok(Ok(dir)) => {
                    tracing::debug!(port = self.port, other = %dir, "port answered by another server")
                }
                Ok(Err(e)) => last_error = Some(e),
                Err(_elapsed) => {}
            }

            if Instant::now() >= deadline {
                let log_tail = tail(&read_log_from(&self.log_path, log_offset), TAIL_LINES);
                return Err(ClusterError::StartTimeout {
                    port: self.port,
                    timeout: READY_TIMEOUT,
                    log_tail,
                    source: last_error,
                });
            }
            tokio::time::sleep(POLL_INTERVAL).await;
        }
    }
}

/// Crash a server verify does not own, the one running from `data_dir`,
/// and start it again: `pg_ctl restart -m immediate -w` (the immediate stop
/// is the crash; the start runs crash recovery, with the command line the
/// server was started with), as the data directory's owner. Its log goes to
/// `postbox-verify-restart.log` in the data directory.
pub async fn crash_and_restart_external(data_dir: &Path) -> Result<Crash, ClusterError> {
    use std::os::unix::fs::MetadataExt;
    let started = Instant::now();
    let meta = fs::metadata(data_dir).map_err(|source| ClusterError::DataDir {
        path: data_dir.to_owned(),
        source,
    })?;
    let bins = find_binaries().await?;
    let pg_ctl = bins
        .postgres
        .parent()
        .map_or_else(|| PathBuf::from("pg_ctl"), |d| d.join("pg_ctl"));
    let mut cmd = tokio::process::Command::new(&pg_ctl);
    cmd.args(["restart", "-m", "immediate", "-w", "-t", "60", "-D"])
        .arg(data_dir)
        .arg("-l")
        .arg(data_dir.join("postbox-verify-restart.log"))
        .stdin(Stdio::null())
        .current_dir(data_dir)
        .kill_on_drop(true);
    if os::is_root() && meta.uid() != 0 {
        cmd.uid(meta.uid()).gid(meta.gid());
    }
    let output = cmd
        .output()
        .await
        .map_err(|source| spawn_error(&pg_ctl, None, data_dir, source))?;
    if !output.status.success() {
        let mut text = String::from_utf8_lossy(&output.stdout).into_owned();
        text.push_str(&String::from_utf8_lossy(&output.stderr));
        return Err(ClusterError::ExternalRestart {
            data_dir: data_dir.to_owned(),
            status: output.status,
            output: tail(&text, TAIL_LINES),
        });
    }
    Ok(Crash {
        downtime: started.elapsed(),
    })
}

impl Drop for TempCluster {
    fn drop(&mut self) {
        if let Some(child) = self.child.take() {
            kill_blocking(&child);
        }
        if !self.removed {
            if fs::remove_dir_all(&self.root).is_err() {
                // A dying server process may still have been writing; retry once.
                std::thread::sleep(Duration::from_millis(50));
                if let Err(e) = fs::remove_dir_all(&self.root) {
                    if e.kind() != io::ErrorKind::NotFound {
                        tracing::warn!(path = %self.root.display(), error = %e, "could not remove temporary PostgreSQL directory");
                    }
                }
            }
            self.removed = true;
        }
    }
}

enum Readiness {
    Ready,
    /// The server could not bind its port; carries the log tail.
    PortInUse(String),
}

/// Connects and returns the server's data directory, to be sure the server
/// answering on the port is ours.
async fn probe(url: &str) -> Result<String, sqlx::Error> {
    let mut conn = PgConnection::connect(url).await?;
    let dir = data_directory(&mut conn).await?;
    let _ = conn.close().await;
    Ok(dir)
}

/// The data directory of the server `conn` is connected to.
async fn data_directory(conn: &mut PgConnection) -> Result<String, sqlx::Error> {
    static SQL: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        let mut sql = crate::catalog("cluster.sql", include_str!("../sql/cluster.sql"));
        let data_directory = sql.take("data_directory").to_owned();
        sql.finish();
        data_directory
    });
    sqlx::query(trusted(&SQL))
        .fetch_one(conn)
        .await?
        .try_get("data_directory")
}

fn is_port_collision(log: &str) -> bool {
    log.contains("Address already in use") || log.contains("could not create any TCP/IP sockets")
}

/// Reserves a currently free port by binding to port 0 and releasing it.
fn free_port() -> io::Result<u16> {
    let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
    Ok(listener.local_addr()?.port())
}

/// Fast shutdown (SIGINT); SIGKILL to the whole process group on timeout.
async fn shutdown(child: &ChildProcess) -> Result<(), (&'static str, io::Error)> {
    if let Some(ended) = child.try_exit() {
        return ended.map(drop).map_err(|e| ("check on", e));
    }
    child.signal(Signal::Interrupt);
    if let Some(ended) = child.wait_for(SHUTDOWN_TIMEOUT).await {
        return ended.map(drop).map_err(|e| ("wait for", e));
    }
    tracing::warn!(
        pid = child.id(),
        "PostgreSQL did not shut down within {SHUTDOWN_TIMEOUT:?}; killing it"
    );
    // The postmaster is not reaped yet, so its process-group id cannot have
    // been reused.
    child.signal_group(Signal::Kill);
    match child.wait_for(KILL_TIMEOUT).await {
        Some(ended) => ended.map(drop).map_err(|e| ("wait for", e)),
        None => Err((
            "stop",
            io::Error::new(io::ErrorKind::TimedOut, "still running after SIGKILL"),
        )),
    }
}

/// Synchronous best effort for `Drop`: SIGKILL the whole process group and
/// wait for the postmaster to be reaped.
fn kill_blocking(child: &ChildProcess) {
    if child.try_exit().is_some() {
        return;
    }
    if !child.signal_group(Signal::Kill) {
        child.signal(Signal::Kill);
    }
    let _ = child.wait_blocking(KILL_TIMEOUT);
}

/// Reads the log from `offset` on; errors yield a placeholder (this is only
/// used to build error messages).
fn read_log_from(path: &Path, offset: u64) -> String {
    let read = || -> io::Result<String> {
        let mut file = File::open(path)?;
        file.seek(SeekFrom::Start(offset))?;
        let mut bytes = Vec::new();
        file.read_to_end(&mut bytes)?;
        Ok(String::from_utf8_lossy(&bytes).into_owned())
    };
    read().unwrap_or_else(|e| format!("(could not read {}: {e})", path.display()))
}

/// The last `n` non-empty lines of `text`, indented for error messages.
fn tail(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    if lines.is_empty() {
        return "  (empty)".to_owned();
    }
    lines[lines.len().saturating_sub(n)..]
        .iter()
        .map(|l| format!("  {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

// ---------------------------------------------------------------------------
// Privileges and the temporary directory
// ---------------------------------------------------------------------------

/// The unprivileged user PostgreSQL runs as when we are root.
type RunAs = User;

/// `None` when not root (run as the current user).
fn run_as() -> Result<Option<RunAs>, ClusterError> {
    if !os::is_root() {
        return Ok(None);
    }
    ["postgres", "nobody"]
        .into_iter()
        .find_map(os::system_user)
        .filter(|user| user.uid != 0)
        .map(Some)
        .ok_or(ClusterError::NoUnprivilegedUser)
}

/// Creates `$TMPDIR/postbox-pg-PID-RANDOM` (mode 0700, owned by `owner` if
/// given) and returns its canonical path.
fn create_temp_root(owner: Option<&RunAs>) -> Result<PathBuf, ClusterError> {
    let base = std::env::temp_dir();
    let mut last_err = None;
    for _ in 0..8 {
        let path = base.join(format!(
            "postbox-pg-{}-{:016x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        match DirBuilder::new().mode(0o700).create(&path) {
            Ok(()) => return prepare_temp_root(path, owner),
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => last_err = Some((path, e)),
            Err(source) => return Err(ClusterError::TempDir { path, source }),
        }
    }
    let (path, source) = last_err.unwrap_or_else(|| (base, io::Error::other("no attempt made")));
    Err(ClusterError::TempDir { path, source })
}

fn prepare_temp_root(path: PathBuf, owner: Option<&RunAs>) -> Result<PathBuf, ClusterError> {
    let prepared = (|| {
        if let Some(user) = owner {
            std::os::unix::fs::chown(&path, Some(user.uid), Some(user.gid)).map_err(|source| {
                ClusterError::Chown {
                    path: path.clone(),
                    user: user.name.clone(),
                    uid: user.uid,
                    gid: user.gid,
                    source,
                }
            })?;
        }
        fs::canonicalize(&path).map_err(|source| ClusterError::TempDir {
            path: path.clone(),
            source,
        })
    })();
    if prepared.is_err() {
        let _ = fs::remove_dir_all(&path);
    }
    prepared
}

fn spawn_error(
    program: &Path,
    run_as: Option<&RunAs>,
    dir: &Path,
    source: io::Error,
) -> ClusterError {
    let what = match run_as {
        Some(user) => format!("{} as user `{}`", program.display(), user.name),
        None => program.display().to_string(),
    };
    let hint = match (run_as, source.kind()) {
        (Some(user), io::ErrorKind::PermissionDenied) => format!(
            " (user `{}` must be able to enter {}; set TMPDIR to a directory it can access, e.g. /tmp)",
            user.name,
            dir.display()
        ),
        _ => String::new(),
    };
    ClusterError::Spawn { what, hint, source }
}

// ---------------------------------------------------------------------------
// Finding the binaries
// ---------------------------------------------------------------------------

#[derive(Debug, Clone, PartialEq, Eq)]
struct PgBinaries {
    initdb: PathBuf,
    postgres: PathBuf,
}

async fn find_binaries() -> Result<PgBinaries, ClusterError> {
    let pg_config_bindir = pg_config_bindir().await;
    let path_var = std::env::var_os("PATH");
    let found = find_binaries_in(
        pg_config_bindir.as_deref(),
        Path::new(VERSIONED_ROOT),
        path_var.as_deref(),
    );
    match found {
        Some(bins) => {
            tracing::debug!(initdb = %bins.initdb.display(), postgres = %bins.postgres.display(), "found PostgreSQL binaries");
            Ok(bins)
        }
        None => Err(ClusterError::BinariesNotFound),
    }
}

/// `pg_config --bindir`, if `pg_config` is on PATH and succeeds.
async fn pg_config_bindir() -> Option<PathBuf> {
    let output = tokio::process::Command::new("pg_config")
        .arg("--bindir")
        .stdin(Stdio::null())
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(10), output)
        .await
        .ok()?
        .ok()?;
    if !output.status.success() {
        return None;
    }
    let dir = String::from_utf8(output.stdout).ok()?;
    let dir = dir.trim();
    (!dir.is_empty()).then(|| PathBuf::from(dir))
}

/// Search order: the pg_config bindir, the highest version under
/// `versioned_root/*/bin`, then `initdb` on `path_var`.
fn find_binaries_in(
    pg_config_bindir: Option<&Path>,
    versioned_root: &Path,
    path_var: Option<&OsStr>,
) -> Option<PgBinaries> {
    pg_config_bindir
        .and_then(binaries_in_dir)
        .or_else(|| highest_versioned(versioned_root))
        .or_else(|| binaries_on_path(path_var?))
}

fn binaries_in_dir(dir: &Path) -> Option<PgBinaries> {
    let initdb = dir.join("initdb");
    let postgres = dir.join("postgres");
    (is_executable(&initdb) && is_executable(&postgres)).then_some(PgBinaries { initdb, postgres })
}

fn highest_versioned(root: &Path) -> Option<PgBinaries> {
    fs::read_dir(root)
        .ok()?
        .filter_map(Result::ok)
        .filter_map(|entry| {
            let version = parse_version(&entry.file_name().to_string_lossy())?;
            let bins = binaries_in_dir(&entry.path().join("bin"))?;
            Some((version, bins))
        })
        .max_by(|a, b| a.0.cmp(&b.0))
        .map(|(_, bins)| bins)
}

/// "15" -> [15], "9.6" -> [9, 6], "17beta1" -> [17]; None if not a version.
fn parse_version(name: &str) -> Option<Vec<u64>> {
    let mut parts = Vec::new();
    for part in name.split('.') {
        let digits: String = part.chars().take_while(char::is_ascii_digit).collect();
        match digits.parse() {
            Ok(n) => parts.push(n),
            Err(_) => break,
        }
        if digits.len() != part.len() {
            break;
        }
    }
    (!parts.is_empty()).then_some(parts)
}

fn binaries_on_path(path_var: &OsStr) -> Option<PgBinaries> {
    let find = |name: &str| {
        std::env::split_paths(path_var)
            .map(|dir| dir.join(name))
            .find(|p| is_executable(p))
    };
    let initdb = find("initdb")?;
    // Prefer the `postgres` next to the real initdb (PATH entries are often symlinks).
    if let Some(bins) = fs::canonicalize(&initdb)
        .ok()
        .and_then(|real| binaries_in_dir(real.parent()?))
    {
        return Some(bins);
    }
    Some(PgBinaries {
        postgres: find("postgres")?,
        initdb,
    })
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Starts a cluster; `None` (test skipped) only if PostgreSQL is not installed.
    async fn start_or_skip() -> Option<TempCluster> {
        match TempCluster::start().await {
            Ok(cluster) => Some(cluster),
            Err(ClusterError::BinariesNotFound) => {
                crate::errln!("skipping: PostgreSQL server binaries are not installed");
                None
            }
            Err(e) => panic!("starting the cluster failed: {e} ({e:?})"),
        }
    }

    #[tokio::test]
    async fn start_query_create_tables_write_and_stop() {
        let Some(cluster) = start_or_skip().await else {
            return;
        };
        let data_dir = cluster.data_dir().to_path_buf();
        let root = cluster.root.clone();
        assert!(data_dir.join("PG_VERSION").is_file());
        assert!(cluster.url().starts_with("postgres://postbox@127.0.0.1:"));

        let mut conn = PgConnection::connect(cluster.url()).await.unwrap();
        let dir = data_directory(&mut conn).await.unwrap();
        assert_eq!(Path::new(&dir), data_dir);
        // Tables (postbox's schema) and a row in one of them.
        let schema = postbox::Schema::new("pgcluster_test").unwrap();
        let applied = postbox::sqlx::migrate(&mut conn, &schema).await.unwrap();
        assert!(!applied.is_empty());
        let event = postbox::NewEvent::from_json("t", "a", "1", r#"{"hello":1}"#).unwrap();
        let id = postbox::sqlx::enqueue(&postbox::Outbox::new(schema.clone()), &mut conn, &event)
            .await
            .unwrap();
        assert_eq!(id, event.event_id());
        conn.close().await.unwrap();

        cluster.stop().await.unwrap();
        assert!(!data_dir.exists(), "data directory still exists");
        assert!(!root.exists(), "temporary directory still exists");
    }

    #[tokio::test]
    async fn a_crash_keeps_commits_breaks_connections_and_the_cluster_comes_back() {
        let Some(mut cluster) = (match TempCluster::start_crashable().await {
            Ok(c) => Some(c),
            Err(ClusterError::BinariesNotFound) => None,
            Err(e) => panic!("starting the cluster failed: {e}"),
        }) else {
            return;
        };
        let schema = postbox::Schema::new("pgcluster_crash").unwrap();
        let mut conn = PgConnection::connect(cluster.url()).await.unwrap();
        postbox::sqlx::migrate(&mut conn, &schema).await.unwrap();
        let event = postbox::NewEvent::from_json("t", "a", "1", r#"{"n":1}"#).unwrap();
        let outbox = postbox::Outbox::new(schema.clone());
        postbox::sqlx::enqueue(&outbox, &mut conn, &event)
            .await
            .unwrap();
        let pid = cluster.child.as_ref().map(ChildProcess::id).unwrap();

        let crash = cluster.crash_and_restart().await.unwrap();
        assert!(crash.downtime < READY_TIMEOUT);
        assert!(!os::exists(pid), "the old postmaster {pid} still runs");
        // The connection from before the crash is gone…
        assert!(data_directory(&mut conn).await.is_err());
        // …the committed event is not, and the server answers on the same URL.
        let mut conn = PgConnection::connect(cluster.url()).await.unwrap();
        let ids = postbox::sqlx::applied_version(&mut conn, &schema)
            .await
            .unwrap();
        assert!(ids.is_some());
        let store = postbox_store::Store::new(
            sqlx::PgPool::connect(cluster.url()).await.unwrap(),
            schema.clone(),
        );
        assert_eq!(store.status_counts().await.unwrap().pending, 1);
        drop(conn);
        cluster.stop().await.unwrap();
    }

    /// `--crash-external-database`: a server verify did not start, crashed
    /// and restarted through `pg_ctl` with its own command line.
    #[tokio::test]
    async fn an_external_server_is_crashed_and_restarted_with_pg_ctl() {
        let Some(mut cluster) = start_or_skip().await else {
            return;
        };
        let data_dir = cluster.data_dir().to_path_buf();
        let pid = cluster.child.as_ref().map(ChildProcess::id).unwrap();
        let mut before = PgConnection::connect(cluster.url()).await.unwrap();
        crash_and_restart_external(&data_dir).await.unwrap();
        // The postmaster verify started is gone (reap it), a new one answers.
        let old = cluster.child.take().unwrap();
        assert!(old.wait_for(KILL_TIMEOUT).await.is_some());
        assert!(!os::exists(pid));
        assert!(data_directory(&mut before).await.is_err());
        let mut after = PgConnection::connect(cluster.url()).await.unwrap();
        let dir = data_directory(&mut after).await.unwrap();
        assert_eq!(Path::new(&dir), data_dir);
        drop((before, after));
        // Stop the restarted server, which pg_ctl started, before the
        // directory goes.
        let bins = find_binaries().await.unwrap();
        let mut stop = std::process::Command::new(bins.postgres.with_file_name("pg_ctl"));
        stop.args(["stop", "-m", "fast", "-w", "-D"]).arg(&data_dir);
        if let Some(user) = run_as().unwrap() {
            stop.uid(user.uid).gid(user.gid);
        }
        assert!(stop.status().unwrap().success());
        cluster.stop().await.unwrap();
    }

    #[tokio::test]
    async fn two_clusters_at_once() {
        let (a, b) = tokio::join!(start_or_skip(), start_or_skip());
        let (Some(a), Some(b)) = (a, b) else {
            return;
        };
        assert_ne!(a.port(), b.port());
        assert_ne!(a.data_dir(), b.data_dir());

        let mut conn_a = PgConnection::connect(a.url()).await.unwrap();
        let mut conn_b = PgConnection::connect(b.url()).await.unwrap();
        let schema = postbox::Schema::new("only_in_a").unwrap();
        postbox::sqlx::migrate(&mut conn_a, &schema).await.unwrap();
        let in_b = postbox::sqlx::applied_version(&mut conn_b, &schema)
            .await
            .unwrap();
        assert_eq!(in_b, None, "clusters must be independent");
        for (conn, cluster) in [(&mut conn_a, &a), (&mut conn_b, &b)] {
            let dir = data_directory(conn).await.unwrap();
            assert_eq!(Path::new(&dir), cluster.data_dir());
        }

        // Sessions are still open: a fast shutdown must not wait for them.
        let (dir_a, dir_b) = (a.data_dir().to_path_buf(), b.data_dir().to_path_buf());
        let (ra, rb) = tokio::join!(a.stop(), b.stop());
        ra.unwrap();
        rb.unwrap();
        assert!(!dir_a.exists() && !dir_b.exists());
        drop((conn_a, conn_b));
    }

    #[tokio::test]
    async fn drop_kills_server_and_removes_directory() {
        let Some(cluster) = start_or_skip().await else {
            return;
        };
        let root = cluster.root.clone();
        let pid = cluster.child.as_ref().map(ChildProcess::id).unwrap();
        drop(cluster);
        assert!(!root.exists(), "temporary directory still exists");
        assert!(!os::exists(pid), "postmaster {pid} still running");
    }

    #[test]
    fn picks_highest_complete_version() {
        let root =
            std::env::temp_dir().join(format!("postbox-pgtest-{:016x}", rand::random::<u64>()));
        let make = |version: &str, names: &[&str]| {
            let bin = root.join(version).join("bin");
            fs::create_dir_all(&bin).unwrap();
            for name in names {
                let p = bin.join(name);
                fs::write(&p, "#!/bin/sh\n").unwrap();
                fs::set_permissions(&p, fs::Permissions::from_mode(0o755)).unwrap();
            }
        };
        make("9.6", &["initdb", "postgres"]);
        make("10", &["initdb", "postgres"]);
        make("15", &["initdb", "postgres"]);
        make("16", &["initdb"]); // incomplete: ignored
        fs::create_dir_all(root.join("common")).unwrap();

        let found = find_binaries_in(None, &root, None).unwrap();
        assert_eq!(found.initdb, root.join("15/bin/initdb"));
        assert_eq!(found.postgres, root.join("15/bin/postgres"));

        // pg_config's bindir wins when complete; an incomplete one is skipped.
        let found = find_binaries_in(Some(&root.join("10/bin")), &root, None).unwrap();
        assert_eq!(found.initdb, root.join("10/bin/initdb"));
        let found = find_binaries_in(Some(&root.join("16/bin")), &root, None).unwrap();
        assert_eq!(found.initdb, root.join("15/bin/initdb"));

        // PATH fallback.
        let nothing = root.join("missing");
        let path = std::env::join_paths([root.join("16/bin"), root.join("9.6/bin")]).unwrap();
        let found = find_binaries_in(None, &nothing, Some(&path)).unwrap();
        assert_eq!(found.initdb, root.join("16/bin/initdb"));
        assert_eq!(found.postgres, root.join("9.6/bin/postgres"));
        assert_eq!(find_binaries_in(None, &nothing, None), None);

        fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn versions_and_messages() {
        assert_eq!(parse_version("15"), Some(vec![15]));
        assert_eq!(parse_version("9.6"), Some(vec![9, 6]));
        assert_eq!(parse_version("17beta1"), Some(vec![17]));
        assert_eq!(parse_version("common"), None);
        assert!(parse_version("10").unwrap() > parse_version("9.6").unwrap());

        let msg = ClusterError::BinariesNotFound.to_string();
        for needle in [
            "apt-get install postgresql",
            "dnf install postgresql-server",
            "brew install postgresql",
            "DATABASE_URL",
        ] {
            assert!(msg.contains(needle), "{msg}");
        }
        assert_eq!(tail("a\n\nb\nc\n", 2), "  b\n  c");
    }
}
