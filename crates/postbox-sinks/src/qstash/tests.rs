use super::*;
use chrono::TimeZone;

fn credentials() -> QstashCredentials {
    QstashCredentials::new("tok3n-value", "http://127.0.0.1:9/")
}

fn options(qstash: QstashOptions) -> SinkOptions {
    SinkOptions::default().with(qstash)
}

#[test]
fn builds_urls_and_describes_without_secrets() {
    let s = QstashSink::new(
        "qstash:https://user:pw@example.com/hook",
        SinkOptions::default(),
        credentials(),
    )
    .unwrap();
    assert_eq!(
        s.publish_url.as_ref().unwrap().as_str(),
        "http://127.0.0.1:9/v2/publish/https://user:pw@example.com/hook"
    );
    assert_eq!(s.batch_url.as_str(), "http://127.0.0.1:9/v2/batch");
    let d = s.describe();
    assert_eq!(
        d,
        "qstash http://127.0.0.1:9/ → https://example.com:443/hook"
    );
    assert!(!format!("{:?}", credentials()).contains("tok3n"));
    let q = QstashSink::new(
        "qstash:https://example.com/hook?key=1",
        SinkOptions::default(),
        credentials(),
    )
    .unwrap();
    assert!(q.publish_url.is_none(), "a query goes through /v2/batch");
    assert!(!q.describe().contains("key=1"));
}

#[test]
fn option_headers() {
    let o = QstashOptions {
        retries: Some(3),
        delay: Some(Duration::from_millis(1500)),
        callback: Some("https://example.com/cb".into()),
        failure_callback: Some("https://example.com/failed".into()),
        forward_headers: [("X-Tenant".to_owned(), "acme".to_owned())].into(),
        flow_control: Some(FlowControl {
            key: "orders".into(),
            parallelism: Some(2),
            rate: Some(10),
            period: Some(Duration::from_secs(60)),
        }),
        timeout: Some(Duration::from_secs(30)),
        request_timeout: Duration::from_secs(5),
    };
    let h: BTreeMap<String, String> = o.headers().unwrap().into_iter().collect();
    let want: BTreeMap<String, String> = [
        ("Upstash-Retries", "3"),
        ("Upstash-Delay", "2s"),
        ("Upstash-Callback", "https://example.com/cb"),
        ("Upstash-Failure-Callback", "https://example.com/failed"),
        ("Upstash-Timeout", "30s"),
        ("Upstash-Flow-Control-Key", "orders"),
        (
            "Upstash-Flow-Control-Value",
            "parallelism=2, rate=10, period=60s",
        ),
        ("Upstash-Forward-X-Tenant", "acme"),
    ]
    .into_iter()
    .map(|(a, b)| (a.to_owned(), b.to_owned()))
    .collect();
    assert_eq!(h, want);
}

#[test]
fn validates_options_naming_the_field() {
    let flow = |parallelism, rate, period| FlowControl {
        key: "k".into(),
        parallelism,
        rate,
        period,
    };
    let cases: Vec<(QstashOptions, &str)> = vec![
        (
            QstashOptions {
                retries: Some(1000),
                ..Default::default()
            },
            "qstash.retries: must be at most 100",
        ),
        (
            QstashOptions {
                callback: Some("ftp://x".into()),
                ..Default::default()
            },
            "qstash.callback",
        ),
        (
            QstashOptions {
                flow_control: Some(flow(None, None, None)),
                ..Default::default()
            },
            "qstash.flow_control: set parallelism, rate or both",
        ),
        (
            QstashOptions {
                flow_control: Some(flow(Some(1), None, Some(Duration::from_secs(5)))),
                ..Default::default()
            },
            "qstash.flow_control.period: only applies together with rate",
        ),
        (
            QstashOptions {
                forward_headers: [("Upstash-Signature".to_owned(), "x".to_owned())].into(),
                ..Default::default()
            },
            "qstash.forward_headers: \"Upstash-Signature\" cannot be forwarded",
        ),
        (
            QstashOptions {
                timeout: Some(Duration::from_millis(10)),
                ..Default::default()
            },
            "qstash.timeout: must be at least 1s",
        ),
    ];
    for (o, want) in cases {
        let err = o.validate().unwrap_err().to_string();
        assert!(err.contains(want), "{err} (wanted {want})");
    }
    let o: QstashOptions = serde_json::from_value(serde_json::json!({
        "retries": 2, "delay": "10s", "flow_control": {"key": "k", "rate": 5, "period": "1m"}
    }))
    .unwrap();
    assert!(o.validate().is_ok());
    assert!(serde_json::from_value::<QstashOptions>(serde_json::json!({"retry": 2})).is_err());
}

#[test]
fn token_errors_never_show_the_token() {
    for token in ["", "  ", "bad\ntoken-value"] {
        let err = QstashSink::new(
            "qstash:https://example.com/hook",
            options(QstashOptions::default()),
            QstashCredentials::new(token, DEFAULT_URL),
        )
        .err()
        .unwrap()
        .to_string();
        assert!(err.contains("QSTASH_TOKEN"), "{err}");
        assert!(!err.contains("token-value"), "{err}");
    }
    let err = QstashSink::new(
        "https://example.com/hook",
        SinkOptions::default(),
        credentials(),
    )
    .err()
    .unwrap()
    .to_string();
    assert!(err.contains("qstash:DESTINATION_URL"), "{err}");
}

#[test]
fn reads_rate_limit_resets() {
    let now = Utc.with_ymd_and_hms(2026, 1, 2, 3, 4, 5).unwrap();
    let ts = now.timestamp();
    let secs = |s| Some(Duration::from_secs(s));
    assert_eq!(parse_reset(&(ts + 3).to_string(), now), secs(3));
    assert_eq!(parse_reset(&((ts + 2) * 1000).to_string(), now), secs(2));
    assert_eq!(parse_reset(&(ts - 100).to_string(), now), secs(0));
    assert_eq!(parse_reset("5", now), secs(5));
    assert_eq!(parse_reset("1e300", now), Some(MAX_RETRY_AFTER));
    assert_eq!(parse_reset("99999999", now), Some(MAX_RETRY_AFTER));
    for garbage in ["", "-1", "NaN", "inf", "soon"] {
        assert_eq!(parse_reset(garbage, now), None, "{garbage:?}");
    }
    let mut headers = HeaderMap::new();
    headers.insert("Retry-After", HeaderValue::from_static("7"));
    assert_eq!(rate_limit_reset(&headers, now), secs(7));
    headers.insert("RateLimit-Reset", HeaderValue::from(ts + 9));
    assert_eq!(rate_limit_reset(&headers, now), secs(9));
    headers.insert("Burst-RateLimit-Reset", HeaderValue::from(ts + 1));
    assert_eq!(rate_limit_reset(&headers, now), secs(1));
}

#[test]
fn batch_answers_map_to_outcomes() {
    let body =
        br#"[{"messageId":"a"},{"messageId":"b","deduplicated":true},{"error":"bad token=x"}]"#;
    let outcomes = batch_outcomes(body, 3);
    assert_eq!(outcomes[0], Outcome::Delivered);
    assert_eq!(outcomes[1], Outcome::Delivered);
    match &outcomes[2] {
        Outcome::Retry { error, .. } => {
            assert!(error.starts_with("QStash: bad"), "{error}");
            assert!(!error.contains("token=x"), "{error}");
        }
        other => panic!("{other:?}"),
    }
    assert!(batch_outcomes(body, 2)
        .iter()
        .all(|o| matches!(o, Outcome::Retry { error, .. } if error.contains("3 entries for 2"))));
    assert!(batch_outcomes(b"{}", 1)
        .iter()
        .all(|o| matches!(o, Outcome::Retry { .. })));
}
