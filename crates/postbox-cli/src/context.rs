//! What every command shares: the global flags and the settings they
//! resolve to (with the config file), the error type, connecting to the
//! database, and stopping on a signal. Commands import this module, never
//! `main.rs` or each other.

use crate::config::FileConfig;
use crate::output::errln;
use clap::Args;
use postbox::Schema;
use postbox_store::connect as db;
use sqlx::postgres::PgConnectOptions;
use sqlx::{ConnectOptions, Connection};
use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// An error and its causes on one line, credentials masked: how errors are shown.
pub use postbox_harness::error_chain;
/// The error every command returns (the harness's, so its errors pass through).
pub use postbox_harness::AnyError;

/// Settings every command shares. A flag beats its environment variable, which
/// beats the config file.
#[derive(Args, Debug, Clone)]
pub struct Global {
    /// PostgreSQL connection URL, e.g. postgres://user@host:5432/db
    #[arg(long, env = "DATABASE_URL", global = true, hide_env_values = true)]
    pub database_url: Option<String>,
    /// Schema holding postbox's tables [default: postbox] (not for bench,
    /// demo, verify: they make their own)
    #[arg(long, env = "POSTBOX_SCHEMA", global = true)]
    pub schema: Option<String>,
    /// TOML config file (see README: Configuration) [env: POSTBOX_CONFIG;
    /// default: ./postbox.toml when it exists] (not for bench, demo, verify)
    #[arg(long, global = true, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// Log lines as text, or as one JSON object per line (for log pipelines)
    #[arg(
        long,
        env = "POSTBOX_LOG_FORMAT",
        global = true,
        value_enum,
        default_value_t = crate::output::LogFormat::Text
    )]
    pub log_format: crate::output::LogFormat,
}

/// The config file read when neither `--config` nor `POSTBOX_CONFIG` names one,
/// if it exists (relative to the working directory).
pub const DEFAULT_CONFIG: &str = "postbox.toml";

/// Where the configuration came from, for messages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigOrigin {
    Flag(PathBuf),
    Env(PathBuf),
    DefaultPath(PathBuf),
    /// No file: neither named nor found at the default path.
    None,
    /// No file, on purpose: `POSTBOX_CONFIG` is set and empty.
    Off,
}

impl ConfigOrigin {
    /// Find the configuration the same way for every command: `--config`,
    /// else `POSTBOX_CONFIG` (set and empty: no file at all), else
    /// `./postbox.toml` when it exists, else none.
    pub fn discover(flag: Option<&Path>, env: Option<&OsStr>) -> Self {
        if let Some(path) = flag {
            return Self::Flag(path.to_owned());
        }
        match env {
            Some(v) if v.is_empty() => return Self::Off,
            Some(path) => return Self::Env(PathBuf::from(path)),
            None => {}
        }
        let default = Path::new(DEFAULT_CONFIG);
        if default.is_file() {
            return Self::DefaultPath(default.to_owned());
        }
        Self::None
    }

    pub fn path(&self) -> Option<&Path> {
        match self {
            Self::Flag(p) | Self::Env(p) | Self::DefaultPath(p) => Some(p),
            Self::None | Self::Off => None,
        }
    }
}

impl std::fmt::Display for ConfigOrigin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Flag(p) => write!(f, "{} (--config)", p.display()),
            Self::Env(p) => write!(f, "{} (POSTBOX_CONFIG)", p.display()),
            Self::DefaultPath(p) => write!(f, "{} (the default path)", p.display()),
            Self::None => write!(
                f,
                "no configuration file (no --config, no POSTBOX_CONFIG, no ./{DEFAULT_CONFIG})"
            ),
            Self::Off => write!(f, "no configuration file (POSTBOX_CONFIG is empty)"),
        }
    }
}

/// Global settings after merging flags, environment and the config file.
pub struct Settings {
    pub file: FileConfig,
    /// Where `file` came from.
    pub origin: ConfigOrigin,
    pub database_url: Option<String>,
    pub schema: Schema,
}

impl Settings {
    pub fn resolve(global: &Global) -> Result<Self, AnyError> {
        let origin = ConfigOrigin::discover(
            global.config.as_deref(),
            std::env::var_os("POSTBOX_CONFIG").as_deref(),
        );
        let file = match origin.path() {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        let schema_name = global
            .schema
            .clone()
            .or_else(|| file.schema.clone())
            .unwrap_or_else(|| "postbox".to_owned());
        let schema = Schema::new(&schema_name)?;
        let database_url = global
            .database_url
            .clone()
            .or_else(|| file.database_url.clone());
        Ok(Self {
            file,
            origin,
            database_url,
            schema,
        })
    }

    /// A pool for a command. One short connection first, so that a wrong
    /// host or port says so at once instead of after the pool's patience.
    pub async fn pool(&self, application: &str) -> Result<sqlx::PgPool, AnyError> {
        let options = db::options(self.database_url.as_deref(), application)?;
        probe(&options).await?;
        Ok(db::pool(options, 4, db::CONNECT_PATIENCE).await?)
    }

    /// Say loudly, on stderr, that `what` shows payloads in full when no
    /// `[redact]` paths or headers are configured.
    pub fn warn_if_unredacted(&self, what: &str) {
        if let Some(line) = unredacted_warning(&self.file, &self.origin, what) {
            errln!("{line}");
        }
    }

    /// What a database error means when the command ran before `postbox
    /// migrate`: SQLSTATE 42P01 (no such table) or 3F000 (no such schema)
    /// while the schema lacks (some of) postbox's migrations. Other errors
    /// are returned as they are.
    pub async fn explain(&self, error: AnyError) -> AnyError {
        if !missing_relation(error.as_ref()) {
            return error;
        }
        let latest = postbox::MIGRATIONS.last().map_or(0, |m| m.version);
        let applied = async {
            let options = db::options(self.database_url.as_deref(), "postbox")?;
            let mut conn = tokio::time::timeout(PROBE_TIMEOUT, options.connect())
                .await
                .map_err(|_| "timed out")??;
            Ok::<_, AnyError>(postbox::sqlx::applied_version(&mut conn, &self.schema).await?)
        };
        match applied.await {
            Ok(None) => CommandError::NotMigrated {
                schema: self.schema.to_string(),
            }
            .into(),
            Ok(Some(v)) if v < latest => CommandError::Behind {
                schema: self.schema.to_string(),
                applied: v,
                latest,
            }
            .into(),
            _ => error,
        }
    }
}

/// How long the first connection may take before the pool's retries take over.
const PROBE_TIMEOUT: Duration = Duration::from_secs(5);

/// One connection attempt: refused means nothing listens at that address,
/// which no retry will fix. Anything else is left to the pool's retries.
async fn probe(options: &PgConnectOptions) -> Result<(), CommandError> {
    match tokio::time::timeout(PROBE_TIMEOUT, options.connect()).await {
        Ok(Err(sqlx::Error::Io(e))) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
            Err(CommandError::Refused {
                target: db::target(options),
                source: e,
            })
        }
        Ok(Ok(conn)) => {
            let _ = conn.close().await;
            Ok(())
        }
        _ => Ok(()),
    }
}

/// Whether a database error in `e`'s chain is SQLSTATE 42P01 or 3F000.
fn missing_relation(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut next = Some(e);
    while let Some(e) = next {
        if let Some(sqlx::Error::Database(db)) = e.downcast_ref::<sqlx::Error>() {
            if matches!(db.code().as_deref(), Some("42P01") | Some("3F000")) {
                return true;
            }
        }
        next = e.source();
    }
    false
}

/// The warning for a command that shows payloads with nothing redacted.
pub fn unredacted_warning(file: &FileConfig, origin: &ConfigOrigin, what: &str) -> Option<String> {
    if !file.redact.paths.is_empty() || !file.redact.headers.is_empty() {
        return None;
    }
    let why = match origin {
        ConfigOrigin::None | ConfigOrigin::Off => origin.to_string(),
        found => format!("the configuration {found} has no [redact] paths or headers"),
    };
    Some(format!(
        "WARNING: {what} shows payloads and headers in full, nothing redacted: {why}. \
         Name the sensitive paths under [redact] (README: Configuration)."
    ))
}

/// Errors a command explains in the user's terms.
#[derive(Debug, thiserror::Error)]
pub enum CommandError {
    #[error("cannot connect to PostgreSQL at {target}: connection refused (is PostgreSQL running there, and are the host and port right?)")]
    Refused {
        target: String,
        #[source]
        source: std::io::Error,
    },
    #[error("schema `{schema}` has no postbox tables: run `postbox migrate` first (or pass the right --schema)")]
    NotMigrated { schema: String },
    #[error("schema `{schema}` is at migration {applied}, this postbox needs {latest}: run `postbox migrate` first")]
    Behind {
        schema: String,
        applied: i32,
        latest: i32,
    },
}

/// Cancel `token` on SIGINT or SIGTERM.
pub async fn cancel_on_signal(token: CancellationToken) {
    shutdown_signal().await;
    token.cancel();
}

/// Resolves on SIGINT or SIGTERM (saying so in the log); never, when the
/// signal handlers cannot be installed. The handlers are installed when it
/// is first polled.
pub async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!(
            "cannot install signal handlers; stop the relay with SIGKILL (leases will expire)"
        );
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
    tracing::info!("shutting down: no new claims; finishing in-flight batches");
}

/// A setting out of range that the user gave as a flag, named by that flag
/// (not by the config key behind it).
#[derive(Debug, thiserror::Error)]
#[error("{flag}: {reason}")]
pub struct FlagError {
    pub flag: &'static str,
    pub reason: String,
}

/// `error`, named by the flag that set its field when one did: each entry is
/// (config field, flag, whether the flag was given).
pub fn name_the_flag(
    error: postbox_relay::ConfigError,
    flags: &[(&str, &'static str, bool)],
) -> AnyError {
    match flags
        .iter()
        .find(|(field, _, given)| *given && *field == error.field)
    {
        Some((_, flag, _)) => FlagError {
            flag,
            reason: error.reason,
        }
        .into(),
        None => error.into(),
    }
}

/// The OS user: `$USER`, `$LOGNAME`, else what `whoami` prints.
pub fn os_user() -> Option<String> {
    for var in ["USER", "LOGNAME"] {
        if let Ok(u) = std::env::var(var) {
            if !u.trim().is_empty() {
                return Some(u);
            }
        }
    }
    let out = std::process::Command::new("whoami").output().ok()?;
    let name = String::from_utf8(out.stdout).ok()?.trim().to_owned();
    (out.status.success() && !name.is_empty()).then_some(name)
}

/// Who an audited action is recorded under: `--actor` when given, else the
/// OS user; 1 to 255 bytes.
pub fn actor(given: Option<String>) -> Result<String, AnyError> {
    let actor = match given {
        Some(a) => a,
        None => os_user().ok_or(
            "cannot tell who you are ($USER is unset and `whoami` failed): pass --actor NAME",
        )?,
    };
    if actor.is_empty() || actor.len() > 255 {
        return Err("--actor: must be 1 to 255 bytes long".into());
    }
    Ok(actor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_beats_the_environment_and_an_empty_variable_means_no_file() {
        let flag = Path::new("a.toml");
        let env = OsStr::new("b.toml");
        assert_eq!(
            ConfigOrigin::discover(Some(flag), Some(env)),
            ConfigOrigin::Flag(flag.to_owned())
        );
        assert_eq!(
            ConfigOrigin::discover(None, Some(env)),
            ConfigOrigin::Env(PathBuf::from("b.toml"))
        );
        assert_eq!(
            ConfigOrigin::discover(None, Some(OsStr::new(""))),
            ConfigOrigin::Off
        );
        assert_eq!(ConfigOrigin::Off.path(), None);
    }
}
