//! Every connection a postbox pool opens over TCP has `TCP_NODELAY`: sqlx
//! 0.9.0 left Nagle's algorithm on, which over TLS (the default
//! `sslmode=prefer`) held a small request back until the server
//! acknowledged the previous one, and put claim mode's p99 at 50–80 ms.
//! sqlx sets it from 0.9.1; this test keeps it that way.

// The test borrows its own sockets' descriptors to read their options.
#![allow(unsafe_code)]

use postbox_store::connect;
use std::time::Duration;

/// Whether the process's TCP socket whose local port is `port` has
/// `TCP_NODELAY` (`None`: no such socket).
#[cfg(target_os = "linux")]
fn nodelay_of_local_port(port: u16) -> Option<bool> {
    use std::os::unix::ffi::OsStrExt;
    std::fs::read_dir("/proc/self/fd")
        .ok()?
        .flatten()
        .filter_map(|entry| {
            let fd: std::os::fd::RawFd = entry.file_name().to_str()?.parse().ok()?;
            let target = std::fs::read_link(entry.path()).ok()?;
            if !target.as_os_str().as_bytes().starts_with(b"socket:") {
                return None;
            }
            // SAFETY: borrowed for these reads only, never closed here; the
            // pool's connections stay open while the test looks.
            let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
            let socket = socket2::SockRef::from(&fd);
            let local = socket.local_addr().ok()?.as_socket()?.port();
            (local == port).then(|| socket.tcp_nodelay().ok()).flatten()
        })
        .next()
}

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
        let nodelay =
            nodelay_of_local_port(port).expect("the pool's socket among the process's sockets");
        assert!(nodelay, "the connection from port {port} has Nagle on");
    }
    drop(conns);
    pool.close().await;
}
