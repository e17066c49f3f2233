//! The relay processes under test: `postbox relay` children of this binary,
//! restarted whenever they die, and the signals faults send them.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::process::{Child, Command};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How to start one relay.
#[derive(Clone, Debug)]
pub struct RelaySpec {
    pub exe: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    /// Each relay's stderr goes to `relay-N.log` here.
    pub log_dir: PathBuf,
}

/// What happened to the relay processes.
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
    pid: Mutex<Option<u32>>,
    kill_requested: AtomicBool,
    stalled: AtomicBool,
}

pub struct Relays {
    slots: Vec<Arc<Slot>>,
    tasks: Vec<JoinHandle<()>>,
    stop: CancellationToken,
    pub counters: Arc<RelayCounters>,
}

impl Relays {
    pub fn start(n: usize, spec: RelaySpec, seed: u64) -> Relays {
        let stop = CancellationToken::new();
        let counters = Arc::new(RelayCounters::default());
        let mut slots = Vec::with_capacity(n);
        let mut tasks = Vec::with_capacity(n);
        for i in 0..n {
            let slot = Arc::new(Slot::default());
            slots.push(slot.clone());
            tasks.push(tokio::spawn(supervise(
                i,
                slot,
                spec.clone(),
                stop.clone(),
                counters.clone(),
                seed.wrapping_add(i as u64),
            )));
        }
        Relays {
            slots,
            tasks,
            stop,
            counters,
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// The pid of relay `i`, if it is running and not stalled.
    pub fn running(&self, i: usize) -> Option<u32> {
        let slot = &self.slots[i];
        if slot.stalled.load(Ordering::SeqCst) {
            return None;
        }
        *lock(&slot.pid)
    }

    /// SIGKILL relay `i`; false if it was not running.
    pub fn kill(&self, i: usize) -> bool {
        let Some(pid) = self.running(i) else {
            return false;
        };
        self.slots[i].kill_requested.store(true, Ordering::SeqCst);
        signal(pid, libc::SIGKILL)
    }

    /// SIGSTOP relay `i`; returns the pid to [`Relays::resume`] later.
    pub fn stall(&self, i: usize) -> Option<u32> {
        let pid = self.running(i)?;
        self.slots[i].stalled.store(true, Ordering::SeqCst);
        signal(pid, libc::SIGSTOP).then_some(pid)
    }

    /// SIGCONT a relay stopped by [`Relays::stall`], if it is still that process.
    pub fn resume(&self, i: usize, pid: u32) {
        let slot = &self.slots[i];
        if *lock(&slot.pid) == Some(pid) {
            signal(pid, libc::SIGCONT);
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    match m.lock() {
        Ok(g) => g,
        Err(poisoned) => poisoned.into_inner(),
    }
}

fn signal(pid: u32, sig: libc::c_int) -> bool {
    let Ok(pid) = libc::pid_t::try_from(pid) else {
        return false;
    };
    // SAFETY: kill(2) with a pid this process spawned and has not reaped yet.
    unsafe { libc::kill(pid, sig) == 0 }
}

fn spawn(i: usize, spec: &RelaySpec) -> std::io::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(spec.log_dir.join(format!("relay-{i}.log")))?;
    let mut cmd = Command::new(&spec.exe);
    cmd.args(&spec.args)
        .env_remove("POSTBOX_SINK")
        .env_remove("POSTBOX_BATCH_SIZE")
        .env_remove("POSTBOX_METRICS_LISTEN")
        .env_remove("POSTBOX_CONFIG")
        .envs(spec.env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(log))
        .kill_on_drop(true);
    // SAFETY: prctl is async-signal-safe; the relay dies with this process
    // even if verify itself is killed.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.spawn()
}

async fn supervise(
    i: usize,
    slot: Arc<Slot>,
    spec: RelaySpec,
    stop: CancellationToken,
    counters: Arc<RelayCounters>,
    seed: u64,
) {
    let mut rng = StdRng::seed_from_u64(seed);
    while !stop.is_cancelled() {
        let mut child = match spawn(i, &spec) {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!(relay = i, error = %e, "cannot start a relay; trying again");
                counters.unexpected_exits.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        counters.starts.fetch_add(1, Ordering::Relaxed);
        *lock(&slot.pid) = child.id();
        let ended = tokio::select! {
            status = child.wait() => Some(status),
            _ = stop.cancelled() => None,
        };
        match ended {
            Some(status) => {
                *lock(&slot.pid) = None;
                let killed = slot.kill_requested.swap(false, Ordering::SeqCst);
                let code = status.as_ref().ok().and_then(|s| s.code());
                if killed {
                    counters.killed.fetch_add(1, Ordering::Relaxed);
                } else if code == Some(postbox_relay::failpoint::EXIT_STATUS) {
                    counters.failpoint_exits.fetch_add(1, Ordering::Relaxed);
                } else {
                    counters.unexpected_exits.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!(relay = i, ?status, log = %spec.log_dir.join(format!("relay-{i}.log")).display(), "a relay exited by itself; restarting it");
                }
                // Restart after a short, random pause (a supervisor's restart delay).
                let pause = Duration::from_millis(rng.random_range(100..800));
                tokio::select! {
                    _ = tokio::time::sleep(pause) => {}
                    _ = stop.cancelled() => {}
                }
            }
            None => {
                let pid = lock(&slot.pid).take();
                if let Some(pid) = pid {
                    signal(pid, libc::SIGCONT);
                    signal(pid, libc::SIGTERM);
                }
                if tokio::time::timeout(Duration::from_secs(10), child.wait())
                    .await
                    .is_err()
                {
                    let _ = child.kill().await;
                }
            }
        }
    }
}
