#!/usr/bin/env bash
# A local PostgreSQL for the tuning farm's Optuna storage, its files in a folder of your choice.
#   bash scripts/pg_local.sh start pgdata          # initdb on first use, start, print the storage URL
#   bash scripts/pg_local.sh start pgdata --listen '*' --password S3cret   # other hosts may join
#   bash scripts/pg_local.sh url|status|stop pgdata
# Needs the server programs initdb/pg_ctl/postgres (Debian/Ubuntu: apt-get install postgresql) and the
# psycopg driver (dev extras). As root the server runs as the 'postgres' account. See autotune/tuning/pg_local.py.
set -euo pipefail
_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
_py=python3
if [ -x "$_root/.venv/bin/python" ]; then _py="$_root/.venv/bin/python"; fi
PYTHONPATH="$_root${PYTHONPATH:+:$PYTHONPATH}" exec "$_py" -m autotune.tuning.pg_local "$@"
