//! Writing to stdout and stderr without ever panicking on a closed pipe
//! (`postbox bench | head`): Rust ignores SIGPIPE, so a write to a pipe whose
//! reader is gone fails with `BrokenPipe`, and `println!`/`eprintln!` turn
//! that into a panic. The workloads and the CLI print through these.
//!
//! - stdout ([`outln!`](crate::outln), [`out!`](crate::out)): the first
//!   failed write marks stdout closed; later writes are skipped, and loops
//!   that print stop when a write returns false.
//! - stderr ([`errln!`](crate::errln)): a failed write is dropped silently.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

static STDOUT_CLOSED: AtomicBool = AtomicBool::new(false);

/// Write `text` to stdout and flush; returns false once stdout is closed.
pub fn write_stdout(text: &str) -> bool {
    if STDOUT_CLOSED.load(Ordering::Relaxed) {
        return false;
    }
    let mut out = std::io::stdout().lock();
    match out.write_all(text.as_bytes()).and_then(|()| out.flush()) {
        Ok(()) => true,
        Err(_) => {
            // Closed (EPIPE) or otherwise unwritable: nothing more can be shown.
            STDOUT_CLOSED.store(true, Ordering::Relaxed);
            false
        }
    }
}

/// Write `text` to stderr; a failure is ignored (there is nowhere left to say it).
pub fn write_stderr(text: &str) {
    let mut err = std::io::stderr().lock();
    let _ = err.write_all(text.as_bytes()).and_then(|()| err.flush());
}

/// `println!` that stops printing when stdout is closed instead of panicking.
#[macro_export]
macro_rules! outln {
    () => { $crate::output::write_stdout("\n") };
    ($($arg:tt)*) => { $crate::output::write_stdout(&format!("{}\n", format_args!($($arg)*))) };
}

/// `print!` that stops printing when stdout is closed instead of panicking.
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write_stdout(&format!($($arg)*)) };
}

/// `eprintln!` that drops the line when stderr is closed instead of panicking.
#[macro_export]
macro_rules! errln {
    ($($arg:tt)*) => { $crate::output::write_stderr(&format!("{}\n", format_args!($($arg)*))) };
}
