//! Which address a request comes from: the TCP peer, or — only when the peer
//! is a trusted proxy — the rightmost address in `X-Forwarded-For` that is
//! not itself a trusted proxy.

use axum::http::HeaderMap;
use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

/// An address or a network (`10.0.0.0/8`, `::1`, `fd00::/8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    network: IpAddr,
    prefix: u8,
}

/// A `--trusted-proxy` value that is neither an address nor a network.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{value:?} is not an IP address or network (e.g. 10.0.0.5, 10.0.0.0/8, fd00::/8): {why}")]
pub struct CidrError {
    value: String,
    why: &'static str,
}

impl FromStr for Cidr {
    type Err = CidrError;

    fn from_str(s: &str) -> Result<Self, CidrError> {
        let fail = |why| CidrError {
            value: s.to_owned(),
            why,
        };
        let (addr, prefix) = match s.trim().split_once('/') {
            Some((a, p)) => (a, Some(p)),
            None => (s.trim(), None),
        };
        let network: IpAddr = addr.parse().map_err(|_| fail("not an IP address"))?;
        let max = if network.is_ipv4() { 32 } else { 128 };
        let prefix =
            match prefix {
                None => max,
                Some(p) => p.parse::<u8>().ok().filter(|p| *p <= max).ok_or_else(|| {
                    fail("the prefix length must be 0 to 32 (IPv4) or 128 (IPv6)")
                })?,
            };
        Ok(Cidr {
            network: mask(network, prefix),
            prefix,
        })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.network, self.prefix)
    }
}

impl Cidr {
    /// Whether `ip` is in this network (an IPv4-mapped IPv6 address counts as IPv4).
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = canonical(ip);
        ip.is_ipv4() == self.network.is_ipv4() && mask(ip, self.prefix) == self.network
    }
}

/// `ip` with all but its first `prefix` bits cleared.
fn mask(ip: IpAddr, prefix: u8) -> IpAddr {
    match ip {
        IpAddr::V4(v4) => {
            let bits = u32::from(v4);
            let keep = u32::MAX.checked_shl(32 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V4((bits & keep).into())
        }
        IpAddr::V6(v6) => {
            let bits = u128::from(v6);
            let keep = u128::MAX.checked_shl(128 - u32::from(prefix)).unwrap_or(0);
            IpAddr::V6((bits & keep).into())
        }
    }
}

/// An IPv4-mapped IPv6 address as IPv4; anything else as it is.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        v4 => v4,
    }
}

/// One `X-Forwarded-For` entry as an address: `1.2.3.4`, `1.2.3.4:567`,
/// `::1` or `[::1]:567`.
fn forwarded_ip(entry: &str) -> Option<IpAddr> {
    let entry = entry.trim().trim_matches('"');
    if let Ok(ip) = entry.parse() {
        return Some(ip);
    }
    if let Some(rest) = entry.strip_prefix('[') {
        return rest.split_once(']')?.0.parse().ok();
    }
    entry
        .rsplit_once(':')?
        .0
        .parse::<std::net::Ipv4Addr>()
        .ok()
        .map(IpAddr::V4)
}

/// The client's address: `peer` itself unless it is a trusted proxy; then
/// the rightmost `X-Forwarded-For` address that is not a trusted proxy (each
/// trusted hop appended the address it saw). An entry that is not an address
/// stops the walk at the last trusted hop, whose word is all there is.
pub(crate) fn client_ip(peer: IpAddr, headers: &HeaderMap, trusted: &[Cidr]) -> IpAddr {
    let peer = canonical(peer);
    let is_trusted = |ip: IpAddr| trusted.iter().any(|t| t.contains(ip));
    if !is_trusted(peer) {
        return peer;
    }
    let forwarded: Vec<&str> = headers
        .get_all("x-forwarded-for")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .collect();
    let mut client = peer;
    for entry in forwarded.iter().rev() {
        let Some(ip) = forwarded_ip(entry).map(canonical) else {
            break;
        };
        client = ip;
        if !is_trusted(ip) {
            break;
        }
    }
    client
}

/// The key rate limits count a client under: its address, or its /64 for
/// IPv6 (one host usually holds a whole /64).
pub(crate) fn limit_key(ip: IpAddr) -> String {
    match canonical(ip) {
        IpAddr::V6(_) => format!("{}/64", mask(ip, 64)),
        v4 => v4.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cidrs(list: &[&str]) -> Vec<Cidr> {
        list.iter().map(|s| s.parse().unwrap()).collect()
    }

    fn xff(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("x-forwarded-for", v.parse().unwrap());
        }
        h
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn networks_parse_and_contain_their_addresses() {
        let net: Cidr = "10.1.2.3/8".parse().unwrap();
        assert_eq!(net.to_string(), "10.0.0.0/8");
        assert!(net.contains(ip("10.200.0.1")));
        assert!(net.contains(ip("::ffff:10.0.0.1")), "IPv4-mapped");
        assert!(!net.contains(ip("11.0.0.1")));
        let one: Cidr = "192.168.0.7".parse().unwrap();
        assert!(one.contains(ip("192.168.0.7")) && !one.contains(ip("192.168.0.8")));
        let v6: Cidr = "fd00::/8".parse().unwrap();
        assert!(v6.contains(ip("fd12::1")) && !v6.contains(ip("fe80::1")));
        let all: Cidr = "0.0.0.0/0".parse().unwrap();
        assert!(all.contains(ip("8.8.8.8")) && !all.contains(ip("::1")));
        for bad in ["", "10.0.0.0/33", "::/129", "proxy.internal", "10.0.0.0/x"] {
            assert!(bad.parse::<Cidr>().is_err(), "{bad}");
        }
    }

    #[test]
    fn forwarded_for_counts_only_from_a_trusted_peer() {
        let trusted = cidrs(&["10.0.0.0/8"]);
        let h = xff(&["203.0.113.9"]);
        assert_eq!(
            client_ip(ip("198.51.100.1"), &h, &trusted),
            ip("198.51.100.1")
        );
        assert_eq!(client_ip(ip("10.0.0.2"), &h, &trusted), ip("203.0.113.9"));
        assert_eq!(client_ip(ip("10.0.0.2"), &h, &[]), ip("10.0.0.2"));
        assert_eq!(
            client_ip(ip("10.0.0.2"), &HeaderMap::new(), &trusted),
            ip("10.0.0.2"),
            "no header: the proxy itself"
        );
    }

    #[test]
    fn the_rightmost_untrusted_address_is_the_client() {
        let trusted = cidrs(&["10.0.0.0/8", "fd00::/8"]);
        // The client forged the first entry; the trusted proxies appended the rest.
        let h = xff(&["1.1.1.1, 203.0.113.9", "10.0.0.7"]);
        assert_eq!(client_ip(ip("10.0.0.2"), &h, &trusted), ip("203.0.113.9"));
        let h = xff(&["[2001:db8::5]:4711, fd00::3"]);
        assert_eq!(client_ip(ip("fd00::2"), &h, &trusted), ip("2001:db8::5"));
        let h = xff(&["203.0.113.9:5555"]);
        assert_eq!(client_ip(ip("10.0.0.2"), &h, &trusted), ip("203.0.113.9"));
        // Garbage stops the walk at the last trusted hop.
        let h = xff(&["1.1.1.1, unknown, 10.0.0.9"]);
        assert_eq!(client_ip(ip("10.0.0.2"), &h, &trusted), ip("10.0.0.9"));
        // Every hop trusted: the leftmost one.
        let h = xff(&["10.0.0.8, 10.0.0.9"]);
        assert_eq!(client_ip(ip("10.0.0.2"), &h, &trusted), ip("10.0.0.8"));
    }

    #[test]
    fn ipv6_clients_are_limited_per_64() {
        assert_eq!(limit_key(ip("2001:db8:1:2:aaaa::1")), "2001:db8:1:2::/64");
        assert_eq!(limit_key(ip("2001:db8:1:2:bbbb::9")), "2001:db8:1:2::/64");
        assert_eq!(limit_key(ip("203.0.113.9")), "203.0.113.9");
        assert_eq!(limit_key(ip("::ffff:203.0.113.9")), "203.0.113.9");
    }
}
