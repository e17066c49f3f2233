//! `postbox relay` children of this binary: how one is started
//! ([`RelayCommand`]), running several to the end at once (`postbox bench`:
//! [`run_together`]), and keeping several running whatever happens to them
//! (`postbox verify`: [`Supervisor`], which restarts a relay when it dies and
//! sends the signals the fault schedule asks for).

use crate::lock;
use crate::os::{self, Signal};
use crate::process::{ChildHandle, ChildProcess, Exit};
use postbox::Schema;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Settings a relay would otherwise take from the environment postbox runs in.
const INHERITED: [&str; 4] = [
    "POSTBOX_SINK",
    "POSTBOX_BATCH_SIZE",
    "POSTBOX_METRICS_LISTEN",
    "POSTBOX_CONFIG",
];

/// How to start `postbox relay` as a child of this binary: on one database
/// and schema, logging warnings only, with nothing taken from this
/// process's `POSTBOX_*` settings but what is set here.
#[derive(Clone, Debug)]
pub struct RelayCommand {
    exe: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
}

impl RelayCommand {
    pub fn new(database_url: &str, schema: &Schema) -> std::io::Result<Self> {
        Ok(Self {
            exe: std::env::current_exe()?,
            args: vec!["relay".to_owned()],
            env: vec![
                ("DATABASE_URL".to_owned(), database_url.to_owned()),
                ("POSTBOX_SCHEMA".to_owned(), schema.name().to_owned()),
                ("POSTBOX_LOG".to_owned(), "warn".to_owned()),
                // Empty: no config file, not even ./postbox.toml (`config` adds one).
                ("POSTBOX_CONFIG".to_owned(), String::new()),
            ],
        })
    }

    /// `postbox replay ARGS…` instead of a relay (the bench's replay beside
    /// live traffic).
    pub fn replay(database_url: &str, schema: &Schema) -> std::io::Result<Self> {
        let mut command = Self::new(database_url, schema)?;
        command.args = vec!["replay".to_owned()];
        Ok(command)
    }

    /// `postbox group serve --listen ADDR` instead of a relay: the consumer
    /// groups' HTTP API, which the fault schedule kills and stalls as it
    /// does relays (verify's pull run over HTTP).
    pub fn group_server(
        database_url: &str,
        schema: &Schema,
        listen: &str,
    ) -> std::io::Result<Self> {
        let mut command = Self::new(database_url, schema)?;
        command.args = ["group", "serve", "--listen", listen, "--token-cache", "1s"]
            .map(String::from)
            .to_vec();
        Ok(command)
    }

    /// Add arguments of `postbox relay`.
    pub fn args<I, S>(mut self, args: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        self.args.extend(args.into_iter().map(Into::into));
        self
    }

    /// Read the relay's settings from the TOML file at `path`.
    pub fn config(self, path: &Path) -> Self {
        self.args(["--config".to_owned(), path.display().to_string()])
    }

    pub fn env(mut self, name: &str, value: &str) -> Self {
        self.env.push((name.to_owned(), value.to_owned()));
        self
    }

    /// Start one relay; its stderr goes to `log` (appended) or to ours.
    ///
    /// The relay is killed when this process ends, however it ends. Call
    /// from a runtime worker (the kernel ties that to the spawning thread).
    pub fn spawn(&self, log: Option<&Path>) -> std::io::Result<ChildProcess> {
        let mut cmd = std::process::Command::new(&self.exe);
        cmd.args(&self.args);
        for name in INHERITED {
            cmd.env_remove(name);
        }
        cmd.envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::null());
        if let Some(path) = log {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)?;
            cmd.stderr(Stdio::from(file));
        }
        os::die_with_parent(&mut cmd);
        ChildProcess::spawn(&mut cmd)
    }
}

/// `n` relays run to their end together.
pub struct TogetherRun {
    /// From the first start to the last exit.
    pub elapsed: Duration,
    /// The largest peak RSS among them, in MB.
    pub peak_rss_mb: f64,
    /// The CPU time they used together, in seconds.
    pub cpu_s: f64,
}

/// Start `n` relays at once (`postbox relay --drain …`) and wait for all of them.
pub async fn run_together(
    command: &RelayCommand,
    n: usize,
) -> Result<TogetherRun, crate::AnyError> {
    let started = Instant::now();
    let mut children = Vec::with_capacity(n);
    for _ in 0..n {
        children.push(command.spawn(None)?);
    }
    let mut peak = 0.0_f64;
    let mut cpu_s = 0.0;
    for child in &children {
        let exit = child.wait().await?;
        if !exit.status.success() {
            return Err("a relay process failed; run it by hand to see why".into());
        }
        peak = peak.max(exit.peak_rss_mb);
        cpu_s += exit.cpu_s;
    }
    Ok(TogetherRun {
        elapsed: started.elapsed(),
        peak_rss_mb: peak,
        cpu_s,
    })
}

/// What happened to supervised relays.
#[derive(Debug, Default)]
pub struct RelayCounters {
    pub starts: AtomicU64,
    /// Ended by a SIGKILL the fault schedule sent.
    pub killed: AtomicU64,
    /// Ended at a failpoint (`exit`).
    pub failpoint_exits: AtomicU64,
    /// Ended any other way (an error: see the relay's log).
    pub unexpected_exits: AtomicU64,
}

#[derive(Default)]
struct Slot {
    running: Mutex<Option<ChildHandle>>,
    kill_requested: AtomicBool,
    stalled: AtomicBool,
}

/// `n` relays kept running: each restarted (after a short random pause)
/// whenever it ends, until [`Supervisor::shutdown`]. Relay `i` logs to
/// `relay-i.log` in the log directory.
pub struct Supervisor {
    slots: Vec<Arc<Slot>>,
    tasks: Vec<JoinHandle<()>>,
    stop: CancellationToken,
    pub counters: Arc<RelayCounters>,
}

impl Supervisor {
    pub fn start(n: usize, command: RelayCommand, log_dir: &Path, seed: u64) -> Supervisor {
        Self::start_each(vec![command; n], log_dir, seed)
    }

    /// One child per command (each may differ: a port of its own).
    pub fn start_each(commands: Vec<RelayCommand>, log_dir: &Path, seed: u64) -> Supervisor {
        let n = commands.len();
        let stop = CancellationToken::new();
        let counters = Arc::new(RelayCounters::default());
        let mut slots = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for (i, command) in commands.into_iter().enumerate() {
            let slot = Arc::new(Slot::default());
            slots.push(slot.clone());
            let one = Supervised {
                index: i,
                slot,
                command,
                log: log_dir.join(format!("relay-{i}.log")),
                counters: counters.clone(),
            };
            tasks.push(tokio::spawn(
                one.run(stop.clone(), seed.wrapping_add(i as u64)),
            ));
        }
        Supervisor {
            slots,
            tasks,
            stop,
            counters,
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Relay `i`, if it is running and not stalled.
    fn running(&self, i: usize) -> Option<ChildHandle> {
        let slot = &self.slots[i];
        if slot.stalled.load(Ordering::SeqCst) {
            return None;
        }
        lock(&slot.running).clone()
    }

    /// SIGKILL relay `i`; false if it was not running.
    pub fn kill(&self, i: usize) -> bool {
        let Some(relay) = self.running(i) else {
            return false;
        };
        self.slots[i].kill_requested.store(true, Ordering::SeqCst);
        relay.signal(Signal::Kill)
    }

    /// SIGSTOP relay `i`; returns its pid, to [`Supervisor::resume`] it later.
    pub fn stall(&self, i: usize) -> Option<u32> {
        let relay = self.running(i)?;
        self.slots[i].stalled.store(true, Ordering::SeqCst);
        relay.signal(Signal::Stop).then(|| relay.id())
    }

    /// SIGCONT a relay stopped by [`Supervisor::stall`], if it is still that process.
    pub fn resume(&self, i: usize, pid: u32) {
        let slot = &self.slots[i];
        if let Some(relay) = lock(&slot.running).as_ref().filter(|r| r.id() == pid) {
            relay.signal(Signal::Continue);
        }
        slot.stalled.store(false, Ordering::SeqCst);
    }

    /// SIGTERM every relay (SIGKILL after 10 s) and stop restarting them.
    pub async fn shutdown(self) {
        self.stop.cancel();
        for t in self.tasks {
            let _ = t.await;
        }
    }
}

/// One supervised relay slot.
struct Supervised {
    index: usize,
    slot: Arc<Slot>,
    command: RelayCommand,
    log: PathBuf,
    counters: Arc<RelayCounters>,
}

impl Supervised {
    async fn run(self, stop: CancellationToken, seed: u64) {
        let mut rng = StdRng::seed_from_u64(seed);
        while !stop.is_cancelled() {
            let child = match self.command.spawn(Some(&self.log)) {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(relay = self.index, error = %e, "cannot start a relay; trying again");
                    self.counters
                        .unexpected_exits
                        .fetch_add(1, Ordering::Relaxed);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    continue;
                }
            };
            self.counters.starts.fetch_add(1, Ordering::Relaxed);
            *lock(&self.slot.running) = Some(child.handle());
            let ended = tokio::select! {
                exit = child.wait() => Some(exit),
                _ = stop.cancelled() => None,
            };
            *lock(&self.slot.running) = None;
            let Some(exit) = ended else {
                let _ = child.stop(Duration::from_secs(10)).await;
                return;
            };
            self.count_exit(&exit);
            // Restart after a short, random pause (a supervisor's restart delay).
            let pause = Duration::from_millis(rng.random_range(100..800));
            tokio::select! {
                _ = tokio::time::sleep(pause) => {}
                _ = stop.cancelled() => {}
            }
        }
    }

    fn count_exit(&self, exit: &std::io::Result<Exit>) {
        let killed = self.slot.kill_requested.swap(false, Ordering::SeqCst);
        let code = exit.as_ref().ok().and_then(|e| e.status.code());
        let counter = if killed {
            &self.counters.killed
        } else if code == Some(postbox_relay::failpoint::EXIT_STATUS) {
            &self.counters.failpoint_exits
        } else {
            let status = exit.as_ref().map(|e| e.status);
            tracing::warn!(relay = self.index, ?status, log = %self.log.display(), "a relay exited by itself; restarting it");
            &self.counters.unexpected_exits
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }
}
