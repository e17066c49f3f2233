//! The `--config` file (TOML) and how it combines with flags and the environment:
//! a flag beats its environment variable, which beats the file, which beats the default.

use postbox_relay::{HealthConfig, RelayConfig, RetentionConfig, RouteConfig};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;

/// The whole config file. Every section and field is optional.
///
/// ```toml
/// database_url = "postgres://relay@db/app"   # or DATABASE_URL
/// schema = "postbox"                         # or POSTBOX_SCHEMA
///
/// [relay]
/// batch_size = 500
/// lease = "60s"
///
/// [sink]
/// url = "redis://127.0.0.1:6379?mode=stream" # or --sink / POSTBOX_SINK
/// source = "shop"                            # CloudEvents source
///
/// [retention]
/// enabled = true
/// older_than = "7d"
/// ```
///
/// Instead of `[sink]`, named destinations and routes (fan-out, ordering):
///
/// ```toml
/// [destinations.billing]
/// url = "https://billing.internal/hooks/postbox"
/// [destinations.search]
/// url = "redis://127.0.0.1:6379?mode=stream"
///
/// [[routes]]
/// match = ["order.*", "invoice.*"]
/// to = ["billing", "search"]
/// ordered = true        # per aggregate, in sequence
/// poison = "block"      # or "skip"
/// ```
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub database_url: Option<String>,
    pub schema: Option<String>,
    #[serde(default)]
    pub relay: RelayConfig,
    #[serde(default)]
    pub sink: SinkSection,
    /// `[destinations.NAME]`: named sinks for `[[routes]]`.
    #[serde(default)]
    pub destinations: BTreeMap<String, SinkSection>,
    /// `[[routes]]`: event types (exact or glob) to destinations.
    #[serde(default)]
    pub routes: Vec<RouteConfig>,
    /// `[retention]`: the relay's background purge (off by default) and the
    /// defaults of `postbox purge`.
    #[serde(default)]
    pub retention: RetentionConfig,
    /// `[health]`: the relay's database health watch (on by default).
    #[serde(default)]
    pub health: HealthConfig,
}

/// `[sink]`, and each `[destinations.NAME]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SinkSection {
    pub url: Option<String>,
    pub source: Option<String>,
    /// `http` settings for `http://` and `https://` URLs.
    #[serde(default)]
    pub http: postbox_relay::sinks::http::HttpOptions,
    /// `qstash` settings for `qstash:` URLs.
    #[serde(default)]
    pub qstash: postbox_relay::sinks::qstash::QstashOptions,
}

/// The config file could not be used.
#[derive(Debug, thiserror::Error)]
pub enum FileError {
    #[error("cannot read config file {path}")]
    Read {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("config file {path}: {message}")]
    Parse { path: String, message: String },
}

impl FileConfig {
    pub fn load(path: &Path) -> Result<Self, FileError> {
        let text = std::fs::read_to_string(path).map_err(|source| FileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|message| FileError::Parse {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parse TOML; the message names the offending key and line.
    pub fn parse(text: &str) -> Result<Self, String> {
        toml::from_str(text).map_err(|e| {
            // toml's message quotes the offending line, which could hold a secret.
            let span = e.span().map(|s| {
                let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                format!(" (line {line})")
            });
            format!("{}{}", e.message(), span.unwrap_or_default())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_a_full_file() {
        let c = FileConfig::parse(
            "schema = \"app_outbox\"\n[relay]\nbatch_size = 50\nlease = \"2m\"\n[sink]\nurl = \"stdout\"\n",
        )
        .unwrap();
        assert_eq!(c.schema.as_deref(), Some("app_outbox"));
        assert_eq!(c.relay.batch_size, 50);
        assert_eq!(c.sink.url.as_deref(), Some("stdout"));
    }

    #[test]
    fn names_unknown_and_mistyped_fields() {
        let err = FileConfig::parse("[relay]\nbatch_sise = 5\n").unwrap_err();
        assert!(
            err.contains("unknown field `batch_sise`") && err.contains("line 2"),
            "{err}"
        );
        let err = FileConfig::parse("[relay]\nlease = \"soon\"\n").unwrap_err();
        assert!(err.contains("line 2"), "{err}");
        let err = FileConfig::parse("[retention]\nolder_then = \"1d\"\n").unwrap_err();
        assert!(err.contains("unknown field `older_then`"), "{err}");
        let err = FileConfig::parse("database_url = \"postgres://u:hunter2@h/db\"\nextra = 1\n")
            .unwrap_err();
        assert!(!err.contains("hunter2"), "{err}");
    }
}
