//! One shop per test: its own schema, pool, router and Redis stream.

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use postbox::Outbox;
use postbox_relay::{RelayConfig, RunMode, StatsSnapshot};
use postbox_testkit::{redis_url, unique, TestDb};
use serde_json::Value;
use shop::{App, Consumer, ConsumerStats};
use sqlx::PgPool;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

pub const WAIT: Duration = Duration::from_secs(30);

pub struct TestShop {
    pub db: TestDb,
    /// The shop's pool (search_path = the test's schema).
    pub pool: PgPool,
    pub router: Router,
    pub stream: String,
}

/// A response: status, headers, JSON body (`Value::Null` when not JSON).
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Value,
}

impl TestShop {
    pub async fn new() -> Self {
        let db = TestDb::new().await;
        let pool = shop::connect(&db.url, &db.schema).await.unwrap();
        shop::setup(&pool, &db.schema).await.unwrap();
        let router = shop::router(App::new(pool.clone(), db.schema.clone()));
        let stream = unique("shop:test:");
        TestShop {
            db,
            pool,
            router,
            stream,
        }
    }

    pub async fn post_order(&self, key: Option<&str>, body: &Value) -> Reply {
        let mut request = Request::post("/orders").header("content-type", "application/json");
        if let Some(key) = key {
            request = request.header("idempotency-key", key);
        }
        self.send(request.body(Body::from(body.to_string())).unwrap())
            .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        self.send(Request::get(path).body(Body::empty()).unwrap())
            .await
    }

    async fn send(&self, request: Request<Body>) -> Reply {
        let response = self.router.clone().oneshot(request).await.unwrap();
        let status = response.status();
        let headers = response.headers().clone();
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        let body = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            headers,
            body,
        }
    }

    /// A single count from a query on the test's schema (`{schema}` is replaced).
    pub async fn count(&self, sql: &str) -> i64 {
        self.db.count(sql).await
    }

    /// The customer's order counter, 0 before the first event is applied.
    pub async fn customer_orders(&self, customer: &str) -> i64 {
        let sql =
            "SELECT coalesce(max(orders), 0) FROM {schema}.customer_stats WHERE customer = $1";
        sqlx::query_scalar(sqlx::AssertSqlSafe(self.db.sql(sql)))
            .bind(customer)
            .fetch_one(&self.db.pool)
            .await
            .unwrap()
    }

    pub async fn consumer(&self, name: &str) -> Consumer {
        let outbox = Outbox::new(self.db.schema.clone());
        Consumer::connect(self.pool.clone(), outbox, &redis_url(), &self.stream, name)
            .await
            .unwrap()
    }

    /// Start the relay and a consumer named `shop-1`.
    pub async fn start(&self) -> Running {
        let running = self.start_relay();
        let consumer = self.consumer("shop-1").await;
        running.with_consumer(consumer)
    }

    pub fn start_relay(&self) -> Running {
        let config = RelayConfig {
            poll_interval: Duration::from_millis(100),
            ..RelayConfig::default()
        };
        let relay = shop::relay(
            self.pool.clone(),
            self.db.schema.clone(),
            &redis_url(),
            &self.stream,
            config,
        )
        .unwrap();
        let stop = CancellationToken::new();
        let relay = tokio::spawn({
            let stop = stop.clone();
            async move { relay.run(RunMode::Forever, stop).await }
        });
        Running {
            stop,
            relay: Some(relay),
            consumer: None,
            stats: Arc::default(),
        }
    }

    pub async fn finish(self) {
        let mut redis = postbox_testkit::redis().await;
        let _: () = redis::cmd("DEL")
            .arg(&self.stream)
            .arg(format!("{}:dead", self.stream))
            .query_async(&mut redis)
            .await
            .unwrap();
        self.pool.close().await;
        self.db.drop_schema().await;
    }
}

/// A relay and/or a consumer running in the background.
pub struct Running {
    stop: CancellationToken,
    relay: Option<JoinHandle<StatsSnapshot>>,
    consumer: Option<JoinHandle<()>>,
    pub stats: Arc<ConsumerStats>,
}

impl Running {
    pub fn with_consumer(mut self, consumer: Consumer) -> Self {
        self.stats = consumer.stats();
        self.consumer = Some(tokio::spawn(consumer.run(self.stop.clone())));
        self
    }

    pub async fn stop(self) {
        self.stop.cancel();
        if let Some(relay) = self.relay {
            relay.await.unwrap();
        }
        if let Some(consumer) = self.consumer {
            consumer.await.unwrap();
        }
    }
}
