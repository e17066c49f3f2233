//! One module per command; each has its flags (`…Args`) and its entry point,
//! `run(&Settings, …Args)`. `demo`, `bench` and `verify` only parse flags and
//! call the harness (`postbox_harness`).

pub mod bench;
pub mod completions;
pub mod console;
pub mod demo;
pub mod dlq;
pub mod enqueue;
pub mod group;
pub mod log;
pub mod man;
pub mod migrate;
pub mod purge;
pub mod receive;
pub mod relay;
pub mod replay;
pub mod route;
pub mod slot;
pub mod status;
pub mod verify;

/// `--mode claim|log|logical`, as `relay`, `migrate`, `verify` and `demo` take it.
pub(crate) fn parse_mode(s: &str) -> Result<postbox_relay::ReadMode, String> {
    s.parse()
}

/// A switch given as `on` or `off`.
pub(crate) fn parse_on_off(s: &str) -> Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, got {other:?}")),
    }
}
