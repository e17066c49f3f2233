//! The postbox transports: every sink the relay delivers through. Each sink
//! is built from a URL (`--sink`) plus the shared [`SinkOptions`];
//! [`from_url`] picks the sink by scheme from the registry, [`SINKS`].
//!
//! Every sink keeps the contract of the `postbox-sink` crate ([`Sink`],
//! [`Message`](postbox_sink::Message), [`Outcome`](postbox_sink::Outcome))
//! and knows nothing of Postgres: this crate depends on the contract and the
//! `postbox` library (its secret masking and webhook signing) alone, never on
//! the store, the relay or sqlx. The relay re-exports it as
//! `postbox_relay::sinks`.
//!
//! Layout: one folder per sink — `mod.rs` the [`Sink`] implementation (the
//! transport) and its registry entry (`SINK`), `config.rs` its options table,
//! URL parameters and their validation, `tests.rs` its unit tests — and
//! `shared/` for what several sinks use. Every broker is behind the cargo
//! feature of its name; `stdout` is always built.
//!
//! Adding a sink: a folder `src/NAME/` whose `mod.rs` defines `pub(crate)
//! const SINK: BuiltSink`, its `mod` line below, one line in the registry
//! (its URL prefixes, its cargo feature, its options type if it has an
//! options table: a type implementing [`OptionsTable`]), the feature in this
//! crate's `Cargo.toml`, and the same feature in postbox-relay's, forwarding
//! to it.

#[cfg(feature = "amqp")]
pub mod amqp;
#[cfg(feature = "http")]
pub mod http;
#[cfg(feature = "kafka")]
pub mod kafka;
#[cfg(feature = "kinesis")]
pub mod kinesis;
#[cfg(feature = "nats")]
pub mod nats;
mod options;
#[cfg(feature = "qstash")]
pub mod qstash;
#[cfg(feature = "redis")]
pub mod redis;
pub(crate) mod shared;
#[cfg(feature = "sns")]
pub mod sns;
#[cfg(feature = "sqs")]
pub mod sqs;
pub mod stdout;

pub use options::{OptionTables, OptionsTable, SinkOptions, SinkSection};
pub use shared::KeyTemplate;

use postbox_sink::{Sink, SinkError};
use std::sync::Arc;

/// Builds a sink from its URL and the options.
pub type Build = fn(&str, &SinkOptions) -> Result<Arc<dyn Sink>, SinkError>;

/// What a sink built into this binary provides: each sink's `mod.rs` defines
/// one, as `pub(crate) const SINK`.
pub struct BuiltSink {
    /// Its URL form in one line, for `relay --sink` help (see [`scheme_help`]).
    pub usage: &'static str,
    /// Builds it from a URL with one of its schemes.
    pub build: Build,
}

/// One sink postbox has, built into this binary or not.
pub struct SinkKind {
    /// Its name: the cargo feature that builds it, and the name of its
    /// options table (`[sink.http]`) when it has one.
    pub name: &'static str,
    /// The URL prefixes it serves, as users write them (`redis://`,
    /// `qstash:`, `stdout`); the scheme is the part before the first `:`.
    pub prefixes: &'static [&'static str],
    /// The cargo feature that builds it; `None` when it is always built.
    pub feature: Option<&'static str>,
    /// Whether it has an options table (`[sink.NAME]`).
    pub has_options: bool,
    built: Option<&'static BuiltSink>,
}

impl SinkKind {
    /// What it provides, when it is built into this binary.
    pub fn built(&self) -> Option<&'static BuiltSink> {
        self.built
    }

    /// Whether it serves URLs of `scheme` (`rediss`).
    pub fn serves(&self, scheme: &str) -> bool {
        self.prefixes.iter().any(|p| prefix_scheme(p) == scheme)
    }

    /// Why it cannot be used when it is not built.
    fn not_built(&self) -> String {
        format!(
            "the {0} sink is not built into this binary: build postbox with --features {0}",
            self.feature.unwrap_or(self.name)
        )
    }
}

/// `redis` of `redis://`, `qstash` of `qstash:`, `stdout` of `stdout`.
fn prefix_scheme(prefix: &str) -> &str {
    prefix.split_once(':').map_or(prefix, |(s, _)| s)
}

/// The registry: declares [`SINKS`] and reads the options tables of the
/// sinks built into this binary, keeping the configuration file's own errors
/// (the field, the line).
macro_rules! registry {
    ($(
        $name:ident: $(feature $feature:literal,)? prefixes [$($prefix:literal),+] $(, options $options:ty)?;
    )*) => {
        /// Every sink postbox has, built into this binary or not, in the
        /// order help texts list them.
        pub static SINKS: &[SinkKind] = &[$(
            SinkKind {
                name: stringify!($name),
                prefixes: &[$($prefix),+],
                feature: registry!(@some $($feature)?),
                has_options: registry!(@has $($options)?),
                $(#[cfg(feature = $feature)])?
                built: Some(&$name::SINK),
                $(#[cfg(not(feature = $feature))] built: None,)?
            },
        )*];

        /// Read the options table of `sink` from `map` (its value is next),
        /// or `None` when no sink of that name has one built into this binary.
        fn read_options<'de, A: serde::de::MapAccess<'de>>(
            sink: &str,
            map: &mut A,
        ) -> Option<Result<(&'static str, Box<dyn options::AnyTable>), A::Error>> {
            $(registry!(@read sink, map, $name, [$($feature)?], [$($options)?]);)*
            let _ = (sink, map);
            None
        }
    };
    (@some) => { None };
    (@some $feature:literal) => { Some($feature) };
    (@has) => { false };
    (@has $options:ty) => { true };
    (@read $sink:ident, $map:ident, $name:ident, [$($feature:literal)?], []) => {};
    (@read $sink:ident, $map:ident, $name:ident, [$($feature:literal)?], [$options:ty]) => {
        $(#[cfg(feature = $feature)])?
        if $sink == stringify!($name) {
            let table = $map.next_value::<$options>();
            return Some(table.map(|t| {
                let sink = <$options as OptionsTable>::SINK;
                (sink, Box::new(t) as Box<dyn options::AnyTable>)
            }));
        }
    };
}

registry! {
    redis: feature "redis", prefixes ["redis://", "rediss://"];
    nats: feature "nats", prefixes ["nats://"];
    amqp: feature "amqp", prefixes ["amqp://", "amqps://"];
    kafka: feature "kafka", prefixes ["kafka://"];
    sqs: feature "sqs", prefixes ["sqs://"];
    sns: feature "sns", prefixes ["sns://"];
    kinesis: feature "kinesis", prefixes ["kinesis://"];
    http: feature "http", prefixes ["http://", "https://"], options http::HttpOptions;
    qstash: feature "qstash", prefixes ["qstash:"], options qstash::QstashOptions;
    stdout: prefixes ["stdout"];
}

/// Build the sink a URL names: `redis://…`, `rediss://…`, `nats://…`,
/// `amqp://…`, `amqps://…`, `kafka://…`, `http://…`, `https://…` (webhooks),
/// `qstash:DESTINATION_URL`, `sqs://QUEUE`, `sns://TOPIC`, `kinesis://STREAM`
/// or `stdout` — each only when its cargo feature
/// is built (see [`SINKS`]).
///
/// The HTTP sink reads its signing secrets (`POSTBOX_WEBHOOK_SECRET`, or the
/// variable `http.secret_env` names) and the QStash sink its token
/// (`QSTASH_TOKEN`, `QSTASH_URL`) from the environment here, once.
pub fn from_url(url: &str, options: &SinkOptions) -> Result<Arc<dyn Sink>, SinkError> {
    if options.source.is_empty() {
        return Err(SinkError::Config(
            "sink.source: the CloudEvents source must not be empty".into(),
        ));
    }
    let scheme = url.split_once(':').map_or(url, |(s, _)| s);
    let Some(kind) = SINKS.iter().find(|k| k.serves(scheme)) else {
        let known: Vec<&str> = SINKS
            .iter()
            .flat_map(|k| k.prefixes.iter().copied())
            .collect();
        let expected = match known.split_last() {
            Some((last, init)) => format!("{} or {last}", init.join(", ")),
            None => String::new(),
        };
        return Err(SinkError::Config(format!(
            "unsupported sink {:?}: expected {expected}",
            postbox::redact::sanitize_error(scheme)
        )));
    };
    match kind.built {
        Some(sink) => (sink.build)(url, options),
        None => Err(SinkError::Config(kind.not_built())),
    }
}

/// The URL forms of every sink built into this binary, one per line, for
/// `relay --sink` help.
pub fn scheme_help() -> String {
    SINKS
        .iter()
        .filter_map(|k| k.built)
        .map(|sink| sink.usage)
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scheme_has_one_sink_and_every_built_sink_its_entry() {
        let mut schemes = std::collections::HashSet::new();
        for kind in SINKS {
            for prefix in kind.prefixes {
                assert!(schemes.insert(prefix_scheme(prefix)), "{prefix} twice");
            }
            assert_eq!(
                kind.built.is_some(),
                kind.feature.is_none_or(cfg_feature),
                "{}",
                kind.name
            );
        }
        assert_eq!(
            scheme_help().lines().count(),
            SINKS.iter().filter(|k| k.built.is_some()).count()
        );
        assert!(scheme_help().contains("stdout"));
    }

    /// Whether the cargo feature `name` is on in this build.
    fn cfg_feature(name: &str) -> bool {
        match name {
            "redis" => cfg!(feature = "redis"),
            "nats" => cfg!(feature = "nats"),
            "amqp" => cfg!(feature = "amqp"),
            "kafka" => cfg!(feature = "kafka"),
            "http" => cfg!(feature = "http"),
            "qstash" => cfg!(feature = "qstash"),
            "sqs" => cfg!(feature = "sqs"),
            "sns" => cfg!(feature = "sns"),
            "kinesis" => cfg!(feature = "kinesis"),
            other => panic!("no cargo feature {other}"),
        }
    }

    #[test]
    fn unknown_and_unbuilt_schemes_are_named() {
        let err = from_url("kafka-ish://x", &SinkOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(
            err.contains("unsupported sink \"kafka-ish\": expected redis://, rediss://"),
            "{err}"
        );
        assert!(err.ends_with("qstash: or stdout"), "{err}");
        for kind in SINKS.iter().filter(|k| k.built.is_none()) {
            let url = format!("{}x", kind.prefixes[0]);
            let err = from_url(&url, &SinkOptions::default())
                .err()
                .unwrap()
                .to_string();
            assert!(
                err.contains(&format!("build postbox with --features {}", kind.name)),
                "{err}"
            );
        }
        let err = from_url(
            "stdout",
            &SinkOptions {
                source: String::new(),
                ..SinkOptions::default()
            },
        )
        .err()
        .unwrap()
        .to_string();
        assert!(
            err.contains("sink.source: the CloudEvents source must not be empty"),
            "{err}"
        );
    }

    #[test]
    fn option_tables_match_their_sinks() {
        for kind in SINKS.iter().filter(|k| k.built.is_some()) {
            let text = format!("{{\"{}\": {{}}}}", kind.name);
            match serde_json::from_str::<SinkSection>(&text) {
                Ok(section) => {
                    assert!(kind.has_options, "{}", kind.name);
                    // Stored under the sink's own name, where its sink looks.
                    assert!(section.tables.contains(kind.name), "{}", kind.name);
                }
                Err(e) => assert!(!kind.has_options, "{}: {e}", kind.name),
            }
        }
    }
}
