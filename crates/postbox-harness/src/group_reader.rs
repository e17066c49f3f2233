//! A reader of one consumer group, over SQL (`postbox_store::Groups`) or
//! over the HTTP API of `postbox group serve`: what bench's group runs and
//! verify's pull runs read with.

use crate::AnyError;
use postbox_store::Groups;
use std::time::Duration;
use uuid::Uuid;

/// One handed-out event, as a reader needs it.
pub struct Handed {
    pub receipt: String,
    pub event_id: Uuid,
    pub aggregate_type: String,
    pub aggregate_id: String,
    /// 0 when the event has no sequence.
    pub sequence: i64,
    pub attempts: i32,
}

/// A reader's way to its group.
#[derive(Clone)]
pub enum GroupReader {
    Sql {
        groups: Groups,
        group: String,
    },
    Http {
        client: reqwest::Client,
        /// `http://HOST:PORT/groups/NAME`.
        base: String,
        token: String,
    },
}

#[derive(serde::Deserialize)]
struct Answer {
    events: Vec<AnswerEvent>,
}

#[derive(serde::Deserialize)]
struct AnswerEvent {
    receipt: String,
    attempts: i32,
    event: CloudEvent,
}

#[derive(serde::Deserialize)]
struct CloudEvent {
    id: Uuid,
    aggregatetype: String,
    subject: String,
    sequence: Option<i64>,
}

#[derive(serde::Deserialize)]
struct Acked {
    acknowledged: i64,
}

/// An HTTP client for the groups' API that gives up after `timeout`.
pub fn http_client(timeout: Duration) -> Result<reqwest::Client, AnyError> {
    // reqwest (rustls without a provider of its own) needs one, even for
    // plain HTTP.
    let _ = rustls::crypto::ring::default_provider().install_default();
    Ok(reqwest::Client::builder().timeout(timeout).build()?)
}

impl GroupReader {
    /// Up to `max` events (at most 1,000), hidden for `visibility`,
    /// waiting up to `wait` when there is none.
    pub async fn receive(
        &self,
        max: usize,
        visibility: Duration,
        wait: Duration,
    ) -> Result<Vec<Handed>, AnyError> {
        let max = i32::try_from(max.min(1000)).unwrap_or(1000);
        match self {
            GroupReader::Sql { groups, group } => Ok(groups
                .receive(group, max, visibility, wait)
                .await?
                .into_iter()
                .map(|r| Handed {
                    receipt: r.receipt,
                    event_id: r.event_id,
                    aggregate_type: r.aggregate_type,
                    aggregate_id: r.aggregate_id,
                    sequence: r.sequence.unwrap_or(0),
                    attempts: r.attempts,
                })
                .collect()),
            GroupReader::Http { .. } => {
                let answer: Answer = self
                    .post(
                        "receive",
                        serde_json::json!({
                            "max_events": max,
                            "visibility_seconds": visibility.as_secs_f64().max(1.0),
                            "wait_seconds": wait.as_secs_f64(),
                        }),
                    )
                    .await?;
                Ok(answer
                    .events
                    .into_iter()
                    .map(|e| Handed {
                        receipt: e.receipt,
                        event_id: e.event.id,
                        aggregate_type: e.event.aggregatetype,
                        aggregate_id: e.event.subject,
                        sequence: e.event.sequence.unwrap_or(0),
                        attempts: e.attempts,
                    })
                    .collect())
            }
        }
    }

    /// Acknowledge `receipts`; how many still named an event in flight.
    pub async fn ack(&self, receipts: &[String]) -> Result<i64, AnyError> {
        if receipts.is_empty() {
            return Ok(0);
        }
        match self {
            GroupReader::Sql { groups, group } => Ok(i64::from(groups.ack(group, receipts).await?)),
            GroupReader::Http { .. } => {
                let acked: Acked = self
                    .post("ack", serde_json::json!({ "receipts": receipts }))
                    .await?;
                Ok(acked.acknowledged)
            }
        }
    }

    async fn post<T: serde::de::DeserializeOwned>(
        &self,
        call: &str,
        body: serde_json::Value,
    ) -> Result<T, AnyError> {
        let GroupReader::Http {
            client,
            base,
            token,
        } = self
        else {
            return Err("not an HTTP reader".into());
        };
        let response = client
            .post(format!("{base}/{call}"))
            .bearer_auth(token)
            .header("content-type", "application/json")
            .body(body.to_string())
            .send()
            .await?;
        let status = response.status();
        let bytes = response.bytes().await?;
        if !status.is_success() {
            return Err(format!(
                "{call} answered {status}: {}",
                String::from_utf8_lossy(&bytes)
            )
            .into());
        }
        Ok(serde_json::from_slice(&bytes)?)
    }
}
