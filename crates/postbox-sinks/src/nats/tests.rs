use super::config::capture_subject;
use super::*;

#[test]
fn parses_urls_without_leaking_credentials() {
    let s = NatsSink::from_url(
        "nats://app:s3cret@127.0.0.1:4223?subject=shop.{aggregate_type}.{event_type}&stream=SHOP&timeout=2s",
        SinkOptions::default(),
    )
    .unwrap();
    assert_eq!(
        s.describe(),
        "nats://127.0.0.1:4223 subject shop.{aggregate_type}.{event_type} stream SHOP"
    );
    assert_eq!(s.capture_subject(), "shop.>");
    assert_eq!(s.timeout, Duration::from_secs(2));
    assert!(matches!(&s.auth, Auth::UserPassword(u, p) if u == "app" && p == "s3cret"));
    let t = NatsSink::from_url("nats://tok%40en@h", SinkOptions::default()).unwrap();
    assert!(matches!(&t.auth, Auth::Token(tok) if tok == "tok@en"));
    assert_eq!(t.describe(), "nats://h:4222 subject postbox.{event_type}");
}

#[test]
fn capture_covers_multi_token_placeholders() {
    assert_eq!(capture_subject("events.{event_type}"), "events.>");
    assert_eq!(capture_subject("a.b.{aggregate_id}.c"), "a.b.>");
    assert_eq!(capture_subject("a.b{event_type}"), "a.>");
    assert_eq!(capture_subject("{event_type}"), ">");
    assert_eq!(capture_subject("fixed.subject"), "fixed.subject");
}

#[test]
fn rejects_bad_parameters() {
    let cases = [
        ("nats://h?colour=red", "\"colour\" is unknown"),
        ("nats://h?subject={oops}", "unknown placeholder {oops}"),
        ("nats://h?subject=a..{event_type}", "empty token"),
        ("nats://h?subject=a.*.{event_type}", "wildcard"),
        (
            "nats://h?subject={event_type}&stream=S",
            "must start with a literal token",
        ),
        ("nats://h?stream=a.b", "not a valid stream name"),
        ("nats://h?timeout=soon", "timeout: expected a duration"),
        ("nats://h?tls=maybe", "tls: expected true or false"),
        ("nats://h/path", "has no path"),
        ("nats://:4222", "empty host"),
    ];
    for (url, want) in cases {
        let err = match NatsSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

#[test]
fn checks_rendered_subjects() {
    assert!(check_subject("orders.order.created").is_ok());
    assert!(check_subject("orders.a b").is_err());
    assert!(check_subject("orders.>").is_err());
    assert!(check_subject("orders.").is_err());
    assert!(check_subject(&format!("orders.{}", "x".repeat(1100))).is_err());
}

#[test]
fn tokens_and_passwords_are_masked_in_errors() {
    let token =
        NatsSink::from_url("nats://t0ken-abc@127.0.0.1:4222", SinkOptions::default()).unwrap();
    assert_eq!(
        token
            .secrets()
            .sanitize("authorization violation: t0ken-abc"),
        "authorization violation: ***"
    );
    let pair = NatsSink::from_url(
        "nats://app:n%20ats-pw@127.0.0.1:4222",
        SinkOptions::default(),
    )
    .unwrap();
    assert_eq!(
        pair.secrets()
            .sanitize("user app password n ats-pw refused"),
        "user app password *** refused"
    );
}
