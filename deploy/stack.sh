#!/usr/bin/env bash
# The team stack without Docker, started as an operator would: Debian's PostgreSQL in a data directory of its own
# (one database each for Prefect and MLflow), the Prefect server on it, the MLflow tracking server on it with its
# artifacts in an S3 store (moto's standalone server unless LIFECYCLE_S3_ENDPOINT names a real one), a Prefect
# process worker on the work pool `lifecycle`, and the deployments of deploy/prefect.yaml registered.
#
#   deploy/stack.sh [--env-file FILE] start [SERVICE...]   # all, or some of: postgres s3 mlflow prefect worker deploy
#   deploy/stack.sh [--env-file FILE] stop [SERVICE...]    # all (worker first, postgres last), or the ones named
#   deploy/stack.sh [--env-file FILE] status               # one line per service: up/down, pid, URL
#   eval "$(deploy/stack.sh env)"                          # PREFECT_API_URL, MLFLOW_TRACKING_URI for clients
#
# Settings come from the environment, else from the env file (default deploy/.env; deploy/env.example lists them).
# Secrets (POSTGRES_PASSWORD, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) never reach a command line, a URL or a
# service's environment: the servers read them from files made here, mode 0600, in $LIFECYCLE_STACK_DIR/secrets
# (libpq's PGPASSFILE, a Prefect profile at PREFECT_PROFILES_PATH, boto3's AWS_SHARED_CREDENTIALS_FILE), and the
# worker, which runs the flows, gets neither. Any character but a control character works in the Postgres password.
# State, logs and pid files live in $LIFECYCLE_STACK_DIR. docs/operations.md, "The team stack".
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(dirname "$HERE")
ENV_FILE=${LIFECYCLE_ENV_FILE:-$HERE/.env}
if [[ ${1:-} == --env-file ]]; then ENV_FILE=${2:?--env-file needs a file}; shift 2; fi
SECRETS=(POSTGRES_PASSWORD AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY)
ALL=(postgres s3 mlflow prefect worker deploy)

die() { echo "stack: $*" >&2; exit 2; }

load_env_file() {  # KEY=VALUE lines (never sourced: no code runs from it); the environment wins over the file
    [[ -f $ENV_FILE ]] || return 0
    local n=0 line key value
    if [[ $(stat -c %a "$ENV_FILE") != [4-7]00 ]]; then
        echo "stack: warning: $ENV_FILE is readable by other users (chmod 600 it): it holds the passwords" >&2
    fi
    while IFS= read -r line || [[ -n $line ]]; do
        n=$((n + 1))
        [[ $line =~ ^[[:space:]]*(#|$) ]] && continue
        [[ $line =~ ^[[:space:]]*([A-Za-z_][A-Za-z0-9_]*)=(.*)$ ]] || die "$ENV_FILE, line $n: expected KEY=VALUE"
        key=${BASH_REMATCH[1]} value=${BASH_REMATCH[2]}
        [[ $value =~ ^\"(.*)\"$ || $value =~ ^\'(.*)\'$ ]] && value=${BASH_REMATCH[1]}
        [[ -n ${!key+set} ]] || printf -v "$key" '%s' "$value"
    done < "$ENV_FILE"
}

settings() {
    load_env_file
    export -n "${SECRETS[@]}" 2>/dev/null || true  # kept in this shell only: no child inherits them
    STACK=${LIFECYCLE_STACK_DIR:-$HOME/.local/state/lifecycle-stack}
    WORK=${LIFECYCLE_WORK:-$STACK/work}
    BIND=${LIFECYCLE_BIND:-127.0.0.1}
    PG_PORT=${POSTGRES_PORT:-5432} PREFECT_PORT=${PREFECT_PORT:-4200} MLFLOW_PORT=${MLFLOW_PORT:-5000}
    S3_PORT=${S3_PORT:-9000}
    S3_ENDPOINT=${LIFECYCLE_S3_ENDPOINT:-http://$BIND:$S3_PORT}
    ARTIFACTS=${LIFECYCLE_ARTIFACTS:-s3://lifecycle-artifacts/mlflow}
    VENV=${LIFECYCLE_VENV:-$REPO/.venv}
    PG_BIN=${PG_BIN:-$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1)}
    PG_USER=${LIFECYCLE_PG_USER:-postgres}  # the OS user Postgres runs as when this script runs as root
    PG_ROLE=lifecycle
    PREFECT_URL=http://$BIND:$PREFECT_PORT/api
    MLFLOW_URL=http://$BIND:$MLFLOW_PORT
    STACK=$(mkdir -p "$STACK" && cd "$STACK" && pwd)
    mkdir -p "$STACK"/{logs,pids,secrets} "$WORK"
    chmod 700 "$STACK/secrets"
}

pidfile() { echo "$STACK/pids/$1.pid"; }
running() { local f; f=$(pidfile "$1"); [[ -f $f ]] && kill -0 "$(cat "$f")" 2>/dev/null; }

spawn() {  # spawn NAME ENV... -- CMD...: a new session (its own process group), log and pid file in $STACK
    local name=$1; shift
    local envs=()
    while [[ $1 != -- ]]; do envs+=("$1"); shift; done; shift
    running "$name" && { echo "stack: $name already up (pid $(cat "$(pidfile "$name")"))"; return 0; }
    # only what the service needs: PATH, HOME, locale and the settings given; no variable of the caller's shell
    setsid env -i PATH="$VENV/bin:/usr/bin:/bin:/usr/sbin:/sbin" HOME="$HOME" LANG=C.UTF-8 "${envs[@]}" "$@" \
        >> "$STACK/logs/$name.log" 2>&1 < /dev/null &
    echo $! > "$(pidfile "$name")"
}

tool() { "$VENV/bin/python" "$HERE/stack_tool.py" "$@"; }

write_secret_files() {
    [[ -n ${POSTGRES_PASSWORD:-} ]] || die "set POSTGRES_PASSWORD in the environment or $ENV_FILE (deploy/env.example)"
    [[ $POSTGRES_PASSWORD != *[[:cntrl:]]* ]] || die "POSTGRES_PASSWORD must not hold control characters"
    local pg=${POSTGRES_PASSWORD//\\/\\\\} toml=${POSTGRES_PASSWORD//\\/\\\\}
    pg=${pg//:/\\:} toml=${toml//\"/\\\"}  # libpq's pgpass escapes `\` and `:`; a TOML string `\` and `"`
    (umask 077; printf '%s:%s:*:%s:%s\n' "$BIND" "$PG_PORT" "$PG_ROLE" "$pg" > "$STACK/secrets/pgpass")
    # the Prefect server's asyncpg (0.32) reads a pgpass file without undoing those escapes: it gets the password
    # as a Prefect setting from a profiles file instead, and Prefect puts it in its URL with SQLAlchemy's quoting
    (umask 077; printf 'active = "stack"\n[profiles.stack]\nPREFECT_SERVER_DATABASE_PASSWORD = "%s"\n' "$toml" \
        > "$STACK/secrets/prefect-profiles.toml")
    (umask 077; printf '[default]\naws_access_key_id = %s\naws_secret_access_key = %s\n' \
        "${AWS_ACCESS_KEY_ID:-lifecycle}" "${AWS_SECRET_ACCESS_KEY:-${POSTGRES_PASSWORD}-s3}" \
        > "$STACK/secrets/aws-credentials")
}

as_pg() {  # Postgres refuses to run as root: as root, run it as $PG_USER
    if [[ $(id -u) -eq 0 ]]; then runuser -u "$PG_USER" -- "$@"; else "$@"; fi
}

start_postgres() {
    [[ -x $PG_BIN/pg_ctl ]] || die "PostgreSQL's pg_ctl is not in ${PG_BIN:-/usr/lib/postgresql/*/bin}" \
        "(deploy/system-packages.sh installs Debian's postgresql)"
    local dir=$STACK/postgres fresh=0
    mkdir -p "$dir/run"
    if [[ $(id -u) -eq 0 ]]; then
        chown -R "$PG_USER" "$dir"
        as_pg test -x "$dir" || die "$dir: user $PG_USER cannot reach it (make every folder above it o+x)"
    fi
    if [[ ! -f $dir/data/PG_VERSION ]]; then
        local pwfile=$dir/.pw
        (umask 077; printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile")
        [[ $(id -u) -eq 0 ]] && chown "$PG_USER" "$pwfile"
        as_pg "$PG_BIN/initdb" -D "$dir/data" -U "$PG_ROLE" --pwfile="$pwfile" -E UTF8 --no-locale \
            --auth-local=scram-sha-256 --auth-host=scram-sha-256 > "$STACK/logs/postgres-initdb.log" 2>&1 \
            || { rm -f "$pwfile"; die "initdb failed: $STACK/logs/postgres-initdb.log"; }
        rm -f "$pwfile"
        fresh=1
    fi
    if ! as_pg "$PG_BIN/pg_ctl" -D "$dir/data" status > /dev/null 2>&1; then
        as_pg "$PG_BIN/pg_ctl" -D "$dir/data" -l "$dir/postgres.log" -w -t 60 \
            -o "-c listen_addresses=$BIND -p $PG_PORT -k $dir/run" start > /dev/null \
            || die "Postgres did not start: $dir/postgres.log"
    fi
    head -n 1 "$dir/data/postmaster.pid" > "$(pidfile postgres)"
    if [[ $fresh -eq 1 ]]; then  # what compose's postgres image does with docker-entrypoint-initdb.d
        PGPASSFILE=$STACK/secrets/pgpass "$PG_BIN/psql" -q -v ON_ERROR_STOP=1 \
            "host=$BIND port=$PG_PORT user=$PG_ROLE dbname=postgres" -f "$HERE/postgres-init.sql" \
            || die "creating the databases (deploy/postgres-init.sql) failed"
    fi
}

start_s3() {
    [[ -n ${LIFECYCLE_S3_ENDPOINT:-} ]] && return 0  # a real S3 store: nothing to start here
    spawn s3 -- moto_server -H "$BIND" -p "$S3_PORT"
    tool wait "$S3_ENDPOINT/moto-api/" 60 "$(cat "$(pidfile s3)")"
    make_bucket  # moto keeps its buckets in memory: a restarted one has none
}

make_bucket() {
    AWS_SHARED_CREDENTIALS_FILE=$STACK/secrets/aws-credentials MLFLOW_S3_ENDPOINT_URL=$S3_ENDPOINT \
        tool bucket "$ARTIFACTS"
}

start_mlflow() {
    make_bucket
    spawn mlflow PGPASSFILE="$STACK/secrets/pgpass" AWS_SHARED_CREDENTIALS_FILE="$STACK/secrets/aws-credentials" \
        AWS_DEFAULT_REGION=us-east-1 MLFLOW_S3_ENDPOINT_URL="$S3_ENDPOINT" \
        MLFLOW_BACKEND_STORE_URI="postgresql://$PG_ROLE@$BIND:$PG_PORT/mlflow" \
        MLFLOW_ARTIFACTS_DESTINATION="$ARTIFACTS" -- \
        mlflow server --host "$BIND" --port "$MLFLOW_PORT" --workers 1 \
        --allowed-hosts "$BIND:$MLFLOW_PORT,localhost:$MLFLOW_PORT,127.0.0.1:$MLFLOW_PORT"
    tool wait "$MLFLOW_URL/health" 180 "$(cat "$(pidfile mlflow)")"
}

start_prefect() {
    spawn prefect PREFECT_PROFILES_PATH="$STACK/secrets/prefect-profiles.toml" PREFECT_HOME="$STACK/prefect-server" \
        PREFECT_SERVER_DATABASE_DRIVER=postgresql+asyncpg PREFECT_SERVER_DATABASE_HOST="$BIND" \
        PREFECT_SERVER_DATABASE_PORT="$PG_PORT" PREFECT_SERVER_DATABASE_USER="$PG_ROLE" \
        PREFECT_SERVER_DATABASE_NAME=prefect \
        PREFECT_SERVER_ANALYTICS_ENABLED=false DO_NOT_TRACK=1 \
        ${PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS:+PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS=$PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS} \
        -- prefect server start --host "$BIND" --port "$PREFECT_PORT"
    tool wait "$PREFECT_URL/health" 180 "$(cat "$(pidfile prefect)")"
}

client_env() {  # CLIENT_ENV: what the worker, `deploy` and users' clients get: URLs and paths, no secret
    CLIENT_ENV=(PREFECT_API_URL="$PREFECT_URL" MLFLOW_TRACKING_URI="$MLFLOW_URL" LIFECYCLE_HOME="$REPO"
                LIFECYCLE_WORK="$WORK" DS_ACCELERATOR="${DS_ACCELERATOR:-cpu}" PREFECT_SERVER_ANALYTICS_ENABLED=false
                ${PYTHONPATH:+PYTHONPATH="$PYTHONPATH"})
}

start_worker() {
    # the flow sends a heartbeat every 30 s, so the zombie automation (deploy) marks a dead run Crashed
    client_env
    spawn worker "${CLIENT_ENV[@]}" PREFECT_HOME="$STACK/prefect-worker" PREFECT_RUNNER_HEARTBEAT_FREQUENCY=30 \
        ${PREFECT_WORKER_QUERY_SECONDS:+PREFECT_WORKER_QUERY_SECONDS=$PREFECT_WORKER_QUERY_SECONDS} \
        ${LIFECYCLE_EMBEDDED_MAX:+LIFECYCLE_EMBEDDED_MAX=$LIFECYCLE_EMBEDDED_MAX} \
        -- prefect worker start --pool lifecycle --type process --name "lifecycle-$(hostname)"
}

start_deploy() {  # the work pool, the deployments of deploy/prefect.yaml, the zombie-run automation
    local log=$STACK/logs/deploy.log
    client_env
    (cd "$REPO" && env -i PATH="$VENV/bin:/usr/bin:/bin" HOME="$HOME" LANG=C.UTF-8 "${CLIENT_ENV[@]}" \
        PREFECT_HOME="$STACK/prefect-client" sh -c '
        prefect work-pool inspect lifecycle > /dev/null 2>&1 || prefect work-pool create lifecycle --type process
        prefect --no-prompt deploy --all --prefect-file deploy/prefect.yaml
        python -c "from lifecycle.flows.serve import ensure_zombie_automation as z; z()"') >> "$log" 2>&1 \
        || die "registering the deployments failed: $log"
    echo "stack: deployments registered ($(grep -c '^  - name:' "$HERE/prefect.yaml") from deploy/prefect.yaml)"
}

stop_one() {
    local name=$1 f pid
    if [[ $name == postgres ]]; then
        [[ -f $STACK/postgres/data/PG_VERSION ]] || return 0
        as_pg "$PG_BIN/pg_ctl" -D "$STACK/postgres/data" -m fast -w -t 60 stop > /dev/null 2>&1 || true
        rm -f "$(pidfile postgres)"
        return 0
    fi
    f=$(pidfile "$name"); [[ -f $f ]] || return 0
    pid=$(cat "$f")
    if kill -0 "$pid" 2>/dev/null; then
        kill -TERM -- "-$pid" 2>/dev/null || true  # the session spawn made: the service and its children
        for _ in $(seq 1 40); do kill -0 "$pid" 2>/dev/null || break; sleep 0.5; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    fi
    rm -f "$f"
}

status() {
    local name
    for name in postgres s3 mlflow prefect worker; do
        if running "$name"; then echo "$name: up (pid $(cat "$(pidfile "$name")"))"; else echo "$name: down"; fi
    done
    echo "prefect: $PREFECT_URL  mlflow: $MLFLOW_URL  artifacts: $ARTIFACTS at $S3_ENDPOINT  work: $WORK"
}

main() {
    local cmd=${1:-}; shift || true
    settings
    local services=("$@"); [[ ${#services[@]} -gt 0 ]] || services=("${ALL[@]}")
    case $cmd in
        start)  # a worker-only host (`start worker`) needs no secret
            [[ " ${services[*]} " =~ \ (postgres|s3|mlflow|prefect)\  ]] && write_secret_files
            for s in "${ALL[@]}"; do  # in dependency order, whatever order they were named in
                [[ " ${services[*]} " == *" $s "* ]] || continue
                "start_$s"
                echo "stack: $s up"
            done ;;
        stop)
            for s in worker prefect mlflow s3 postgres; do
                [[ " ${services[*]} " == *" $s "* ]] && stop_one "$s"
            done
            echo "stack: stopped ${services[*]}" ;;
        status) status ;;
        env) client_env; printf 'export %q\n' "${CLIENT_ENV[@]}" ;;
        *) die "usage: deploy/stack.sh [--env-file FILE] start|stop [SERVICE...] | status | env" ;;
    esac
}

main "$@"; exit $?  # on one line: bash never reads past it, so editing this file mid-run is safe
