//! Serving an axum [`Router`] on a port the outside world can reach, with the
//! bounds such a port needs (feature `axum`). `axum::serve` has none of them:
//! a client that opens a socket and sends nothing, or one header byte a
//! second, holds a connection and a task for as long as it likes.
//!
//! [`serve`] closes a connection whose request head (also the next request's,
//! on a kept-alive connection) does not arrive within
//! [`Limits::header_read_timeout`], answers `408` to a request whose body and
//! answer take longer than [`Limits::request_timeout`], and accepts no more
//! than [`Limits::max_connections`] at once (the rest wait in the listen
//! queue). Every socket gets `TCP_NODELAY`, and every request a
//! `ConnectInfo<SocketAddr>` extension naming its peer. HTTP/1.1 only.
//!
//! ```no_run
//! # async fn example(app: axum::Router) -> std::io::Result<()> {
//! let listener = tokio::net::TcpListener::bind("127.0.0.1:8080").await?;
//! postbox::serve::serve(listener, app, postbox::serve::Limits::default(), async {
//!     let _ = tokio::signal::ctrl_c().await;
//! })
//! .await
//! # }
//! ```

use axum::extract::ConnectInfo;
use axum::http::{header, HeaderValue, Request, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Router;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use std::future::Future;
use std::pin::pin;
use std::sync::Arc;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;
use tower::Service;

/// The bounds [`serve`] keeps. The defaults suit an endpoint on the internet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// A request's head must arrive whole within this time, counted from when
    /// the connection is ready for it (so also an idle kept-alive connection):
    /// otherwise the connection is closed. Default 10 s.
    pub header_read_timeout: Duration,
    /// Reading a request's body and answering it must be done within this
    /// time, else the answer is `408 Request Timeout`. `None`: no bound (a
    /// route that streams for long). Default 30 s.
    pub request_timeout: Option<Duration>,
    /// Connections served at once; more wait in the listen queue until one
    /// closes. Default 1,024.
    pub max_connections: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_read_timeout: Duration::from_secs(10),
            request_timeout: Some(Duration::from_secs(30)),
            max_connections: 1024,
        }
    }
}

/// How long open connections get to finish their requests once `shutdown`
/// resolves, beyond the request timeout.
const DRAIN_GRACE: Duration = Duration::from_secs(5);

/// Serve `app` on `listener` within `limits` until `shutdown` resolves, then
/// stop accepting, let each open connection finish the request it is on, and
/// return. Errors only when accepting fails for a reason other than a
/// connection's own (which is skipped) or too many open files (waited out).
pub async fn serve<F>(
    listener: TcpListener,
    app: Router,
    limits: Limits,
    shutdown: F,
) -> std::io::Result<()>
where
    F: Future<Output = ()> + Send,
{
    let app = match limits.request_timeout {
        Some(bound) => app.layer(axum::middleware::from_fn(
            move |request: Request<axum::body::Body>, next: axum::middleware::Next| async move {
                match tokio::time::timeout(bound, next.run(request)).await {
                    Ok(response) => response,
                    Err(_) => timed_out(),
                }
            },
        )),
        None => app,
    };
    let permits = Arc::new(Semaphore::new(limits.max_connections.max(1)));
    let (closing, closed) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let permit = tokio::select! {
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            () = &mut shutdown => break,
        };
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) if is_connection_error(&e) => continue,
                Err(e) if is_out_of_files(&e) => {
                    // Too many open files: wait for connections to close.
                    tracing::warn!(error = %e, "cannot accept a connection; retrying shortly");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
                Err(e) => return Err(e),
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let app = app.clone();
        let mut closed = closed.clone();
        let header_read_timeout = limits.header_read_timeout;
        connections.spawn(async move {
            let _permit = permit;
            let service = hyper::service::service_fn(move |mut request: Request<Incoming>| {
                request.extensions_mut().insert(ConnectInfo(peer));
                let mut app = app.clone();
                async move { app.call(request).await }
            });
            let mut builder = http1::Builder::new();
            builder
                .timer(TokioTimer::new())
                .header_read_timeout(header_read_timeout);
            let mut connection = pin!(builder.serve_connection(TokioIo::new(stream), service));
            let mut draining = false;
            loop {
                tokio::select! {
                    served = connection.as_mut() => {
                        if let Err(e) = served {
                            tracing::debug!(%peer, error = %e, "an HTTP connection ended with an error");
                        }
                        break;
                    }
                    _ = closed.wait_for(|closing| *closing), if !draining => {
                        draining = true;
                        connection.as_mut().graceful_shutdown();
                    }
                }
            }
        });
        while connections.try_join_next().is_some() {}
    }
    let _ = closing.send(true);
    let grace = limits.request_timeout.unwrap_or_default() + DRAIN_GRACE;
    let _ = tokio::time::timeout(grace, async {
        while connections.join_next().await.is_some() {}
    })
    .await;
    Ok(())
}

/// The answer to a request that ran out of time: a fixed phrase.
fn timed_out() -> Response {
    (
        StatusCode::REQUEST_TIMEOUT,
        [
            (
                header::CONTENT_TYPE,
                HeaderValue::from_static("text/plain; charset=utf-8"),
            ),
            (header::CONNECTION, HeaderValue::from_static("close")),
        ],
        "request timeout",
    )
        .into_response()
}

/// Errors of one connection's accept (the peer went away first): skip it.
fn is_connection_error(e: &std::io::Error) -> bool {
    matches!(
        e.kind(),
        std::io::ErrorKind::ConnectionRefused
            | std::io::ErrorKind::ConnectionAborted
            | std::io::ErrorKind::ConnectionReset
    )
}

/// The process or the system is out of file descriptors (EMFILE, ENFILE).
fn is_out_of_files(e: &std::io::Error) -> bool {
    matches!(e.raw_os_error(), Some(23 | 24))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::routing::post;
    use std::net::SocketAddr;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpStream;

    async fn started(limits: Limits) -> (SocketAddr, tokio::sync::oneshot::Sender<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let app = Router::new().route(
            "/",
            post(
                |ConnectInfo(peer): ConnectInfo<SocketAddr>, body: String| async move {
                    format!("{} {}", peer.ip(), body.len())
                },
            ),
        );
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(serve(listener, app, limits, async move {
            let _ = stopped.await;
        }));
        (addr, stop)
    }

    /// Reads until the peer closes the connection; the bytes read.
    async fn until_closed(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let _ = stream.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn a_request_is_served_with_its_peer_address() {
        let (addr, _stop) = started(Limits::default()).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(
            b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\nconnection: close\r\n\r\nabc",
        )
        .await
        .expect("write");
        let answer = until_closed(&mut s).await;
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.ends_with("127.0.0.1 3"), "{answer}");
    }

    #[tokio::test]
    async fn a_silent_or_slow_head_is_cut_off() {
        let limits = Limits {
            header_read_timeout: Duration::from_millis(200),
            ..Limits::default()
        };
        let (addr, _stop) = started(limits).await;
        // Nothing at all, then half a head: both connections are closed.
        let mut silent = TcpStream::connect(addr).await.expect("connect");
        let mut slow = TcpStream::connect(addr).await.expect("connect");
        slow.write_all(b"POST / HTTP/1.1\r\nhost")
            .await
            .expect("write");
        let bounded = Duration::from_secs(10);
        tokio::time::timeout(bounded, until_closed(&mut silent))
            .await
            .expect("a silent connection is closed");
        tokio::time::timeout(bounded, until_closed(&mut slow))
            .await
            .expect("a slow head's connection is closed");
    }

    #[tokio::test]
    async fn a_slow_body_is_answered_408() {
        let limits = Limits {
            request_timeout: Some(Duration::from_millis(200)),
            ..Limits::default()
        };
        let (addr, _stop) = started(limits).await;
        let mut s = TcpStream::connect(addr).await.expect("connect");
        s.write_all(b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nab")
            .await
            .expect("write");
        let answer = tokio::time::timeout(Duration::from_secs(10), until_closed(&mut s))
            .await
            .expect("answered");
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    }

    #[tokio::test]
    async fn connections_beyond_the_cap_wait_for_one_to_close() {
        let limits = Limits {
            max_connections: 1,
            ..Limits::default()
        };
        let (addr, _stop) = started(limits).await;
        let mut first = TcpStream::connect(addr).await.expect("connect");
        // The second is queued by the kernel, not served.
        let mut second = TcpStream::connect(addr).await.expect("connect");
        second
            .write_all(
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            )
            .await
            .expect("write");
        let mut buf = [0u8; 1];
        let waited = tokio::time::timeout(Duration::from_millis(300), second.read(&mut buf)).await;
        assert!(
            waited.is_err(),
            "the second connection is served only after the first closes"
        );
        first
            .write_all(
                b"POST / HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
            )
            .await
            .expect("write");
        until_closed(&mut first).await;
        let answer = tokio::time::timeout(Duration::from_secs(10), until_closed(&mut second))
            .await
            .expect("served");
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    }
}
