//! `postbox relay --metrics-listen ADDR`: the Prometheus exporter and the
//! health endpoints.
//!
//! - `GET /metrics`: every `postbox_*` metric (names in `postbox_relay::metrics`),
//!   rendered by `metrics-exporter-prometheus`.
//! - `GET /healthz`: `200 ok` while the process runs (touches nothing).
//! - `GET /readyz`: `200 ready` when the database answers (and postbox's table is
//!   readable), every destination's sink check passes and, in logical mode, the
//!   slot's reader has not failed three times in a row; otherwise `503` with a
//!   fixed phrase naming the part that failed (never an error's text).
//! - `GET /outboxes` (a relay serving many outboxes only): every outbox as
//!   JSON — served or not, its errors and counters, and whether the health
//!   watch found it `healthy` (with what it found in `health`). `200`, or
//!   `503` when any served outbox is unhealthy, so a probe can alert on it;
//!   `?unhealthy` lists only those that are not healthy.

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::Router;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use postbox_relay::{metrics as m, Sink, Store, Tenants};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How long `/readyz` waits for the database and for the sink.
const READY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often histogram buckets are maintained.
const UPKEEP_INTERVAL: Duration = Duration::from_secs(5);

/// The metrics endpoint could not be started.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ObserveError {
    #[error("cannot set up the Prometheus exporter")]
    Exporter(#[from] metrics_exporter_prometheus::BuildError),
    #[error("cannot install the metrics recorder: one is already installed")]
    Installed,
    #[error("--metrics-listen {addr}: cannot listen there")]
    Bind {
        addr: String,
        #[source]
        source: std::io::Error,
    },
}

#[derive(Clone)]
struct Probe {
    handle: PrometheusHandle,
    store: Store,
    sinks: Arc<Vec<Arc<dyn Sink>>>,
    outboxes: Option<Arc<Tenants>>,
    /// The relay's counters: a logical reader failing again and again is unready.
    reader: Option<Arc<postbox_relay::Stats>>,
}

/// From this many failures in a row of the slot's reader, `/readyz` is unready.
const READER_FAILURES_UNREADY: u64 = 3;

/// A bound metrics endpoint, not yet serving.
pub struct Endpoint {
    listener: tokio::net::TcpListener,
    probe: Probe,
}

impl Endpoint {
    /// Answer `/readyz` unready while the relay's slot reader fails again
    /// and again (logical mode; three failures in a row).
    pub fn with_reader(mut self, stats: Arc<postbox_relay::Stats>) -> Self {
        self.probe.reader = Some(stats);
        self
    }

    /// Install the Prometheus recorder (once per process) and bind `addr`.
    pub async fn bind(
        addr: &str,
        store: Store,
        sinks: Vec<Arc<dyn Sink>>,
    ) -> Result<Self, ObserveError> {
        Self::bind_labelled(addr, store, sinks, false).await
    }

    /// [`Endpoint::bind`], with the `outbox` label on what a relay serving
    /// many outboxes records (none when `aggregate`).
    pub async fn bind_labelled(
        addr: &str,
        store: Store,
        sinks: Vec<Arc<dyn Sink>>,
        aggregate: bool,
    ) -> Result<Self, ObserveError> {
        let mut builder = PrometheusBuilder::new();
        for (name, buckets) in m::HISTOGRAMS {
            builder = builder.set_buckets_for_metric(Matcher::Full((*name).to_owned()), buckets)?;
        }
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        metrics::set_global_recorder(postbox_relay::label::OutboxLabels::new(recorder, aggregate))
            .map_err(|_| ObserveError::Installed)?;
        m::describe();
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| ObserveError::Bind {
                addr: addr.to_owned(),
                source,
            })?;
        Ok(Self {
            listener,
            probe: Probe {
                handle,
                store,
                sinks: Arc::new(sinks),
                outboxes: None,
                reader: None,
            },
        })
    }

    /// Serve `GET /outboxes`: the status of every outbox `tenants` serves.
    pub fn with_outboxes(mut self, tenants: Arc<Tenants>) -> Self {
        self.probe.outboxes = Some(tenants);
        self
    }

    /// Bind `addr` beside a server that is not a relay (`receive`, `group
    /// serve`: no sink to check), say where, and serve until `stop`.
    pub async fn serve_beside(
        addr: &str,
        store: Store,
        stop: CancellationToken,
    ) -> Result<(), ObserveError> {
        let endpoint = Self::bind(addr, store, Vec::new()).await?;
        if let Some(addr) = endpoint.local_addr() {
            tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
        }
        tokio::spawn(endpoint.serve(stop));
        Ok(())
    }

    pub fn local_addr(&self) -> Option<SocketAddr> {
        self.listener.local_addr().ok()
    }

    /// Serve until `stop` is cancelled.
    pub async fn serve(self, stop: CancellationToken) {
        let handle = self.probe.handle.clone();
        let upkeep_stop = stop.clone();
        tokio::spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(UPKEEP_INTERVAL) => handle.run_upkeep(),
                    _ = upkeep_stop.cancelled() => return,
                }
            }
        });
        let mut app = Router::new()
            .route("/metrics", get(scrape))
            .route("/healthz", get(|| async { text(StatusCode::OK, "ok") }))
            .route("/readyz", get(ready));
        if self.probe.outboxes.is_some() {
            app = app.route("/outboxes", get(outboxes));
        }
        let app = app.with_state(self.probe);
        let limits = postbox::serve::Limits::default();
        if let Err(e) =
            postbox::serve::serve(self.listener, app, limits, stop.cancelled_owned()).await
        {
            tracing::error!(error = %e, "the metrics endpoint stopped");
        }
    }
}

fn text(status: StatusCode, body: &'static str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "text/plain; charset=utf-8")],
        body,
    )
        .into_response()
}

async fn scrape(State(probe): State<Probe>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        probe.handle.render(),
    )
        .into_response()
}

async fn outboxes(
    State(probe): State<Probe>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
) -> Response {
    let Some(tenants) = &probe.outboxes else {
        return text(StatusCode::NOT_FOUND, "not serving many outboxes");
    };
    let only_unhealthy = query.as_deref().is_some_and(|q| {
        q.split('&')
            .any(|p| p == "unhealthy" || p.starts_with("unhealthy="))
    });
    let all = tenants.status();
    let sick = all.iter().any(|o| o.serving && !o.healthy);
    let shown: Vec<_> = all
        .into_iter()
        .filter(|o| !only_unhealthy || !o.healthy)
        .collect();
    let status = if sick {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::OK
    };
    match serde_json::to_vec(&shown) {
        Ok(body) => (status, [(header::CONTENT_TYPE, "application/json")], body).into_response(),
        Err(_) => text(
            StatusCode::INTERNAL_SERVER_ERROR,
            "cannot render the outboxes",
        ),
    }
}

async fn ready(State(probe): State<Probe>) -> Response {
    if probe.reader.as_ref().is_some_and(|s| {
        s.reader_failures.load(std::sync::atomic::Ordering::Relaxed) >= READER_FAILURES_UNREADY
    }) {
        return text(
            StatusCode::SERVICE_UNAVAILABLE,
            "the replication slot's reader keeps failing",
        );
    }
    match tokio::time::timeout(READY_TIMEOUT, probe.store.ping()).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => {
            tracing::debug!(error = %postbox_relay::redact::sanitize_error(&e.to_string()), "readyz: database check failed");
            return text(StatusCode::SERVICE_UNAVAILABLE, "database unavailable");
        }
        Err(_) => return text(StatusCode::SERVICE_UNAVAILABLE, "database unavailable"),
    }
    let checks = probe.sinks.iter().map(|sink| async move {
        match tokio::time::timeout(READY_TIMEOUT, sink.check()).await {
            Ok(Ok(())) => true,
            Ok(Err(e)) => {
                let e = e.masked(sink.secrets());
                tracing::debug!(error = %postbox_relay::redact::sanitize_error(&e.to_string()), "readyz: sink check failed");
                false
            }
            Err(_) => false,
        }
    });
    if futures::future::join_all(checks)
        .await
        .into_iter()
        .all(|ok| ok)
    {
        text(StatusCode::OK, "ready")
    } else {
        text(StatusCode::SERVICE_UNAVAILABLE, "sink unavailable")
    }
}
