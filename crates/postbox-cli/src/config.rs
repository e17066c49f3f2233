//! The `--config` file (TOML) and how it combines with flags and the environment:
//! a flag beats its environment variable, which beats the file, which beats the default.

use postbox_relay::{HealthConfig, RelayConfig, RetentionConfig, RouteConfig, TenantsConfig};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

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
    /// `[redact]`: payload paths and headers masked wherever an event is shown.
    #[serde(default)]
    pub redact: RedactSection,
    /// `[console]`: `postbox console`'s settings (trusted proxies).
    #[serde(default)]
    pub console: ConsoleSection,
    /// `[[outboxes]]`: outboxes one relay serves (see `crate::tenants`).
    #[serde(default)]
    pub outboxes: Vec<OutboxSection>,
    /// `[tenants]`: how a relay serving many outboxes shares its resources.
    #[serde(default)]
    pub tenants: TenantsSection,
    /// `[groups.NAME]`: consumer groups `postbox migrate` makes when they
    /// do not exist (it never changes or drops one).
    #[serde(default)]
    pub groups: BTreeMap<String, GroupSection>,
}

/// `[groups.NAME]` of the config file: a consumer group, as `postbox group
/// create` takes it.
///
/// ```toml
/// [groups.billing]
/// start = "now"            # or "beginning", or an RFC 3339 time
/// types = ["order.*"]      # default: every type
/// ordered = false
/// max_attempts = 5
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GroupSection {
    #[serde(default = "GroupSection::default_start")]
    pub start: String,
    #[serde(default)]
    pub types: Vec<String>,
    #[serde(default)]
    pub ordered: bool,
    #[serde(default = "GroupSection::default_max_attempts")]
    pub max_attempts: i32,
}

impl GroupSection {
    fn default_start() -> String {
        "now".to_owned()
    }

    fn default_max_attempts() -> i32 {
        5
    }
}

/// `[console]` of the config file.
///
/// ```toml
/// [console]
/// trusted_proxies = ["10.0.0.0/8", "fd00::/8"]   # or --trusted-proxy, repeated
/// ```
#[derive(Debug, Default, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConsoleSection {
    /// Proxies whose `X-Forwarded-For` is believed (addresses or networks).
    #[serde(default)]
    pub trusted_proxies: Vec<String>,
}

impl ConsoleSection {
    /// The trusted proxies; a bad one is named by its key, e.g. `console.trusted_proxies[1]`.
    pub fn trusted_proxies(&self) -> Result<Vec<postbox_console::Cidr>, String> {
        self.trusted_proxies
            .iter()
            .enumerate()
            .map(|(i, s)| {
                s.parse()
                    .map_err(|e| format!("console.trusted_proxies[{i}]: {e}"))
            })
            .collect()
    }
}

/// `[redact]`: what `postbox dlq show` and the console mask.
///
/// ```toml
/// [redact]
/// paths = ["card.number", "customer.email", "items[*].ssn", "**.password"]
/// headers = ["authorization"]
/// ```
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedactSection {
    #[serde(default)]
    pub paths: Vec<String>,
    #[serde(default)]
    pub headers: Vec<String>,
}

impl RedactSection {
    /// The redactor; an unparsable path is named by its field, e.g. `redact.paths[1]`.
    pub fn redactor(&self) -> Result<postbox_relay::redact::PayloadRedactor, String> {
        for (i, path) in self.paths.iter().enumerate() {
            if let Err(e) = postbox_relay::redact::PayloadRedactor::new(std::slice::from_ref(path))
            {
                return Err(format!("redact.paths[{i}]: {e}"));
            }
        }
        let redactor = postbox_relay::redact::PayloadRedactor::new(&self.paths)
            .map_err(|e| format!("redact.paths: {e}"))?;
        Ok(redactor.with_headers(&self.headers))
    }
}

/// `[sink]`, and each `[destinations.NAME]`: `url`, `source`, and the
/// options table of any sink built into this binary (`[sink.http]`,
/// `[sink.qstash]`, …), as the relay's sink registry lists them.
pub use postbox_relay::sinks::SinkSection;

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
        let config: Self = toml::from_str(text).map_err(|e| {
            // toml's message quotes the offending line, which could hold a secret.
            let span = e.span().map(|s| {
                let line = text[..s.start.min(text.len())].matches('\n').count() + 1;
                format!(" (line {line})")
            });
            // serde's own message may quote a misplaced value (`invalid type:
            // string "postgres://u:pw@…"`): mask credentials in it.
            let message = postbox_relay::redact::mask_secrets(e.message());
            format!("{message}{}", span.unwrap_or_default())
        })?;
        config.redact.redactor()?;
        config.groups()?;
        config.starts()?;
        Ok(config)
    }

    /// Each `[destinations.NAME]`'s `start`, checked: an error names the
    /// field. `[sink]` takes none (a single sink is the outbox's first).
    pub fn starts(&self) -> Result<Vec<Option<postbox_store::GroupStart>>, String> {
        if self.sink.start.is_some() {
            return Err("sink.start: only a [destinations.NAME] section takes a start".to_owned());
        }
        self.destinations
            .iter()
            .map(|(name, d)| {
                d.start
                    .as_deref()
                    .map(|s| {
                        s.parse()
                            .map_err(|e| format!("destinations.{name}.start: {e}"))
                    })
                    .transpose()
            })
            .collect()
    }

    /// `[groups.NAME]`, checked: an error names the field.
    pub fn groups(&self) -> Result<Vec<postbox_store::NewGroup>, String> {
        self.groups
            .iter()
            .map(|(name, g)| {
                let field = |f: &str, why: String| format!("groups.{name}.{f}: {why}");
                if name.is_empty()
                    || name.len() > 63
                    || !name
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
                {
                    return Err(format!(
                        "groups.{name}: a group's name is 1 to 63 letters, digits, '.', '_' or '-'"
                    ));
                }
                let start = g.start.parse().map_err(|e| field("start", e))?;
                if !(1..=1000).contains(&g.max_attempts) {
                    return Err(field("max_attempts", "must be 1 to 1000".to_owned()));
                }
                if g.types.iter().any(String::is_empty) {
                    return Err(field("types", "a type glob must not be empty".to_owned()));
                }
                Ok(postbox_store::NewGroup {
                    name: name.clone(),
                    start,
                    types: (!g.types.is_empty()).then(|| g.types.clone()),
                    ordered: g.ordered,
                    max_attempts: g.max_attempts,
                })
            })
            .collect()
    }
}

/// `[[outboxes]]`: one outbox a relay serves, besides those `--schemas` finds.
///
/// ```toml
/// [[outboxes]]
/// url = "postgres://relay@db-eu/app"   # default: database_url
/// schema = "tenant_acme"
/// routes = [{ match = ["invoice.*"], to = ["billing"] }]   # default: the relay's
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OutboxSection {
    pub url: Option<String>,
    pub schema: String,
    pub routes: Option<Vec<RouteConfig>>,
}

/// `[tenants]`: how a relay serving many outboxes shares its resources.
///
/// ```toml
/// [tenants]
/// max_in_flight_batches = 8     # across every outbox
/// pool_size = 3                 # per database, plus its LISTEN connection
/// rediscover_interval = "30s"   # list databases and schemas again
/// idle_poll = "30s"             # an idle outbox's safety poll
/// aggregate_metrics = false     # true: no `outbox` label on metrics
/// ```
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TenantsSection {
    pub max_in_flight_batches: usize,
    pub pool_size: u32,
    #[serde(with = "humantime_serde")]
    pub rediscover_interval: Duration,
    #[serde(with = "humantime_serde")]
    pub idle_poll: Duration,
    pub aggregate_metrics: bool,
}

impl Default for TenantsSection {
    fn default() -> Self {
        let d = TenantsConfig::default();
        Self {
            max_in_flight_batches: d.max_in_flight_batches,
            pool_size: d.pool_size,
            rediscover_interval: d.rediscover_interval,
            idle_poll: d.idle_poll,
            aggregate_metrics: false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn trusted_proxies_are_read_from_the_file_and_named_when_bad() {
        let ok = ConsoleSection {
            trusted_proxies: vec!["10.0.0.0/8".into(), "::1".into()],
        };
        assert_eq!(ok.trusted_proxies().unwrap().len(), 2);
        let bad = ConsoleSection {
            trusted_proxies: vec!["10.0.0.1".into(), "proxy.internal".into()],
        };
        let e = bad.trusted_proxies().unwrap_err();
        assert!(e.starts_with("console.trusted_proxies[1]:"), "{e}");
    }

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

    #[test]
    fn names_a_bad_redaction_path() {
        let err =
            FileConfig::parse("[redact]\npaths = [\"card.number\", \"items[x]\"]\n").unwrap_err();
        assert!(err.starts_with("redact.paths[1]: "), "{err}");
        let c = FileConfig::parse(
            "[redact]\npaths = [\"card.number\"]\nheaders = [\"Authorization\"]\n",
        )
        .unwrap();
        assert!(!c.redact.redactor().unwrap().is_empty());
    }
}

/// Hostile input (issue 9): arbitrary text and structurally plausible but
/// wrong TOML. Parsing ends in a config or a message, never a panic; the
/// message never repeats a credential from the file; the settings of a file
/// that parses validate (or not) without panicking.
#[cfg(test)]
mod hostile_tests {
    use super::*;
    use proptest::collection::vec;
    use proptest::prelude::*;

    use postbox_testkit::proptest_config as config;

    /// The password every credential below carries; no message may repeat it.
    const PASSWORD: &str = "hunter2";

    /// Values that hold a credential, in the forms config files carry them.
    const SECRETS: &[&str] = &[
        "postgres://app:hunter2@db.internal:5432/app",
        "postgresql://app:hunter2@db/app?sslmode=require",
        "redis://:hunter2@cache:6379/0?mode=stream",
        "amqp://user:hunter2@rabbit/%2f",
        "https://user:hunter2@hooks.example.com/postbox",
        "nats://relay:hunter2@nats:4222",
        "Bearer hunter2",
        "Basic hunter2",
        "password=hunter2",
        "host=db password=hunter2 user=app",
        "token=hunter2",
        // A webhook secret (base64, padded) where a variable's name belongs.
        "whsec_hunter2hunter2hunter2hunter2AAAAAAAAAA==",
    ];

    /// What a key expects, to generate mostly well-typed values.
    #[derive(Clone, Copy, Debug)]
    enum Kind {
        Int,
        Float,
        Bool,
        Duration,
        Text,
        List,
        Map,
        Table,
    }

    /// TOML basic string for `s`.
    fn quoted(s: &str) -> String {
        let mut out = String::from('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                c if c.is_control() => out.push_str(&format!("\\u{:04X}", c as u32)),
                c => out.push(c),
            }
        }
        out.push('"');
        out
    }

    /// One of the `|`-separated options.
    fn pick(options: &'static str) -> BoxedStrategy<String> {
        proptest::sample::select(options.split('|').collect::<Vec<_>>())
            .prop_map(str::to_owned)
            .boxed()
    }

    fn text() -> BoxedStrategy<String> {
        prop_oneof![
            3 => proptest::sample::select(SECRETS).prop_map(str::to_owned),
            3 => pick(
                "|stdout|postbox|shop|redis://127.0.0.1:6379|qstash:|https://example.com/hook|\
                 block|skip|Block|structured|binary|POST|GET|order.*|*|5s|POSTBOX_WEBHOOK_SECRET|\
                 A=B|a\0b|'; DROP TABLE outbox; --|\u{202e}🦀|\u{ffff}"
            ),
            1 => any::<String>(),
        ]
        .boxed()
    }

    /// Durations humantime reads (up to the largest), and some it does not.
    fn duration_text() -> BoxedStrategy<String> {
        prop_oneof![
            3 => pick(
                "0s|1ns|1ms|500ms|1s|30s|60s|2m|1h|7d|1y|1h 1h 1h|9223372036854775807ns|\
                 5000000000000h|300000000000y|10000000000000000000s|18446744073709551615s"
            ),
            1 => pick(
                "18446744073709551616s|584942417355y|99999999999999y|1e3s|-5s|5|soon|| 5s|5 s"
            ),
        ]
        .boxed()
    }

    /// A TOML value of the given kind (in its source form).
    fn value_of(kind: Kind) -> BoxedStrategy<String> {
        match kind {
            Kind::Int => prop_oneof![
                3 => pick("0|1|-1|2|50|500|10000|10001|100000|100001|4294967295"),
                1 => pick(
                    "4294967296|9223372036854775807|-9223372036854775808|\
                     99999999999999999999|0x10|1_000|+5|007"
                ),
                1 => any::<i64>().prop_map(|n| n.to_string()),
            ]
            .boxed(),
            Kind::Float => pick("0.0|0.5|1.0|1.5|-0.0|nan|+inf|-inf|1e308|1e400|5e-324|0.1|2"),
            Kind::Bool => proptest::sample::select(vec!["true", "false"])
                .prop_map(str::to_owned)
                .boxed(),
            Kind::Duration => duration_text().prop_map(|d| quoted(&d)).boxed(),
            Kind::Text => text().prop_map(|t| quoted(&t)).boxed(),
            Kind::List => vec(text(), 0..4)
                .prop_map(|items| {
                    let items: Vec<String> = items.iter().map(|t| quoted(t)).collect();
                    format!("[{}]", items.join(", "))
                })
                .boxed(),
            Kind::Map | Kind::Table => vec((text(), text()), 0..3)
                .prop_map(|kv| {
                    let kv: Vec<String> = kv
                        .iter()
                        .map(|(k, v)| format!("{} = {}", quoted(k), quoted(v)))
                        .collect();
                    format!("{{ {} }}", kv.join(", "))
                })
                .boxed(),
        }
    }

    /// Anything at all where a value goes, including broken TOML.
    fn any_value() -> BoxedStrategy<String> {
        prop_oneof![
            6 => proptest::sample::select(vec![
                Kind::Int, Kind::Float, Kind::Bool, Kind::Duration, Kind::Text, Kind::List,
                Kind::Map,
            ])
            .prop_flat_map(value_of),
            1 => proptest::sample::select(vec![
                "1979-05-27T07:32:00Z", "07:32:00", "[1, \"a\"]", "[{ x = 1 }]", "{}", "[]",
                "\"unterminated", "'''", "= =", "[", "", "\"\"\"multi\nline\"\"\"",
                "postgres://app:hunter2@db/app", "\"postgres://app:hunter2@db/app",
                "'redis://:hunter2@cache'", "{ url = \"postgres://app:hunter2@db\" ",
            ])
            .prop_map(str::to_owned),
        ]
        .boxed()
    }

    /// A section header and the keys that belong under it.
    fn sections() -> Vec<(&'static str, Vec<(&'static str, Kind)>)> {
        use Kind::*;
        let sink = vec![
            ("url", Text),
            ("source", Text),
            ("http", Table),
            ("qstash", Table),
        ];
        let http = vec![
            ("method", Text),
            ("mode", Text),
            ("timeout", Duration),
            ("concurrency", Int),
            ("rate_per_second", Float),
            ("headers", Map),
            ("secret_env", Text),
        ];
        let qstash = vec![
            ("retries", Int),
            ("delay", Duration),
            ("callback", Text),
            ("failure_callback", Text),
            ("forward_headers", Map),
            ("flow_control", Table),
            ("timeout", Duration),
            ("request_timeout", Duration),
        ];
        vec![
            ("", vec![("database_url", Text), ("schema", Text)]),
            (
                "[relay]",
                vec![
                    ("batch_size", Int),
                    ("poll_interval", Duration),
                    ("lease", Duration),
                    ("publish_timeout", Duration),
                    ("max_attempts", Int),
                    ("backoff_base", Duration),
                    ("backoff_max", Duration),
                    ("rescue_interval", Duration),
                    ("listen", Bool),
                    ("shutdown_timeout", Duration),
                ],
            ),
            ("[sink]", sink.clone()),
            ("[sink.http]", http.clone()),
            ("[sink.qstash]", qstash.clone()),
            (
                "[sink.qstash.flow_control]",
                vec![
                    ("key", Text),
                    ("parallelism", Int),
                    ("rate", Int),
                    ("period", Duration),
                ],
            ),
            (
                "[sink.http.headers]",
                vec![
                    ("Authorization", Text),
                    ("x-api-key", Text),
                    ("content-type", Text),
                ],
            ),
            ("[destinations.billing]", sink.clone()),
            ("[destinations.\"we ird\"]", sink),
            ("[destinations.billing.http]", http),
            ("[destinations.billing.qstash]", qstash),
            (
                "[[routes]]",
                vec![
                    ("match", List),
                    ("to", List),
                    ("ordered", Bool),
                    ("poison", Text),
                ],
            ),
            (
                "[health]",
                vec![
                    ("enabled", Bool),
                    ("interval", Duration),
                    ("max_transaction_age", Duration),
                    ("max_slot_xmin_age", Int),
                    ("max_dead_tuple_ratio", Float),
                    ("min_dead_tuples", Int),
                    ("repeat_warning", Duration),
                ],
            ),
            (
                "[retention]",
                vec![
                    ("enabled", Bool),
                    ("older_than", Duration),
                    ("archive", Bool),
                    ("inbox", Bool),
                    ("batch_size", Int),
                    ("pause", Duration),
                    ("interval", Duration),
                ],
            ),
            ("[bogus]", vec![("x", Int)]),
            ("[[relay]]", vec![("batch_size", Int)]),
            ("[relay.sub]", vec![("lease", Duration)]),
        ]
    }

    /// The lines of one section: mostly distinct keys of the section with
    /// values of their kind, sometimes a misspelt, foreign or repeated key,
    /// sometimes a value of any kind or broken TOML.
    fn entries(keys: Vec<(&'static str, Kind)>) -> BoxedStrategy<Vec<String>> {
        let n = keys.len();
        let own = proptest::sample::subsequence(keys, 0..=n.min(5)).prop_flat_map(|keys| {
            keys.into_iter()
                .map(|(key, kind)| {
                    prop_oneof![8 => value_of(kind), 1 => any_value()]
                        .prop_map(move |v| format!("{key} = {v}"))
                })
                .collect::<Vec<_>>()
        });
        let stray = vec(
            (
                proptest::sample::select(vec![
                    "batch_sise",
                    "url ",
                    "\"quoted key\"",
                    "a.b",
                    "database_url",
                    "lease",
                    "match",
                    "\"\"",
                    "enabled",
                    "relay",
                    "sink",
                ]),
                any_value(),
            )
                .prop_map(|(k, v)| format!("{k} = {v}")),
            0..2,
        );
        prop_oneof![
            4 => own.clone(),
            1 => (own, stray).prop_map(|(mut a, b)| {
                a.extend(b);
                a
            }),
        ]
        .boxed()
    }

    /// A whole file of the given sections: distinct ones (a repeat now and
    /// then), each with its lines.
    fn document_of(all: Vec<(&'static str, Vec<(&'static str, Kind)>)>) -> BoxedStrategy<String> {
        prop_oneof![
            6 => proptest::sample::subsequence(all.clone(), 0..=5.min(all.len())),
            1 => vec(proptest::sample::select(all), 0..5),
        ]
        .prop_flat_map(|sections| {
            sections
                .into_iter()
                .map(|(header, keys)| {
                    entries(keys).prop_map(move |lines| {
                        let mut out = format!("{header}\n");
                        for line in lines {
                            out.push_str(&line);
                            out.push('\n');
                        }
                        out
                    })
                })
                .collect::<Vec<_>>()
        })
        .prop_map(|s| s.concat())
        .boxed()
    }

    /// Any file.
    fn document() -> BoxedStrategy<String> {
        document_of(sections())
    }

    /// A file of `[relay]`, `[health]`, `[retention]` and sink options only,
    /// which parses more often, so that their validation runs more often.
    fn settings_document() -> BoxedStrategy<String> {
        let settings = sections()
            .into_iter()
            .filter(|(h, _)| {
                [
                    "[relay]",
                    "[health]",
                    "[retention]",
                    "[sink.http]",
                    "[sink.qstash]",
                ]
                .contains(h)
            })
            .collect();
        document_of(settings)
    }

    /// Parse, then validate whatever parsed as the relay would; check every
    /// message on the way.
    fn check(text: &str) -> Result<(), TestCaseError> {
        match FileConfig::parse(text) {
            Err(message) => {
                prop_assert!(!message.is_empty());
                prop_assert!(
                    !message.contains(PASSWORD),
                    "the parse error repeats a credential: {message}"
                );
            }
            Ok(c) => {
                let mut messages = Vec::new();
                messages.extend(c.relay.validate().err().map(|e| e.to_string()));
                messages.extend(c.health.validate().err().map(|e| e.to_string()));
                messages.extend(c.retention.validate().err().map(|e| e.to_string()));
                for sink in std::iter::once(&c.sink).chain(c.destinations.values()) {
                    messages.extend(sink.validation_errors().iter().map(|e| e.to_string()));
                }
                for message in messages {
                    prop_assert!(!message.is_empty());
                    prop_assert!(
                        !message.contains(PASSWORD),
                        "a validation error repeats a credential: {message}"
                    );
                }
            }
        }
        Ok(())
    }

    /// The largest duration humantime reads, where doubling it overflows.
    #[test]
    fn the_largest_durations_validate_without_overflow() {
        for d in ["18446744073709551615s", "300000000000y"] {
            for key in ["publish_timeout", "lease", "backoff_base", "poll_interval"] {
                let c = FileConfig::parse(&format!("[relay]\n{key} = \"{d}\"\n")).unwrap();
                let _ = c.relay.validate();
            }
        }
        let c =
            FileConfig::parse("[relay]\npublish_timeout = \"18446744073709551615s\"\n").unwrap();
        assert_eq!(
            c.relay.validate().unwrap_err().field,
            "relay.publish_timeout"
        );
    }

    proptest! {
        #![proptest_config(config(512))]

        /// Plausible files with wrong keys, types, ranges and syntax.
        #[test]
        fn plausible_files_parse_or_fail_cleanly(text in document()) {
            check(&text)?;
        }

        /// Settings of every size, most of them well-typed.
        #[test]
        fn settings_validate_or_fail_cleanly(text in settings_document()) {
            check(&text)?;
        }

        /// Arbitrary text, alone or around a line holding a credential.
        #[test]
        fn arbitrary_text_parses_or_fails_cleanly(
            before in any::<String>(),
            secret in proptest::sample::select(SECRETS),
            after in any::<String>(),
            with_secret in any::<bool>(),
        ) {
            let text = if with_secret {
                format!("{before}\ndatabase_url = {}\n{after}", quoted(secret))
            } else {
                format!("{before}{after}")
            };
            check(&text)?;
        }
    }
}
