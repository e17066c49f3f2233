//! `postbox receive`: serves the library's HTTP receiver
//! (`postbox::received::http`, which verifies each delivery's signature and
//! stores it once per consumer in `{schema}.received`) with the server bounds
//! of `postbox::serve` (header, request and idle timeouts, a connection cap).

use crate::context::{cancel_on_signal, AnyError, Settings};
use clap::{Args, ValueEnum};
use postbox::axum::SignatureVerifier;
use postbox::received::http::{Receiver, DEFAULT_MAX_BODY_BYTES};
use postbox::serve::{serve, Limits};
use postbox::verify::{qstash, webhooks};
use postbox::Outbox;
use postbox_store::connect as db;
use sqlx::PgPool;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Database connections the receiver keeps at most.
const POOL_SIZE: u32 = 8;

#[derive(Args, Debug)]
pub struct ReceiveArgs {
    /// Address to listen on, e.g. 0.0.0.0:8080
    #[arg(long, value_name = "ADDR", env = "POSTBOX_LISTEN")]
    pub listen: SocketAddr,
    /// Consumer name the deliveries are stored under (deduplication is per consumer)
    #[arg(long, value_name = "NAME", env = "POSTBOX_CONSUMER")]
    pub consumer: String,
    /// Signature deliveries must carry. qstash: QSTASH_CURRENT_SIGNING_KEY (and
    /// optionally QSTASH_NEXT_SIGNING_KEY); webhooks: POSTBOX_WEBHOOK_SECRET
    /// (space-separated whsec_... secrets); none: accept unsigned deliveries
    #[arg(long, value_enum, value_name = "SCHEME")]
    pub verify: VerifyMode,
    /// With --verify qstash: the public URL QStash delivers to; the token's `sub`
    /// claim must equal it
    #[arg(long, value_name = "EXPECTED_URL")]
    pub url: Option<String>,
    /// Largest accepted request body in bytes; larger deliveries get 413
    #[arg(long, value_name = "N", default_value_t = DEFAULT_MAX_BODY_BYTES)]
    pub max_body_bytes: usize,
    /// How long a delivery waits for a database connection before it is answered 503
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub db_timeout: Duration,
    /// A request's head (also the next one on a kept-alive connection) must
    /// arrive within this time, else the connection is closed
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_timeout: Duration,
    /// Reading a delivery's body and storing it must be done within this
    /// time, else it is answered 408
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// Connections served at once; more wait until one closes
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_connections: usize,
    /// Serve Prometheus /metrics (postbox_inbox_duplicates_total), /healthz and
    /// /readyz on ADDR, a port apart from the deliveries
    #[arg(long, env = "POSTBOX_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<String>,
}

/// The signature scheme `--verify` selects.
#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum VerifyMode {
    /// Upstash QStash (`Upstash-Signature`, HS256 JWT)
    Qstash,
    /// Standard Webhooks (`webhook-id`, `webhook-timestamp`, `webhook-signature`)
    Webhooks,
    /// No verification (only behind a trusted network boundary)
    None,
}

/// Why `postbox receive` could not start. Messages never contain a secret.
#[derive(Debug, thiserror::Error)]
pub enum ReceiveError {
    #[error("--verify webhooks: cannot use {}", webhooks::SECRET_ENV)]
    WebhookSecret(#[source] webhooks::SecretError),
    #[error(
        "--verify qstash: cannot use {} / {}",
        qstash::CURRENT_SIGNING_KEY_ENV,
        qstash::NEXT_SIGNING_KEY_ENV
    )]
    QStashKeys(#[source] qstash::KeyError),
    #[error("--url only applies to --verify qstash")]
    UrlWithoutQStash,
    #[error("--max-body-bytes must be at least 1")]
    ZeroBodyLimit,
    #[error("--{0} must be more than zero")]
    ZeroLimit(&'static str),
    #[error("--consumer is not a valid consumer name")]
    Consumer(#[source] postbox::Error),
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the HTTP server failed")]
    Serve(#[source] std::io::Error),
}

/// Builds the verifier `--verify` asks for, reading its secrets from the environment.
fn verifier(args: &ReceiveArgs) -> Result<Option<SignatureVerifier>, ReceiveError> {
    if args.url.is_some() && args.verify != VerifyMode::Qstash {
        return Err(ReceiveError::UrlWithoutQStash);
    }
    Ok(match args.verify {
        VerifyMode::Webhooks => Some(
            webhooks::Verifier::from_env()
                .map_err(ReceiveError::WebhookSecret)?
                .into(),
        ),
        VerifyMode::Qstash => {
            let mut v = qstash::Verifier::from_env().map_err(ReceiveError::QStashKeys)?;
            if let Some(url) = &args.url {
                v = v.with_expected_url(url);
            }
            Some(v.into())
        }
        VerifyMode::None => None,
    })
}

pub async fn run(settings: &Settings, args: ReceiveArgs) -> Result<ExitCode, AnyError> {
    if args.max_body_bytes == 0 {
        return Err(ReceiveError::ZeroBodyLimit.into());
    }
    let limits = limits(&args)?;
    let verifier = verifier(&args)?;
    if verifier.is_none() {
        tracing::warn!("--verify none: deliveries are accepted WITHOUT signature verification");
    }
    let options = db::options(settings.database_url.as_deref(), "postbox-receive")?;
    // Lazy: the receiver starts (and answers 503) while the database is down.
    let pool = db::pool_options(&options)
        .max_connections(POOL_SIZE)
        .acquire_timeout(args.db_timeout)
        .connect_lazy_with(options.clone());
    let mut receiver = Receiver::new(
        pool.clone(),
        Outbox::new(settings.schema.clone()),
        &args.consumer,
    )
    .map_err(ReceiveError::Consumer)?
    .max_body_bytes(args.max_body_bytes);
    if let Some(verifier) = verifier {
        receiver = receiver.verify_with(verifier);
    }

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| ReceiveError::Listen {
            addr: args.listen,
            source,
        })?;
    let local = listener.local_addr().unwrap_or(args.listen);
    tracing::info!(
        listen = %local,
        consumer = %args.consumer,
        verify = args.verify.to_possible_value().map(|v| v.get_name().to_owned()).unwrap_or_default(),
        schema = %settings.schema,
        database = %db::target(&options),
        "receiving deliveries"
    );
    tokio::spawn(warn_if_unreachable(pool.clone()));

    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    if let Some(addr) = &args.metrics_listen {
        let store = postbox_relay::Store::new(pool.clone(), settings.schema.clone());
        crate::metrics_endpoint::Endpoint::serve_beside(addr, store, shutdown.clone()).await?;
        metrics::counter!(postbox_relay::metrics::INBOX_DUPLICATES, "consumer" => args.consumer.clone())
            .absolute(0);
    }
    serve(
        listener,
        receiver.router(),
        limits,
        shutdown.clone().cancelled_owned(),
    )
    .await
    .map_err(ReceiveError::Serve)?;
    pool.close().await;
    tracing::info!("receiver stopped");
    Ok(ExitCode::SUCCESS)
}

/// The server bounds the flags ask for.
fn limits(args: &ReceiveArgs) -> Result<Limits, ReceiveError> {
    if args.header_timeout.is_zero() {
        return Err(ReceiveError::ZeroLimit("header-timeout"));
    }
    if args.request_timeout.is_zero() {
        return Err(ReceiveError::ZeroLimit("request-timeout"));
    }
    if args.max_connections == 0 {
        return Err(ReceiveError::ZeroLimit("max-connections"));
    }
    Ok(Limits {
        header_read_timeout: args.header_timeout,
        request_timeout: Some(args.request_timeout),
        max_connections: args.max_connections,
    })
}

/// Warns early when the database is not reachable; deliveries get 503 until it is.
async fn warn_if_unreachable(pool: PgPool) {
    if let Err(e) = pool.acquire().await {
        tracing::warn!(
            error = %postbox_harness::error_chain(&e),
            "the database is not reachable yet; deliveries are answered 503 until it is"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn url_needs_qstash() {
        let args = ReceiveArgs {
            listen: "127.0.0.1:0".parse().expect("addr"),
            consumer: "c".to_owned(),
            verify: VerifyMode::None,
            url: Some("https://x".to_owned()),
            max_body_bytes: 1,
            db_timeout: Duration::from_secs(1),
            header_timeout: Duration::from_secs(1),
            request_timeout: Duration::from_secs(1),
            max_connections: 1,
            metrics_listen: None,
        };
        assert!(matches!(
            verifier(&args),
            Err(ReceiveError::UrlWithoutQStash)
        ));
    }
}
