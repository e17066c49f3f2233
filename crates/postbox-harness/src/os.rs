//! The one place postbox calls libc: signals, waiting for a child process
//! (with its peak memory), dying with the parent, and the user to run
//! PostgreSQL as. Everything else goes through [`crate::process`].

// The workspace denies `unsafe`; this module is where libc is called.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::io;
use std::os::unix::process::{CommandExt, ExitStatusExt};
use std::process::ExitStatus;

/// The signals postbox sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Signal {
    /// SIGINT: PostgreSQL's fast shutdown.
    Interrupt,
    /// SIGTERM: a relay's graceful shutdown.
    Terminate,
    /// SIGKILL.
    Kill,
    /// SIGSTOP: freeze a process (a stall).
    Stop,
    /// SIGCONT: thaw it.
    Continue,
    /// SIGQUIT: PostgreSQL's immediate shutdown (what `pg_ctl stop -m
    /// immediate` sends): no checkpoint, recovery from the WAL at the next start.
    Quit,
}

impl Signal {
    fn raw(self) -> libc::c_int {
        match self {
            Signal::Interrupt => libc::SIGINT,
            Signal::Terminate => libc::SIGTERM,
            Signal::Kill => libc::SIGKILL,
            Signal::Stop => libc::SIGSTOP,
            Signal::Continue => libc::SIGCONT,
            Signal::Quit => libc::SIGQUIT,
        }
    }
}

fn pid_t(pid: u32) -> io::Result<libc::pid_t> {
    libc::pid_t::try_from(pid)
        .ok()
        .filter(|p| *p > 0)
        .ok_or_else(|| io::Error::other(format!("pid {pid} out of range")))
}

/// Send `signal` to `target` (a pid, or a negated process-group id). A
/// target that no longer exists is not an error.
fn kill(target: libc::pid_t, signal: Signal) -> io::Result<()> {
    // SAFETY: kill(2) has no memory-safety preconditions.
    if unsafe { libc::kill(target, signal.raw()) } == 0 {
        return Ok(());
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::ESRCH) {
        Ok(())
    } else {
        Err(err)
    }
}

/// Send `signal` to process `pid`; a process that is gone is not an error.
///
/// Only for children not reaped yet (their pid cannot have been reused):
/// [`crate::process::ChildProcess`] makes sure of that.
pub fn signal(pid: u32, signal: Signal) -> io::Result<()> {
    kill(pid_t(pid)?, signal)
}

/// Send `signal` to every process of process group `pgid`.
pub fn signal_group(pgid: u32, signal: Signal) -> io::Result<()> {
    kill(-pid_t(pgid)?, signal)
}

/// Whether a process `pid` exists (signal 0).
pub fn exists(pid: u32) -> bool {
    // SAFETY: signal 0 only checks for existence.
    pid_t(pid).is_ok_and(|p| unsafe { libc::kill(p, 0) } == 0)
}

/// Block until child `pid` has ended, without reaping it: until [`reap`],
/// it stays a zombie and its pid cannot be given to another process.
pub fn wait_ended(pid: u32) -> io::Result<()> {
    let pid = pid_t(pid)?;
    loop {
        // SAFETY: all-zero is a valid siginfo_t; waitid fills it in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: `info` is valid for the duration of the call.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOWAIT,
            )
        };
        if r == 0 {
            return Ok(());
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// What reaping a child tells of it.
#[derive(Clone, Copy, Debug)]
pub struct Reaped {
    pub status: ExitStatus,
    /// Peak resident set size (`ru_maxrss`), in MB.
    pub peak_rss_mb: f64,
    /// User and system CPU time it used, in seconds.
    pub cpu_s: f64,
}

/// Reap ended child `pid`: its exit status, peak memory and CPU time.
pub fn reap(pid: u32) -> io::Result<Reaped> {
    let pid = pid_t(pid)?;
    loop {
        let mut status = 0;
        // SAFETY: rusage is plain data; wait4 fills it for our own child.
        let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
        // SAFETY: both pointers are valid for the duration of the call.
        let r = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
        if r >= 0 {
            let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
            return Ok(Reaped {
                status: ExitStatus::from_raw(status),
                peak_rss_mb: usage.ru_maxrss as f64 / 1024.0,
                cpu_s: seconds(usage.ru_utime) + seconds(usage.ru_stime),
            });
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
}

/// Have the kernel SIGKILL the child when this process's spawning thread
/// ends, so children never outlive a killed postbox. Spawn from a thread that
/// lives as long as the child should (a runtime worker, not a blocking-pool
/// thread).
pub fn die_with_parent(cmd: &mut std::process::Command) {
    // SAFETY: prctl is async-signal-safe and touches no memory of ours.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
}

/// Whether this process runs as root.
pub fn is_root() -> bool {
    // SAFETY: geteuid(2) cannot fail and has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// A system user's ids.
#[derive(Debug, Clone)]
pub struct User {
    pub name: String,
    pub uid: u32,
    pub gid: u32,
}

/// Look a user up by name in the system's user database.
pub fn system_user(name: &str) -> Option<User> {
    let cname = CString::new(name).ok()?;
    let mut buf: Vec<libc::c_char> = vec![0; 1024];
    loop {
        // SAFETY: all-zero is a valid `passwd` (null pointers, zero ids); it is
        // only read after getpwnam_r filled it in.
        let mut pwd: libc::passwd = unsafe { std::mem::zeroed() };
        let mut result: *mut libc::passwd = std::ptr::null_mut();
        // SAFETY: every pointer is valid for the duration of the call and
        // `buf.len()` is the true size of `buf`.
        let rc = unsafe {
            libc::getpwnam_r(
                cname.as_ptr(),
                &mut pwd,
                buf.as_mut_ptr(),
                buf.len(),
                &mut result,
            )
        };
        if rc == libc::ERANGE && buf.len() < (1 << 20) {
            buf.resize(buf.len() * 2, 0);
            continue;
        }
        if rc != 0 || result.is_null() {
            return None;
        }
        return Some(User {
            name: name.to_owned(),
            uid: pwd.pw_uid,
            gid: pwd.pw_gid,
        });
    }
}

/// User and system CPU time this process has used so far, in seconds.
pub fn own_cpu_seconds() -> f64 {
    // SAFETY: rusage is plain data; getrusage fills it for this process.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: the pointer is valid for the duration of the call.
    if unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut usage) } != 0 {
        return 0.0;
    }
    let seconds = |t: libc::timeval| t.tv_sec as f64 + t.tv_usec as f64 / 1e6;
    seconds(usage.ru_utime) + seconds(usage.ru_stime)
}

/// Clock ticks per second (`sysconf(_SC_CLK_TCK)`), the unit of `/proc/PID/stat`'s CPU times.
pub fn ticks_per_second() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}
