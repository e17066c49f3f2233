//! The broker of a checker run: the relays publish through a fault proxy
//! into a stream of the run's own, which the consumer reads directly.

use super::consumer::Source;
use crate::AnyError;
use postbox_proxy::FaultProxy;

/// The broker, as the relays and the consumer see it.
pub struct Broker {
    /// The sink URL for the relays (through the proxy).
    pub relay_url: String,
    /// The broker's address, for the proxy.
    pub target: String,
    /// What the run left on the broker, to delete afterwards.
    pub cleanup: Cleanup,
}

pub enum Cleanup {
    RedisKey { url: String, key: String },
    NatsStream { url: String, stream: String },
    AmqpQueue { url: String, queue: String },
}

impl Cleanup {
    pub async fn run(&self) -> Result<(), AnyError> {
        match self {
            Cleanup::RedisKey { url, key } => {
                let client = redis::Client::open(url.as_str())?;
                let mut conn = crate::redis_connection(&client).await?;
                redis::cmd("DEL")
                    .arg(key)
                    .query_async::<()>(&mut conn)
                    .await?;
            }
            Cleanup::NatsStream { url, stream } => {
                let client = async_nats::connect(url.as_str()).await?;
                async_nats::jetstream::new(client)
                    .delete_stream(stream)
                    .await?;
            }
            Cleanup::AmqpQueue { url, queue } => {
                let connection =
                    lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
                let channel = connection.create_channel().await?;
                channel
                    .queue_delete(
                        queue.as_str().into(),
                        lapin::options::QueueDeleteOptions::default(),
                    )
                    .await?;
                let _ = connection.close(200, "deleted".into()).await;
            }
        }
        Ok(())
    }

    pub fn describe(&self) -> String {
        match self {
            Cleanup::RedisKey { key, .. } => format!("Redis stream {key}"),
            Cleanup::NatsStream { stream, .. } => format!("JetStream stream {stream}"),
            Cleanup::AmqpQueue { queue, .. } => format!("RabbitMQ queue {queue}"),
        }
    }
}

/// Replace `url`'s host and port with the proxy's.
pub fn through(url: &url::Url, port: u16) -> Result<url::Url, AnyError> {
    let mut u = url.clone();
    u.set_host(Some("127.0.0.1"))
        .map_err(|e| format!("cannot point {} at the fault proxy: {e}", url.scheme()))?;
    u.set_port(Some(port))
        .map_err(|()| format!("cannot point {} at the fault proxy", url.scheme()))?;
    Ok(u)
}

pub fn host_port(url: &url::Url, default_port: u16) -> Result<String, AnyError> {
    let host = url
        .host_str()
        .filter(|h| !h.is_empty())
        .ok_or_else(|| format!("{}: the URL needs a host", url.scheme()))?;
    Ok(format!("{host}:{}", url.port().unwrap_or(default_port)))
}

/// Put a fault proxy in front of the broker `sink` names, and prepare what
/// the run's relays publish to (a Redis stream or a JetStream stream of its
/// own) and its consumer reads.
pub async fn set_up(sink: &str, run_id: &str) -> Result<(Broker, Source, FaultProxy), AnyError> {
    let url = url::Url::parse(sink).map_err(|e| format!("--sink: {e}"))?;
    if url.query().is_some() {
        return Err("--sink: give the broker's address only (verify chooses the stream)".into());
    }
    match url.scheme() {
        "redis" => {
            let target = host_port(&url, 6379)?;
            let proxy = FaultProxy::start(&target).await?;
            let key = format!("postbox_verify:{run_id}");
            let mut relay = through(&url, proxy.port())?;
            relay
                .query_pairs_mut()
                .append_pair("mode", "stream")
                .append_pair("key", &key);
            let source = Source::redis_stream(sink, &key).await?;
            Ok((
                Broker {
                    relay_url: relay.to_string(),
                    target,
                    cleanup: Cleanup::RedisKey {
                        url: sink.to_owned(),
                        key,
                    },
                },
                source,
                proxy,
            ))
        }
        "nats" => {
            let target = host_port(&url, 4222)?;
            let proxy = FaultProxy::start(&target).await?;
            let stream = format!("POSTBOX_VERIFY_{}", run_id.to_uppercase());
            let prefix = format!("postbox_verify_{run_id}");
            let mut relay = through(&url, proxy.port())?;
            relay
                .query_pairs_mut()
                .append_pair("subject", &format!("{prefix}.{{event_type}}"))
                .append_pair("stream", &stream);
            let source = Source::jetstream(sink, &stream, &format!("{prefix}.>")).await?;
            Ok((
                Broker {
                    relay_url: relay.to_string(),
                    target,
                    cleanup: Cleanup::NatsStream {
                        url: sink.to_owned(),
                        stream,
                    },
                },
                source,
                proxy,
            ))
        }
        "amqp" => {
            // The relays publish through the proxy to the default exchange,
            // which routes to the queue named by the routing key.
            let target = host_port(&url, 5672)?;
            let proxy = FaultProxy::start(&target).await?;
            let queue = format!("postbox_verify_{run_id}");
            let mut relay = through(&url, proxy.port())?;
            relay
                .query_pairs_mut()
                .append_pair("exchange", "")
                .append_pair("routing_key", &queue)
                .append_pair("timeout", "3s");
            let source = Source::amqp_queue(sink, &queue).await?;
            Ok((
                Broker {
                    relay_url: relay.to_string(),
                    target,
                    cleanup: Cleanup::AmqpQueue {
                        url: sink.to_owned(),
                        queue,
                    },
                },
                source,
                proxy,
            ))
        }
        other => Err(format!(
            "--sink: verify runs with redis://, nats:// or amqp:// brokers, not {other}://"
        )
        .into()),
    }
}
