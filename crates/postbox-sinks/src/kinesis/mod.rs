//! Amazon Kinesis Data Streams: every event is one record, written with
//! `PutRecords`; the stream's answer for the record is the outcome.
//!
//! URL: `kinesis://STREAM_NAME[?region=REGION&endpoint=URL&timeout=DURATION]`
//!
//! - `STREAM_NAME`: the stream in the configured account and region (1–128
//!   letters, digits, `-`, `_` and `.`). The start-up check asks for it
//!   (`DescribeStreamSummary`); a missing stream fails the check.
//! - `region`, `endpoint`, `timeout`: as for the SQS sink.
//!
//! Each record: the data is the CloudEvents JSON document (records have no
//! attributes: the event id, type and trace context are in the document),
//! and the partition key is the aggregate id, so an aggregate's events land
//! on one shard, in order.
//!
//! Delivery: the batch is written in calls of at most 500 records and 5 MiB,
//! one after the other. A record with a sequence number is `Delivered`; a
//! record with an error code (`ProvisionedThroughputExceededException`,
//! `InternalFailure`, a KMS error) and a throttled, failed or timed-out call
//! are retries, and the calls after a retry are not sent (retried). Rejected
//! before sending: a record over 1 MiB (data plus partition key) and an
//! aggregate id that cannot be a partition key (empty, or over 256
//! characters). Kinesis does not deduplicate: a retry after an ambiguous
//! failure writes the record again, and consumers deduplicate on the
//! document's `id`. A record that failed inside a call is written after the
//! records that followed it, so strict per-aggregate order needs the
//! relay's ordered mode.

#[cfg(test)]
mod tests;

use crate::shared::aws::{self, AwsConfig, AwsUrl, CallError};
use crate::{BuiltSink, SinkOptions};
use async_trait::async_trait;
use aws_sdk_kinesis::primitives::Blob;
use aws_sdk_kinesis::types::PutRecordsRequestEntry;
use aws_sdk_kinesis::Client;
use postbox_sink::cloudevents;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use std::collections::HashMap;
use std::sync::Arc;
use tokio::sync::OnceCell;

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "kinesis://STREAM_NAME[?region=REGION&endpoint=URL&timeout=DURATION]  Amazon Kinesis Data Streams",
    build: |url, options| Ok(Arc::new(KinesisSink::from_url(url, options.clone())?)),
};

const SERVICE: &str = "kinesis";
/// Records per `PutRecords`.
const MAX_ENTRIES: usize = 500;
/// Bytes per `PutRecords` (data and partition keys of all its records).
const MAX_CALL_BYTES: usize = 5 * 1024 * 1024;
/// The largest record (data plus partition key).
pub const MAX_RECORD: usize = 1024 * 1024;
/// The longest partition key, in characters.
const MAX_KEY_CHARS: usize = 256;
const MISSING: &[&str] = &["ResourceNotFoundException"];

/// The Amazon Kinesis sink; see the module docs for the URL.
pub struct KinesisSink {
    stream: String,
    config: AwsConfig,
    options: SinkOptions,
    described: String,
    client: OnceCell<Client>,
}

impl KinesisSink {
    /// Parse the sink URL; connects lazily (on [`Sink::check`] or the first publish).
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let AwsUrl {
            name,
            target,
            described,
        } = AwsUrl::parse(raw, "kinesis", "stream", check_stream_name)?;
        Ok(Self {
            stream: name,
            config: AwsConfig::new(target),
            options,
            described,
            client: OnceCell::new(),
        })
    }

    /// Use these credentials instead of the standard AWS chain's (the secret
    /// is masked in every error).
    pub fn with_credentials(mut self, access_key_id: &str, secret_access_key: &str) -> Self {
        self.config
            .set_credentials(access_key_id, secret_access_key);
        self
    }

    async fn client(&self) -> &Client {
        self.client
            .get_or_init(|| async { Client::new(self.config.sdk().await) })
            .await
    }

    /// The record of `m` (its data), or why Kinesis would never take it.
    fn record(&self, m: &Message) -> Result<String, String> {
        let key_chars = m.aggregate_id.chars().count();
        if key_chars == 0 || key_chars > MAX_KEY_CHARS {
            return Err(format!(
                "the aggregate id has {key_chars} characters; a partition key has 1 to {MAX_KEY_CHARS}"
            ));
        }
        let data = cloudevents::to_json(m, &self.options.source);
        let size = data.len() + m.aggregate_id.len();
        if size > MAX_RECORD {
            return Err(format!(
                "the record is {size} bytes, over Kinesis's limit of {MAX_RECORD} bytes"
            ));
        }
        Ok(data)
    }

    async fn send(
        &self,
        batch: &[Message],
        records: &[Option<String>],
        call: Vec<usize>,
    ) -> (Vec<(usize, Outcome)>, bool) {
        let mut request = Vec::with_capacity(call.len());
        for &i in &call {
            let Some(data) = &records[i] else { continue };
            let entry = PutRecordsRequestEntry::builder()
                .data(Blob::new(data.as_bytes()))
                .partition_key(&batch[i].aggregate_id)
                .build();
            match entry {
                Ok(e) => request.push(e),
                Err(e) => return (aws::retry_all_of(&call, SERVICE, &e.to_string()), false),
            }
        }
        let answer = self
            .client()
            .await
            .put_records()
            .stream_name(&self.stream)
            .set_records(Some(request))
            .send()
            .await;
        match answer {
            Ok(out) => {
                let mut outcomes = HashMap::new();
                // Records answer in request order.
                for (n, record) in out.records().iter().enumerate().take(call.len()) {
                    let outcome = match (record.error_code(), record.sequence_number()) {
                        (Some(code), _) => aws::entry_failure(
                            SERVICE,
                            false,
                            code,
                            record.error_message().unwrap_or_default(),
                        ),
                        (None, Some(_)) => Outcome::Delivered,
                        (None, None) => {
                            Outcome::retry("kinesis: no sequence number for this record")
                        }
                    };
                    outcomes.insert(n, outcome);
                }
                aws::collect_call(&call, outcomes, SERVICE)
            }
            Err(e) => (
                aws::retry_all_of(&call, SERVICE, &CallError::new(&e).text),
                false,
            ),
        }
    }
}

#[async_trait]
impl Sink for KinesisSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        if let Some(why) = self.config.missing_setting().await {
            return aws::retry_all(batch.len(), SERVICE, &why);
        }
        let mut outcomes: Vec<Option<Outcome>> = vec![None; batch.len()];
        let mut records: Vec<Option<String>> = Vec::with_capacity(batch.len());
        for (i, m) in batch.iter().enumerate() {
            match self.record(m) {
                Ok(data) => records.push(Some(data)),
                Err(why) => {
                    outcomes[i] = Some(Outcome::reject(format!(
                        "{SERVICE}: {}",
                        postbox::redact::sanitize_error(&why)
                    )));
                    records.push(None);
                }
            }
        }
        let sizes: Vec<(usize, usize)> = records
            .iter()
            .enumerate()
            .filter_map(|(i, r)| {
                r.as_ref()
                    .map(|r| (i, r.len() + batch[i].aggregate_id.len()))
            })
            .collect();
        // One lane: PutRecords takes a whole relay batch in one call.
        let lanes = aws::lanes(batch, &sizes, 1, MAX_ENTRIES, MAX_CALL_BYTES);
        let sent =
            aws::send_in_lanes(lanes, SERVICE, |call| self.send(batch, &records, call)).await;
        for (i, o) in sent {
            outcomes[i] = Some(o);
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Outcome::retry("kinesis: no answer for this record")))
            .collect()
    }

    async fn check(&self) -> Result<(), SinkError> {
        if let Some(why) = self.config.missing_setting().await {
            return Err(SinkError::Config(why));
        }
        match self
            .client()
            .await
            .describe_stream_summary()
            .stream_name(&self.stream)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = CallError::new(&e);
                let missing = e.is_missing(MISSING);
                Err(aws::check_error(
                    &self.described,
                    &e,
                    missing,
                    &format!("stream {:?}", self.stream),
                ))
            }
        }
    }

    fn describe(&self) -> String {
        self.described.clone()
    }

    fn secrets(&self) -> &Secrets {
        self.config.secrets()
    }
}

/// Why `name` is not a Kinesis stream name.
fn check_stream_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > 128 {
        return Err("a stream name has 1 to 128 characters".into());
    }
    if !name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
    {
        return Err("use ASCII letters, digits, '-', '_' and '.'".into());
    }
    Ok(())
}
