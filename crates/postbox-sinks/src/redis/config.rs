//! The Redis sink's URL: `redis://…?mode=…&key=…&maxlen=…`, checked before
//! anything is sent. The sink has no options table.

use crate::shared::params;
use crate::KeyTemplate;
use postbox_sink::SinkError;

/// How messages are written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// `LPUSH key body`: consumers `BRPOP` (oldest first).
    List,
    /// `XADD key * id … type … body …`: consumer groups, replay, acknowledgements.
    Stream,
}

/// What a sink URL asks for.
pub(crate) struct RedisConfig {
    /// The URL the client connects to: the sink URL without postbox's own
    /// parameters.
    pub client_url: url::Url,
    pub mode: Mode,
    pub key: KeyTemplate,
    pub maxlen: Option<usize>,
    /// The URL without credentials, the mode and the key template.
    pub described: String,
}

impl RedisConfig {
    /// Parse and check the sink URL.
    pub(crate) fn from_url(raw: &str) -> Result<Self, SinkError> {
        let mut url = url::Url::parse(raw)
            .map_err(|e| SinkError::Config(format!("sink URL is not a valid redis:// URL: {e}")))?;
        let mut mode = Mode::List;
        let mut key = "postbox:{event_type}".to_owned();
        let mut maxlen = None;
        let mut passthrough = Vec::new();
        for (name, value) in url.query_pairs() {
            match name.as_ref() {
                "mode" => {
                    mode = match value.as_ref() {
                        "list" => Mode::List,
                        "stream" => Mode::Stream,
                        other => {
                            return Err(SinkError::Config(format!(
                                "sink URL parameter mode: expected list or stream, got {other:?}"
                            )))
                        }
                    }
                }
                "key" => key = value.into_owned(),
                "maxlen" => {
                    maxlen = Some(value.parse::<usize>().ok().filter(|n| *n > 0).ok_or_else(
                        || {
                            SinkError::Config(format!(
                            "sink URL parameter maxlen: expected a positive integer, got {value:?}"
                        ))
                        },
                    )?)
                }
                // Connection parameters the redis client understands.
                "protocol" | "insecure" => {
                    passthrough.push((name.into_owned(), value.into_owned()))
                }
                other => return Err(params::unknown(other, &["mode", "key", "maxlen"])),
            }
        }
        if maxlen.is_some() && mode == Mode::List {
            return Err(SinkError::Config(
                "sink URL parameter maxlen: only applies to mode=stream".into(),
            ));
        }
        let key = KeyTemplate::parse("sink URL parameter key", &key)?;
        url.set_query(None);
        if !passthrough.is_empty() {
            url.query_pairs_mut().extend_pairs(passthrough);
        }
        let described = format!(
            "{}://{}:{}{} {} {}",
            url.scheme(),
            url.host_str().unwrap_or("localhost"),
            url.port().unwrap_or(6379),
            url.path(),
            match mode {
                Mode::List => "list",
                Mode::Stream => "stream",
            },
            key.as_str()
        );
        Ok(Self {
            client_url: url,
            mode,
            key,
            maxlen,
            described,
        })
    }
}
