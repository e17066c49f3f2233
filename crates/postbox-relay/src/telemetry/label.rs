//! The `outbox` label: which outbox the current task works for, and a
//! metrics recorder that adds it to every metric recorded there.
//!
//! A relay serving many outboxes runs each outbox's engine inside
//! [`scope`]; the engine's own tasks inherit the label when spawned. The CLI
//! wraps its Prometheus recorder in [`OutboxLabels`], so `postbox_*` metrics
//! carry `outbox="<database>/<schema>"` — or, with aggregation on (when the
//! outboxes are too many for label cardinality), do not.

use metrics::{Counter, Gauge, Histogram, Key, KeyName, Label, Metadata, Recorder, SharedString};
use std::future::Future;
use std::sync::Arc;

/// The name of the label added to every metric.
pub const OUTBOX_LABEL: &str = "outbox";

tokio::task_local! {
    static OUTBOX: Option<Arc<str>>;
}

/// The outbox the current task works for, if any.
pub fn current() -> Option<Arc<str>> {
    OUTBOX.try_with(Clone::clone).ok().flatten()
}

/// Run `task` as working for `outbox`.
pub fn scope<F: Future>(outbox: Arc<str>, task: F) -> impl Future<Output = F::Output> {
    OUTBOX.scope(Some(outbox), task)
}

/// Run `task` for the same outbox as the current task (for spawned tasks).
pub(crate) fn inherit<F: Future>(task: F) -> impl Future<Output = F::Output> {
    OUTBOX.scope(current(), task)
}

/// A recorder adding the `outbox` label to what is recorded inside [`scope`]
/// (unless `aggregate`), then handing it to `inner`.
pub struct OutboxLabels<R> {
    inner: R,
    aggregate: bool,
}

impl<R> OutboxLabels<R> {
    /// `aggregate`: record without the label (one series for all outboxes).
    pub fn new(inner: R, aggregate: bool) -> Self {
        Self { inner, aggregate }
    }

    fn key(&self, key: &Key) -> Option<Key> {
        if self.aggregate || key.labels().any(|l| l.key() == OUTBOX_LABEL) {
            return None;
        }
        let outbox = current()?;
        Some(key.with_extra_labels(vec![Label::new(OUTBOX_LABEL, outbox.to_string())]))
    }
}

impl<R: Recorder> Recorder for OutboxLabels<R> {
    fn describe_counter(&self, key: KeyName, unit: Option<metrics::Unit>, text: SharedString) {
        self.inner.describe_counter(key, unit, text)
    }

    fn describe_gauge(&self, key: KeyName, unit: Option<metrics::Unit>, text: SharedString) {
        self.inner.describe_gauge(key, unit, text)
    }

    fn describe_histogram(&self, key: KeyName, unit: Option<metrics::Unit>, text: SharedString) {
        self.inner.describe_histogram(key, unit, text)
    }

    fn register_counter(&self, key: &Key, metadata: &Metadata<'_>) -> Counter {
        match self.key(key) {
            Some(labelled) => self.inner.register_counter(&labelled, metadata),
            None => self.inner.register_counter(key, metadata),
        }
    }

    fn register_gauge(&self, key: &Key, metadata: &Metadata<'_>) -> Gauge {
        match self.key(key) {
            Some(labelled) => self.inner.register_gauge(&labelled, metadata),
            None => self.inner.register_gauge(key, metadata),
        }
    }

    fn register_histogram(&self, key: &Key, metadata: &Metadata<'_>) -> Histogram {
        match self.key(key) {
            Some(labelled) => self.inner.register_histogram(&labelled, metadata),
            None => self.inner.register_histogram(key, metadata),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_util::debugging::DebuggingRecorder;

    fn labels_of(aggregate: bool) -> Vec<Vec<(String, String)>> {
        let debugging = DebuggingRecorder::new();
        let snapshotter = debugging.snapshotter();
        let recorder = OutboxLabels::new(debugging, aggregate);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        runtime.block_on(scope("app/tenant_1".into(), async {
            // A task spawned by the engine keeps the label.
            let inner = inherit(async { current() }).await;
            assert_eq!(inner.as_deref(), Some("app/tenant_1"));
            metrics::with_local_recorder(&recorder, || {
                metrics::counter!("postbox_test_total", "destination" => "d").increment(1)
            });
        }));
        metrics::with_local_recorder(&recorder, || {
            metrics::counter!("postbox_test_total", "destination" => "d").increment(1)
        });
        let mut series: Vec<Vec<(String, String)>> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .map(|(key, ..)| {
                key.key()
                    .labels()
                    .map(|l| (l.key().to_owned(), l.value().to_owned()))
                    .collect()
            })
            .collect();
        series.sort();
        series
    }

    #[test]
    fn metrics_recorded_for_an_outbox_carry_its_name() {
        let d = ("destination".to_owned(), "d".to_owned());
        let o = ("outbox".to_owned(), "app/tenant_1".to_owned());
        assert_eq!(labels_of(false), vec![vec![d.clone()], vec![d.clone(), o]]);
        assert_eq!(labels_of(true), vec![vec![d]], "aggregated: one series");
    }
}
