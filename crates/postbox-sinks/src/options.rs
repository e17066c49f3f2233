//! Sink options: what every sink shares (the CloudEvents `source`) and each
//! sink's own options table, keyed by the sink's name as the registry lists
//! it — `[sink.http]`, `[sink.qstash]`, `[destinations.NAME.http]` in the
//! configuration file. A table is deserialized by the sink's own type (an
//! [`OptionsTable`] in its `config.rs`), with the file's deserializer, so its
//! errors name the field and the line as a derived struct's would.

use crate::{read_options, SinkKind, SINKS};
use postbox_sink::SinkError;
use serde::de::{self, DeserializeOwned, DeserializeSeed, MapAccess, Visitor};
use std::any::Any;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::OnceLock;

/// A sink's options table (`[sink.NAME]`), defined in the sink's `config.rs`.
pub trait OptionsTable:
    Clone + Default + fmt::Debug + DeserializeOwned + Send + Sync + 'static
{
    /// The sink's name in the registry: the table's name (`http` for
    /// `[sink.http]`) and the start of its errors (`http.timeout: …`).
    const SINK: &'static str;

    /// Check every field; the error names the field (`http.concurrency: …`).
    fn validate(&self) -> Result<(), SinkError>;
}

/// An options table of any sink.
pub(super) trait AnyTable: Any + Send + Sync + fmt::Debug {
    fn validate(&self) -> Result<(), SinkError>;
    fn clone_box(&self) -> Box<dyn AnyTable>;
    fn as_any(&self) -> &dyn Any;
}

impl<T: OptionsTable> AnyTable for T {
    fn validate(&self) -> Result<(), SinkError> {
        OptionsTable::validate(self)
    }

    fn clone_box(&self) -> Box<dyn AnyTable> {
        Box::new(self.clone())
    }

    fn as_any(&self) -> &dyn Any {
        self
    }
}

/// The options tables given, by sink name (read them with
/// [`SinkOptions::get`], set them with [`SinkOptions::with`]).
#[derive(Debug, Default)]
pub struct OptionTables(BTreeMap<&'static str, Box<dyn AnyTable>>);

impl Clone for OptionTables {
    fn clone(&self) -> Self {
        Self(self.0.iter().map(|(k, v)| (*k, v.clone_box())).collect())
    }
}

impl OptionTables {
    /// The table of `T`'s sink as given, or its defaults.
    fn get<T: OptionsTable>(&self) -> T {
        self.0
            .get(T::SINK)
            .and_then(|t| t.as_any().downcast_ref::<T>())
            .cloned()
            .unwrap_or_default()
    }

    fn set<T: OptionsTable>(&mut self, table: T) {
        self.0.insert(T::SINK, Box::new(table));
    }

    /// Whether `sink`'s table was given.
    pub(super) fn contains(&self, sink: &str) -> bool {
        self.0.contains_key(sink)
    }

    /// Every given table's validation error, in registry order.
    fn errors(&self) -> Vec<SinkError> {
        SINKS
            .iter()
            .filter_map(|k| self.0.get(k.name))
            .filter_map(|t| t.validate().err())
            .collect()
    }
}

/// The settings a sink is built with: what every sink shares, and the
/// options table of each sink that has one (defaults when not given).
#[derive(Clone, Debug)]
pub struct SinkOptions {
    /// The CloudEvents `source` attribute of every message.
    pub source: String,
    /// Each sink's options table; a sink without one here uses its defaults.
    pub tables: OptionTables,
}

impl Default for SinkOptions {
    fn default() -> Self {
        Self {
            source: postbox_sink::cloudevents::DEFAULT_SOURCE.to_owned(),
            tables: OptionTables::default(),
        }
    }
}

impl SinkOptions {
    /// The options table of `T`'s sink, or its defaults when none was given.
    pub fn get<T: OptionsTable>(&self) -> T {
        self.tables.get()
    }

    /// Set the options table of `T`'s sink.
    pub fn set<T: OptionsTable>(&mut self, table: T) {
        self.tables.set(table);
    }

    /// These options with `table` as the options table of its sink.
    pub fn with<T: OptionsTable>(mut self, table: T) -> Self {
        self.set(table);
        self
    }

    /// Check every options table given; the error names the field (`http.timeout: …`).
    pub fn validate(&self) -> Result<(), SinkError> {
        self.tables.errors().into_iter().next().map_or(Ok(()), Err)
    }
}

/// A sink as the configuration file describes it — `[sink]`, or each
/// `[destinations.NAME]`: its `url`, its CloudEvents `source`, and the
/// options table of any sink built into this binary (`[sink.http]`,
/// `[sink.qstash]`, …). Unknown keys are errors naming them; so is the table
/// of a sink not built into this binary, naming its cargo feature.
///
/// `filter`, `transform` and `headers` are the relay's jq expressions on the
/// way to this destination (the relay compiles and runs them; the sink never
/// sees them), and `start` where a new destination starts: they are read
/// here so that the section keeps one set of keys.
#[derive(Clone, Debug, Default)]
pub struct SinkSection {
    pub url: Option<String>,
    pub source: Option<String>,
    /// The destination gets an event only when this jq expression's first
    /// output is true.
    pub filter: Option<String>,
    /// A jq expression whose first output is the payload the destination gets.
    pub transform: Option<String>,
    /// A jq expression whose first output (an object of strings) is the set of
    /// headers the destination gets.
    pub headers: Option<String>,
    /// Where a destination added to the configuration starts: `now`,
    /// `beginning` or an RFC 3339 time (the relay reads and checks it).
    pub start: Option<String>,
    pub(super) tables: OptionTables,
}

impl SinkSection {
    /// The options to build this section's sink with: the CloudEvents source
    /// `source` (a flag's, which wins), else the section's, else the default.
    pub fn sink_options(&self, source: Option<String>) -> SinkOptions {
        let mut options = SinkOptions {
            tables: self.tables.clone(),
            ..SinkOptions::default()
        };
        if let Some(s) = source.or_else(|| self.source.clone()) {
            options.source = s;
        }
        options
    }

    /// The options table of `T`'s sink, or its defaults when none was given.
    pub fn get<T: OptionsTable>(&self) -> T {
        self.tables.get()
    }

    /// Check every options table given; the first error names the field.
    pub fn validate(&self) -> Result<(), SinkError> {
        self.validation_errors()
            .into_iter()
            .next()
            .map_or(Ok(()), Err)
    }

    /// Every options table's validation error, one per table that fails.
    pub fn validation_errors(&self) -> Vec<SinkError> {
        self.tables.errors()
    }
}

/// The keys of a sink section: `url`, `source`, and the options table of
/// every sink built into this binary, in registry order.
fn section_keys() -> &'static [&'static str] {
    static KEYS: OnceLock<Vec<&'static str>> = OnceLock::new();
    KEYS.get_or_init(|| {
        ["url", "source", "filter", "transform", "headers", "start"]
            .into_iter()
            .chain(
                SINKS
                    .iter()
                    .filter(|k| k.has_options && k.built().is_some())
                    .map(|k| k.name),
            )
            .collect()
    })
}

enum Key {
    Url,
    Source,
    Expression(&'static str),
    Table(&'static SinkKind),
}

/// Reads a key, so that a wrong one is reported at its own line.
struct KeySeed;

impl<'de> DeserializeSeed<'de> for KeySeed {
    type Value = Key;

    fn deserialize<D: de::Deserializer<'de>>(self, deserializer: D) -> Result<Key, D::Error> {
        deserializer.deserialize_identifier(self)
    }
}

impl Visitor<'_> for KeySeed {
    type Value = Key;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("field identifier")
    }

    fn visit_str<E: de::Error>(self, key: &str) -> Result<Key, E> {
        match key {
            "url" => Ok(Key::Url),
            "source" => Ok(Key::Source),
            "filter" => Ok(Key::Expression("filter")),
            "transform" => Ok(Key::Expression("transform")),
            "headers" => Ok(Key::Expression("headers")),
            "start" => Ok(Key::Expression("start")),
            _ => match SINKS.iter().find(|k| k.has_options && k.name == key) {
                Some(kind) if kind.built().is_some() => Ok(Key::Table(kind)),
                Some(kind) => Err(E::custom(kind.not_built())),
                None => Err(E::unknown_field(key, section_keys())),
            },
        }
    }
}

impl<'de> serde::Deserialize<'de> for SinkSection {
    fn deserialize<D: de::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(SectionVisitor)
    }
}

struct SectionVisitor;

impl<'de> Visitor<'de> for SectionVisitor {
    type Value = SinkSection;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("struct SinkSection")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<SinkSection, A::Error> {
        let mut section = SinkSection::default();
        while let Some(key) = map.next_key_seed(KeySeed)? {
            match key {
                Key::Url if section.url.is_some() => return Err(de::Error::duplicate_field("url")),
                Key::Url => section.url = Some(map.next_value()?),
                Key::Source if section.source.is_some() => {
                    return Err(de::Error::duplicate_field("source"))
                }
                Key::Source => section.source = Some(map.next_value()?),
                Key::Expression(name) => {
                    let slot = match name {
                        "filter" => &mut section.filter,
                        "transform" => &mut section.transform,
                        "start" => &mut section.start,
                        _ => &mut section.headers,
                    };
                    if slot.is_some() {
                        return Err(de::Error::duplicate_field(name));
                    }
                    *slot = Some(map.next_value()?);
                }
                Key::Table(kind) => {
                    if section.tables.contains(kind.name) {
                        return Err(de::Error::duplicate_field(kind.name));
                    }
                    let (sink, table) = read_options(kind.name, &mut map).unwrap_or_else(|| {
                        Err(de::Error::custom(format!(
                            "the {} sink has no options table",
                            kind.name
                        )))
                    })?;
                    section.tables.0.insert(sink, table);
                }
            }
        }
        Ok(section)
    }
}
