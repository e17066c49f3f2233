use axum::body::Body;
use axum::extract::State;
use axum::http::{Request, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use postbox::idempotency::axum::{Idempotency, Idempotent, REPLAYED_HEADER};
use postbox::idempotency::{
    self, Begin, Fingerprint, IdempotencyError, IdempotencyKey, StoredResponse,
};
use postbox::statements::trusted;
use postbox::{NewEvent, Outbox};
use postbox_testkit::TestDb;
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Duration;
use tower::ServiceExt;

const DAY: Duration = Duration::from_secs(86_400);

async fn with_orders(db: &TestDb) {
    db.exec("CREATE TABLE {schema}.orders (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, item text NOT NULL)")
        .await;
}

/// The command: one order and its event, behind an idempotency key, in one transaction.
/// Returns the response and whether the command ran (false: replayed).
async fn place_order(
    db: &TestDb,
    key: &str,
    item: &str,
    commit: bool,
) -> Result<(StoredResponse, bool), IdempotencyError> {
    let outbox = Outbox::new(db.schema.clone());
    let key = IdempotencyKey::new("orders", key)?;
    let fingerprint = Fingerprint::of_json(&json!({ "item": item }))?;
    let mut tx = db.pool.begin().await?;
    let pending = match idempotency::begin(&outbox, &mut tx, &key, &fingerprint, DAY).await? {
        Begin::Replay(stored) => return Ok((stored, false)),
        Begin::Execute(p) => p,
    };
    let id: i64 = sqlx::query_scalar(trusted(
        &db.sql("INSERT INTO {schema}.orders (item) VALUES ($1) RETURNING id"),
    ))
    .bind(item)
    .fetch_one(&mut *tx)
    .await?;
    let event = NewEvent::new(
        "order.placed",
        "order",
        id.to_string(),
        &json!({ "id": id }),
    )
    .unwrap();
    postbox::sqlx::enqueue(&outbox, &mut tx, &event)
        .await
        .unwrap();
    let response = StoredResponse::json(201, &json!({ "order_id": id }))?;
    idempotency::complete(&outbox, &mut tx, pending, &response).await?;
    if commit {
        tx.commit().await?;
    } else {
        // The connection dies before COMMIT reaches the server: the server rolls back.
        tx.rollback().await?;
    }
    Ok((response, true))
}

async fn counts(db: &TestDb) -> (i64, i64) {
    (
        db.count("SELECT count(*) FROM {schema}.orders").await,
        db.count("SELECT count(*) FROM {schema}.outbox").await,
    )
}

#[tokio::test]
async fn a_command_retried_after_a_timeout_around_commit_runs_once() {
    let db = TestDb::new().await;
    with_orders(&db).await;

    // The COMMIT landed but its answer was lost: the client only knows it timed out.
    let (first, ran) = place_order(&db, "k-1", "book", true).await.unwrap();
    assert!(ran);
    let (retry, ran) = place_order(&db, "k-1", "book", true).await.unwrap();
    assert!(!ran, "the retry replays the stored response");
    assert_eq!(retry, first);
    assert_eq!(retry.json_body::<Value>().unwrap()["order_id"], 1);
    assert_eq!(counts(&db).await, (1, 1), "one order, one event");

    // The connection died before COMMIT: nothing committed, so the retry executes.
    let (_, ran) = place_order(&db, "k-2", "pen", false).await.unwrap();
    assert!(ran);
    assert_eq!(counts(&db).await, (1, 1));
    let (_, ran) = place_order(&db, "k-2", "pen", true).await.unwrap();
    assert!(ran);
    let (_, ran) = place_order(&db, "k-2", "pen", true).await.unwrap();
    assert!(!ran);
    assert_eq!(counts(&db).await, (2, 2));
    db.drop_schema().await;
}

#[tokio::test]
async fn the_same_key_for_another_request_is_refused_and_expired_keys_are_new() {
    let db = TestDb::new().await;
    with_orders(&db).await;
    place_order(&db, "k", "book", true).await.unwrap();
    let err = place_order(&db, "k", "lamp", true).await.unwrap_err();
    assert!(matches!(err, IdempotencyError::Mismatch), "{err}");
    assert_eq!(counts(&db).await, (1, 1));

    // Another scope is another key space.
    let outbox = Outbox::new(db.schema.clone());
    let mut tx = db.pool.begin().await.unwrap();
    let other = IdempotencyKey::new("refunds", "k").unwrap();
    let fp = Fingerprint::of_parts(&[b"x"]);
    let begun = idempotency::begin(&outbox, &mut tx, &other, &fp, Duration::ZERO)
        .await
        .unwrap();
    let Begin::Execute(p) = begun else {
        panic!("a new scope executes")
    };
    idempotency::complete(&outbox, &mut tx, p, &StoredResponse::json(200, &1).unwrap())
        .await
        .unwrap();
    tx.commit().await.unwrap();

    // That key expired at once: it runs again, even for a different request; then it is purged.
    let mut tx = db.pool.begin().await.unwrap();
    let fp2 = Fingerprint::of_parts(&[b"y"]);
    let begun = idempotency::begin(&outbox, &mut tx, &other, &fp2, Duration::ZERO)
        .await
        .unwrap();
    assert!(matches!(begun, Begin::Execute(_)));
    tx.rollback().await.unwrap();
    let mut conn = db.pool.acquire().await.unwrap();
    assert_eq!(
        idempotency::purge_expired(&outbox, &mut conn, 100)
            .await
            .unwrap(),
        1
    );
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.idempotency_keys")
            .await,
        1
    );
    drop(conn);
    db.drop_schema().await;
}

#[tokio::test]
async fn concurrent_requests_with_one_key_never_both_execute() {
    let db = Arc::new(TestDb::new().await);
    with_orders(&db).await;
    let outbox = Outbox::new(db.schema.clone());
    let key = IdempotencyKey::new("orders", "race").unwrap();
    let fp = Fingerprint::of_json(&json!({"item": "book"})).unwrap();

    // While the first transaction is open, a second request gets InFlight at once.
    let mut first = db.pool.begin().await.unwrap();
    let Begin::Execute(p) = idempotency::begin(&outbox, &mut first, &key, &fp, DAY)
        .await
        .unwrap()
    else {
        panic!("first request executes")
    };
    let err = place_order(&db, "race", "book", true).await.unwrap_err();
    assert!(matches!(err, IdempotencyError::InFlight), "{err}");
    idempotency::complete(
        &outbox,
        &mut first,
        p,
        &StoredResponse::json(201, &"first").unwrap(),
    )
    .await
    .unwrap();
    first.commit().await.unwrap();
    let (replayed, ran) = place_order(&db, "race", "book", true).await.unwrap();
    assert!(!ran);
    assert_eq!(replayed.json_body::<String>().unwrap(), "first");

    // Many at once on a fresh key: exactly one runs; the others are told it is in
    // flight, or replay its response.
    let tasks: Vec<_> = (0..8)
        .map(|_| {
            let db = db.clone();
            tokio::spawn(async move { place_order(&db, "burst", "pen", true).await })
        })
        .collect();
    let mut ran = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok((_, true)) => ran += 1,
            Ok((_, false)) | Err(IdempotencyError::InFlight) => {}
            Err(e) => panic!("unexpected: {e}"),
        }
    }
    assert_eq!(ran, 1);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.orders WHERE item = 'pen'")
            .await,
        1
    );
    assert_eq!(counts(&db).await, (1, 1), "one order and one event in all");
    Arc::try_unwrap(db).ok().unwrap().drop_schema().await;
}

async fn http_order(State(db): axum::extract::State<Arc<TestDb>>, mut req: Idempotent) -> Response {
    let body: Value = serde_json::from_slice(req.body()).unwrap_or(Value::Null);
    let item = body["item"].as_str().unwrap_or("?").to_owned();
    let id: i64 = sqlx::query_scalar(trusted(
        &db.sql("INSERT INTO {schema}.orders (item) VALUES ($1) RETURNING id"),
    ))
    .bind(item)
    .fetch_one(req.tx())
    .await
    .unwrap();
    req.commit_json(StatusCode::CREATED, &json!({ "order_id": id }))
        .await
        .unwrap()
}
#[derive(Clone)]
struct AppState {
    db: Arc<TestDb>,
    idempotency: Idempotency,
}
impl axum::extract::FromRef<AppState> for Idempotency {
    fn from_ref(s: &AppState) -> Self {
        s.idempotency.clone()
    }
}
impl axum::extract::FromRef<AppState> for Arc<TestDb> {
    fn from_ref(s: &AppState) -> Self {
        s.db.clone()
    }
}

fn request(key: Option<&str>, body: &str) -> Request<Body> {
    let mut r = Request::post("/orders?src=test");
    if let Some(k) = key {
        r = r.header("Idempotency-Key", k);
    }
    r.body(Body::from(body.to_owned())).unwrap()
}

async fn text(r: Response) -> String {
    let bytes = axum::body::to_bytes(r.into_body(), 1 << 20).await.unwrap();
    String::from_utf8_lossy(&bytes).into_owned()
}

#[tokio::test]
async fn the_axum_extractor_follows_the_idempotency_key_header() {
    let db = Arc::new(TestDb::new().await);
    with_orders(&db).await;
    let outbox = Outbox::new(db.schema.clone());
    let state = AppState {
        db: db.clone(),
        idempotency: Idempotency::new(db.pool.clone(), outbox.clone(), "orders"),
    };
    let app = Router::new()
        .route("/orders", post(http_order))
        .with_state(state);

    let r = app
        .clone()
        .oneshot(request(None, r#"{"item":"a"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    assert!(text(r).await.contains("requires an Idempotency-Key"));

    let r = app
        .clone()
        .oneshot(request(Some("h-1"), r#"{"item":"a"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert!(r.headers().get(REPLAYED_HEADER).is_none());
    let first = text(r).await;

    let r = app
        .clone()
        .oneshot(request(Some("h-1"), r#"{"item":"a"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    assert_eq!(r.headers()[REPLAYED_HEADER], "true");
    assert_eq!(r.headers()["content-type"], "application/json");
    assert_eq!(text(r).await, first);

    let r = app
        .clone()
        .oneshot(request(Some("h-1"), r#"{"item":"b"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY);

    // The first request with h-2 is still in flight (its transaction is open).
    let mut open = db.pool.begin().await.unwrap();
    let key = IdempotencyKey::new("orders", "h-2").unwrap();
    let fp = Fingerprint::of_parts(&[b"POST", b"/orders?src=test", br#"{"item":"c"}"#]);
    let begun = idempotency::begin(&outbox, &mut open, &key, &fp, DAY)
        .await
        .unwrap();
    assert!(matches!(begun, Begin::Execute(_)));
    let r = app
        .clone()
        .oneshot(request(Some("h-2"), r#"{"item":"c"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CONFLICT);
    open.rollback().await.unwrap();
    let r = app
        .clone()
        .oneshot(request(Some("h-2"), r#"{"item":"c"}"#))
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        StatusCode::CREATED,
        "the first never committed: this one runs"
    );

    assert_eq!(db.count("SELECT count(*) FROM {schema}.orders").await, 2);
    drop(app);
    Arc::try_unwrap(db).ok().unwrap().drop_schema().await;
}

#[derive(serde::Deserialize)]
struct NewOrder {
    item: String,
}

async fn typed_order(
    State(db): axum::extract::State<Arc<TestDb>>,
    mut req: Idempotent<axum::Json<NewOrder>>,
) -> Response {
    let item = req.body().item.clone();
    let id: i64 = sqlx::query_scalar(trusted(
        &db.sql("INSERT INTO {schema}.orders (item) VALUES ($1) RETURNING id"),
    ))
    .bind(item)
    .fetch_one(req.tx())
    .await
    .unwrap();
    req.commit_json(StatusCode::CREATED, &json!({ "order_id": id }))
        .await
        .unwrap()
}

/// `Idempotent<Json<T>>`: the body decodes before the key is taken, with
/// axum's own rejections; a refused body takes no key, so the same key then
/// works for the corrected request; replays work as for raw bodies.
#[tokio::test]
async fn the_typed_axum_extractor_decodes_before_taking_the_key() {
    let db = Arc::new(TestDb::new().await);
    with_orders(&db).await;
    let outbox = Outbox::new(db.schema.clone());
    let state = AppState {
        db: db.clone(),
        idempotency: Idempotency::new(db.pool.clone(), outbox, "orders"),
    };
    let app = Router::new()
        .route("/orders", post(typed_order))
        .with_state(state);

    let r = app
        .clone()
        .oneshot(request(Some("t-1"), r#"{"item": 7}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::UNPROCESSABLE_ENTITY, "wrong shape");
    let r = app
        .clone()
        .oneshot(request(Some("t-1"), "{not json"))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST, "bad syntax");
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.idempotency_keys")
            .await,
        0,
        "a refused body takes no key"
    );

    let r = app
        .clone()
        .oneshot(request(Some("t-1"), r#"{"item":"pen"}"#))
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::CREATED);
    let first = text(r).await;
    let r = app
        .clone()
        .oneshot(request(Some("t-1"), r#"{"item":"pen"}"#))
        .await
        .unwrap();
    assert_eq!(r.headers()[REPLAYED_HEADER], "true");
    assert_eq!(text(r).await, first);
    assert_eq!(
        db.count("SELECT count(*) FROM {schema}.orders WHERE item = 'pen'")
            .await,
        1
    );
    drop(app);
    Arc::try_unwrap(db).ok().unwrap().drop_schema().await;
}
