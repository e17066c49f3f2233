use super::*;

#[test]
fn parses_urls() {
    let s = KafkaSink::from_url(
        "kafka://k1:9092,k2:9092?topic=shop.{aggregate_type}&timeout=5s&rdkafka.compression.type=zstd",
        SinkOptions::default(),
    )
    .unwrap();
    assert_eq!(
        s.describe(),
        "kafka://k1:9092,k2:9092 topic shop.{aggregate_type}"
    );
    assert_eq!(s.config.get("enable.idempotence"), Some("true"));
    assert_eq!(s.config.get("acks"), Some("all"));
    assert_eq!(s.config.get("message.timeout.ms"), Some("5000"));
    assert_eq!(s.config.get("compression.type"), Some("zstd"));
    assert_eq!(s.config.get("bootstrap.servers"), Some("k1:9092,k2:9092"));
}

#[test]
fn rejects_bad_parameters() {
    let cases = [
        ("kafka://k?colour=red", "\"colour\" is unknown"),
        ("kafka://k?topic={nope}", "unknown placeholder {nope}"),
        ("kafka://k?topic=a/{event_type}", "may only contain"),
        ("kafka://k?rdkafka.acks=1", "cannot be overridden"),
        ("kafka://u:p@k", "credentials"),
        ("kafka://?topic=x", "comma-separated list"),
        ("kafka://k?timeout=never", "timeout: expected a duration"),
    ];
    for (url, want) in cases {
        let err = match KafkaSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

#[test]
fn checks_topics() {
    assert!(check_topic("orders.order-created_v1").is_ok());
    assert!(check_topic("has space").is_err());
    assert!(check_topic(&"x".repeat(250)).is_err());
}

#[test]
fn secret_properties_are_masked_in_errors() {
    let s = KafkaSink::from_url(
        "kafka://k:9092?topic=orders&rdkafka.sasl.username=app&rdkafka.sasl.password=hunter2-kafka&rdkafka.ssl.key.password=k%2Bpw",
        SinkOptions::default(),
    )
    .unwrap();
    let masked = s
        .secrets()
        .sanitize("auth failed for app with hunter2-kafka (key k+pw) on topic orders");
    assert_eq!(
        masked,
        "auth failed for app with *** (key ***) on topic orders"
    );
    assert!(!s.describe().contains("hunter2"), "{}", s.describe());
}
