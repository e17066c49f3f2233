//! A relay speaks up while a destination is down: a WARN as it starts
//! failing (what, since when, how many attempts, what waits), and an INFO
//! when it delivers again; every event still arrives.

use crate::support::*;
use postbox_relay::sinks::{self, SinkOptions};
use postbox_relay::{Relay, RunMode};
use postbox_testkit::proxy::Proxy;
use postbox_testkit::{redis, unique, wait_for, TestDb};
use redis::AsyncCommands;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const WAIT: Duration = Duration::from_secs(60);

#[tokio::test]
async fn a_destination_that_keeps_failing_is_reported_and_its_recovery_too() {
    let logs = Logs::default();
    let _capturing = logs.capture(tracing::Level::INFO);

    let db = TestDb::new().await;
    let n = enqueue(&db, 20).await.len();
    let proxy = Proxy::start("127.0.0.1:6379").await;
    proxy.stop();
    let key = unique("trouble:");
    let url = format!("redis://{}?key={key}", proxy.host_port());
    let sink = sinks::from_url(&url, &SinkOptions::default()).unwrap();
    let relay = Relay::new(store(&db), sink, fast_config()).unwrap();
    let stop = CancellationToken::new();
    let running = tokio::spawn({
        let stop = stop.clone();
        async move { relay.run(RunMode::Forever, stop).await }
    });

    wait_for(
        "a WARN that the destination keeps failing",
        WAIT,
        || async { logs.text().contains("destination keeps failing") },
    )
    .await;
    let warned = logs.text();
    let line = warned
        .lines()
        .find(|l| l.contains("destination keeps failing"))
        .unwrap();
    assert!(line.contains("WARN"), "{line}");
    for field in [
        "destination=",
        "since=",
        "failed_attempts=",
        "events_waiting=",
        "error=",
    ] {
        assert!(line.contains(field), "the warning says {field}: {line}");
    }
    assert_eq!(
        warned.matches("destination keeps failing").count(),
        1,
        "said once, not once per retry (the next one comes after a minute)"
    );

    proxy.restore();
    wait_for(
        "an INFO that the destination delivers again",
        WAIT,
        || async { logs.text().contains("destination delivers again") },
    )
    .await;
    let mut conn = redis().await;
    wait_for("every event in Redis", WAIT, || {
        let mut conn = conn.clone();
        let key = key.clone();
        async move { conn.llen::<_, usize>(&key).await.unwrap_or(0) == n }
    })
    .await;
    let _: () = conn.del(&key).await.unwrap();
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), running)
        .await
        .expect("the relay stops")
        .unwrap();
    db.drop_schema().await;
}
