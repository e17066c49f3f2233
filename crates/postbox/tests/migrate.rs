use postbox::{Error, Schema, MIGRATIONS};
use postbox_testkit::TestDb;

#[tokio::test]
async fn a_second_run_changes_nothing() {
    let db = TestDb::empty().await;
    let mut conn = db.pool.acquire().await.unwrap();
    let first = postbox::sqlx::migrate(&mut conn, &db.schema).await.unwrap();
    assert_eq!(
        first,
        MIGRATIONS.iter().map(|m| m.version).collect::<Vec<_>>()
    );
    let objects = "SELECT count(*) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace \
                   WHERE n.nspname = '{name}'";
    let before = db.count(&objects.replace("{name}", db.schema.name())).await;
    let second = postbox::sqlx::migrate(&mut conn, &db.schema).await.unwrap();
    assert!(second.is_empty(), "second run applied {second:?}");
    assert_eq!(
        db.count(&objects.replace("{name}", db.schema.name())).await,
        before
    );
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn concurrent_runs_apply_each_migration_once() {
    let db = TestDb::empty().await;
    let runs = (0..6).map(|_| {
        let pool = db.pool.clone();
        let schema = db.schema.clone();
        tokio::spawn(async move {
            let mut conn = pool.acquire().await.unwrap();
            postbox::sqlx::migrate(&mut conn, &schema).await
        })
    });
    let mut applied = Vec::new();
    for r in futures::future::join_all(runs).await {
        applied.extend(r.unwrap().expect("every concurrent run succeeds"));
    }
    applied.sort();
    assert_eq!(
        applied,
        MIGRATIONS.iter().map(|m| m.version).collect::<Vec<_>>()
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.schema_migrations")
            .await,
        MIGRATIONS.len() as i64
    );
    db.drop_schema().await;
}

#[tokio::test]
async fn an_edited_migration_is_refused() {
    let db = TestDb::new().await;
    db.exec("UPDATE {schema}.schema_migrations SET checksum = 'edited' WHERE version = 1")
        .await;
    let mut conn = db.pool.acquire().await.unwrap();
    let err = postbox::sqlx::migrate(&mut conn, &db.schema)
        .await
        .unwrap_err();
    assert!(
        matches!(err, Error::MigrationChanged { version: 1, .. }),
        "{err}"
    );
    assert!(err.to_string().contains("never be edited"), "{err}");
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn a_newer_schema_is_refused() {
    let db = TestDb::new().await;
    db.exec("INSERT INTO {schema}.schema_migrations (version, name, checksum) VALUES (9999, 'future', 'x')")
        .await;
    let mut conn = db.pool.acquire().await.unwrap();
    let err = postbox::sqlx::migrate(&mut conn, &db.schema)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("upgrade postbox"), "{err}");
    drop(conn);
    db.drop_schema().await;
}

#[test]
fn schema_names_are_validated() {
    assert!(Schema::new("bad name").is_err());
    assert!(postbox::Outbox::with_schema("x; DROP TABLE y").is_err());
}
