//! `postbox completions <shell>`: the shell completion script, on stdout.
//!
//! Generated from the same clap definitions the binary parses, so it always
//! matches this build's commands and flags.

use crate::output::out;
use clap::Args;
use clap_complete::Shell;
use std::process::ExitCode;

#[derive(Args, Debug)]
pub struct CompletionsArgs {
    /// The shell: bash, zsh, fish, elvish or powershell
    #[arg(value_enum)]
    pub shell: Shell,
}

/// Write the script for `args.shell` to stdout. `command` is the whole CLI.
pub fn run(mut command: clap::Command, args: CompletionsArgs) -> ExitCode {
    let mut script = Vec::new();
    clap_complete::generate(args.shell, &mut command, "postbox", &mut script);
    out!("{}", String::from_utf8_lossy(&script));
    ExitCode::SUCCESS
}
