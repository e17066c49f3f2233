//! Every connection a postbox pool opens over TCP has `TCP_NODELAY` (sqlx
//! 0.9.0 leaves Nagle's algorithm on, which over TLS holds a small request
//! back until the server acknowledges the previous one).

use postbox_store::connect::{self, nodelay};
use std::time::Duration;

#[cfg(target_os = "linux")]
#[tokio::test]
async fn a_pool_s_connections_to_the_server_have_nodelay() {
    // No schema: the test only connects.
    let url = postbox_testkit::database_url();
    let options = connect::options(Some(&url), "postbox-test-nodelay").unwrap();
    let pool = connect::pool(options, 2, Duration::from_secs(10))
        .await
        .unwrap();
    let mut conns = vec![pool.acquire().await.unwrap(), pool.acquire().await.unwrap()];
    for conn in &mut conns {
        // The backend's view of the client port is our socket's local port.
        let port: Option<i32> = sqlx::query_scalar("SELECT inet_client_port()")
            .fetch_one(&mut **conn)
            .await
            .unwrap();
        let port = u16::try_from(port.expect("the test database is reached over TCP")).unwrap();
        let ours = nodelay::connections()
            .into_iter()
            .find(|c| c.local_port == port)
            .expect("the pool's socket among the process's connections");
        assert!(ours.nodelay, "{ours:?}");
    }
    drop(conns);
    pool.close().await;
}
