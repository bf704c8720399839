#!/usr/bin/env bash
# Set up hermes-batch and run a small batch.
# With OPENROUTER_API_KEY set, the batch runs against OpenRouter; without it,
# against the scripted model server of hermes_batch.testing on 127.0.0.1
# (a stand-in that answers like a model, so the demo works offline).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/python.sh

VENV=${HERMES_BATCH_VENV:-.venv}
ensure_venv "$VENV"
install_once "$VENV" demo -e '.[testing]'  # pip only the first time, or after a pyproject.toml changed

args=(--dataset_file examples/prompts.jsonl --batch_size 2 --run_name demo --num_workers 4 --overwrite "$@")
if [ -n "${OPENROUTER_API_KEY:-}" ]; then
    exec "$VENV/bin/hermes-batch" run "${args[@]}"
fi

log=$(mktemp)
"$VENV/bin/python" -m hermes_batch.testing.server --port 0 --latency 0.2 --tool-calls 2 >"$log" &
server=$!
trap 'kill $server 2>/dev/null || true; rm -f "$log"' EXIT
for _ in $(seq 100); do grep -q '^READY' "$log" && break; sleep 0.1; done
url=$(awk '/^READY/ {print $2}' "$log")
[ -n "$url" ] || { echo "the scripted model server did not start" >&2; cat "$log" >&2; exit 1; }
echo "No OPENROUTER_API_KEY: running against the scripted model server at $url" >&2
"$VENV/bin/hermes-batch" run "${args[@]}" --base_url "$url" --model scripted-model --api_key demo
echo "Outputs: data/demo/ (trajectories.jsonl, statistics.json)" >&2
