//! The fault proxy between `postbox verify`'s processes and a server
//! (PostgreSQL or the broker): it forwards TCP connections and, on command,
//! takes the server away in the ways networks and servers fail.
//!
//! - [`FaultProxy::reset`]: every open connection is reset (a server restart,
//!   a firewall dropping state); new connections work at once.
//! - [`FaultProxy::down`]: open connections are reset and new ones are reset
//!   as soon as they are accepted, until [`FaultProxy::restore`].
//! - [`FaultProxy::hang`]: open connections are reset; new ones are accepted
//!   and left silent (a partition: only the clients' timeouts end the wait).
//! - [`FaultProxy::stall`]: open connections stay up, but nothing is
//!   forwarded in either direction until [`FaultProxy::restore`] (a stalled
//!   server or a congested link: queries and publishes just take longer).
//!
//! Every close the proxy makes is a reset, never an orderly FIN.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{AbortHandle, JoinHandle};

const FORWARD: u8 = 0;
const DOWN: u8 = 1;
const HANG: u8 = 2;

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
    connections: Mutex<HashMap<u64, AbortHandle>>,
}

impl Shared {
    fn reset_all(&self) {
        let handles: Vec<AbortHandle> = match self.connections.lock() {
            Ok(mut map) => map.drain().map(|(_, h)| h).collect(),
            Err(poisoned) => poisoned.into_inner().drain().map(|(_, h)| h).collect(),
        };
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
            connections: Mutex::new(HashMap::new()),
        });
        let accept = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(FaultProxy {
            addr,
            shared,
            accept,
        })
    }

    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    pub fn reset(&self) {
        self.shared.reset_all();
    }

    pub fn down(&self) {
        self.shared.mode.store(DOWN, Ordering::SeqCst);
        self.shared.reset_all();
    }

    pub fn hang(&self) {
        self.shared.mode.store(HANG, Ordering::SeqCst);
        self.shared.reset_all();
    }

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
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            continue;
        };
        let _ = client.set_zero_linger();
        let _ = client.set_nodelay(true);
        match shared.mode.load(Ordering::SeqCst) {
            DOWN => drop(client),
            HANG => track(&shared, async move {
                let _held = client;
                std::future::pending::<()>().await;
            }),
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
    let mut map = match shared.connections.lock() {
        Ok(map) => map,
        Err(poisoned) => poisoned.into_inner(),
    };
    let task = tokio::spawn(async move {
        work.await;
        if let Ok(mut map) = cleanup.connections.lock() {
            map.remove(&id);
        }
    });
    map.insert(id, task.abort_handle());
}

async fn forward(client: TcpStream, target: String, stalled: watch::Receiver<bool>) {
    let Ok(upstream) = TcpStream::connect(&target).await else {
        return;
    };
    let _ = upstream.set_zero_linger();
    let _ = upstream.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (ur, uw) = upstream.into_split();
    // When either direction ends, both sockets are dropped (reset).
    tokio::select! {
        _ = pump(cr, uw, stalled.clone()) => {}
        _ = pump(ur, cw, stalled) => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    mut stalled: watch::Receiver<bool>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        // Hold what was read while stalled.
        while *stalled.borrow_and_update() {
            if stalled.changed().await.is_err() {
                return;
            }
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    async fn echo() -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut buf = [0u8; 64];
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

    async fn ping(s: &mut TcpStream) -> std::io::Result<()> {
        s.write_all(b"ping").await?;
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await?;
        Ok(())
    }

    #[tokio::test]
    async fn resets_stalls_and_restores() {
        let proxy = FaultProxy::start(&echo().await.to_string()).await.unwrap();
        let addr = format!("127.0.0.1:{}", proxy.port());
        let mut a = TcpStream::connect(&addr).await.unwrap();
        ping(&mut a).await.unwrap();

        proxy.stall();
        a.write_all(b"ping").await.unwrap();
        let mut buf = [0u8; 4];
        let waited = tokio::time::timeout(Duration::from_millis(200), a.read_exact(&mut buf)).await;
        assert!(waited.is_err(), "a stalled connection answered");
        proxy.restore();
        a.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping", "the held bytes arrive after the stall");

        proxy.reset();
        assert!(ping(&mut a).await.is_err(), "survived a reset");
        let mut b = TcpStream::connect(&addr).await.unwrap();
        ping(&mut b).await.unwrap();

        proxy.down();
        let mut c = TcpStream::connect(&addr).await.unwrap();
        assert!(ping(&mut c).await.is_err(), "served while down");
        proxy.restore();
        let mut d = TcpStream::connect(&addr).await.unwrap();
        ping(&mut d).await.unwrap();
    }
}
