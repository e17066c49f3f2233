//! What every command shares: the global flags and the settings they
//! resolve to (with the config file), the error type, connecting to the
//! database, and stopping on a signal. Commands import this module, never
//! `main.rs` or each other.

use crate::config::FileConfig;
use clap::Args;
use postbox::Schema;
use postbox_harness::db;
use std::path::PathBuf;
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
    /// Schema holding postbox's tables [default: postbox]
    #[arg(long, env = "POSTBOX_SCHEMA", global = true)]
    pub schema: Option<String>,
    /// TOML config file (see README: Configuration)
    #[arg(long, env = "POSTBOX_CONFIG", global = true)]
    pub config: Option<PathBuf>,
}

/// Global settings after merging flags, environment and the config file.
pub struct Settings {
    pub file: FileConfig,
    pub database_url: Option<String>,
    pub schema: Schema,
}

impl Settings {
    pub fn resolve(global: &Global) -> Result<Self, AnyError> {
        let file = match &global.config {
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
            database_url,
            schema,
        })
    }

    pub async fn pool(&self, application: &str) -> Result<sqlx::PgPool, AnyError> {
        let options = db::options(self.database_url.as_deref(), application)?;
        Ok(db::pool(options, 4, db::CONNECT_PATIENCE).await?)
    }
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
