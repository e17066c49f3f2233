//! What a drain costs in CPU: the relay's (its process, from reaping it) and
//! the PostgreSQL server's, read from `/proc` when the server runs on this
//! machine. On a shared primary the database's CPU is the scarce one, so the
//! bench reports both, per million events delivered.

use std::collections::HashMap;

/// CPU seconds the PostgreSQL server's processes have used so far: every
/// process named `postgres` (the postmaster, its background workers and
/// backends), plus what the postmaster's ended children used (the kernel
/// adds a reaped child's time to its parent's), so a backend that exits
/// during a run is still counted. `None` when no such process is visible (a
/// server on another host or in another PID namespace).
///
/// Every PostgreSQL server on the machine is counted; an idle one adds next
/// to nothing.
pub fn postgres_seconds() -> Option<f64> {
    let mut processes: HashMap<u32, Times> = HashMap::new();
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
            continue;
        };
        // A process may end between the listing and the read: skip it.
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some(times) = Times::parse(&stat).filter(|t| t.command == "postgres") {
            processes.insert(pid, times);
        }
    }
    if processes.is_empty() {
        return None;
    }
    let ticks: u64 = processes
        .values()
        .map(|t| {
            let own = t.user + t.system;
            // A postmaster: its parent is no postgres process.
            if processes.contains_key(&t.parent) {
                own
            } else {
                own + t.children_user + t.children_system
            }
        })
        .sum();
    Some(ticks as f64 / crate::os::ticks_per_second())
}

/// The fields of `/proc/PID/stat` this module reads, in clock ticks.
#[derive(Debug, PartialEq)]
struct Times {
    command: String,
    parent: u32,
    user: u64,
    system: u64,
    children_user: u64,
    children_system: u64,
}

impl Times {
    fn parse(stat: &str) -> Option<Self> {
        // `PID (COMMAND) STATE PPID …`: the command may hold spaces and
        // parentheses, so it ends at the last ')'.
        let (head, rest) = stat.rsplit_once(')')?;
        let command = head.split_once('(')?.1.to_owned();
        let fields: Vec<&str> = rest.split_whitespace().collect();
        // Fields 4 and 14–17 of the line (1-based) are 1 and 11–14 here.
        let field = |i: usize| fields.get(i)?.parse::<u64>().ok();
        Some(Times {
            command,
            parent: u32::try_from(field(1)?).ok()?,
            user: field(11)?,
            system: field(12)?,
            children_user: field(13)?,
            children_system: field(14)?,
        })
    }
}

/// CPU seconds per million events, rounded to a tenth.
pub fn per_million(seconds: f64, events: i64) -> f64 {
    if events <= 0 {
        return 0.0;
    }
    (seconds / events as f64 * 1e6 * 10.0).round() / 10.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_with_an_odd_command_name_parses() {
        let line = "4242 (postgres: a (b) c) S 17 4242 4242 0 -1 4194560 311 0 0 0 \
                    120 35 7 2 20 0 1 0 5126 223305728 5087 18446744073709551615";
        let t = Times::parse(line).unwrap();
        assert_eq!(t.command, "postgres: a (b) c");
        assert_eq!(
            (
                t.parent,
                t.user,
                t.system,
                t.children_user,
                t.children_system
            ),
            (17, 120, 35, 7, 2)
        );
    }

    #[test]
    fn this_machine_s_server_is_seen() {
        // The tests run against a PostgreSQL server on this machine.
        let seconds = postgres_seconds().expect("a postgres process in /proc");
        assert!(seconds > 0.0);
    }

    #[test]
    fn per_million_scales_and_rounds() {
        assert_eq!(per_million(1.234, 200_000), 6.2);
        assert_eq!(per_million(1.0, 0), 0.0);
    }
}
