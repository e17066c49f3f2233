use super::*;

#[test]
fn parses_urls() {
    let s = RedisSink::from_url(
        "redis://:pw@127.0.0.1:6380/2?mode=stream&key=ev:{aggregate_type}&maxlen=1000",
        SinkOptions::default(),
    )
    .unwrap();
    assert_eq!(s.mode, Mode::Stream);
    assert_eq!(s.maxlen, Some(1000));
    assert_eq!(
        s.describe(),
        "redis://127.0.0.1:6380/2 stream ev:{aggregate_type}"
    );
    assert!(!s.describe().contains("pw"));
}

#[test]
fn rejects_bad_parameters() {
    let cases = [
        ("redis://h?mode=queue", "mode: expected list or stream"),
        ("redis://h?colour=red", "\"colour\" is unknown"),
        ("redis://h?key={oops}", "unknown placeholder {oops}"),
        ("redis://h?maxlen=10", "only applies to mode=stream"),
        (
            "redis://h?mode=stream&maxlen=-1",
            "maxlen: expected a positive integer",
        ),
    ];
    for (url, want) in cases {
        let err = match RedisSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

#[test]
fn the_password_is_masked_in_errors() {
    let s = RedisSink::from_url(
        "redis://app:r3dis-pw@127.0.0.1:6380/2?key=orders",
        SinkOptions::default(),
    )
    .unwrap();
    assert_eq!(
        s.secrets()
            .sanitize("WRONGPASS app r3dis-pw for key orders"),
        "WRONGPASS app *** for key orders"
    );
}
