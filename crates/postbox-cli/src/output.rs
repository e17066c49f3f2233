//! Writing to stdout and stderr without ever panicking on a closed pipe.
//!
//! Rust ignores SIGPIPE, so a write to a pipe whose reader is gone fails with
//! `BrokenPipe`, and `println!`/`eprintln!` turn that into a panic. Here:
//!
//! - stdout (`outln!`, `out!`): the first failed write marks stdout closed;
//!   later writes are skipped, and loops that print (`status --watch`) stop
//!   when a write returns false, exiting 0 like `head`'s other tools.
//! - stderr (`errln!` and the log): a failed write is dropped silently. A
//!   relay whose log pipe closes goes on delivering; it only stops logging.

use std::io::{IsTerminal, Write};

/// Whether colour may be used on stderr: a terminal, and `NO_COLOR` unset or empty.
pub fn stderr_colour() -> bool {
    colour_allowed(std::env::var_os("NO_COLOR").as_deref()) && std::io::stderr().is_terminal()
}

/// Whether stdout is a terminal (screen clearing, for `--watch`).
pub fn stdout_is_terminal() -> bool {
    std::io::stdout().is_terminal()
}

/// <https://no-color.org>: any non-empty `NO_COLOR` turns colour off.
fn colour_allowed(no_color: Option<&std::ffi::OsStr>) -> bool {
    no_color.is_none_or(|v| v.is_empty())
}

/// The log's writer: stderr, where a failed write is dropped instead of
/// reported (the fmt layer would report it with `eprintln!`, which panics on a
/// closed pipe).
pub struct LogWriter;

impl Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let _ = std::io::stderr().write_all(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        let _ = std::io::stderr().flush();
        Ok(())
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = LogWriter;
    fn make_writer(&'a self) -> Self::Writer {
        LogWriter
    }
}

/// How log lines are written (`--log-format`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines: time, level, message, fields.
    Text,
    /// One JSON object per line: `timestamp`, `level`, `fields` (with
    /// `message`), `span` and `spans` (the spans the event happened in).
    Json,
}

/// The JSON log (`--log-format json`): the same filter and writer as the
/// text log, never coloured, with the current span and its parents.
pub fn json_log_layer<S>() -> impl tracing_subscriber::Layer<S>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    tracing_subscriber::fmt::layer()
        .json()
        .with_writer(LogWriter)
        .with_ansi(false)
        .log_internal_errors(false)
        .with_target(false)
        .with_current_span(true)
        .with_span_list(true)
}

/// Progress of long operations: on a terminal only (see `postbox_harness::progress`).
pub(crate) use postbox_harness::progress::Progress;
pub(crate) use postbox_harness::{errln, out, outln};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_color_turns_colour_off_when_set_and_not_empty() {
        assert!(colour_allowed(None));
        assert!(colour_allowed(Some(std::ffi::OsStr::new(""))));
        assert!(!colour_allowed(Some(std::ffi::OsStr::new("1"))));
    }
}
