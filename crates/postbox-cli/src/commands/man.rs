//! `postbox man`: the manual pages (roff), generated from the clap
//! definitions: `postbox(1)` on stdout, or with `--out-dir` one file per
//! command (`postbox.1`, `postbox-relay.1`, `postbox-dlq-replay.1`, …).

use crate::context::AnyError;
use crate::output::{out, outln};
use clap::Args;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct ManArgs {
    /// Write postbox.1 and a page per command (postbox-<command>.1) into
    /// this directory instead of printing postbox.1
    #[arg(long, value_name = "DIR")]
    pub out_dir: Option<PathBuf>,
}

/// Print the top page, or write every page into `--out-dir`. `command` is
/// the whole CLI.
pub fn run(command: clap::Command, args: ManArgs) -> Result<ExitCode, AnyError> {
    let mut command = command;
    command.build();
    match args.out_dir {
        None => {
            out!("{}", render(&command, "postbox")?);
        }
        Some(dir) => {
            std::fs::create_dir_all(&dir)
                .map_err(|e| format!("--out-dir {}: cannot create it: {e}", dir.display()))?;
            let written = write_pages(&command, "postbox", &dir)?;
            outln!("wrote {written} manual page(s) into {}", dir.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The page of `command`, titled `title`. Its synopsis shows the command as
/// typed (`postbox dlq replay`): clap sets that once the CLI is built.
fn render(command: &clap::Command, title: &str) -> Result<String, AnyError> {
    let mut page = Vec::new();
    clap_mangen::Man::new(command.clone())
        .title(title.to_owned())
        .render(&mut page)?;
    Ok(String::from_utf8_lossy(&page).into_owned())
}

/// Write `name.1` for `command` and, recursively, `name-<sub>.1` for each
/// visible subcommand; how many pages were written.
fn write_pages(command: &clap::Command, name: &str, dir: &Path) -> Result<usize, AnyError> {
    let path = dir.join(format!("{name}.1"));
    std::fs::write(&path, render(command, name)?)
        .map_err(|e| format!("--out-dir: cannot write {}: {e}", path.display()))?;
    let mut written = 1;
    for sub in command.get_subcommands().filter(|s| !s.is_hide_set()) {
        if sub.get_name() == "help" {
            continue;
        }
        written += write_pages(sub, &format!("{name}-{}", sub.get_name()), dir)?;
    }
    Ok(written)
}
