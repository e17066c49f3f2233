//! Amazon SQS: every event is one message on a queue, sent with
//! `SendMessageBatch`; the queue's answer for the entry is the outcome.
//!
//! URL: `sqs://QUEUE_NAME[?region=REGION&endpoint=URL&timeout=DURATION]`
//!
//! - `QUEUE_NAME`: the queue in the configured account and region (1–80
//!   letters, digits, `-` and `_`); a name ending in `.fifo` is a FIFO queue.
//!   Its URL and `MaximumMessageSize` are looked up (`GetQueueUrl`,
//!   `GetQueueAttributes`) at the start-up check or the first publish; a
//!   missing queue fails the check.
//! - `region`, `endpoint`: override the region and endpoint of the standard
//!   AWS environment (`AWS_REGION`, `AWS_ENDPOINT_URL`, profiles, …);
//!   credentials always come from the standard chain.
//! - `timeout` (default `10s`): each call to SQS, connecting included; a
//!   call that takes longer is a retry.
//!
//! Each message: the body is the CloudEvents JSON document; the message
//! attributes are `ce-id`, `ce-specversion`, `ce-type`, `ce-source`,
//! `ce-time`, `ce-aggregatetype`, `ce-schemaversion` (Number), `ce-subject`
//! (aggregate id), `traceparent` and `tracestate` when present, and
//! `postbox-headers` (the producer's other headers as one JSON object) — SQS
//! allows ten attributes. FIFO queues: `MessageGroupId` is the aggregate id
//! and `MessageDeduplicationId` the event id, so SQS drops a resend of the
//! same event within its five-minute deduplication interval.
//!
//! Delivery: the batch is cut into calls of at most 10 entries and 1 MiB, in
//! lanes (an aggregate always in the same lane, its calls one after the
//! other; lanes in parallel). An entry SQS lists as successful is
//! `Delivered`; one it failed as the sender's fault is a reject, any other
//! failed entry, a throttled, failed or timed-out call a retry; after a retry
//! in a lane, the lane's later calls are not sent (retried), so an
//! aggregate's events cannot overtake each other. Rejected before sending: a
//! message over the queue's `MaximumMessageSize` (body plus attributes), a
//! body or attribute with a character SQS refuses, on a FIFO queue an
//! aggregate id that cannot be a `MessageGroupId`.

#[cfg(test)]
mod tests;

use crate::shared::aws::{self, AwsConfig, AwsUrl, CallError};
use crate::{BuiltSink, SinkOptions};
use async_trait::async_trait;
use aws_sdk_sqs::types::{MessageAttributeValue, QueueAttributeName, SendMessageBatchRequestEntry};
use aws_sdk_sqs::Client;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use std::sync::Arc;
use tokio::sync::{Mutex, OnceCell};

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "sqs://QUEUE_NAME[?region=REGION&endpoint=URL&timeout=DURATION]  Amazon SQS (a .fifo name is a FIFO queue)",
    build: |url, options| Ok(Arc::new(SqsSink::from_url(url, options.clone())?)),
};

const SERVICE: &str = "sqs";
/// Entries per `SendMessageBatch`.
const MAX_ENTRIES: usize = 10;
/// Bytes per `SendMessageBatch` (all messages of the call together).
const MAX_CALL_BYTES: usize = 1024 * 1024;
/// `MaximumMessageSize` when the queue does not say.
const DEFAULT_MAX_MESSAGE: usize = 256 * 1024;
/// The error codes of a missing queue (JSON and query protocols).
const MISSING: &[&str] = &[
    "AWS.SimpleQueueService.NonExistentQueue",
    "QueueDoesNotExist",
];

/// The Amazon SQS sink; see the module docs for the URL.
pub struct SqsSink {
    queue: String,
    fifo: bool,
    config: AwsConfig,
    options: SinkOptions,
    described: String,
    client: OnceCell<Client>,
    resolved: Mutex<Option<Queue>>,
}

/// The queue as looked up.
#[derive(Clone, Debug)]
struct Queue {
    url: String,
    max_message: usize,
}

impl SqsSink {
    /// Parse the sink URL; connects lazily (on [`Sink::check`] or the first publish).
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let AwsUrl {
            name,
            target,
            mut described,
        } = AwsUrl::parse(raw, "sqs", "queue", check_queue_name)?;
        let fifo = name.ends_with(".fifo");
        if fifo {
            described.push_str(" fifo");
        }
        Ok(Self {
            queue: name,
            fifo,
            config: AwsConfig::new(target),
            options,
            described,
            client: OnceCell::new(),
            resolved: Mutex::new(None),
        })
    }

    /// Use these credentials instead of the standard AWS chain's (the secret
    /// is masked in every error).
    pub fn with_credentials(mut self, access_key_id: &str, secret_access_key: &str) -> Self {
        self.config
            .set_credentials(access_key_id, secret_access_key);
        self
    }

    /// Whether the queue is a FIFO queue (its name ends in `.fifo`).
    pub fn is_fifo(&self) -> bool {
        self.fifo
    }

    async fn client(&self) -> &Client {
        self.client
            .get_or_init(|| async { Client::new(self.config.sdk().await) })
            .await
    }

    /// Look the queue up (its URL, its size limit).
    async fn lookup(&self) -> Result<Queue, CallError> {
        let client = self.client().await;
        let url = match self.resolved.lock().await.as_ref() {
            Some(q) => q.url.clone(),
            None => {
                let answer = client
                    .get_queue_url()
                    .queue_name(&self.queue)
                    .send()
                    .await
                    .map_err(|e| CallError::new(&e))?;
                answer.queue_url().unwrap_or_default().to_owned()
            }
        };
        let attributes = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(QueueAttributeName::MaximumMessageSize)
            .send()
            .await
            .map_err(|e| CallError::new(&e))?;
        let max_message = attributes
            .attributes()
            .and_then(|a| a.get(&QueueAttributeName::MaximumMessageSize))
            .and_then(|v| v.parse().ok())
            .unwrap_or(DEFAULT_MAX_MESSAGE);
        let queue = Queue { url, max_message };
        *self.resolved.lock().await = Some(queue.clone());
        Ok(queue)
    }

    async fn queue(&self) -> Result<Queue, CallError> {
        if let Some(q) = self.resolved.lock().await.as_ref() {
            return Ok(q.clone());
        }
        self.lookup().await
    }

    /// Send one call; the outcome of each of its entries, and whether the
    /// lane may go on.
    async fn send(
        &self,
        queue: &Queue,
        batch: &[Message],
        entries: &[Option<aws::Entry>],
        call: Vec<usize>,
    ) -> (Vec<(usize, Outcome)>, bool) {
        let request = aws::request_entries(
            &call,
            batch,
            entries,
            self.fifo,
            |data_type, value| {
                MessageAttributeValue::builder()
                    .data_type(data_type)
                    .string_value(value)
                    .build()
            },
            |e| {
                SendMessageBatchRequestEntry::builder()
                    .id(e.id)
                    .message_body(e.body)
                    .set_message_attributes(Some(e.attributes))
                    .set_message_group_id(e.group_id)
                    .set_message_deduplication_id(e.deduplication_id)
                    .build()
            },
        );
        let request = match request {
            Ok(request) => request,
            Err(why) => return (aws::retry_all_of(&call, SERVICE, &why), false),
        };
        let answer = self
            .client()
            .await
            .send_message_batch()
            .queue_url(&queue.url)
            .set_entries(Some(request))
            .send()
            .await;
        match answer {
            Ok(out) => aws::batch_answer(
                &call,
                SERVICE,
                out.successful().iter().map(|ok| ok.id()),
                out.failed().iter().map(|f| {
                    (
                        f.id(),
                        f.sender_fault(),
                        f.code(),
                        f.message().unwrap_or_default(),
                    )
                }),
            ),
            Err(e) => aws::failed_call(&call, SERVICE, &e, MISSING, &self.resolved).await,
        }
    }

    /// The message of `m`, or why SQS would never take it.
    fn entry(&self, m: &Message, max_message: usize) -> Result<aws::Entry, String> {
        aws::entry(
            m,
            &self.options.source,
            self.fifo,
            max_message,
            "the queue's MaximumMessageSize",
        )
    }
}

#[async_trait]
impl Sink for SqsSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        if let Some(why) = self.config.missing_setting().await {
            return aws::retry_all(batch.len(), SERVICE, &why);
        }
        let queue = match self.queue().await {
            Ok(q) => q,
            Err(e) => return aws::retry_all(batch.len(), SERVICE, &e.text),
        };
        let plan = aws::Plan::new(batch, SERVICE, |m| self.entry(m, queue.max_message));
        let lanes = plan.lanes(batch, MAX_ENTRIES, MAX_CALL_BYTES);
        let sent = aws::send_in_lanes(lanes, SERVICE, |call| {
            self.send(&queue, batch, &plan.entries, call)
        })
        .await;
        plan.outcomes(sent, SERVICE)
    }

    async fn check(&self) -> Result<(), SinkError> {
        if let Some(why) = self.config.missing_setting().await {
            return Err(SinkError::Config(why));
        }
        match self.lookup().await {
            Ok(_) => Ok(()),
            Err(e) => Err(aws::check_error(
                &self.described,
                &e,
                e.is_missing(MISSING),
                &format!("queue {:?}", self.queue),
            )),
        }
    }

    fn describe(&self) -> String {
        self.described.clone()
    }

    fn secrets(&self) -> &Secrets {
        self.config.secrets()
    }
}

/// Why `name` is not an SQS queue name.
fn check_queue_name(name: &str) -> Result<(), String> {
    aws::check_fifo_name(name, "queue", 80)
}
