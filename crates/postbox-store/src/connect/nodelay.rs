//! `TCP_NODELAY` on the process's connections to PostgreSQL.
//!
//! sqlx 0.9.0 opens its TCP sockets with Nagle's algorithm on (its 0.7 and
//! 0.8 releases turned it off; the fix is merged upstream, after 0.9.0). Over
//! TLS a small request then waits for the server's delayed acknowledgement of
//! the previous one: a claim round trip's tail goes from about 9 ms to 60–80
//! ms with the default `sslmode=prefer`. sqlx gives no hook on the socket it
//! opens, so each new connection's `after_connect` calls [`set_for_port`],
//! which finds the process's TCP sockets connected to the server's port
//! that lack the option and sets it. Remove once sqlx sets it again.
//!
//! Linux only (it lists `/proc/self/fd`); elsewhere it does nothing.

/// One TCP connection of this process, as [`connections`] finds it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Connection {
    pub local_port: u16,
    pub peer_port: u16,
    pub nodelay: bool,
}

/// Sets `TCP_NODELAY` on every TCP socket of this process whose peer port is
/// `port` and that does not have it yet; returns how many it set.
///
/// Every failure (a socket closed meanwhile, a file descriptor that is no
/// socket) skips that descriptor: the worst outcome is a connection left as
/// sqlx opened it.
pub fn set_for_port(port: u16) -> usize {
    sockets()
        .filter(|&(fd, c)| c.peer_port == port && !c.nodelay && set_nodelay(fd))
        .count()
}

/// This process's TCP connections and whether each has `TCP_NODELAY`.
pub fn connections() -> Vec<Connection> {
    sockets().map(|(_, c)| c).collect()
}

#[cfg(target_os = "linux")]
fn sockets() -> impl Iterator<Item = (std::os::fd::RawFd, Connection)> {
    use std::os::unix::ffi::OsStrExt;

    std::fs::read_dir("/proc/self/fd")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let fd = entry.file_name().to_str()?.parse().ok()?;
            // A socket's link reads `socket:[INODE]`; files, pipes and the
            // directory being listed are skipped without touching them.
            let target = std::fs::read_link(entry.path()).ok()?;
            if !target.as_os_str().as_bytes().starts_with(b"socket:") {
                return None;
            }
            Some((fd, inspect(fd)?))
        })
}

#[cfg(not(target_os = "linux"))]
fn sockets() -> impl Iterator<Item = (i32, Connection)> {
    std::iter::empty()
}

/// Borrow descriptor `fd` as a socket for the calls of `with`.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn with_socket<T>(fd: std::os::fd::RawFd, with: impl FnOnce(socket2::SockRef<'_>) -> T) -> T {
    // SAFETY: the descriptor is only borrowed for the calls of `with` and
    // never closed here. Had another thread closed it since it was listed
    // and the number been reused, the calls reach that other descriptor:
    // getsockopt and getpeername read, and setsockopt changes nothing but
    // `TCP_NODELAY` on a TCP socket, failing harmlessly on anything else.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
    with(socket2::SockRef::from(&fd))
}

#[cfg(target_os = "linux")]
fn inspect(fd: std::os::fd::RawFd) -> Option<Connection> {
    with_socket(fd, |socket| {
        if socket.r#type().ok()? != socket2::Type::STREAM {
            return None;
        }
        Some(Connection {
            local_port: socket.local_addr().ok()?.as_socket()?.port(),
            peer_port: socket.peer_addr().ok()?.as_socket()?.port(),
            nodelay: socket.tcp_nodelay().ok()?,
        })
    })
}

#[cfg(target_os = "linux")]
fn set_nodelay(fd: std::os::fd::RawFd) -> bool {
    with_socket(fd, |socket| socket.set_tcp_nodelay(true).is_ok())
}

#[cfg(not(target_os = "linux"))]
fn set_nodelay(_fd: i32) -> bool {
    false
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn a_connection_to_the_port_gets_nodelay_and_others_keep_theirs() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let other = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = server.local_addr().unwrap().port();
        let ours = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let theirs = std::net::TcpStream::connect(other.local_addr().unwrap()).unwrap();
        assert!(!ours.nodelay().unwrap() && !theirs.nodelay().unwrap());

        assert!(set_for_port(port) >= 1);
        assert!(ours.nodelay().unwrap());
        assert!(
            !theirs.nodelay().unwrap(),
            "a socket to another port is left alone"
        );
        assert_eq!(set_for_port(port), 0, "set once: nothing left to change");
    }
}
