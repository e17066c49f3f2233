use super::*;

#[test]
fn parses_urls_and_names() {
    let s =
        KinesisSink::from_url("kinesis://clicks.v1?timeout=3s", SinkOptions::default()).unwrap();
    assert_eq!(s.describe(), "kinesis://clicks.v1");
    for (url, want) in [
        ("kinesis://", "the stream name is missing"),
        ("kinesis://a:b", "not a valid stream name"),
        ("kinesis://s?shard=1", "\"shard\" is unknown"),
    ] {
        let err = match KinesisSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

#[test]
fn refuses_records_kinesis_would_never_take() {
    let s = KinesisSink::from_url("kinesis://s", SinkOptions::default()).unwrap();
    let mut m = crate::shared::aws::test_message("o-1");
    assert!(s.record(&m).is_ok());
    m.aggregate_id = "k".repeat(257);
    let err = s.record(&m).err().unwrap();
    assert!(err.contains("partition key has 1 to 256"), "{err}");
    m.aggregate_id = "k".into();
    m.payload = serde_json::value::RawValue::from_string(format!("\"{}\"", "x".repeat(MAX_RECORD)))
        .unwrap();
    let err = s.record(&m).err().unwrap();
    assert!(err.contains("over Kinesis's limit"), "{err}");
}
