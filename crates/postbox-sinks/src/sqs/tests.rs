use super::*;
use crate::shared::aws::test_message as message;
use crate::shared::aws::{attributes, pack};

#[test]
fn parses_urls() {
    let s = SqsSink::from_url(
        "sqs://orders.fifo?region=eu-west-1&endpoint=http://127.0.0.1:5000&timeout=2s",
        SinkOptions::default(),
    )
    .unwrap();
    assert!(s.is_fifo());
    assert_eq!(
        s.describe(),
        "sqs://orders.fifo region eu-west-1 endpoint http://127.0.0.1:5000 fifo"
    );
    assert_eq!(s.config.timeout(), std::time::Duration::from_secs(2));
    let plain = SqsSink::from_url("sqs://orders", SinkOptions::default()).unwrap();
    assert!(!plain.is_fifo());
    assert_eq!(plain.describe(), "sqs://orders");
}

#[test]
fn rejects_bad_urls_naming_the_part() {
    let cases = [
        ("sqs://", "the queue name is missing"),
        ("sqs://a b", "not a valid queue name"),
        ("sqs://.fifo", "1 to 80 characters"),
        (&format!("sqs://{}", "q".repeat(81)), "1 to 80 characters"),
        (
            "sqs://q?colour=red",
            "\"colour\" is unknown; expected region, endpoint or timeout",
        ),
        ("sqs://q?region=eu west", "parameter region"),
        ("sqs://q?endpoint=ftp://x", "parameter endpoint"),
        ("sqs://q?timeout=soon", "timeout: expected a duration"),
    ];
    for (url, want) in cases {
        let err = match SqsSink::from_url(url, SinkOptions::default()) {
            Ok(_) => panic!("{url} was accepted"),
            Err(e) => e.to_string(),
        };
        assert!(err.contains(want), "{url}: {err}");
    }
}

#[test]
fn attributes_carry_cloudevents_and_trace_context_within_ten() {
    let m = message("o-1");
    let attrs = attributes(&m, "shop");
    assert!(attrs.len() <= 10, "{attrs:?}");
    let get = |name: &str| {
        attrs
            .iter()
            .find(|(n, _, _)| *n == name)
            .map(|(_, t, v)| (*t, v.as_str()))
    };
    let id = m.event_id.hyphenated().to_string();
    assert_eq!(get("ce-id"), Some(("String", id.as_str())));
    assert_eq!(get("ce-source"), Some(("String", "shop")));
    assert_eq!(get("ce-subject"), Some(("String", "o-1")));
    assert_eq!(get("ce-schemaversion"), Some(("Number", "2")));
    assert_eq!(get("traceparent"), Some(("String", "00-abc-def-01")));
    assert_eq!(
        get("postbox-headers"),
        Some(("String", r#"{"x-tenant":"acme"}"#))
    );
}

#[test]
fn entries_refuse_what_sqs_would_never_take() {
    let fifo = SqsSink::from_url("sqs://q.fifo", SinkOptions::default()).unwrap();
    assert!(fifo.entry(&message("o-1"), 1024 * 1024).is_ok());
    let err = fifo
        .entry(&message("has space"), 1024 * 1024)
        .err()
        .unwrap();
    assert!(err.contains("MessageGroupId"), "{err}");
    let standard = SqsSink::from_url("sqs://q", SinkOptions::default()).unwrap();
    assert!(standard.entry(&message("has space"), 1024 * 1024).is_ok());
    let mut control = message("o-1");
    control.event_type = "order.\u{1}".into();
    let err = standard.entry(&control, 1024 * 1024).err().unwrap();
    assert!(err.contains("U+0001"), "{err}");
    let err = standard.entry(&message("o-1"), 100).err().unwrap();
    assert!(
        err.contains("over the queue's MaximumMessageSize of 100"),
        "{err}"
    );
}

#[test]
fn packs_calls_by_count_and_bytes_in_order() {
    let items: Vec<(usize, usize)> = (0..25).map(|i| (i, 10)).collect();
    let calls = pack(&items, 10, 1000);
    assert_eq!(calls.len(), 3);
    assert_eq!(calls[2], (20..25).collect::<Vec<_>>());
    let calls = pack(&[(0, 600), (1, 600), (2, 300), (3, 2000)], 10, 1000);
    assert_eq!(calls, vec![vec![0], vec![1, 2], vec![3]]);
}

#[test]
fn the_environment_secret_is_masked() {
    let s = SqsSink::from_url("sqs://q", SinkOptions::default())
        .unwrap()
        .with_credentials("AKIDEXAMPLE", "wJalrXUtnFEMI-secret");
    assert_eq!(
        s.secrets().sanitize("signature for wJalrXUtnFEMI-secret"),
        "signature for ***"
    );
}
