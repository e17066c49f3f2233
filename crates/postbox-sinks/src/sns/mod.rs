//! Amazon SNS: every event is one message published to a topic with
//! `PublishBatch`; the topic's answer for the entry is the outcome.
//!
//! URL: `sns://TOPIC_NAME[?region=REGION&endpoint=URL&timeout=DURATION]`
//!
//! - `TOPIC_NAME`: the topic in the configured account and region (1–256
//!   letters, digits, `-` and `_`); a name ending in `.fifo` is a FIFO topic.
//!   Its ARN is found with `ListTopics` at the start-up check or the first
//!   publish (the credentials need `sns:ListTopics` besides `sns:Publish`); a
//!   missing topic fails the check.
//! - `region`, `endpoint`, `timeout`: as for the SQS sink.
//!
//! Each message: the CloudEvents JSON document, with the same ten message
//! attributes as the SQS sink (`ce-id`, `ce-type`, …, `traceparent`,
//! `postbox-headers`); subscribers with raw message delivery receive them as
//! their own attributes. FIFO topics: `MessageGroupId` is the aggregate id,
//! `MessageDeduplicationId` the event id.
//!
//! Delivery: calls of at most 10 entries and 256 KiB, in lanes by aggregate,
//! exactly like the SQS sink: a successful entry is `Delivered` (SNS has
//! stored it for its subscribers), a failed entry the sender's fault a
//! reject, anything else a retry. A message over 256 KiB (body plus
//! attributes) is rejected before sending.

#[cfg(test)]
mod tests;

use crate::shared::aws::{self, AwsConfig, AwsUrl, CallError};
use crate::{BuiltSink, SinkOptions};
use async_trait::async_trait;
use aws_sdk_sns::types::{MessageAttributeValue, PublishBatchRequestEntry};
use aws_sdk_sns::Client;
use postbox_sink::{Message, Outcome, Secrets, Sink, SinkError};
use std::sync::Arc;
use tokio::sync::{Mutex, OnceCell};

/// The registry's entry for this sink.
pub(crate) const SINK: BuiltSink = BuiltSink {
    usage: "sns://TOPIC_NAME[?region=REGION&endpoint=URL&timeout=DURATION]  Amazon SNS (a .fifo name is a FIFO topic)",
    build: |url, options| Ok(Arc::new(SnsSink::from_url(url, options.clone())?)),
};

const SERVICE: &str = "sns";
/// Entries per `PublishBatch`.
const MAX_ENTRIES: usize = 10;
/// The largest message, and the largest call (all its messages together).
pub const MAX_MESSAGE: usize = 256 * 1024;
/// The error codes of a missing topic.
const MISSING: &[&str] = &["NotFound", "NotFoundException"];

/// The Amazon SNS sink; see the module docs for the URL.
pub struct SnsSink {
    topic: String,
    fifo: bool,
    config: AwsConfig,
    options: SinkOptions,
    described: String,
    client: OnceCell<Client>,
    arn: Mutex<Option<String>>,
}

/// Why the topic could not be found.
enum LookupError {
    Call(CallError),
    Missing,
}

impl LookupError {
    fn text(&self, topic: &str) -> String {
        match self {
            LookupError::Call(e) => e.text.clone(),
            LookupError::Missing => format!("no topic named {topic:?} in this account and region"),
        }
    }
}

impl SnsSink {
    /// Parse the sink URL; connects lazily (on [`Sink::check`] or the first publish).
    pub fn from_url(raw: &str, options: SinkOptions) -> Result<Self, SinkError> {
        let AwsUrl {
            name,
            target,
            mut described,
        } = AwsUrl::parse(raw, "sns", "topic", check_topic_name)?;
        let fifo = name.ends_with(".fifo");
        if fifo {
            described.push_str(" fifo");
        }
        Ok(Self {
            topic: name,
            fifo,
            config: AwsConfig::new(target),
            options,
            described,
            client: OnceCell::new(),
            arn: Mutex::new(None),
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

    /// Find the topic's ARN among the account's topics.
    async fn find(&self) -> Result<String, LookupError> {
        let client = self.client().await;
        let suffix = format!(":{}", self.topic);
        let mut token: Option<String> = None;
        loop {
            let page = client
                .list_topics()
                .set_next_token(token.take())
                .send()
                .await
                .map_err(|e| LookupError::Call(CallError::new(&e)))?;
            if let Some(arn) = page
                .topics()
                .iter()
                .filter_map(|t| t.topic_arn())
                .find(|arn| arn.ends_with(&suffix))
            {
                return Ok(arn.to_owned());
            }
            match page.next_token() {
                Some(next) if !next.is_empty() => token = Some(next.to_owned()),
                _ => return Err(LookupError::Missing),
            }
        }
    }

    async fn topic_arn(&self) -> Result<String, LookupError> {
        let mut slot = self.arn.lock().await;
        if let Some(arn) = slot.as_ref() {
            return Ok(arn.clone());
        }
        let arn = self.find().await?;
        *slot = Some(arn.clone());
        Ok(arn)
    }

    /// The message of `m`, or why SNS would never take it.
    fn entry(&self, m: &Message) -> Result<aws::Entry, String> {
        aws::entry(
            m,
            &self.options.source,
            self.fifo,
            MAX_MESSAGE,
            "SNS's limit",
        )
    }

    /// Send one call; the outcome of each of its entries, and whether the
    /// lane may go on.
    async fn send(
        &self,
        arn: &str,
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
                PublishBatchRequestEntry::builder()
                    .id(e.id)
                    .message(e.body)
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
            .publish_batch()
            .topic_arn(arn)
            .set_publish_batch_request_entries(Some(request))
            .send()
            .await;
        match answer {
            Ok(out) => aws::batch_answer(
                &call,
                SERVICE,
                out.successful().iter().filter_map(|ok| ok.id()),
                out.failed().iter().map(|f| {
                    (
                        f.id(),
                        f.sender_fault(),
                        f.code(),
                        f.message().unwrap_or_default(),
                    )
                }),
            ),
            Err(e) => aws::failed_call(&call, SERVICE, &e, MISSING, &self.arn).await,
        }
    }
}

#[async_trait]
impl Sink for SnsSink {
    async fn publish(&self, batch: &[Message]) -> Vec<Outcome> {
        if batch.is_empty() {
            return Vec::new();
        }
        if let Some(why) = self.config.missing_setting().await {
            return aws::retry_all(batch.len(), SERVICE, &why);
        }
        let arn = match self.topic_arn().await {
            Ok(arn) => arn,
            Err(e) => return aws::retry_all(batch.len(), SERVICE, &e.text(&self.topic)),
        };
        let plan = aws::Plan::new(batch, SERVICE, |m| self.entry(m));
        let lanes = plan.lanes(batch, MAX_ENTRIES, MAX_MESSAGE);
        let sent = aws::send_in_lanes(lanes, SERVICE, |call| {
            self.send(&arn, batch, &plan.entries, call)
        })
        .await;
        plan.outcomes(sent, SERVICE)
    }

    async fn check(&self) -> Result<(), SinkError> {
        if let Some(why) = self.config.missing_setting().await {
            return Err(SinkError::Config(why));
        }
        let what = format!("topic {:?}", self.topic);
        let arn = match self.topic_arn().await {
            Ok(arn) => arn,
            Err(LookupError::Missing) => {
                return Err(SinkError::Misconfigured {
                    sink: self.described.clone(),
                    reason: format!(
                        "{what} does not exist in this account and region (create it first)"
                    ),
                })
            }
            Err(LookupError::Call(e)) => {
                return Err(aws::check_error(&self.described, &e, false, &what))
            }
        };
        // The ARN may be remembered: ask the topic itself, so an outage or a
        // deleted topic fails the check.
        match self
            .client()
            .await
            .get_topic_attributes()
            .topic_arn(&arn)
            .send()
            .await
        {
            Ok(_) => Ok(()),
            Err(e) => {
                let e = CallError::new(&e);
                let missing = e.is_missing(MISSING);
                if missing {
                    *self.arn.lock().await = None;
                }
                Err(aws::check_error(&self.described, &e, missing, &what))
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

/// Why `name` is not an SNS topic name.
fn check_topic_name(name: &str) -> Result<(), String> {
    aws::check_fifo_name(name, "topic", 256)
}
