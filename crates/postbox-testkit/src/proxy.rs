//! A TCP proxy that lets a test take a broker "down" and bring it back without
//! touching the broker itself, so tests running in parallel against the same
//! broker are not disturbed.
//!
//! This is `postbox verify`'s fault proxy ([`postbox_proxy::FaultProxy`],
//! whose documentation lists every fault), started the way tests want it.
//! Point the client under test at [`FaultProxy::addr`] instead of the broker:
//!
//! - [`Proxy::stop`]: the broker is gone. New connections are accepted and
//!   reset at once (the client sees a connection reset before any protocol
//!   byte, as from a broker that is shutting down) and every open connection
//!   is reset.
//! - [`FaultProxy::hang`]: the broker hangs (a network partition). New
//!   connections are accepted and then left silent, open connections are
//!   reset; only the client's own timeouts end its waits.
//! - [`FaultProxy::restore`]: connections are forwarded to the broker again.
//!
//! The listening port never changes, so the client reconnects to the same
//! address when the broker "returns". Every connection the proxy holds is
//! reset when the proxy is dropped.

pub use postbox_proxy::FaultProxy;

/// A [`FaultProxy`] on `127.0.0.1:<random port>`; every [`FaultProxy`]
/// method works on it.
pub struct Proxy(FaultProxy);

impl Proxy {
    /// Start forwarding `127.0.0.1:<random port>` to `target` (e.g. `"127.0.0.1:4222"`).
    ///
    /// Panics if the local port cannot be bound (a test set-up failure).
    pub async fn start(target: &str) -> Proxy {
        Proxy(
            FaultProxy::start(target)
                .await
                .expect("bind the test proxy on 127.0.0.1"),
        )
    }

    /// Take the broker down: refuse (reset) new connections and reset open ones.
    pub fn stop(&self) {
        self.0.down();
    }
}

impl std::ops::Deref for Proxy {
    type Target = FaultProxy;

    fn deref(&self) -> &FaultProxy {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    #[tokio::test]
    async fn stops_and_restores_through_the_harness_proxy() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let target = listener.local_addr().unwrap().to_string();
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
        let proxy = Proxy::start(&target).await;
        let ping = |addr: String| async move {
            let mut s = TcpStream::connect(addr).await?;
            s.write_all(b"ping").await?;
            let mut buf = [0u8; 4];
            s.read_exact(&mut buf).await?;
            std::io::Result::Ok(buf)
        };
        assert_eq!(&ping(proxy.host_port()).await.unwrap(), b"ping");
        proxy.stop();
        assert!(
            ping(proxy.host_port()).await.is_err(),
            "served while stopped"
        );
        proxy.restore();
        assert_eq!(&ping(proxy.host_port()).await.unwrap(), b"ping");
    }
}
