//! Progress of long operations (migrating many schemas, purge, bulk dead-letter
//! actions, bench, demo) on stderr: shown on a terminal, silent in a pipe.
//!
//! Whether progress is shown is decided once per process: when stderr is a
//! terminal, unless `POSTBOX_PROGRESS` says otherwise (`always`: also into a
//! pipe or a file, one line per update; `never`: not even on a terminal;
//! `auto`, empty or unset: the terminal decides). Results never go through
//! here: they are printed on stdout whatever stderr is.
//!
//! On a terminal a [`Progress`] redraws one line in place (carriage return and
//! "erase line"), at most every [`REDRAW_EVERY`]; [`progressln!`](crate::progressln)
//! prints a stage's announcement as a line of its own. Writes go through
//! [`write_stderr`](crate::output::write_stderr), so a closed stderr is never
//! an error.

use crate::output::write_stderr;
use std::io::IsTerminal;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

/// The least time between two redraws of a progress line.
pub const REDRAW_EVERY: Duration = Duration::from_millis(100);

/// How progress is shown, from `POSTBOX_PROGRESS` and stderr.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Not shown (stderr is not a terminal, or `POSTBOX_PROGRESS=never`).
    Hidden,
    /// One line redrawn in place (stderr is a terminal).
    Terminal,
    /// One line per update (`POSTBOX_PROGRESS=always` and stderr is not a terminal).
    Lines,
}

impl Mode {
    /// The mode for a `POSTBOX_PROGRESS` value and whether stderr is a terminal.
    /// An unknown value counts as `auto`.
    pub fn decide(setting: Option<&str>, terminal: bool) -> Self {
        match (setting.map(str::trim), terminal) {
            (Some("never"), _) => Self::Hidden,
            (_, true) => Self::Terminal,
            (Some("always"), false) => Self::Lines,
            _ => Self::Hidden,
        }
    }
}

/// This process's progress mode (decided on first use).
pub fn mode() -> Mode {
    static MODE: OnceLock<Mode> = OnceLock::new();
    *MODE.get_or_init(|| {
        let setting = std::env::var("POSTBOX_PROGRESS").ok();
        Mode::decide(setting.as_deref(), std::io::stderr().is_terminal())
    })
}

/// Whether progress is shown at all. Work done only to report progress (a
/// count query) is skipped when it is not.
pub fn shown() -> bool {
    mode() != Mode::Hidden
}

/// Print a stage announcement on stderr when progress is shown (a line of its
/// own, below any progress line).
pub fn line(text: &str) {
    match mode() {
        Mode::Hidden => {}
        Mode::Terminal => write_stderr(&format!("\r\x1b[2K{text}\n")),
        Mode::Lines => write_stderr(&format!("{text}\n")),
    }
}

/// `eprintln!` for progress: printed only when progress is shown.
#[macro_export]
macro_rules! progressln {
    ($($arg:tt)*) => { $crate::progress::line(&format!($($arg)*)) };
}

/// One long operation's progress line: `LABEL DONE/TOTAL (PCT%) ELAPSED`, or
/// `LABEL DONE ELAPSED` without a total, plus an optional detail.
pub struct Progress {
    label: String,
    total: Option<u64>,
    started: Instant,
    last_drawn: Option<Instant>,
    drawn: bool,
    mode: Mode,
}

impl Progress {
    /// A progress line for `label`; `total` when the amount of work is known.
    pub fn new(label: impl Into<String>, total: Option<u64>) -> Self {
        Self::with_mode(label, total, mode())
    }

    fn with_mode(label: impl Into<String>, total: Option<u64>, mode: Mode) -> Self {
        Self {
            label: label.into(),
            total,
            started: Instant::now(),
            last_drawn: None,
            drawn: false,
            mode,
        }
    }

    /// Change the total (when it becomes known).
    pub fn set_total(&mut self, total: Option<u64>) {
        self.total = total;
    }

    /// Report `done` units of work; redrawn at most every [`REDRAW_EVERY`]
    /// on a terminal (the last update before [`finish`](Self::finish) is
    /// always shown).
    pub fn update(&mut self, done: u64) {
        self.update_with(done, "");
    }

    /// [`update`](Self::update) with a detail after the figures.
    pub fn update_with(&mut self, done: u64, detail: &str) {
        if self.mode == Mode::Hidden {
            return;
        }
        let complete = self.total.is_some_and(|t| done >= t);
        if self.mode == Mode::Terminal
            && !complete
            && self.last_drawn.is_some_and(|t| t.elapsed() < REDRAW_EVERY)
        {
            return;
        }
        self.last_drawn = Some(Instant::now());
        let text = self.render(done, detail);
        match self.mode {
            Mode::Terminal => {
                self.drawn = true;
                write_stderr(&format!("\r\x1b[2K{text}"));
            }
            Mode::Lines => write_stderr(&format!("{text}\n")),
            Mode::Hidden => {}
        }
    }

    /// The line's text (no control characters).
    pub fn render(&self, done: u64, detail: &str) -> String {
        let elapsed = self.started.elapsed().as_secs();
        let mut text = match self.total {
            Some(total) if total > 0 => {
                let pct = (done.min(total) as f64 / total as f64 * 100.0).floor();
                format!("{} {done}/{total} ({pct:.0}%)", self.label)
            }
            _ => format!("{} {done}", self.label),
        };
        if !detail.is_empty() {
            text.push_str("  ");
            text.push_str(detail);
        }
        text.push_str(&format!("  {}s", elapsed));
        text
    }

    /// Clear the line (on a terminal); the next output starts on a clean line.
    pub fn finish(&mut self) {
        if self.drawn {
            write_stderr("\r\x1b[2K");
            self.drawn = false;
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_decides_unless_the_setting_says_otherwise() {
        assert_eq!(Mode::decide(None, true), Mode::Terminal);
        assert_eq!(Mode::decide(None, false), Mode::Hidden);
        assert_eq!(Mode::decide(Some("auto"), false), Mode::Hidden);
        assert_eq!(Mode::decide(Some(""), true), Mode::Terminal);
        assert_eq!(Mode::decide(Some("never"), true), Mode::Hidden);
        assert_eq!(Mode::decide(Some("always"), false), Mode::Lines);
        assert_eq!(Mode::decide(Some("always"), true), Mode::Terminal);
        assert_eq!(Mode::decide(Some("sometimes"), false), Mode::Hidden);
    }

    #[test]
    fn a_line_shows_done_total_and_percent() {
        let p = Progress::with_mode("replayed", Some(2500), Mode::Hidden);
        let text = p.render(1000, "");
        assert!(text.starts_with("replayed 1000/2500 (40%)"), "{text}");
        let p = Progress::with_mode("purge", None, Mode::Hidden);
        let text = p.render(7, "sent events deleted");
        assert!(text.starts_with("purge 7  sent events deleted"), "{text}");
    }
}
