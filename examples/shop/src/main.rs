//! The shop service: HTTP API, relay and consumer in one process (see README.md).
//!
//! Environment: `DATABASE_URL` (required), `REDIS_URL` (default
//! `redis://127.0.0.1:6379`), `LISTEN` (default `127.0.0.1:3000`),
//! `SHOP_SCHEMA` (default `shop`), `SHOP_STREAM` (default `shop:orders`),
//! `CONSUMER_NAME` (default `shop-1`), `RUST_LOG` (default `info`).

use postbox::{Outbox, Schema};
use postbox_relay::{RelayConfig, RunMode};
use shop::{App, Consumer};
use tokio_util::sync::CancellationToken;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt().with_env_filter(filter).init();

    let database_url = std::env::var("DATABASE_URL")
        .map_err(|_| "set DATABASE_URL, e.g. postgres://postgres@127.0.0.1:5432/postgres")?;
    let redis_url = env_or("REDIS_URL", "redis://127.0.0.1:6379");
    let listen = env_or("LISTEN", "127.0.0.1:3000");
    let schema: Schema = env_or("SHOP_SCHEMA", "shop").parse()?;
    let stream = env_or("SHOP_STREAM", "shop:orders");

    let pool = shop::connect(&database_url, &schema).await?;
    shop::setup(&pool, &schema).await?;

    let stop = CancellationToken::new();
    let relay = shop::relay(
        pool.clone(),
        schema.clone(),
        &redis_url,
        &stream,
        RelayConfig::default(),
    )?;
    let relay = tokio::spawn(relay_task(relay, stop.clone()));
    let outbox = Outbox::new(schema.clone());
    let name = env_or("CONSUMER_NAME", "shop-1");
    let consumer = Consumer::connect(pool.clone(), outbox, &redis_url, &stream, &name).await?;
    let consumer = tokio::spawn(consumer.run(stop.clone()));

    let listener = tokio::net::TcpListener::bind(&listen).await?;
    tracing::info!("shop listening on http://{}", listener.local_addr()?);
    axum::serve(listener, shop::router(App::new(pool, schema)))
        .with_graceful_shutdown(stop_signal())
        .await?;

    stop.cancel();
    relay.await?;
    consumer.await?;
    Ok(())
}

async fn relay_task(relay: postbox_relay::Relay, stop: CancellationToken) {
    relay.run(RunMode::Forever, stop).await;
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| default.to_owned())
}

/// Ctrl-C or SIGTERM.
async fn stop_signal() {
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
    tracing::info!("shutting down");
}
