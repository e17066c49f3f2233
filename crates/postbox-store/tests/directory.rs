//! The outbox directory against the real server: a listed outbox that a
//! pattern also matches is found once, with what its listing keeps (the
//! relay: the outbox's own routes); one missing from its database is said
//! to be missing; a schema no pattern matches is not found.

use postbox_store::directory::{self, NamePattern, Presence, Schemas, Source};
use postbox_testkit::TestDb;
use sqlx::postgres::PgConnectOptions;
use std::str::FromStr;

#[tokio::test]
async fn a_listed_outbox_keeps_its_own_settings_when_a_pattern_matches_it_too() {
    let db = TestDb::new().await;
    let connect = PgConnectOptions::from_str(&db.url).unwrap();
    let name = db.schema.name().to_owned();
    let sources = vec![
        // The pattern first, as the CLI orders `--schemas` before `[[outboxes]]`.
        Source::Discover {
            connect: connect.clone(),
            databases: None,
            schemas: NamePattern::parse(&name).unwrap(),
        },
        Source::Outbox {
            connect: connect.clone(),
            schema: db.schema.clone(),
            with: "own routes",
        },
        Source::Outbox {
            connect: connect.clone(),
            schema: postbox::Schema::new("t_not_there_at_all").unwrap(),
            with: "none",
        },
    ];
    let mut pool = |_: &str, _: &PgConnectOptions| db.pool.clone();
    let listing = directory::list(&sources, Schemas::Migrated, &mut pool).await;
    assert!(listing.unlisted.is_empty(), "{:?}", listing.unlisted);
    let ours: Vec<_> = listing
        .found
        .iter()
        .filter(|f| f.schema.name() == name)
        .collect();
    assert_eq!(ours.len(), 1, "found once");
    assert_eq!(ours[0].with, Some(&"own routes"));
    assert_eq!(ours[0].presence, Presence::Present);
    assert_eq!(ours[0].source, 1);
    let missing = listing
        .found
        .iter()
        .find(|f| f.schema.name() == "t_not_there_at_all")
        .expect("a listed outbox is reported even when missing");
    assert_eq!(missing.presence, Presence::Missing);
    assert_eq!(listing.found.len(), 2, "nothing else matches the pattern");
    db.drop_schema().await;
}
