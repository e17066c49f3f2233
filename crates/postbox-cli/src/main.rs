//! `postbox`: the transactional outbox for PostgreSQL, from the command line.
//!
//! This file is the clap definitions and the dispatch; each command is a
//! module of `commands/`, and what they share is `context.rs`.

mod output;

mod commands;
mod config;
mod context;
mod metrics_endpoint;
#[cfg(feature = "otel")]
mod otel;
mod tenants;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand};
use commands::{
    bench, completions, console, demo, dlq, enqueue, group, log, man, migrate, purge, receive,
    relay, replay, route, slot, status, verify,
};
use context::{error_chain, AnyError, Global, Settings};
use std::process::ExitCode;

/// Transactional outbox for PostgreSQL: deliver every committed event, at least once.
#[derive(Parser, Debug)]
#[command(name = "postbox", version, propagate_version = true)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Create or upgrade postbox's schema (idempotent; safe to run concurrently)
    Migrate(migrate::MigrateArgs),
    /// Enqueue one event (in its own transaction) and print its id
    Enqueue(enqueue::EnqueueArgs),
    /// Deliver committed events to a sink
    Relay(relay::RelayArgs),
    /// Show counts by status, the oldest pending event, attempts and dead letters
    Status(status::StatusArgs),
    /// Delete (or archive) sent events and old inbox records in bounded batches
    Purge(purge::PurgeArgs),
    /// Measure drain throughput, latency and scale-out on this machine
    Bench(bench::BenchArgs),
    /// Dead letters: list, show, replay (same or new id) and discard them, with an audit log
    Dlq(dlq::DlqArgs),
    /// Run the whole flow on a throwaway database: shop orders, relay, idempotent consumer
    Demo(demo::DemoArgs),
    /// Receive signed HTTP deliveries (QStash, Standard Webhooks) and store each once for the application
    Receive(receive::ReceiveArgs),
    /// The operator console (web): overview, events, dead letters, audit log; and its users
    Console(console::ConsoleArgs),
    /// Check the delivery contract under faults: producers, relays (killed, stalled), broker and database outages, an inbox consumer
    Verify(verify::VerifyArgs),
    /// Print the shell completion script (bash, zsh, fish, elvish, powershell)
    Completions(completions::CompletionsArgs),
    /// Print the manual page (roff), or write one per command with --out-dir
    Man(man::ManArgs),
    /// Logical mode's replication slots: status (lag, retained WAL, invalidation) and drop
    Slot(slot::SlotArgs),
    /// Log mode's cursors: how far each destination is behind, whether a relay reads it, and drop (audited)
    Log(log::LogArgs),
    /// Consumer groups that pull from the log over SQL or HTTP: create, list (unread, in flight, dead letters, readers), dead letters, drop (audited), tokens, serve
    Group(group::GroupArgs),
    /// Routes, filters and transforms: `route test` shows what each destination would receive of one event
    Route(route::RouteArgs),
    /// Deliver retained events again to one destination: a rate-limited, resumable, audited job; list, show, resume, cancel
    Replay(replay::ReplayArgs),
}

/// mimalloc: see the dependency's comment in Cargo.toml.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Transparent huge pages off for this process (and the processes it
/// starts). With the kernel's THP set to `always`, mimalloc's arenas are
/// backed by 2 MiB pages as they are first touched: a claim-mode drain of
/// batch 1,000 peaked at 62–83 MB of RSS, against 32–33 MB with THP off
/// for the process, at the same speed (docs/performance.md). The kernel
/// checks the flag at each page fault, so setting it first thing covers
/// nearly all of the heap.
fn no_transparent_huge_pages() {
    #[cfg(target_os = "linux")]
    {
        #[allow(unsafe_code)]
        // SAFETY: prctl(PR_SET_THP_DISABLE, 1) takes no pointers and only
        // changes how the kernel backs this process's memory; a kernel
        // without it answers EINVAL, which leaves things as they were.
        let _ = unsafe { libc::prctl(libc::PR_SET_THP_DISABLE, 1, 0, 0, 0) };
    }
}

fn main() -> ExitCode {
    no_transparent_huge_pages();
    let matches = Cli::command().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    if let Some(refusal) = inapplicable_flag(&matches) {
        output::errln!("error: {refusal}");
        return ExitCode::from(2);
    }
    // Generated from the clap definitions alone: no settings, no log, no runtime.
    match cli.command {
        Command::Completions(args) => return completions::run(Cli::command(), args),
        Command::Man(args) => {
            return man::run(Cli::command(), args).unwrap_or_else(|e| {
                output::errln!("error: {}", error_chain(e.as_ref()));
                ExitCode::FAILURE
            })
        }
        _ => {}
    }
    let log_format = cli.global.log_format;
    let telemetry = init_logging(&cli.command, log_format);
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            output::errln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(run(cli));
    // The spans still buffered go out before the process ends.
    #[cfg(feature = "otel")]
    if let Some(exporter) = telemetry {
        exporter.shutdown();
    }
    #[cfg(not(feature = "otel"))]
    let () = telemetry;
    match result {
        Ok(code) => code,
        Err(e) if log_format == output::LogFormat::Json => {
            // A log pipeline gets the failure as a log line too.
            tracing::error!("{}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
        Err(e) => {
            output::errln!("error: {}", error_chain(e.as_ref()));
            ExitCode::FAILURE
        }
    }
}

/// The workloads (`bench`, `demo`, `verify`) make their own schemas and take
/// no config file: a `--schema` or `--config` typed for them is refused
/// rather than ignored.
fn inapplicable_flag(matches: &ArgMatches) -> Option<String> {
    let (name, sub) = matches.subcommand()?;
    let instead = match name {
        "bench" => "it benchmarks its own schema, --bench-schema",
        "demo" | "verify" => "it makes and drops its own schema",
        _ => return None,
    };
    let typed = |id: &str| {
        [matches, sub]
            .iter()
            .any(|m| m.value_source(id) == Some(ValueSource::CommandLine))
    };
    ["schema", "config"]
        .into_iter()
        .find(|id| typed(id))
        .map(|id| format!("`postbox {name}` does not use --{id}: {instead}"))
}

/// Resolve the shared settings, then run the command.
async fn run(cli: Cli) -> Result<ExitCode, AnyError> {
    let settings = Settings::resolve(&cli.global)?;
    let on_schema = !matches!(
        cli.command,
        Command::Bench(_) | Command::Demo(_) | Command::Verify(_)
    );
    let result = match cli.command {
        Command::Migrate(args) => migrate::run(&settings, args).await,
        Command::Enqueue(args) => enqueue::run(&settings, args).await,
        Command::Relay(args) => relay::run(&settings, args).await,
        Command::Status(args) => status::run(&settings, args).await,
        Command::Purge(args) => purge::run(&settings, args).await,
        Command::Dlq(args) => dlq::run(&settings, args).await,
        Command::Demo(args) => demo::run(&settings, args).await,
        Command::Bench(args) => bench::run(&settings, args).await,
        Command::Receive(args) => receive::run(&settings, args).await,
        Command::Console(args) => console::run(&settings, args).await,
        Command::Verify(args) => verify::run(&settings, args).await,
        Command::Completions(_) | Command::Man(_) => unreachable!("handled before the runtime"),
        Command::Slot(args) => slot::run(&settings, args).await,
        Command::Log(args) => log::run(&settings, args).await,
        Command::Group(args) => group::run(&settings, args).await,
        Command::Route(args) => route::run(&settings, args).await,
        Command::Replay(args) => replay::run(&settings, args).await,
    };
    match result {
        // Before `postbox migrate`, say so instead of "relation does not exist".
        Err(e) if on_schema => Err(settings.explain(e).await),
        other => other,
    }
}

/// The log: stderr, coloured only on a terminal (and not under `NO_COLOR`),
/// never failing the process when stderr is closed (see `output`); with
/// `--log-format json`, one JSON object per line (`output::json_log_layer`).
/// With the feature `otel` and an OTLP endpoint in the environment, the
/// spans of `postbox::otel` and `postbox_relay::otel` are exported too (see
/// `otel.rs`); they never reach the log, whose lines stay as they were.
#[cfg(feature = "otel")]
fn init_logging(command: &Command, format: output::LogFormat) -> Option<otel::Exporter> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let log = log_layer(format).with_filter(log_filter(command));
    let subscriber = tracing_subscriber::registry().with(log);
    let (endpoint, other_protocol) = match otel::wanted(|name| std::env::var(name).ok()) {
        otel::Wanted::Off => {
            subscriber.init();
            return None;
        }
        otel::Wanted::Otlp {
            endpoint,
            other_protocol,
        } => (endpoint, other_protocol),
    };
    let (exporter, layer) = match otel::Exporter::start() {
        Ok(started) => started,
        Err(e) => {
            subscriber.init();
            tracing::warn!("{}; going on without it", error_chain(&e));
            return None;
        }
    };
    let spans = otel::SPAN_TARGETS.iter().fold(
        tracing_subscriber::filter::Targets::new(),
        |targets, target| targets.with_target(*target, tracing::Level::INFO),
    );
    subscriber.with(layer.with_filter(spans)).init();
    tracing::info!(
        endpoint = %postbox::redact::display_url(&endpoint),
        "exporting OpenTelemetry traces over OTLP/HTTP"
    );
    if let Some(protocol) = other_protocol {
        tracing::warn!(
            "OTEL_EXPORTER_OTLP_PROTOCOL={protocol} is not built in: exporting over http/protobuf"
        );
    }
    Some(exporter)
}

/// The log alone (built without the feature `otel`).
#[cfg(not(feature = "otel"))]
fn init_logging(command: &Command, format: output::LogFormat) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::Layer;
    let log = log_layer(format).with_filter(log_filter(command));
    tracing_subscriber::registry().with(log).init();
}

type LogLayer = Box<dyn tracing_subscriber::Layer<tracing_subscriber::Registry> + Send + Sync>;

/// The log's formatting: text or JSON lines.
fn log_layer(format: output::LogFormat) -> LogLayer {
    if format == output::LogFormat::Json {
        return Box::new(output::json_log_layer());
    }
    Box::new(
        tracing_subscriber::fmt::layer()
            .with_writer(output::LogWriter)
            .with_ansi(output::stderr_colour())
            .log_internal_errors(false)
            .with_target(false),
    )
}

/// What the log shows: `POSTBOX_LOG`, else `RUST_LOG`, else
/// [`default_log_filter`]; never the exported spans.
fn log_filter(
    command: &Command,
) -> impl tracing_subscriber::layer::Filter<tracing_subscriber::Registry> {
    use tracing_subscriber::filter::{FilterExt, LevelFilter, Targets};
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_env("POSTBOX_LOG")
        .or_else(|_| EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| EnvFilter::new(default_log_filter(command)));
    let no_spans = ["postbox::otel", "postbox_relay::otel"].iter().fold(
        Targets::new().with_default(LevelFilter::TRACE),
        |targets, target| targets.with_target(*target, LevelFilter::OFF),
    );
    filter.and(no_spans)
}

/// The log filter when neither `POSTBOX_LOG` nor `RUST_LOG` is set. The
/// workloads (`bench`, `demo`, `verify`) migrate throwaway schemas over and
/// over: their "applied migration" lines would bury the results. The AMQP
/// client's own lines are off (they carry its internal debug dumps): the
/// relay reports every broker failure itself, in plain words. So do the
/// replication client's (logical mode's reader logs each stream failure with
/// what to set). The demo's queue fails on purpose (lost acknowledgements):
/// its report counts them, so the relay's "destination keeps failing" lines
/// would only alarm.
fn default_log_filter(command: &Command) -> &'static str {
    match command {
        Command::Demo(_) => {
            "info,sqlx=warn,sqlx::pool=error,lapin=off,pgwire_replication=off,async_nats=warn,postbox::sqlx=warn,postbox_relay::engine::publish=error,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn"
        }
        Command::Bench(_) | Command::Verify(_) => {
            "info,sqlx=warn,lapin=off,pgwire_replication=off,async_nats=warn,postbox::sqlx=warn,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn"
        }
        _ => "info,sqlx=warn,lapin=off,pgwire_replication=off,async_nats=warn,opentelemetry=warn,opentelemetry_sdk=warn,opentelemetry_otlp=warn",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn command(args: &[&str]) -> Command {
        Cli::try_parse_from(std::iter::once("postbox").chain(args.iter().copied()))
            .unwrap()
            .command
    }

    #[test]
    fn the_workloads_keep_migration_lines_out_of_their_results() {
        for args in [&["bench"][..], &["demo"], &["verify"]] {
            assert!(
                default_log_filter(&command(args)).contains("postbox::sqlx=warn"),
                "{args:?}"
            );
        }
        assert!(!default_log_filter(&command(&["migrate"])).contains("postbox::sqlx"));
        // The demo's failures are simulated and counted in its report.
        assert!(default_log_filter(&command(&["demo"]))
            .contains("postbox_relay::engine::publish=error"));
    }

    #[test]
    fn the_workloads_refuse_schema_and_config_typed_for_them() {
        let refusal = |args: &[&str]| {
            let matches = Cli::command()
                .try_get_matches_from(std::iter::once("postbox").chain(args.iter().copied()))
                .unwrap();
            inapplicable_flag(&matches)
        };
        assert!(refusal(&["bench", "--schema", "x"])
            .unwrap()
            .contains("does not use --schema"));
        assert!(refusal(&["--config", "c.toml", "verify"])
            .unwrap()
            .contains("does not use --config"));
        assert_eq!(refusal(&["status", "--schema", "x"]), None);
        assert_eq!(refusal(&["--schema", "x", "migrate"]), None);
    }
}

/// The book's code, checked against the binary: every ```toml block of the
/// docs parses as the configuration file (unknown keys are errors, so a
/// renamed key fails here), and every `postbox …` command line of a ```sh
/// block parses with the CLI's own definition (a renamed flag fails here).
#[cfg(test)]
mod book {
    use super::*;
    use std::path::{Path, PathBuf};

    fn pages() -> Vec<PathBuf> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut out = vec![root.join("README.md")];
        let mut dirs = vec![root.join("docs")];
        while let Some(dir) = dirs.pop() {
            for entry in std::fs::read_dir(&dir).unwrap().flatten() {
                let path = entry.path();
                if path.is_dir() {
                    dirs.push(path);
                } else if path.extension().is_some_and(|e| e == "md") {
                    out.push(path);
                }
            }
        }
        out
    }

    /// (page, first line, info string, text) of every fenced block.
    fn blocks() -> Vec<(String, usize, String, String)> {
        let mut out = Vec::new();
        for page in pages() {
            let text = std::fs::read_to_string(&page).unwrap();
            let mut open: Option<(usize, String, String)> = None;
            for (n, line) in text.lines().enumerate() {
                let trimmed = line.trim_start();
                match &mut open {
                    None if trimmed.starts_with("```") => {
                        open = Some((n + 1, trimmed[3..].trim().to_owned(), String::new()));
                    }
                    Some((start, info, body)) if trimmed.starts_with("```") => {
                        out.push((
                            page.display().to_string(),
                            *start,
                            info.clone(),
                            body.clone(),
                        ));
                        open = None;
                    }
                    Some((_, _, body)) => {
                        body.push_str(line);
                        body.push('\n');
                    }
                    None => {}
                }
            }
        }
        out
    }

    /// A shell line's words: quotes group, `#` starts a comment.
    fn words(line: &str) -> Vec<String> {
        let (mut out, mut word, mut quote, mut any) = (Vec::new(), String::new(), None, false);
        for c in line.chars() {
            match (quote, c) {
                (None, '#') if word.is_empty() => break,
                (None, '\'' | '"') => {
                    quote = Some(c);
                    any = true;
                }
                (Some(q), c) if c == q => quote = None,
                (None, c) if c.is_whitespace() => {
                    if any {
                        out.push(std::mem::take(&mut word));
                        any = false;
                    }
                }
                (_, c) => {
                    word.push(c);
                    any = true;
                }
            }
        }
        if any {
            out.push(word);
        }
        out
    }

    #[test]
    fn every_toml_block_of_the_book_is_a_valid_configuration() {
        let mut checked = 0;
        for (page, line, info, body) in blocks() {
            if info != "toml" {
                continue;
            }
            if let Err(e) = config::FileConfig::parse(&body) {
                panic!("{page}:{line}: the ```toml block is not a valid configuration: {e}");
            }
            checked += 1;
        }
        assert!(checked >= 5, "found {checked} toml blocks");
    }

    #[test]
    fn every_postbox_command_of_the_book_parses() {
        let mut checked = 0;
        for (page, line, info, body) in blocks() {
            if info != "sh" {
                continue;
            }
            let mut joined = String::new();
            for (i, text) in body.lines().enumerate() {
                // Lines continued with a backslash are one command.
                if let Some(head) = text.strip_suffix('\\') {
                    joined.push_str(head);
                    continue;
                }
                joined.push_str(text);
                let command = std::mem::take(&mut joined);
                let mut w = words(&command);
                // Environment assignments and the binary's path before it.
                while w
                    .first()
                    .is_some_and(|x| x.contains('=') && !x.starts_with('-'))
                {
                    w.remove(0);
                }
                if w.first().is_some_and(|x| x == "sudo") {
                    w.remove(0);
                }
                let is_postbox = w
                    .first()
                    .is_some_and(|x| x == "postbox" || x.ends_with("/postbox"));
                // Pipes, redirections and substitutions are not ours to
                // parse; a synopsis (`[--json]`) is not a command.
                let synopsis = w.iter().any(|x| x.starts_with('[') || x.contains("..."));
                if !is_postbox || synopsis || command.contains(['|', '>', '<', '$', '…']) {
                    continue;
                }
                if let Err(e) = Cli::try_parse_from(&w) {
                    // --help and --version exit early: that is a parse.
                    if !matches!(
                        e.kind(),
                        clap::error::ErrorKind::DisplayHelp
                            | clap::error::ErrorKind::DisplayVersion
                    ) {
                        panic!(
                            "{page}:{}: `{}` does not parse: {e}",
                            line + i + 1,
                            command.trim()
                        );
                    }
                }
                checked += 1;
            }
        }
        assert!(checked >= 20, "found {checked} postbox commands");
    }
}
