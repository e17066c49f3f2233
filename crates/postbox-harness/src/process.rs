//! Child processes: every process the harness starts and supervises (the
//! throwaway cluster's server, `postbox relay` children) is a
//! [`ChildProcess`].
//!
//! A thread per child waits for it to end and only then reaps it, under the
//! same lock every signal takes: a signal never reaches a reused pid. The
//! reaping reads the child's peak memory (what `postbox bench` reports) along
//! with its exit status. Dropping a `ChildProcess` that still runs kills it.

use crate::os::{self, Signal};
use std::io;
use std::process::ExitStatus;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::Notify;

/// How a child ended.
#[derive(Clone, Copy, Debug)]
pub struct Exit {
    pub status: ExitStatus,
    /// Peak resident set size, in MB.
    pub peak_rss_mb: f64,
    /// User and system CPU time it used, in seconds.
    pub cpu_s: f64,
}

/// What the waiting thread found: `None` while the child runs.
type Ended = Option<Result<Exit, Arc<io::Error>>>;

struct Shared {
    pid: u32,
    ended: Mutex<Ended>,
    /// For synchronous waiters ([`ChildProcess::wait_blocking`]).
    changed: Condvar,
    /// For asynchronous ones.
    notify: Notify,
}

impl Shared {
    fn ended(&self) -> MutexGuard<'_, Ended> {
        self.ended.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Signal the child if it has not been reaped; false if it has (or the
    /// signal could not be sent).
    fn signal(&self, group: bool, signal: Signal) -> bool {
        let ended = self.ended();
        if ended.is_some() {
            return false;
        }
        let sent = if group {
            os::signal_group(self.pid, signal)
        } else {
            os::signal(self.pid, signal)
        };
        drop(ended);
        sent.is_ok()
    }
}

fn result(ended: &Ended) -> Option<io::Result<Exit>> {
    ended.as_ref().map(|r| match r {
        Ok(exit) => Ok(*exit),
        Err(e) => Err(io::Error::new(e.kind(), e.to_string())),
    })
}

/// A running (or ended, not yet dropped) child process.
pub struct ChildProcess {
    shared: Arc<Shared>,
}

/// Sends signals to a [`ChildProcess`] from elsewhere (a fault schedule).
#[derive(Clone)]
pub struct ChildHandle {
    shared: Arc<Shared>,
}

impl ChildHandle {
    pub fn id(&self) -> u32 {
        self.shared.pid
    }

    /// Send `signal`; false if the child has ended.
    pub fn signal(&self, signal: Signal) -> bool {
        self.shared.signal(false, signal)
    }
}

impl ChildProcess {
    /// Spawn `cmd` and start waiting for it on a thread of its own.
    pub fn spawn(cmd: &mut std::process::Command) -> io::Result<ChildProcess> {
        let child = cmd.spawn()?;
        let pid = child.id();
        // The std handle only owns pipes (none are set up here); the waiting
        // thread reaps the process.
        drop(child);
        let shared = Arc::new(Shared {
            pid,
            ended: Mutex::new(None),
            changed: Condvar::new(),
            notify: Notify::new(),
        });
        let waiting = shared.clone();
        let spawned = std::thread::Builder::new()
            .name(format!("wait-{pid}"))
            .spawn(move || {
                let ended = os::wait_ended(pid).and_then(|()| {
                    // Reap under the lock signals take.
                    let mut ended = waiting.ended();
                    let reaped = os::reap(pid)?;
                    *ended = Some(Ok(Exit {
                        status: reaped.status,
                        peak_rss_mb: reaped.peak_rss_mb,
                        cpu_s: reaped.cpu_s,
                    }));
                    Ok(())
                });
                if let Err(e) = ended {
                    *waiting.ended() = Some(Err(Arc::new(e)));
                }
                waiting.changed.notify_all();
                waiting.notify.notify_waiters();
            });
        if let Err(e) = spawned {
            let _ = os::signal(pid, Signal::Kill);
            return Err(e);
        }
        Ok(ChildProcess { shared })
    }

    pub fn id(&self) -> u32 {
        self.shared.pid
    }

    pub fn handle(&self) -> ChildHandle {
        ChildHandle {
            shared: self.shared.clone(),
        }
    }

    /// Send `signal` to the child; false if it has ended.
    pub fn signal(&self, signal: Signal) -> bool {
        self.shared.signal(false, signal)
    }

    /// Send `signal` to the child's process group (a child started as a
    /// group leader); false if the child has ended.
    pub fn signal_group(&self, signal: Signal) -> bool {
        self.shared.signal(true, signal)
    }

    /// How the child ended, if it has.
    pub fn try_exit(&self) -> Option<io::Result<Exit>> {
        result(&self.shared.ended())
    }

    /// Wait for the child to end.
    pub async fn wait(&self) -> io::Result<Exit> {
        loop {
            let notified = self.shared.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Some(r) = self.try_exit() {
                return r;
            }
            notified.await;
        }
    }

    /// Wait for the child to end, up to `timeout`; `None` if it still runs.
    pub async fn wait_for(&self, timeout: Duration) -> Option<io::Result<Exit>> {
        tokio::time::timeout(timeout, self.wait()).await.ok()
    }

    /// Block the thread until the child ends, up to `timeout` (for `Drop`).
    pub fn wait_blocking(&self, timeout: Duration) -> Option<io::Result<Exit>> {
        let deadline = Instant::now() + timeout;
        let mut ended = self.shared.ended();
        loop {
            if let Some(r) = result(&ended) {
                return Some(r);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return None;
            }
            ended = self
                .shared
                .changed
                .wait_timeout(ended, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Ask the child to stop (SIGCONT in case it is stopped, then SIGTERM);
    /// SIGKILL if it still runs after `grace`.
    pub async fn stop(&self, grace: Duration) -> io::Result<Exit> {
        self.signal(Signal::Continue);
        self.signal(Signal::Terminate);
        if let Some(r) = self.wait_for(grace).await {
            return r;
        }
        self.signal(Signal::Kill);
        self.wait().await
    }
}

impl std::fmt::Debug for ChildProcess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChildProcess")
            .field("pid", &self.shared.pid)
            .field("ended", &*self.shared.ended())
            .finish()
    }
}

impl Drop for ChildProcess {
    fn drop(&mut self) {
        self.signal(Signal::Kill);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sh(script: &str) -> std::process::Command {
        let mut cmd = std::process::Command::new("sh");
        cmd.args(["-c", script]);
        cmd
    }

    #[tokio::test]
    async fn exit_status_and_memory_are_read() {
        let child = ChildProcess::spawn(&mut sh("exit 3")).unwrap();
        let exit = child.wait().await.unwrap();
        assert_eq!(exit.status.code(), Some(3));
        assert!(exit.peak_rss_mb > 0.0, "{exit:?}");
        assert!(!child.signal(Signal::Kill), "signalled a reaped child");
        assert!(child.try_exit().is_some());
    }

    /// Poll `condition` every 10 ms for up to 10 s.
    async fn until(condition: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while !condition() {
            assert!(Instant::now() < deadline, "condition not met within 10 s");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    #[tokio::test]
    async fn stop_terminates_and_kills_what_ignores_it() {
        use std::os::unix::process::ExitStatusExt;
        let child = ChildProcess::spawn(&mut sh("sleep 30")).unwrap();
        assert!(child.try_exit().is_none());
        assert!(child.wait_for(Duration::from_millis(50)).await.is_none());
        let exit = child.stop(Duration::from_secs(5)).await.unwrap();
        assert_eq!(exit.status.signal(), Some(libc::SIGTERM));

        // A child that ignores SIGTERM is killed after the grace period.
        let ready = std::env::temp_dir().join(format!("postbox-harness-{}", rand::random::<u64>()));
        let script = format!("trap '' TERM; touch '{}'; exec sleep 30", ready.display());
        let stubborn = ChildProcess::spawn(&mut sh(&script)).unwrap();
        until(|| ready.exists()).await;
        let exit = stubborn.stop(Duration::from_millis(200)).await.unwrap();
        assert_eq!(exit.status.signal(), Some(libc::SIGKILL));
        let _ = std::fs::remove_file(&ready);
    }

    #[tokio::test]
    async fn dropping_a_running_child_kills_it() {
        let child = ChildProcess::spawn(&mut sh("sleep 30")).unwrap();
        let handle = child.handle();
        assert!(handle.signal(Signal::Continue));
        drop(child);
        // Once reaped, the handle refuses to signal.
        until(|| !handle.signal(Signal::Continue)).await;
    }
}
