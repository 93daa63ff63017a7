#!/usr/bin/env bash
# A PostgreSQL server for the tests that need one. Installs PostgreSQL if it is missing (Debian, as root),
# starts the first cluster, makes a login role allowed to create databases (each test makes its own) and a
# database for it, and prints the URL to export as SWARMRL_TEST_PG_URL:
#   export SWARMRL_TEST_PG_URL="$(scripts/test-postgres.sh)"
# Safe to run again. Everything it says besides the URL goes to stderr.
set -euo pipefail
# Only the URL goes to stdout: whatever the tools print (pg_ctlcluster says "Removed stale pid file." after an
# unclean stop) goes to stderr, so a caller's $(...) holds the URL alone.
exec 3>&1 1>&2
user="${SWARMRL_TEST_PG_USER:-swarmrl_test}"
password="${SWARMRL_TEST_PG_PASSWORD:-swarmrl_test}"
db="${SWARMRL_TEST_PG_DB:-swarmrl_test}"
if ! command -v pg_lsclusters >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        echo "installing postgresql" >&2
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) >/dev/null
    else
        echo "postgresql is missing: install it (apt-get install postgresql), then run this again" >&2
        exit 1
    fi
fi
read -r version cluster port status _ < <(pg_lsclusters -h | head -n 1)
if [ "$status" != online ]; then
    echo "starting PostgreSQL $version/$cluster on port $port" >&2
    pg_ctlcluster "$version" "$cluster" start 3>&-  # the server must not hold the caller's pipe open
fi
# The server runs as (and trusts over its socket) the postgres user, not root.
psql_admin() { su postgres -c "psql -X -q -p $port -v ON_ERROR_STOP=1 $*"; }
if [ -z "$(psql_admin "-tAc \"SELECT 1 FROM pg_roles WHERE rolname = '$user'\"")" ]; then
    psql_admin "-c \"CREATE ROLE $user LOGIN CREATEDB PASSWORD '$password'\""
fi
if [ -z "$(psql_admin "-tAc \"SELECT 1 FROM pg_database WHERE datname = '$db'\"")" ]; then
    psql_admin "-c \"CREATE DATABASE $db OWNER $user\""
fi
echo "postgresql+psycopg://$user:$password@127.0.0.1:$port/$db" >&3
