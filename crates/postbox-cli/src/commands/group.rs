//! `postbox group`: consumer groups — readers that pull events from the log
//! over SQL (`receive`, `ack`, `nack`) or HTTP: create one, see how each is
//! doing, list its dead letters, drop one (audited); make and revoke the
//! bearer tokens of its HTTP API (audited) and serve that API
//! (`postbox_pull`, with the server bounds of `postbox::serve`).

use crate::context::{actor as actor_or_user, cancel_on_signal, AnyError, Settings};
use crate::output::{errln, outln};
use clap::{Args, Subcommand};
use postbox::serve::{serve, Limits};
use postbox_pull::{PullApi, PullOptions};
use postbox_relay::Store;
use postbox_store::connect as db;
use postbox_store::{GroupStart, GroupStatus, NewGroup, ProducerTarget};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Args, Debug)]
pub struct GroupArgs {
    #[command(subcommand)]
    pub command: GroupCommand,
}

#[derive(Subcommand, Debug)]
pub enum GroupCommand {
    /// Create a consumer group: readers then call receive/ack/nack on it
    Create {
        /// 1 to 63 letters, digits, '.', '_' or '-'
        name: String,
        /// Where it starts: now (events committed from here on), beginning
        /// (everything the log retains) or an RFC 3339 time
        #[arg(long, default_value = "now", value_parser = parse_start)]
        start: GroupStart,
        /// Only events whose type matches this glob (`*`, `?`); repeat for several
        #[arg(long = "types", value_name = "GLOB")]
        types: Vec<String>,
        /// Never hand out an aggregate's event while an earlier one of it is in flight
        #[arg(long)]
        ordered: bool,
        /// Hand-outs before an event becomes one of the group's dead letters
        #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(i32).range(1..=1000))]
        max_attempts: i32,
    },
    /// Show each group: unread, in flight, waiting, dead letters, readers, lag
    List {
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// List a group's dead letters, oldest first
    DeadLetters {
        name: String,
        /// At most this many
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Give a group's dead letters back to it, to be handed out again (audited)
    ReplayDead {
        name: String,
        /// Only this event (repeat for several)
        #[arg(long = "event-id", value_name = "ID", required_unless_present = "all")]
        event_ids: Vec<uuid::Uuid>,
        /// Every dead letter of the group
        #[arg(long, conflicts_with = "event_ids")]
        all: bool,
        /// Why (kept in the audit log)
        #[arg(long)]
        reason: Option<String>,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
    /// Bearer tokens of the groups' HTTP API (`postbox group serve`)
    Token {
        #[command(subcommand)]
        command: TokenCommand,
    },
    /// Serve the groups' HTTP API: POST /groups/{group}/receive, /ack and
    /// /nack, each call with its group's bearer token
    Serve(ServeArgs),
    /// Drop a group with everything it holds (audited)
    Drop {
        name: String,
        /// Why (kept in the audit log)
        #[arg(long)]
        reason: Option<String>,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Make a token that opens one group; it is printed once, and only its
    /// SHA-256 is stored (audited)
    Create {
        /// The group it opens
        group: String,
        /// What or who it is for (shown by `token list`)
        #[arg(long)]
        label: Option<String>,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
    /// List tokens (never the tokens themselves): id, group, label, made, last used
    List {
        /// Only this group's
        group: Option<String>,
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Revoke a token by its id (audited); a server stops taking it within
    /// its --token-cache time
    Revoke {
        group: String,
        id: i64,
        /// Who (kept in the audit log) [default: $USER]
        #[arg(long)]
        actor: Option<String>,
    },
}

#[derive(Args, Debug)]
pub struct ServeArgs {
    /// Address to listen on, e.g. 127.0.0.1:8089 (plain HTTP: put a TLS
    /// proxy in front of it for anything beyond the host)
    #[arg(long, value_name = "ADDR", env = "POSTBOX_GROUPS_LISTEN")]
    pub listen: SocketAddr,
    /// The CloudEvents `source` of the events handed out
    #[arg(long, value_name = "URI", default_value = postbox_relay::cloudevents::DEFAULT_SOURCE)]
    pub source: String,
    /// The longest long poll a reader may ask for (`wait_seconds`), at most 20s
    #[arg(long, value_name = "DURATION", default_value = "20s", value_parser = humantime::parse_duration)]
    pub max_wait: Duration,
    /// How often a waiting long poll looks again when no notification woke it
    #[arg(long, value_name = "DURATION", default_value = "500ms", value_parser = humantime::parse_duration)]
    pub poll_every: Duration,
    /// How long a token's group is remembered (a revoked token works this much longer at most; 0s: look it up on every call)
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub token_cache: Duration,
    /// Failed tokens a client address (an IPv6 /64) may send a minute before
    /// unknown tokens from it are answered 429 (the server takes ten times
    /// as many from everyone; a token that worked lately always passes)
    #[arg(long, value_name = "N", default_value_t = 30)]
    pub failed_tokens_per_minute: u32,
    /// Largest ack body in bytes (10,000 receipts are about 500 kB); a
    /// receive or a nack takes 64 kB at most
    #[arg(long, value_name = "N", default_value_t = 1 << 20)]
    pub max_body_bytes: usize,
    /// Long polls of one group that wait at once; more answer at once with what there is
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub max_polls_per_group: usize,
    /// Database connections the calls share (LISTEN has one of its own)
    #[arg(long, value_name = "N", default_value_t = 8)]
    pub pool_size: u32,
    /// How long a call waits for a database connection before it is answered 503
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = humantime::parse_duration)]
    pub db_timeout: Duration,
    /// A request's head (also the next one on a kept-alive connection) must
    /// arrive within this time, else the connection is closed
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = humantime::parse_duration)]
    pub header_timeout: Duration,
    /// A call must be answered within this time, else 408; longer than --max-wait
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = humantime::parse_duration)]
    pub request_timeout: Duration,
    /// Connections served at once; more wait until one closes
    #[arg(long, value_name = "N", default_value_t = 1024)]
    pub max_connections: usize,
    /// Serve Prometheus /metrics, /healthz and /readyz on ADDR, a port apart
    #[arg(long, env = "POSTBOX_METRICS_LISTEN", value_name = "ADDR")]
    pub metrics_listen: Option<String>,
}

/// Why `postbox group serve` could not start. Messages never hold a secret.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("--{0} must be more than zero")]
    Zero(&'static str),
    #[error("--max-wait must be at most 20s (the SQL receive's bound)")]
    MaxWait,
    #[error("--request-timeout ({request:?}) must be longer than --max-wait ({wait:?}), or long polls are cut off")]
    Timeouts { request: Duration, wait: Duration },
    #[error("cannot listen on {addr}")]
    Listen {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("the HTTP server failed")]
    Serve(#[source] std::io::Error),
}

impl ServeArgs {
    fn check(&self) -> Result<(PullOptions, Limits), ServeError> {
        for (flag, zero) in [
            ("header-timeout", self.header_timeout.is_zero()),
            ("request-timeout", self.request_timeout.is_zero()),
            ("poll-every", self.poll_every.is_zero()),
            ("db-timeout", self.db_timeout.is_zero()),
            ("max-connections", self.max_connections == 0),
            ("max-body-bytes", self.max_body_bytes == 0),
            ("max-polls-per-group", self.max_polls_per_group == 0),
            ("pool-size", self.pool_size == 0),
            (
                "failed-tokens-per-minute",
                self.failed_tokens_per_minute == 0,
            ),
        ] {
            if zero {
                return Err(ServeError::Zero(flag));
            }
        }
        if self.max_wait > postbox_pull::MAX_WAIT {
            return Err(ServeError::MaxWait);
        }
        if self.request_timeout <= self.max_wait + Duration::from_secs(1) {
            return Err(ServeError::Timeouts {
                request: self.request_timeout,
                wait: self.max_wait,
            });
        }
        let options = PullOptions {
            source: self.source.clone(),
            max_wait: self.max_wait,
            poll_every: self.poll_every,
            token_cache_for: self.token_cache,
            failed_tokens_per_minute: self.failed_tokens_per_minute,
            max_body_bytes: self.max_body_bytes,
            max_polls_per_group: self.max_polls_per_group,
        };
        let limits = Limits {
            header_read_timeout: self.header_timeout,
            request_timeout: Some(self.request_timeout),
            max_connections: self.max_connections,
        };
        Ok((options, limits))
    }
}

/// `postbox group serve`.
async fn serve_groups(settings: &Settings, args: ServeArgs) -> Result<ExitCode, AnyError> {
    let (options, limits) = args.check()?;
    let connect = db::options(settings.database_url.as_deref(), "postbox-groups")?;
    // Lazy: the server starts (and answers 503) while the database is down.
    let pool = db::pool_options(&connect)
        .max_connections(args.pool_size)
        .acquire_timeout(args.db_timeout)
        .connect_lazy_with(connect.clone());
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|source| ServeError::Listen {
            addr: args.listen,
            source,
        })?;
    let local = listener.local_addr().unwrap_or(args.listen);
    if !local.ip().is_loopback() {
        tracing::warn!(
            listen = %local,
            "serving plain HTTP beyond this host: bearer tokens cross the network in the clear \
            unless a TLS proxy is in front (docs/consumer-groups.md, Over HTTP)"
        );
    }
    tracing::info!(
        listen = %local,
        schema = %settings.schema,
        database = %db::target(&connect),
        "serving consumer groups over HTTP"
    );
    let shutdown = CancellationToken::new();
    tokio::spawn(cancel_on_signal(shutdown.clone()));
    let api = PullApi::new(pool.clone(), &settings.schema, options, shutdown.clone());
    tokio::spawn(api.clone().wake_on_notifications(shutdown.clone()));
    if let Some(addr) = &args.metrics_listen {
        let store = Store::new(pool.clone(), settings.schema.clone());
        crate::metrics_endpoint::Endpoint::serve_beside(addr, store, shutdown.clone()).await?;
    }
    serve(
        listener,
        api.router(),
        limits,
        shutdown.clone().cancelled_owned(),
    )
    .await
    .map_err(ServeError::Serve)?;
    pool.close().await;
    tracing::info!("consumer groups' HTTP server stopped");
    Ok(ExitCode::SUCCESS)
}

async fn token(
    groups: &postbox_store::Groups,
    command: TokenCommand,
) -> Result<ExitCode, AnyError> {
    match command {
        TokenCommand::Create {
            group,
            label,
            actor,
        } => {
            let actor = actor_or_user(actor)?;
            if label.as_deref().is_some_and(|l| l.len() > 200) {
                return Err("--label: at most 200 bytes".into());
            }
            let (id, token) = match groups.create_token(&group, label.as_deref(), &actor).await {
                Err(e) if is_sqlstate(&e, "23503") => {
                    return Err(format!("no consumer group named {group}").into())
                }
                other => other?,
            };
            outln!("{token}");
            errln!(
                "token {id} opens consumer group {group}; it is shown this once (only its hash is \
                kept): give it to the reader as `Authorization: Bearer …`"
            );
            Ok(ExitCode::SUCCESS)
        }
        TokenCommand::List { group, json } => {
            let tokens = groups.tokens(group.as_deref()).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&tokens)?);
                return Ok(ExitCode::SUCCESS);
            }
            if tokens.is_empty() {
                outln!("no token (make one: postbox group token create GROUP)");
            }
            for t in &tokens {
                outln!(
                    "{:>6} {:<20} {:<24} made by {} at {}, last used {}",
                    t.id,
                    t.group_name,
                    t.label.as_deref().unwrap_or("-"),
                    t.created_by,
                    t.created_at.format("%Y-%m-%d %H:%M:%S UTC"),
                    t.last_used_at.map_or_else(
                        || "never".to_owned(),
                        |at| at.format("%Y-%m-%d %H:%M UTC").to_string()
                    )
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        TokenCommand::Revoke { group, id, actor } => {
            let actor = actor_or_user(actor)?;
            if groups.revoke_token(&group, id, &actor).await? {
                outln!("revoked token {id} of {group}; recorded in the audit log");
                Ok(ExitCode::SUCCESS)
            } else {
                Err(format!("group {group} has no token {id}").into())
            }
        }
    }
}

fn is_sqlstate(e: &sqlx::Error, code: &str) -> bool {
    e.as_database_error()
        .and_then(|d| d.code())
        .is_some_and(|c| c == code)
}

fn parse_start(s: &str) -> Result<GroupStart, String> {
    s.parse()
}

pub async fn run(settings: &Settings, args: GroupArgs) -> Result<ExitCode, AnyError> {
    // The server connects lazily, with its own pool and bounds.
    let command = match args.command {
        GroupCommand::Serve(serve) => return serve_groups(settings, serve).await,
        command => command,
    };
    let pool = settings.pool("postbox-group").await?;
    let store = Store::new(pool, settings.schema.clone());
    let groups = store.groups();
    match command {
        GroupCommand::Create {
            name,
            start,
            types,
            ordered,
            max_attempts,
        } => {
            let group = NewGroup {
                name: name.clone(),
                start,
                types: (!types.is_empty()).then_some(types),
                ordered,
                max_attempts,
            };
            groups.create(&group).await?;
            outln!(
                "created consumer group {name}: readers call {schema}.receive('{name}', …), then ack or nack",
                schema = settings.schema.name()
            );
            if store.log().producer_target().await? != ProducerTarget::Log {
                errln!(
                    "warning: this outbox's producers write to the outbox table (claim mode), and \
                     consumer groups read the log: {name} gets nothing until producers write to \
                     the log (postbox migrate --mode log)"
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::List { json } => {
            let status = groups.status().await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&status)?);
                return Ok(ExitCode::SUCCESS);
            }
            if status.is_empty() {
                outln!("no consumer group (create one: postbox group create NAME)");
            }
            for g in &status {
                outln!("{}", summary(g));
            }
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::DeadLetters { name, limit, json } => {
            if !(1..=10_000).contains(&limit) {
                return Err("--limit: must be 1 to 10000".into());
            }
            let dead = groups.dead_letters(&name, 0, limit).await?;
            if json {
                outln!("{}", serde_json::to_string_pretty(&dead)?);
                return Ok(ExitCode::SUCCESS);
            }
            if dead.is_empty() {
                outln!("no dead letter in group {name}");
            }
            for d in &dead {
                outln!(
                    "{} {} {}/{} after {} attempt(s) at {}: {}",
                    d.event_id,
                    d.event_type.as_deref().unwrap_or("?"),
                    d.aggregate_type.as_deref().unwrap_or("?"),
                    d.aggregate_id.as_deref().unwrap_or("?"),
                    d.attempts,
                    d.dead_at.format("%Y-%m-%d %H:%M:%S UTC"),
                    d.last_error.as_deref().unwrap_or("-")
                );
            }
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::ReplayDead {
            name,
            event_ids,
            all,
            reason,
            actor,
        } => {
            let actor = actor_or_user(actor)?;
            let ids = (!all).then_some(event_ids.as_slice());
            let n = groups
                .replay_dead(&name, ids, &actor, reason.as_deref())
                .await?;
            outln!(
                "{n} dead letter(s) of {name} wait to be handed out again; recorded in the audit log"
            );
            Ok(ExitCode::SUCCESS)
        }
        GroupCommand::Token { command } => token(&groups, command).await,
        GroupCommand::Serve(serve) => serve_groups(settings, serve).await,
        GroupCommand::Drop {
            name,
            reason,
            actor,
        } => {
            let actor = actor_or_user(actor)?;
            if groups.drop_group(&name, &actor, reason.as_deref()).await? {
                outln!(
                    "dropped consumer group {name} with what it held; recorded in the audit log"
                );
                Ok(ExitCode::SUCCESS)
            } else {
                Err(format!("no consumer group named {name}").into())
            }
        }
    }
}

/// One group on one line, as `group list` and `status` print it.
pub fn summary(g: &GroupStatus) -> String {
    let mut line = format!(
        "{:<20} unread {}, in flight {}, waiting {}, dead letters {}, readers {} (last minute), oldest unacknowledged {}",
        g.name,
        g.unread,
        g.in_flight,
        g.waiting,
        g.dead_letters,
        g.readers,
        g.lag_seconds.map_or_else(|| "-".to_owned(), age),
    );
    let mut traits = Vec::new();
    if g.ordered {
        traits.push("ordered".to_owned());
    }
    if let Some(types) = &g.types {
        traits.push(format!("types {}", types.join(", ")));
    }
    traits.push(format!("max attempts {}", g.max_attempts));
    line.push_str(&format!(" [{}]", traits.join("; ")));
    line
}

fn age(secs: f64) -> String {
    humantime::format_duration(Duration::from_secs(secs.max(0.0).round() as u64)).to_string()
}
