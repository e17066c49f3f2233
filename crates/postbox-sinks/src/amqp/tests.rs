use super::*;

#[test]
fn parses_urls_without_leaking_credentials() {
    let s = AmqpSink::from_url(
        "amqp://app:s%40cret@rabbit:5673/shop?exchange=events&routing_key={aggregate_type}.{event_type}&unroutable=retry&timeout=3s",
        SinkOptions::default(),
    )
    .unwrap();
    assert_eq!(
        s.describe(),
        "amqp://rabbit:5673/shop exchange \"events\" routing_key {aggregate_type}.{event_type} unroutable=retry"
    );
    assert_eq!(s.uri.authority.userinfo.password, "s@cret");
    assert_eq!(s.uri.vhost, "shop");
    assert_eq!(s.unroutable(), Unroutable::Retry);
    assert_eq!(s.timeout, Duration::from_secs(3));
    let d = AmqpSink::from_url("amqp://127.0.0.1?exchange=", SinkOptions::default()).unwrap();
    assert_eq!((d.uri.vhost.as_str(), d.uri.authority.port), ("/", 5672));
    assert_eq!(d.uri.authority.host, "127.0.0.1");
    let v = AmqpSink::from_url("amqps://h/%2f?exchange=x", SinkOptions::default()).unwrap();
    assert_eq!((v.uri.vhost.as_str(), v.uri.authority.port), ("/", 5671));
}

#[test]
fn rejects_bad_parameters() {
    let cases = [
        ("amqp://h", "exchange is required"),
        ("amqp://h?exchange=x&colour=red", "\"colour\" is unknown"),
        (
            "amqp://h?exchange=x&routing_key={nope}",
            "unknown placeholder {nope}",
        ),
        (
            "amqp://h?exchange=x&unroutable=drop",
            "unroutable: expected reject or retry",
        ),
        (
            "amqp://h?exchange=x&timeout=0s",
            "timeout: expected a duration",
        ),
        (
            "amqp://h?exchange=x&heartbeat=-1",
            "heartbeat: expected seconds",
        ),
        ("amqp://u:%ff@h?exchange=x", "password is not valid UTF-8"),
    ];
    for (url, want) in cases {
        let err = match AmqpSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
        assert!(!err.contains("%ff"), "{err}");
    }
}

#[test]
fn the_password_is_masked_in_errors() {
    let s = AmqpSink::from_url(
        "amqp://app:s%40cret-pw@rabbit:5673/shop?exchange=events",
        SinkOptions::default(),
    )
    .unwrap();
    let masked = s
        .secrets()
        .sanitize("ACCESS_REFUSED for app: s@cret-pw / s%40cret-pw; exchange events");
    assert_eq!(masked, "ACCESS_REFUSED for app: *** / ***; exchange events");
}
