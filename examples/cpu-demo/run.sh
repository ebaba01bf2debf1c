#!/usr/bin/env bash
# The tiny CPU demo: ZCPO on the embedded default (a 2-layer Qwen2 partly warmed up on two-digit addition),
# TP=2 over gloo, embedded rollout engine; no GPU, no network, a few minutes on 2 cores.
# The config is megatron_zcpo/cli/demo.yaml; `zcpo demo` fills in the cached model and data paths.
#
#   examples/cpu-demo/run.sh             # zcpo demo: ZCPO, held-out accuracy before/after, plots
#   examples/cpu-demo/run.sh --compare   # then DAPO (no KL), DAPO + k3 KL and ZCPO side by side
#   examples/cpu-demo/run.sh --compare --arms dapo,zcpo-beta0,zcpo-std,zcpo   # the paper's 2 x 2
#   examples/cpu-demo/run.sh --steps 10  # any other flag goes to both commands (--arms, --jobs, --reuse:
#                                        # the comparison only)
#
# Uses `zcpo` from the active environment, else installs one into .venv with `make install`.
set -euo pipefail
cd "$(dirname "$0")/../.."

compare=false
args=()
compare_args=()  # flags of the comparison only
while (( $# )); do
    case "$1" in
        --compare) compare=true ;;
        --arms|--jobs) compare_args+=("$1" "$2"); shift ;;
        --arms=*|--jobs=*|--reuse) compare_args+=("$1") ;;
        *) args+=("$1") ;;
    esac
    shift
done

if ! command -v zcpo >/dev/null 2>&1; then
    make install
    # shellcheck disable=SC1091
    source .venv/bin/activate
fi

zcpo demo --out runs/demo "${args[@]}"
if "${compare}"; then
    zcpo demo --compare --out runs/demo-compare "${args[@]}" "${compare_args[@]}"
fi
echo "results: runs/demo (and runs/demo-compare): summary.json, plots, per-run metrics.jsonl"
