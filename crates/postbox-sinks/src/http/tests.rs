use super::*;

fn options(http: HttpOptions) -> SinkOptions {
    SinkOptions::default().with(http)
}

#[test]
fn describes_without_credentials() {
    let s = HttpSink::new(
        "https://hook:s3cret@example.com:8443/in?token=abc#frag",
        SinkOptions::default(),
        Vec::new(),
    )
    .unwrap();
    let d = s.describe();
    assert_eq!(
        d,
        "http POST https://example.com:8443/in?… structured basic-auth concurrency 16"
    );
    assert!(s.url.username().is_empty() && s.url.password().is_none());
    assert_eq!(s.url.query(), Some("token=abc"));
    let secrets = parse_secrets("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "test").unwrap();
    let s = HttpSink::new(
        "http://127.0.0.1/",
        options(HttpOptions {
            mode: HttpMode::Binary,
            rate_per_second: Some(5.0),
            ..HttpOptions::default()
        }),
        secrets,
    )
    .unwrap();
    assert_eq!(
        s.describe(),
        "http POST http://127.0.0.1:80/ binary signed(1) concurrency 16 rate 5/s"
    );
}

#[test]
fn validates_options_naming_the_field() {
    let cases: Vec<(HttpOptions, &str)> = vec![
        (
            HttpOptions {
                concurrency: 0,
                ..Default::default()
            },
            "http.concurrency: must be between 1 and 1024, got 0",
        ),
        (
            HttpOptions {
                method: "GET".into(),
                ..Default::default()
            },
            "http.method: must be POST, PUT or PATCH",
        ),
        (
            HttpOptions {
                timeout: Duration::ZERO,
                ..Default::default()
            },
            "http.timeout: must be between 1ms and 1h",
        ),
        (
            HttpOptions {
                rate_per_second: Some(f64::NAN),
                ..Default::default()
            },
            "http.rate_per_second: must be between",
        ),
        (
            HttpOptions {
                headers: [("Content-Type".to_owned(), "text/plain".to_owned())].into(),
                ..Default::default()
            },
            "http.headers: \"Content-Type\" is set by the sink",
        ),
        (
            HttpOptions {
                headers: [("bad name".to_owned(), "x".to_owned())].into(),
                ..Default::default()
            },
            "http.headers: \"bad name\" is not a valid header name",
        ),
        (
            HttpOptions {
                headers: [("Authorization".to_owned(), "Bearer a\nb".to_owned())].into(),
                ..Default::default()
            },
            "http.headers: the value of \"Authorization\" is not a valid header value",
        ),
        (
            HttpOptions {
                secret_env: Some(String::new()),
                ..Default::default()
            },
            "http.secret_env:",
        ),
    ];
    for (o, want) in cases {
        let err = o.validate().unwrap_err().to_string();
        assert!(err.contains(want), "{err} (wanted {want})");
        assert!(!err.contains("Bearer a"), "{err}");
    }
    assert!(HttpOptions::default().validate().is_ok());
}

#[test]
fn options_deserialize_with_defaults_and_deny_unknown_fields() {
    let o: HttpOptions =
        serde_json::from_value(serde_json::json!({"mode": "binary", "timeout": "2s"})).unwrap();
    assert_eq!(o.mode, HttpMode::Binary);
    assert_eq!(o.timeout, Duration::from_secs(2));
    assert_eq!(o.concurrency, 16);
    assert_eq!(o.method, "POST");
    let err = serde_json::from_value::<HttpOptions>(serde_json::json!({"colour": 1}))
        .unwrap_err()
        .to_string();
    assert!(err.contains("unknown field `colour`"), "{err}");
    let debug = format!(
        "{:?}",
        HttpOptions {
            headers: [("Authorization".to_owned(), "Bearer hunter2".to_owned())].into(),
            ..Default::default()
        }
    );
    assert!(!debug.contains("hunter2"), "{debug}");
}

#[test]
fn rejects_bad_urls_and_secrets_without_echoing_them() {
    for (url, want) in [
        ("ftp://h/x", "scheme must be http or https"),
        ("http://", "not a valid"),
        ("not a url", "not a valid"),
    ] {
        let err = HttpSink::new(url, SinkOptions::default(), Vec::new())
            .err()
            .unwrap()
            .to_string();
        assert!(err.contains(want), "{url}: {err}");
    }
    let err = parse_secrets(
        "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw, whsec_!!notbase64",
        "X",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("X: secret number 2"), "{err}");
    assert!(!err.contains("notbase64"), "{err}");
    assert_eq!(
        parse_secrets(
            " whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw,whsec_AAECAwQFBgcICQoLDA0ODxAREhMUFRYX ",
            "X"
        )
        .unwrap()
        .len(),
        2
    );
    assert!(parse_secrets(" , ", "X")
        .unwrap_err()
        .to_string()
        .contains("holds no secret"));
}

#[test]
fn producer_headers_are_filtered() {
    assert!(producer_header("x-tenant", "acme").is_some());
    assert!(producer_header("Content-Type", "text/plain").is_none());
    assert!(producer_header("ce-id", "x").is_none());
    assert!(producer_header("webhook-id", "x").is_none());
    assert!(producer_header("bad name", "x").is_none());
    assert!(producer_header("x-a", "line\nbreak").is_none());
    assert!(producer_header("x-a", "café").is_none());
    assert!(producer_header("", "x").is_none());
}
