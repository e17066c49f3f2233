use super::*;

#[test]
fn parses_urls_and_names() {
    let s =
        SnsSink::from_url("sns://events.fifo?region=us-east-1", SinkOptions::default()).unwrap();
    assert!(s.fifo);
    assert_eq!(s.describe(), "sns://events.fifo region us-east-1 fifo");
    for (url, want) in [
        ("sns://", "the topic name is missing"),
        ("sns://a.b", "not a valid topic name"),
        ("sns://t?queue=x", "\"queue\" is unknown"),
        ("sqs://t", "expected sns://TOPIC"),
    ] {
        let err = match SnsSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

#[test]
fn refuses_messages_over_the_limit() {
    let s = SnsSink::from_url("sns://t", SinkOptions::default()).unwrap();
    let mut m = crate::shared::aws::test_message("o-1");
    assert!(s.entry(&m).is_ok());
    m.payload =
        serde_json::value::RawValue::from_string(format!("\"{}\"", "x".repeat(MAX_MESSAGE)))
            .unwrap();
    let err = s.entry(&m).err().unwrap();
    assert!(err.contains("over SNS's limit"), "{err}");
}
