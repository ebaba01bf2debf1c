#!/usr/bin/env bash
# The tiny CPU demo: ZCPO on the embedded default (a 2-layer Qwen2 partly warmed up on two-digit addition),
# TP=2 over gloo, embedded rollout engine; no GPU, no network, a few minutes on 2 cores.
# The config is megatron_zcpo/cli/demo.yaml; `zcpo demo` fills in the cached model and data paths.
#
#   examples/cpu-demo/run.sh             # zcpo demo: ZCPO, held-out accuracy before/after, plots
#   examples/cpu-demo/run.sh --compare   # then DAPO (no KL), DAPO + k3 KL and ZCPO side by side
#   examples/cpu-demo/run.sh --steps 10  # any other flag goes to both commands
#
# Uses `zcpo` from the active environment, else installs one into .venv with `make install`.
set -euo pipefail
cd "$(dirname "$0")/../.."

compare=false
args=()
for arg in "$@"; do
    if [[ "${arg}" == --compare ]]; then compare=true; else args+=("${arg}"); fi
done

if ! command -v zcpo >/dev/null 2>&1; then
    make install
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi

zcpo demo --out runs/demo "${args[@]}"
if "${compare}"; then
    zcpo demo --compare --out runs/demo-compare "${args[@]}"
fi
echo "results: runs/demo (and runs/demo-compare): summary.json, plots, per-run metrics.jsonl"
