//! What the SQS and SNS sinks share beyond the other AWS sinks: one message
//! per event with CloudEvents message attributes (their checks and size),
//! the batch-request entries in each SDK's own types, a batch planned into
//! calls in lanes, and the outcomes of a batch call.

use super::{collect_call, entry_failure, lanes, retry_all_of, CallError};
use aws_smithy_runtime_api::client::orchestrator::HttpResponse;
use aws_smithy_runtime_api::client::result::SdkError;
use aws_smithy_types::error::metadata::ProvideErrorMetadata;
use chrono::SecondsFormat;
use postbox::redact::sanitize_error;
use postbox_sink::{Message, Outcome};
use std::collections::{BTreeMap, HashMap};
use tokio::sync::Mutex;

/// How many calls of one publish may be in flight at once (each lane is one
/// sequence of calls; an aggregate always lands in the same lane).
pub(crate) const LANES: usize = 16;

/// The message attributes (name, data type, value) of SQS and SNS messages:
/// the CloudEvents attributes, the trace context, and the producer's other
/// headers as one JSON object (both services allow 10 attributes).
pub(crate) fn attributes(m: &Message, source: &str) -> Vec<(&'static str, &'static str, String)> {
    let mut out = vec![
        ("ce-id", "String", m.event_id.hyphenated().to_string()),
        ("ce-specversion", "String", "1.0".to_owned()),
        ("ce-type", "String", m.event_type.clone()),
        (
            "ce-source",
            "String",
            postbox_sink::cloudevents::source_of(m, source).to_owned(),
        ),
        (
            "ce-time",
            "String",
            m.created_at.to_rfc3339_opts(SecondsFormat::Micros, true),
        ),
        ("ce-aggregatetype", "String", m.aggregate_type.clone()),
        ("ce-schemaversion", "Number", m.schema_version.to_string()),
    ];
    if !m.aggregate_id.is_empty() {
        out.push(("ce-subject", "String", m.aggregate_id.clone()));
    }
    for name in ["traceparent", "tracestate"] {
        if let Some(value) = m.headers.get(name).filter(|v| !v.is_empty()) {
            out.push((name, "String", value.clone()));
        }
    }
    let others: BTreeMap<&str, &str> = m
        .headers
        .iter()
        .filter(|(k, _)| !matches!(k.as_str(), "traceparent" | "tracestate"))
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    if !others.is_empty() {
        // Serializing a map of strings cannot fail.
        let json = serde_json::to_string(&others).unwrap_or_default();
        out.push(("postbox-headers", "String", json));
    }
    // Empty string attributes are refused by both services.
    out.retain(|(_, _, value)| !value.is_empty());
    out
}

/// The size SQS and SNS count for a message: the body plus every
/// attribute's name, data type and value.
pub(crate) fn message_size(body: &str, attributes: &[(&str, &str, String)]) -> usize {
    body.len()
        + attributes
            .iter()
            .map(|(n, t, v)| n.len() + t.len() + v.len())
            .sum::<usize>()
}

/// Why `text` cannot be sent as an SQS/SNS message body or attribute value
/// (only the characters XML 1.0 allows).
pub(crate) fn check_characters(what: &str, text: &str) -> Result<(), String> {
    let bad = text.chars().find(|&c| {
        !matches!(c, '\t' | '\n' | '\r' | '\u{20}'..='\u{D7FF}' | '\u{E000}'..='\u{FFFD}' | '\u{10000}'..)
    });
    match bad {
        Some(c) => Err(format!(
            "{what} contains the character U+{:04X}, which the service does not accept",
            c as u32
        )),
        None => Ok(()),
    }
}

/// Why `key` cannot be a FIFO `MessageGroupId` (1–128 characters: ASCII
/// letters, digits and punctuation).
pub(crate) fn check_group_id(key: &str) -> Result<(), String> {
    if key.is_empty() || key.len() > 128 || !key.chars().all(|c| c.is_ascii_graphic()) {
        return Err(format!(
            "the aggregate id {:?} cannot be a FIFO MessageGroupId (1-128 ASCII letters, digits and punctuation)",
            sanitize_error(key)
        ));
    }
    Ok(())
}

/// One message as SQS and SNS send it: the CloudEvents body, its message
/// attributes, and its size as the service counts it.
pub(crate) struct Entry {
    pub(crate) body: String,
    pub(crate) attributes: Vec<(&'static str, &'static str, String)>,
    pub(crate) size: usize,
}

/// The entry of `m` (body and attributes with `source`), or why the service
/// would never take it: characters it refuses, an aggregate id that cannot be
/// a FIFO group, or a size over `max_message` (`limit` says whose limit).
pub(crate) fn entry(
    m: &Message,
    source: &str,
    fifo: bool,
    max_message: usize,
    limit: &str,
) -> Result<Entry, String> {
    let body = postbox_sink::cloudevents::to_json(m, source);
    check_characters("the body", &body)?;
    let attributes = attributes(m, source);
    for (name, _, value) in &attributes {
        check_characters(&format!("attribute {name}"), value)?;
    }
    if fifo {
        check_group_id(&m.aggregate_id)?;
    }
    let size = message_size(&body, &attributes);
    if size > max_message {
        return Err(format!(
            "the message is {size} bytes, over {limit} of {max_message} bytes"
        ));
    }
    Ok(Entry {
        body,
        attributes,
        size,
    })
}

/// One SQS or SNS batch-request entry as its SDK builder takes it: the id
/// (the entry's position in the call), the body, the message attributes in
/// the SDK's own type and, on a FIFO queue or topic, the `MessageGroupId`
/// (the aggregate id) and `MessageDeduplicationId` (the event id).
pub(crate) struct RequestEntry<'a, A> {
    pub(crate) id: String,
    pub(crate) body: &'a str,
    pub(crate) attributes: HashMap<String, A>,
    pub(crate) group_id: Option<String>,
    pub(crate) deduplication_id: Option<String>,
}

/// The request entries of one SQS or SNS call (`call`: positions in
/// `batch`, whose entries are `entries`), in the service SDK's own types:
/// `attribute` makes a message attribute of its data type and value, `build`
/// a request entry of its parts. Either failing fails the whole call with
/// its reason (the call is then retried unsent).
pub(crate) fn request_entries<'a, A, R, E, F>(
    call: &[usize],
    batch: &[Message],
    entries: &'a [Option<Entry>],
    fifo: bool,
    attribute: impl Fn(&str, &str) -> Result<A, E>,
    build: impl Fn(RequestEntry<'a, A>) -> Result<R, F>,
) -> Result<Vec<R>, String>
where
    E: std::fmt::Display,
    F: std::fmt::Display,
{
    let mut request = Vec::with_capacity(call.len());
    for (n, &i) in call.iter().enumerate() {
        let Some(entry) = &entries[i] else { continue };
        let mut attributes = HashMap::with_capacity(entry.attributes.len());
        for (name, data_type, value) in &entry.attributes {
            let value = attribute(data_type, value).map_err(|e| e.to_string())?;
            attributes.insert((*name).to_owned(), value);
        }
        let m = &batch[i];
        let (group_id, deduplication_id) = match fifo {
            true => (
                Some(m.aggregate_id.clone()),
                Some(m.event_id.hyphenated().to_string()),
            ),
            false => (None, None),
        };
        let built = build(RequestEntry {
            id: n.to_string(),
            body: &entry.body,
            attributes,
            group_id,
            deduplication_id,
        });
        request.push(built.map_err(|e| e.to_string())?);
    }
    Ok(request)
}

/// Why `name` is not an SQS queue or SNS topic name (`what`: `queue`,
/// `topic`): 1 to `max` ASCII letters, digits, `-` and `_`, and a final
/// `.fifo` for a FIFO one.
pub(crate) fn check_fifo_name(name: &str, what: &str, max: usize) -> Result<(), String> {
    let base = name.strip_suffix(".fifo").unwrap_or(name);
    if base.is_empty() || name.len() > max {
        return Err(format!("a {what} name has 1 to {max} characters"));
    }
    if !base
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        return Err("use ASCII letters, digits, '-' and '_' (and a final .fifo)".into());
    }
    Ok(())
}

/// One batch on its way through a batch API (SQS, SNS): the entry of each
/// message, or its outcome when the service would never take it.
pub(crate) struct Plan {
    outcomes: Vec<Option<Outcome>>,
    pub(crate) entries: Vec<Option<Entry>>,
}

impl Plan {
    /// Make each message's entry with `entry`; one it refuses is rejected
    /// (and never sent).
    pub(crate) fn new(
        batch: &[Message],
        service: &str,
        entry: impl Fn(&Message) -> Result<Entry, String>,
    ) -> Self {
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut entries: Vec<Option<Entry>> = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            match entry(m) {
                Ok(e) => entries.push(Some(e)),
                Err(why) => {
                    outcomes[i] = Some(Outcome::reject(format!(
                        "{service}: {}",
                        postbox::redact::sanitize_error(&why)
                    )));
                    entries.push(None);
                }
            }
        }
        Self { outcomes, entries }
    }

    /// The entries packed into calls of at most `max_entries` entries and
    /// `max_call_bytes` bytes, in lanes that keep an aggregate's calls in
    /// order (for [`send_in_lanes`]).
    pub(crate) fn lanes(
        &self,
        batch: &[Message],
        max_entries: usize,
        max_call_bytes: usize,
    ) -> Vec<Vec<Vec<usize>>> {
        let sizes: Vec<(usize, usize)> = self
            .entries
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (i, e.size)))
            .collect();
        lanes(batch, &sizes, LANES, max_entries, max_call_bytes)
    }

    /// One outcome per message: what the calls answered, a retry for a
    /// message nobody answered for.
    pub(crate) fn outcomes(self, sent: Vec<(usize, Outcome)>, service: &str) -> Vec<Outcome> {
        let mut outcomes = self.outcomes;
        for (i, o) in sent {
            outcomes[i] = Some(o);
        }
        outcomes
            .into_iter()
            .map(|o| {
                o.unwrap_or_else(|| {
                    Outcome::retry(format!("{service}: no answer for this message"))
                })
            })
            .collect()
    }
}

/// The outcomes of one SQS or SNS batch call from its answer: the ids (each
/// entry's position in the call) the service took, and for each entry it
/// refused, its id, whether the fault was the sender's, the code and the
/// message. An id outside the call is ignored; an entry without an answer is
/// a retry (see [`collect_call`]).
pub(crate) fn batch_answer<'a>(
    call: &[usize],
    service: &str,
    taken: impl IntoIterator<Item = &'a str>,
    refused: impl IntoIterator<Item = (&'a str, bool, &'a str, &'a str)>,
) -> (Vec<(usize, Outcome)>, bool) {
    let position = |id: &str| id.parse::<usize>().ok().filter(|n| *n < call.len());
    let mut outcomes = std::collections::HashMap::new();
    for n in taken.into_iter().filter_map(position) {
        outcomes.insert(n, Outcome::Delivered);
    }
    for (id, sender_fault, code, message) in refused {
        if let Some(n) = position(id) {
            outcomes.insert(n, entry_failure(service, sender_fault, code, message));
        }
    }
    collect_call(call, outcomes, service)
}

/// The outcomes of an SQS or SNS batch call that failed as a whole: a retry
/// of each of its entries, and the lane stops. When the service says the
/// queue or topic does not exist (an error code of `missing`), what the sink
/// looked up of it (`looked_up`) is forgotten: it may have been deleted since,
/// and the next call looks it up again.
pub(crate) async fn failed_call<E, T>(
    call: &[usize],
    service: &str,
    e: &SdkError<E, HttpResponse>,
    missing: &[&str],
    looked_up: &Mutex<Option<T>>,
) -> (Vec<(usize, Outcome)>, bool)
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
{
    let e = CallError::new(e);
    if e.is_missing(missing) {
        *looked_up.lock().await = None;
    }
    (retry_all_of(call, service, &e.text), false)
}
