//! Secrets a sink holds never come back through error text: an endpoint
//! answering 4xx with a body that repeats a credential (a configured header,
//! the Basic credential of the URL's user-info — raw and in base64 — a
//! token in the URL's path or query, `QSTASH_TOKEN`) leaves no trace of it in
//! `last_error`, in the relay's log lines or in its metrics labels; nor does
//! a secret path segment of a webhook URL in the start-up line.

use crate::receiver::{Receiver, Reply, Request};
use crate::support::*;
use metrics_util::debugging::DebuggingRecorder;
use postbox::statements::trusted;
use postbox_relay::sinks::SinkOptions;
use postbox_relay::Sink;
use postbox_testkit::TestDb;
use std::sync::Arc;

/// Run `test` on a current-thread runtime, with its logs (every level) and
/// its metrics captured; returns the logs and every metric key with labels.
fn captured(test: impl std::future::Future<Output = ()>) -> (String, String) {
    let logs = Logs::default();
    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    {
        let _capturing = logs.capture(tracing::Level::DEBUG);
        metrics::with_local_recorder(&recorder, || runtime.block_on(test));
    }
    let labels = snapshotter
        .snapshot()
        .into_vec()
        .into_iter()
        .map(|(key, _, _, _)| format!("{:?}", key.key()))
        .collect::<Vec<_>>()
        .join("\n");
    (logs.text(), labels)
}

async fn last_errors(db: &TestDb) -> Vec<String> {
    sqlx::query_scalar(trusted(
        &db.sql("SELECT coalesce(last_error, '') FROM {schema}.outbox ORDER BY id"),
    ))
    .fetch_all(&db.pool)
    .await
    .unwrap()
}

fn assert_clean(what: &str, text: &str, leaks: &[&str]) {
    for leak in leaks {
        assert!(!text.contains(leak), "{what} contains {leak:?}:\n{text}");
    }
}

#[cfg(feature = "http")]
#[test]
fn an_http_endpoint_echoing_credentials_leaks_none_of_them() {
    use postbox_relay::sinks::http::{HttpOptions, HttpSink};

    const API_KEY: &str = "sk_live_4pi-k3y";
    const PASSWORD: &str = "pa55-word";
    const BASIC: &str = "YXBwOnBhNTUtd29yZA"; // base64("app:pa55-word"), unpadded
    const PATH_SECRET: &str = "XXXXSECRETXXXX";
    const QUERY_TOKEN: &str = "qtok123";
    let (logs, labels) = captured(async {
        let db = TestDb::new().await;
        // Answers 400 with a body repeating every credential it received.
        let receiver = Receiver::start(|r: &Request, _| {
            let basic = r
                .header("authorization")
                .unwrap_or("")
                .trim_start_matches("Basic ");
            let body = format!(
                "denied key {} cred {basic} user app:{PASSWORD} at {}",
                r.header("x-api-key").unwrap_or(""),
                r.path
            );
            Reply::Status(400, Vec::new(), body)
        })
        .await;
        let url = receiver
            .url(&format!(
                "/services/T0AB1/{PATH_SECRET}?token={QUERY_TOKEN}"
            ))
            .replace("http://", &format!("http://app:{PASSWORD}@"));
        let mut http = HttpOptions::default();
        http.headers.insert("x-api-key".into(), API_KEY.into());
        let options = SinkOptions {
            source: "shop".into(),
            ..SinkOptions::default()
        }
        .with(http);
        let sink = Arc::new(HttpSink::new(&url, options, Vec::new()).unwrap());
        assert_clean(
            "describe()",
            &sink.describe(),
            &[PASSWORD, PATH_SECRET, QUERY_TOKEN],
        );
        enqueue(&db, 2).await;
        let stats = drain(&db, sink, fast_config()).await;
        assert_eq!(stats.dead_lettered, 2, "{stats:?}");
        // The endpoint did get and echo them: the masking is what keeps them out.
        let echoed = receiver.requests()[0]
            .header("x-api-key")
            .map(str::to_owned);
        assert_eq!(echoed.as_deref(), Some(API_KEY));
        for error in last_errors(&db).await {
            assert!(error.starts_with("HTTP 400: denied key ***"), "{error}");
            assert_clean(
                "last_error",
                &error,
                &[API_KEY, PASSWORD, BASIC, PATH_SECRET, QUERY_TOKEN],
            );
        }
    });
    assert!(logs.contains("relay started"), "{logs}");
    assert!(logs.contains("/services/***/***?…"), "{logs}");
    assert!(logs.contains("rejected by the sink"), "{logs}");
    assert_clean(
        "the logs",
        &logs,
        &[API_KEY, PASSWORD, BASIC, PATH_SECRET, QUERY_TOKEN],
    );
    assert!(labels.contains("destination"), "{labels}");
    assert_clean(
        "the metrics",
        &labels,
        &[PASSWORD, PATH_SECRET, QUERY_TOKEN, "T0AB1"],
    );
}

/// An endpoint that echoes what it got in the encodings endpoints really
/// use — HTML-escaped, JSON-escaped with `\/`, case-folded, split at a
/// quote — and echoes the event's body, whose redacted fields (`[redact]`)
/// and redacted header must not come back either (issue 35, defect 5).
#[cfg(feature = "http")]
#[test]
fn an_endpoint_echoing_in_other_encodings_and_the_body_leaks_nothing() {
    use postbox_relay::redact::PayloadRedactor;
    use postbox_relay::sinks::http::{HttpOptions, HttpSink};
    use postbox_relay::{Relay, Router, RunMode};

    const API_KEY: &str = "HdrKey/9+z\"qrstuvwx";
    const PATH_SECRET: &str = "XXXXSECRETXXXX";
    const CARD: &str = "4111111111111111";
    const TRACE_TOKEN: &str = "producer-tok-77";
    let (logs, _) = captured(async {
        let db = TestDb::new().await;
        let receiver = Receiver::start(|r: &Request, _| {
            let key = r.header("x-api-key").unwrap_or("");
            let html = key.replace('"', "&quot;");
            let json = serde_json::to_string(key).unwrap().replace('/', "\\/");
            let after_quote = key.split('"').nth(1).unwrap_or("");
            let body = format!(
                "<p>{html}</p> {json} piece {after_quote} path {} body {}",
                r.path.to_lowercase(),
                String::from_utf8_lossy(&r.body)
            );
            Reply::Status(400, Vec::new(), body)
        })
        .await;
        let url = receiver.url(&format!("/services/{PATH_SECRET}"));
        let mut http = HttpOptions::default();
        http.headers.insert("x-api-key".into(), API_KEY.into());
        let options = SinkOptions {
            source: "shop".into(),
            ..SinkOptions::default()
        }
        .with(http);
        let sink = Arc::new(HttpSink::new(&url, options, Vec::new()).unwrap());
        let event = postbox::NewEvent::new(
            "order.paid",
            "order",
            "1",
            &serde_json::json!({"card": {"number": CARD}, "total": 5}),
        )
        .unwrap()
        .headers([("x-trace-token", TRACE_TOKEN)])
        .unwrap();
        db.enqueue_events(&[event]).await;
        let redactor = PayloadRedactor::new(&["card.number".to_owned()])
            .unwrap()
            .with_headers(&["X-Trace-Token".to_owned()]);
        let relay = Relay::with_router(
            store(&db),
            Router::single(sink).with_redactor(redactor),
            fast_config(),
        )
        .unwrap();
        let stats = relay
            .run(RunMode::Drain, tokio_util::sync::CancellationToken::new())
            .await;
        assert_eq!(stats.dead_lettered, 1, "{stats:?}");
        // The endpoint got the card and echoed it: the cleaning keeps it out.
        assert!(String::from_utf8_lossy(&receiver.requests()[0].body).contains(CARD));
        for error in last_errors(&db).await {
            assert!(error.starts_with("HTTP 400"), "{error}");
            assert_clean(
                "last_error",
                &error.to_lowercase(),
                &["hdrkey", "qrstuvwx", "xxxxsecretxxxx", CARD, TRACE_TOKEN],
            );
        }
    });
    assert_clean(
        "the logs",
        &logs.to_lowercase(),
        &["hdrkey", "qrstuvwx", "xxxxsecretxxxx", CARD, TRACE_TOKEN],
    );
}

#[cfg(feature = "qstash")]
#[test]
fn a_qstash_api_echoing_the_token_leaks_nothing() {
    use postbox_relay::sinks::qstash::{QstashCredentials, QstashOptions, QstashSink};

    const TOKEN: &str = "qstash-t0ken-5ecret";
    const PATH_SECRET: &str = "XXXXSECRETXXXX";
    const FORWARDED: &str = "fwd-s3cret-value";
    let (logs, labels) = captured(async {
        let db = TestDb::new().await;
        // A QStash API that answers 400, repeating the token and the path.
        let api = Receiver::start(|r: &Request, _| {
            let token = r
                .header("authorization")
                .unwrap_or("")
                .trim_start_matches("Bearer ");
            let body = format!(
                "bad request token {token} fwd {} at {}",
                r.header("upstash-forward-x-key").unwrap_or(""),
                r.path
            );
            Reply::Status(400, Vec::new(), body)
        })
        .await;
        let mut qstash = QstashOptions::default();
        qstash
            .forward_headers
            .insert("x-key".into(), FORWARDED.into());
        let options = SinkOptions {
            source: "shop".into(),
            ..SinkOptions::default()
        }
        .with(qstash);
        let sink = Arc::new(
            QstashSink::new(
                &format!("qstash:https://hooks.example/services/T0AB1/{PATH_SECRET}"),
                options,
                QstashCredentials::new(TOKEN, api.url("")),
            )
            .unwrap(),
        );
        assert_clean("describe()", &sink.describe(), &[TOKEN, PATH_SECRET]);
        enqueue(&db, 1).await;
        let stats = drain(&db, sink, fast_config()).await;
        assert_eq!(stats.dead_lettered, 1, "{stats:?}");
        let echoed = api.requests()[0].header("authorization").map(str::to_owned);
        assert_eq!(echoed, Some(format!("Bearer {TOKEN}")));
        for error in last_errors(&db).await {
            assert!(
                error.starts_with("QStash: HTTP 400: bad request token ***"),
                "{error}"
            );
            assert_clean("last_error", &error, &[TOKEN, PATH_SECRET, FORWARDED]);
        }
    });
    assert!(logs.contains("relay started"), "{logs}");
    assert!(logs.contains("rejected by the sink"), "{logs}");
    assert_clean("the logs", &logs, &[TOKEN, PATH_SECRET, FORWARDED]);
    assert_clean("the metrics", &labels, &[TOKEN, PATH_SECRET]);
}

/// A broker refusing a wrong password: the error the relay keeps has no password.
#[cfg(feature = "amqp")]
#[tokio::test]
async fn a_wrong_amqp_password_stays_out_of_errors() {
    use postbox_relay::sinks::amqp::AmqpSink;
    let password = "wr0ng-amqp-pa55";
    let sink = AmqpSink::from_url(
        &format!("amqp://guest:{password}@127.0.0.1:5672/%2f?exchange=&timeout=5s"),
        SinkOptions::default(),
    )
    .unwrap();
    let error = sink
        .check()
        .await
        .unwrap_err()
        .masked(sink.secrets())
        .to_string();
    assert_clean("the check error", &error, &[password]);
    let outcome = sink.publish(&crate::conformance::messages(1, 1)).await;
    let outcome = format!("{:?}", outcome[0].clone().masked(sink.secrets()));
    assert_clean("the outcome", &outcome, &[password]);
}

/// An unreachable webhook with a token in its path: the check error (what
/// `relay` logs as "not reachable yet") names the destination without it.
#[cfg(feature = "http")]
#[tokio::test]
async fn an_unreachable_webhook_is_named_without_its_path_secret() {
    use postbox_relay::sinks::http::{HttpOptions, HttpSink};
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let url = format!("http://127.0.0.1:{port}/services/T0AB1/B0CD2/XXXXSECRETXXXX");
    let options = SinkOptions {
        source: "shop".into(),
        ..SinkOptions::default()
    }
    .with(HttpOptions::default());
    let sink = HttpSink::new(&url, options, Vec::new()).unwrap();
    let error = sink
        .check()
        .await
        .unwrap_err()
        .masked(sink.secrets())
        .to_string();
    assert!(error.contains("/services/***/***/***"), "{error}");
    assert_clean(
        "the check error",
        &error,
        &["XXXXSECRETXXXX", "T0AB1", "B0CD2"],
    );
}
