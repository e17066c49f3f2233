//! The TCP fault proxy: it sits between clients and a server (PostgreSQL or
//! a broker), forwards connections, and on command takes the server away in
//! the ways networks and servers fail — without touching the server, so runs
//! and tests sharing it are not disturbed.
//!
//! Point the clients at [`FaultProxy::port`] (or [`FaultProxy::host_port`])
//! instead of the server:
//!
//! - [`FaultProxy::reset`]: every open connection is reset (a server restart,
//!   a firewall dropping state); new connections work at once.
//! - [`FaultProxy::refuse_new`]: new connections are reset as soon as they
//!   are accepted (before any protocol byte); open ones keep working.
//! - [`FaultProxy::down`]: both of the above, until [`FaultProxy::restore`]
//!   (the server is gone).
//! - [`FaultProxy::hang`]: open connections are reset; new ones are accepted
//!   and left silent (a partition: only the clients' timeouts end the wait).
//! - [`FaultProxy::stall`]: open connections stay up, but nothing is
//!   forwarded in either direction until [`FaultProxy::restore`] (a stalled
//!   server or a congested link: queries and publishes just take longer).
//!
//! The listening port never changes, so clients reconnect to the same
//! address when the server "returns". A close the proxy makes is a reset,
//! never an orderly FIN; an orderly close by either side is passed on as one.
//! Dropping the proxy resets every connection it holds.
//!
//! `postbox verify` puts one in front of PostgreSQL and one in front of the
//! broker; `postbox_testkit::proxy` wraps it for test suites.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle};

const FORWARD: u8 = 0;
const REFUSE: u8 = 1;
const HANG: u8 = 2;

/// A forwarding TCP proxy on `127.0.0.1:<free port>`.
pub struct FaultProxy {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: JoinHandle<()>,
}

struct Shared {
    target: String,
    mode: AtomicU8,
    /// True while forwarding is stalled.
    stalled: watch::Sender<bool>,
    next_id: AtomicU64,
    accepted: AtomicU64,
    /// Tasks that own a client connection (forwarding or hanging), by id.
    connections: Mutex<HashMap<u64, AbortHandle>>,
}

impl Shared {
    fn connections(&self) -> MutexGuard<'_, HashMap<u64, AbortHandle>> {
        self.connections
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn reset_all(&self) {
        let handles: Vec<AbortHandle> = self.connections().drain().map(|(_, h)| h).collect();
        // Aborting a task drops its sockets; they were set to linger 0, so the
        // peer gets a reset rather than an orderly close.
        for h in handles {
            h.abort();
        }
    }
}

impl FaultProxy {
    /// Listen on `127.0.0.1:<free port>` and forward to `target` (`HOST:PORT`).
    pub async fn start(target: &str) -> std::io::Result<FaultProxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            target: target.to_owned(),
            mode: AtomicU8::new(FORWARD),
            stalled: watch::channel(false).0,
            next_id: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            connections: Mutex::new(HashMap::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(FaultProxy {
            addr,
            shared,
            accept,
        })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// `127.0.0.1:PORT`, ready to put into a URL.
    pub fn host_port(&self) -> String {
        self.addr.to_string()
    }

    /// Reset every connection the proxy holds now (forwarding or hanging).
    pub fn reset(&self) {
        self.shared.reset_all();
    }

    /// Reset new connections as soon as they are accepted; open ones keep working.
    pub fn refuse_new(&self) {
        self.shared.mode.store(REFUSE, Ordering::SeqCst);
    }

    /// The server is gone: refuse (reset) new connections and reset open ones.
    pub fn down(&self) {
        self.refuse_new();
        self.shared.reset_all();
    }

    /// The server hangs: accept new connections but never answer, and reset open ones.
    pub fn hang(&self) {
        self.shared.mode.store(HANG, Ordering::SeqCst);
        self.shared.reset_all();
    }

    /// Keep connections open but forward nothing, either way, until [`FaultProxy::restore`].
    pub fn stall(&self) {
        self.shared.stalled.send_replace(true);
    }

    /// Forward again: unstall, and reset connections held by a hang (they
    /// never reached the server), so their clients reconnect.
    pub fn restore(&self) {
        self.shared.stalled.send_replace(false);
        if self.shared.mode.swap(FORWARD, Ordering::SeqCst) == HANG {
            self.shared.reset_all();
        }
    }

    /// How many connections the proxy holds open now.
    pub fn open_connections(&self) -> usize {
        self.shared.connections().len()
    }

    /// How many connections the proxy has accepted since it started.
    pub fn accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.shared.reset_all();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    loop {
        let Ok((client, _)) = listener.accept().await else {
            // Transient accept errors (e.g. too many open files): try again.
            tokio::time::sleep(Duration::from_millis(10)).await;
            continue;
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        let _ = client.set_zero_linger();
        let _ = client.set_nodelay(true);
        match shared.mode.load(Ordering::SeqCst) {
            REFUSE => drop(client),
            HANG => track(&shared, hold(client)),
            _ => {
                let (target, stalled) = (shared.target.clone(), shared.stalled.subscribe());
                track(&shared, forward(client, target, stalled));
            }
        }
    }
}

fn track<F>(shared: &Arc<Shared>, work: F)
where
    F: std::future::Future<Output = ()> + Send + 'static,
{
    let id = shared.next_id.fetch_add(1, Ordering::SeqCst);
    let cleanup = shared.clone();
    // Hold the map lock across the spawn so the task cannot finish (and forget
    // itself) before it is registered.
    let mut map = shared.connections();
    let task = tokio::spawn(async move {
        work.await;
        cleanup.connections().remove(&id);
    });
    map.insert(id, task.abort_handle());
}

/// Keep a connection open and silent until the task is aborted.
async fn hold(client: TcpStream) {
    let _client = client;
    std::future::pending::<()>().await;
}

async fn forward(client: TcpStream, target: String, stalled: watch::Receiver<bool>) {
    let Ok(upstream) = TcpStream::connect(&target).await else {
        // The real server is down too: the client sees a reset.
        return;
    };
    let _ = upstream.set_zero_linger();
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    // An orderly close of one direction is passed on and the other goes on;
    // an error in either drops both sockets (a reset).
    let _ = tokio::try_join!(pump(cr, uw, stalled.clone()), pump(ur, cw, stalled));
}

/// Copy `from` to `to` until `from` closes (then close `to` in turn), holding
/// everything — bytes and the close — while the proxy is stalled.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) -> std::io::Result<()> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await?;
        while *stalled.borrow_and_update() {
            if stalled.changed().await.is_err() {
                return Err(std::io::ErrorKind::BrokenPipe.into());
            }
        }
        if n == 0 {
            return to.shutdown().await;
        }
        to.write_all(&buf[..n]).await?;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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

    async fn proxy() -> FaultProxy {
        FaultProxy::start(&echo_server().await.to_string())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn resets_stalls_and_restores() {
        let proxy = proxy().await;
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut a).await.unwrap();

        proxy.stall();
        a.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        let waited = tokio::time::timeout(Duration::from_millis(200), a.read_exact(&mut buf)).await;
        assert!(waited.is_err(), "a stalled connection answered");
        proxy.restore();
        a.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping", "the held bytes arrive after the stall");

        proxy.reset();
        assert!(round_trip(&mut a).await.is_err(), "survived a reset");
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut b).await.unwrap();
    }

    #[tokio::test]
    async fn down_refuses_until_restored() {
        let proxy = proxy().await;
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut a).await.unwrap();

        proxy.down();
        assert!(
            round_trip(&mut a).await.is_err(),
            "an open connection survived down()"
        );
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            round_trip(&mut b).await.is_err(),
            "a new connection was served while down"
        );

        proxy.restore();
        let mut c = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut c).await.unwrap();
        assert_eq!(proxy.open_connections(), 1);
        assert_eq!(proxy.accepted(), 3);
    }

    #[tokio::test]
    async fn refuse_new_keeps_open_connections() {
        let proxy = proxy().await;
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut a).await.unwrap();
        proxy.refuse_new();
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        assert!(
            round_trip(&mut b).await.is_err(),
            "a new connection was served"
        );
        round_trip(&mut a).await.unwrap();
    }

    #[tokio::test]
    async fn hangs_until_restored() {
        let proxy = proxy().await;
        proxy.hang();
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        a.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        let read = tokio::time::timeout(Duration::from_millis(200), a.read(&mut buf)).await;
        assert!(read.is_err(), "a hanging proxy answered");
        proxy.restore();
        // The hanging connection is reset on restore; a new one works.
        assert!(round_trip(&mut a).await.is_err());
        let mut b = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut b).await.unwrap();
    }

    #[tokio::test]
    async fn an_orderly_close_is_passed_on() {
        let proxy = proxy().await;
        let mut a = TcpStream::connect(proxy.addr()).await.unwrap();
        round_trip(&mut a).await.unwrap();
        // Half-close: the echo server sees the end, closes in turn, and the
        // client reads an orderly end rather than a reset.
        a.shutdown().await.unwrap();
        let mut rest = Vec::new();
        let read = tokio::time::timeout(Duration::from_secs(5), a.read_to_end(&mut rest)).await;
        assert!(matches!(read, Ok(Ok(0))), "{read:?}");
    }
}
