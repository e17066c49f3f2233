//! A TCP proxy that lets a test take a broker "down" and bring it back without
//! touching the broker itself, so tests running in parallel against the same
//! broker are not disturbed.
//!
//! Point the client under test at [`Proxy::addr`] instead of the broker:
//!
//! - [`Proxy::stop`]: the broker is gone. New connections are accepted and
//!   reset at once (the client sees a connection reset before any protocol
//!   byte, as from a broker that is shutting down) and every open connection
//!   is reset.
//! - [`Proxy::hang`]: the broker hangs (a network partition). New connections
//!   are accepted and then left silent, open connections are reset; only the
//!   client's own timeouts end its waits.
//! - [`Proxy::restore`]: connections are forwarded to the broker again.
//!
//! The listening port never changes, so the client reconnects to the same
//! address when the broker "returns". Every connection the proxy holds is
//! reset when the proxy is dropped.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

const FORWARD: u8 = 0;
const REFUSE: u8 = 1;
const HANG: u8 = 2;

/// A forwarding TCP proxy on `127.0.0.1:<random port>`.
pub struct Proxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

#[derive(Default)]
struct Shared {
    mode: AtomicU8,
    next_id: AtomicU64,
    accepted: AtomicU64,
    /// Tasks that own a client connection (forwarding or hanging), by id.
    connections: Mutex<HashMap<u64, AbortHandle>>,
}

impl Shared {
    fn reset_all(&self) {
        let handles: Vec<AbortHandle> = match self.connections.lock() {
            Ok(mut map) => map.drain().map(|(_, h)| h).collect(),
            Err(poisoned) => poisoned.into_inner().drain().map(|(_, h)| h).collect(),
        };
        // Aborting a task drops its sockets; they were set to linger 0, so the
        // peer gets a reset rather than an orderly close.
        for h in handles {
            h.abort();
        }
    }

    fn forget(&self, id: u64) {
        if let Ok(mut map) = self.connections.lock() {
            map.remove(&id);
        }
    }
}

impl Proxy {
    /// Start forwarding `127.0.0.1:<random port>` to `target` (e.g. `"127.0.0.1:4222"`).
    ///
    /// Panics if the local port cannot be bound (a test set-up failure).
    pub async fn start(target: &str) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the test proxy on 127.0.0.1");
        let addr = listener.local_addr().expect("the proxy's local address");
        let shared = Arc::new(Shared::default());
        let accept = tokio::spawn(accept_loop(listener, target.to_owned(), shared.clone()));
        Proxy {
            addr,
            shared,
            accept,
        }
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// `127.0.0.1:PORT`, ready to put into a URL.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Take the broker down: refuse (reset) new connections and reset open ones.
    pub fn stop(&self) {
        self.refuse_new();
        self.reset_existing();
    }

    /// Make the broker hang: accept new connections but never answer, and reset open ones.
    pub fn hang(&self) {
        self.shared.mode.store(HANG, Ordering::SeqCst);
        self.reset_existing();
    }

    /// Reset new connections as soon as they are accepted; open ones keep working.
    pub fn refuse_new(&self) {
        self.shared.mode.store(REFUSE, Ordering::SeqCst);
    }

    /// Reset every connection the proxy holds now (forwarding or hanging).
    pub fn reset_existing(&self) {
        self.shared.reset_all();
    }

    /// Forward new connections to the target again. Hanging connections are
    /// reset (they never saw the broker), so their clients reconnect.
    pub fn restore(&self) {
        let was = self.shared.mode.swap(FORWARD, Ordering::SeqCst);
        if was == HANG {
            self.shared.reset_all();
        }
    }

    /// How many connections the proxy holds open now.
    pub fn open_connections(&self) -> usize {
        self.shared.connections.lock().map_or(0, |m| m.len())
    }

    /// How many connections the proxy has accepted since it started.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.reset_all();
    }
}

async fn accept_loop(listener: TcpListener, target: String, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Transient accept errors (e.g. too many open files): try again.
            tokio::task::yield_now().await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        // Every close the proxy makes is a reset, never an orderly FIN.
        let _ = client.set_zero_linger();
        match shared.mode.load(Ordering::SeqCst) {
            REFUSE => drop(client),
            HANG => spawn_tracked(&shared, hold(client)),
            _ => spawn_tracked(&shared, forward(client, target.clone())),
        }
    }
}

fn spawn_tracked<F>(shared: &Arc<Shared>, work: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
    let cleanup = shared.clone();
    // Hold the map lock across the spawn so the task cannot finish (and forget
    // itself) before it is registered.
    let mut map = match shared.connections.lock() {
        Ok(map) => map,
        Err(poisoned) => poisoned.into_inner(),
    };
    let task = tokio::spawn(async move {
        work.await;
        cleanup.forget(id);
    });
    map.insert(id, task.abort_handle());
}

/// Keep a connection open and silent until the task is aborted.
async fn hold(client: TcpStream) {
    let _client = client;
    std::future::pending::<()>().await;
}

async fn forward(mut client: TcpStream, target: String) {
    let Ok(mut upstream) = TcpStream::connect(&target).await else {
        // The real broker is down too: the client sees a reset.
        return;
    };
    let _ = upstream.set_zero_linger();
    let _ = upstream.set_nodelay(true);
    let _ = client.set_nodelay(true);
    let _ = tokio::io::copy_bidirectional(&mut client, &mut upstream).await;
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = s.read(&mut buf).await {
                        if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                            break;
                        }
                    }
                });
            }
        });
        addr
    }

    async fn round_trip(s: &mut TcpStream) -> std::io::Result<()> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        assert_eq!(&buf, b"ping");
        Ok(())
    }

    #[tokio::test]
    async fn forwards_stops_and_restores() {
        let echo = echo_server().await;
        let proxy = Proxy::start(&echo.to_string()).await;

        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut a).await.unwrap();

        proxy.stop();
        assert!(
            round_trip(&mut a).await.is_err(),
            "an open connection survived stop()"
        );
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            round_trip(&mut b).await.is_err(),
            "a new connection was served while stopped"
        );

        proxy.restore();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut c).await.unwrap();
        assert_eq!(proxy.open_connections(), 1);
    }

    #[tokio::test]
    async fn hangs_until_restored() {
        let echo = echo_server().await;
        let proxy = Proxy::start(&echo.to_string()).await;
        proxy.hang();
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        a.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        let read =
            tokio::time::timeout(std::time::Duration::from_millis(200), a.read(&mut buf)).await;
        assert!(read.is_err(), "a hanging proxy answered");
        proxy.restore();
        // The hanging connection is reset on restore; a new one works.
        assert!(round_trip(&mut a).await.is_err());
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut b).await.unwrap();
    }
}
