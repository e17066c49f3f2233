#!/usr/bin/env bash
# The test command: sets up what the tests need on a fresh Debian machine of
# the project's kind (PostgreSQL 15 with wal_level = logical and replication
# entries, Redis, NATS with JetStream, RabbitMQ, moto, tansu, Chromium, the
# Python signers), starting what is down and installing what is missing with
# one line per step, then runs every test binary of the workspace (no stop at
# the first failing one). Arguments go to `cargo test`:
#   ./test.sh                      every test
#   ./test.sh -p postbox-relay     one crate's tests
set -euo pipefail
cd "$(dirname "$0")"

log() { printf '[test] %s\n' "$*"; }

wait_for() { # $1: what, $2...: command that succeeds when ready
  local what=$1; shift
  for _ in $(seq 1 120); do
    if "$@" >/dev/null 2>&1; then log "$what is ready"; return 0; fi
    sleep 0.5
  done
  log "$what did not become ready"; return 1
}

# PostgreSQL
if ! pg_isready -h 127.0.0.1 -p 5432 >/dev/null 2>&1; then
  log "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main start || true
fi
wait_for PostgreSQL pg_isready -h 127.0.0.1 -p 5432

# Logical mode's tests read replication slots: the server needs
# wal_level = logical, which takes a restart.
if [ "$(psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SHOW wal_level')" != logical ]; then
  log "setting wal_level = logical and restarting PostgreSQL"
  psql -h 127.0.0.1 -U postgres -d postgres -qc 'ALTER SYSTEM SET wal_level = logical'
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql)" main restart
  wait_for PostgreSQL pg_isready -h 127.0.0.1 -p 5432
fi

# Logical mode reads its slot over a replication connection, which pg_hba.conf
# admits only through a `replication` entry (`all` does not cover it).
hba=$(psql -h 127.0.0.1 -U postgres -d postgres -Atc 'SHOW hba_file')
hba_added=
if ! grep -Eq '^[[:space:]]*host[[:space:]]+replication[[:space:]]+all[[:space:]]+127\.0\.0\.1/32' "$hba"; then
  echo 'host replication all 127.0.0.1/32 trust' >> "$hba"; hba_added=1
fi
if ! grep -Eq '^[[:space:]]*local[[:space:]]+replication[[:space:]]+all' "$hba"; then
  echo 'local replication all trust' >> "$hba"; hba_added=1
fi
if [ -n "$hba_added" ]; then
  log "allowing local replication connections in $hba"
  psql -h 127.0.0.1 -U postgres -d postgres -qAtc 'SELECT pg_reload_conf()' >/dev/null
fi

# A test run killed half-way can leave its replication slots behind, and the
# server has room for only max_replication_slots (10 by default): drop the
# unread slots named like the tests' own (pbx_*, postbox_<test schema>,
# postbox_verify_*, the benches' *_slot of a bench_t_/t_…_bench schema).
stale=$(psql -h 127.0.0.1 -U postgres -d postgres -Atc "SELECT count(pg_drop_replication_slot(slot_name)) FROM pg_replication_slots WHERE NOT active AND slot_name ~ '^(pbx_|postbox_t_|postbox_tn|postbox_verify_|bench_t_.*_slot$|t_[0-9a-f]+_bench_slot$)'")
if [ "${stale:-0}" != 0 ]; then
  log "dropped $stale replication slots left behind by an earlier test run"
fi

# Redis
if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
  log "starting Redis"
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
wait_for Redis redis-cli -h 127.0.0.1 -p 6379 ping

# NATS with JetStream
if ! (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then
  log "starting NATS"
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
    -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
fi
wait_for "NATS with JetStream" bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222 && timeout 2 head -n 1 <&3 | grep -q "\"jetstream\":true"'

# RabbitMQ
if ! (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then
  log "starting RabbitMQ"
  rabbitmq-server -detached || true
fi
wait_for RabbitMQ rabbitmqctl await_startup --timeout 120

# moto in server mode: an AWS-compatible server (SQS, SNS, Kinesis) for the
# AWS sinks' tests, on 127.0.0.1:5000 (POSTBOX_TEST_AWS).
if ! python3 -c 'import moto.server, flask, flask_cors' >/dev/null 2>&1; then
  log "installing moto[server] for the AWS sinks' tests"
  python3 -m pip install --quiet 'moto[server]'
fi
if ! (exec 3<>/dev/tcp/127.0.0.1/5000) 2>/dev/null; then
  log "starting moto_server"
  setsid nohup python3 -m moto.server -H 127.0.0.1 -p 5000 >/tmp/moto-server.log 2>&1 < /dev/null &
fi
wait_for "moto (AWS)" python3 -c 'import urllib.request; urllib.request.urlopen("http://127.0.0.1:5000/moto-api/", timeout=2)'
export POSTBOX_TEST_AWS=127.0.0.1:5000

# Tools the tests need on a fresh machine.
if ! python3 -c 'import standardwebhooks, jwt' >/dev/null 2>&1; then
  log "installing the independent signers used by the receiver tests"
  python3 -m pip install --quiet standardwebhooks pyjwt
fi
# PgQ, the peer `postbox bench --peers pgq` compares log mode with (its
# test runs the comparison on tiny inputs).
pg_major=$(ls /etc/postgresql | sort -n | tail -1)
if [ ! -f "/usr/share/postgresql/$pg_major/extension/pgq.control" ]; then
  log "installing PgQ (postgresql-$pg_major-pgq3) for the bench's peer row"
  apt-get install -y -q "postgresql-$pg_major-pgq3" >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null && apt-get install -y -q "postgresql-$pg_major-pgq3" >/dev/null; }
fi
# jq, the reference the filters-and-transforms page's examples are checked
# against (postbox runs them through jaq).
if ! command -v jq >/dev/null 2>&1; then
  log "installing jq (the reference for the book's jq examples)"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq jq >/dev/null 2>&1 \
    || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq jq >/dev/null; }
fi
# The book's Python inbox consumer (docs/consuming.md) runs on psycopg 3.
if ! python3 -c 'import psycopg' >/dev/null 2>&1; then
  log "installing psycopg for the book's Python consumer"
  python3 -m pip install --quiet 'psycopg[binary]'
fi

# The book's Node.js group reader (docs/consumer-groups.md) runs on pg,
# installed globally (the test puts `npm root -g` on NODE_PATH).
if ! NODE_PATH="$(npm root -g)" node -e 'require("pg")' >/dev/null 2>&1; then
  log "installing pg for the book's Node.js group reader"
  npm install -g --silent pg@8 >/dev/null
fi

# Headless Chromium and its WebDriver, for the console's browser tests (which
# fail under CI when these are missing).
if [ ! -x /usr/bin/chromedriver ] || [ ! -x /usr/bin/chromium ]; then
  log "installing chromium and chromium-driver for the console's browser tests"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null
fi

# The Kafka sink (on by default in postbox-cli, so `cargo test --workspace`
# builds it) compiles the bundled librdkafka: a C compiler and make.
if ! command -v cc >/dev/null 2>&1 || ! command -v make >/dev/null 2>&1; then
  log "installing a C compiler and make for librdkafka"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq build-essential >/dev/null
fi

# A Kafka-protocol broker for the Kafka sink's conformance test: tansu, an
# Apache-Kafka-compatible broker published as a Rust crate, with in-memory
# storage (feature dynostore), on 127.0.0.1:9092 (KAFKA_BROKERS). A debug
# build is enough for a test broker and takes a few minutes on 2 cores.
TANSU="${POSTBOX_TANSU_ROOT:-$HOME/.cache/postbox/tansu}/bin/tansu"
if [ ! -x "$TANSU" ]; then
  log "installing tansu (a Kafka-protocol broker) for the Kafka sink's tests"
  cargo install tansu --version 0.6.0 --locked --debug --features dynostore \
    --root "$(dirname "$(dirname "$TANSU")")" --quiet
fi
if ! (exec 3<>/dev/tcp/127.0.0.1/9092) 2>/dev/null; then
  log "starting tansu"
  setsid nohup "$TANSU" broker --listener-url tcp://127.0.0.1:9092 \
    --advertised-listener-url tcp://127.0.0.1:9092 --storage-engine memory://tansu/ \
    >/tmp/tansu-broker.log 2>&1 < /dev/null &
fi
wait_for "tansu (Kafka)" bash -c 'exec 3<>/dev/tcp/127.0.0.1/9092'
export KAFKA_BROKERS=127.0.0.1:9092

export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"
log "running the tests: cargo test --workspace --no-fail-fast $*"
exec cargo test --workspace --no-fail-fast "$@"
