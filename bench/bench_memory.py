"""Peak resident memory of a GRPO run on a CPU, per phase, against a baseline, side by side.

    python bench/bench_memory.py                  # the demo (python -m recipes.demo), then its baseline
    python bench/bench_memory.py --quick          # a shortened demo: 2 GRPO steps, 4 validation tasks
    python bench/bench_memory.py --arms default   # one arm only
    python bench/bench_memory.py --notebook notebooks/04_async_grpo.ipynb   # a notebook's full mode
    python bench/bench_memory.py --out runs/bench_memory.json

What it measures. A thread samples the process's resident set size (VmRSS in /proc/self/status)
every 50 ms; markers around the library's functions say what the run was doing at each sample:
``load`` (the model), ``warm-start`` (the SFT warm-start), ``sampling`` (playing a step's
episodes), ``training`` (building samples and the optimizer step), ``validation``,
``checkpoint``; anything else is ``other``. In an async run sampling and training overlap, and a
sample counts for both. The kernel's own high-water mark (VmHWM) is the process's true peak (it
also catches a spike between two samples). The run folder's size is the run's disk use.

Arms (each runs in a fresh process, one after the other: a process's peak cannot be split):
  default   the demo exactly as ``python -m recipes.demo`` runs it;
  baseline  the same run with the settings before issue 12: ``micro_batch_tokens=4096``, no
            activation checkpointing, a copy of the model for the generator in lockstep too, no
            token bound on the prefix cache, no memory handed back to the system between phases,
            two full checkpoints and the warm-started model kept at the end.
The ratio column is default / baseline. ``--notebook`` runs one notebook in full mode (no
``COOKBOOK_SMALL``) in a Jupyter kernel with the same probe and prints the same table.

Measure with the environment a user has: ``MALLOC_ARENA_MAX`` unset.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import inspect
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
KEEP_RUNS_ENV = "BENCH_MEMORY_KEEP_RUNS"  # "1": keep each arm's run folder (--keep-runs sets it)
PHASES = ("load", "warm-start", "sampling", "training", "validation", "checkpoint", "other")
# (module, attribute, phase): the functions whose calls mark a phase. A missing one fails the bench
# at once (the library moved something): update this table rather than measure without a phase.
PHASE_HOOKS: tuple[tuple[str, str, str], ...] = (
    ("cookbook_lib.grpo.train", "load_model", "load"),
    ("cookbook_lib.grpo.train", "_run_warm_start", "warm-start"),
    ("cookbook_lib.grpo.lockstep", "collect_groups", "sampling"),
    ("cookbook_lib.grpo.async_loop", "RolloutCollector._play", "sampling"),
    ("cookbook_lib.grpo.lockstep", "train_on_groups", "training"),
    ("cookbook_lib.grpo.async_loop", "train_on_groups", "training"),
    ("cookbook_lib.grpo.train", "_Validator.run", "validation"),
    ("cookbook_lib.grpo.train", "_save", "checkpoint"),
)
GIB = 1024**3


def _status_bytes(field: str) -> int:
    """A ``kB`` field of /proc/self/status (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}: this bench needs Linux")


class MemoryProbe:
    """Samples VmRSS on a thread; remembers the peak per active phase (thread-safe markers)."""

    def __init__(self, interval_s: float = 0.05, write_to: Path | None = None) -> None:
        self.interval_s = interval_s
        self.write_to = write_to  # the summary is rewritten there every few seconds (a kernel may die)
        self._active: dict[str, int] = {}
        self._peaks: dict[str, int] = {}
        self._seconds: dict[str, float] = {}
        self._maxima: dict[str, int] = {}  # sizes noted by the hooks (tokens held in KV caches)
        self._totals: dict[str, int] = {}  # counts added up by the hooks (prompt tokens reused)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self._thread = threading.Thread(target=self._sample_forever, name="memory-probe", daemon=True)

    def start(self) -> MemoryProbe:
        self._thread.start()
        return self

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        summary = self.summary()
        self._write(summary)
        return summary

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._enter(name)
        try:
            yield
        finally:
            self._leave(name)

    def _enter(self, name: str) -> None:
        with self._lock:
            self._active[name] = self._active.get(name, 0) + 1
        self._record(_status_bytes("VmRSS"))  # a short phase is seen even between two samples

    def _leave(self, name: str) -> None:
        self._record(_status_bytes("VmRSS"))
        with self._lock:
            self._active[name] -= 1

    def note_max(self, name: str, value: int) -> None:
        with self._lock:
            self._maxima[name] = max(self._maxima.get(name, 0), value)

    def note_add(self, name: str, value: int) -> None:
        with self._lock:
            self._totals[name] = self._totals.get(name, 0) + value

    def _record(self, rss: int, seconds: float = 0.0) -> None:
        with self._lock:
            current = [name for name, count in self._active.items() if count > 0] or ["other"]
            for name in current:
                self._peaks[name] = max(self._peaks.get(name, 0), rss)
                self._seconds[name] = self._seconds.get(name, 0.0) + seconds

    def _sample_forever(self) -> None:
        last_write = time.perf_counter()
        while not self._stop.wait(self.interval_s):
            self._record(_status_bytes("VmRSS"), self.interval_s)
            if self.write_to is not None and time.perf_counter() - last_write > 5:
                self._write(self.summary())
                last_write = time.perf_counter()

    def summary(self) -> dict[str, Any]:
        with self._lock:
            peaks, seconds, maxima = dict(self._peaks), dict(self._seconds), dict(self._maxima)
            totals = dict(self._totals)
        return {
            "max_tokens": maxima,
            "prompt_tokens": totals,
            "peak_gib": {name: peaks[name] / GIB for name in PHASES if name in peaks},
            "seconds": {name: round(seconds.get(name, 0.0), 1) for name in PHASES if name in peaks},
            "vmhwm_gib": _status_bytes("VmHWM") / GIB,
            "wall_s": round(time.perf_counter() - self._started, 1),
        }

    def _write(self, summary: dict[str, Any]) -> None:
        if self.write_to is not None:
            temp = self.write_to.with_suffix(".tmp")
            temp.write_text(json.dumps(summary, indent=2))
            os.replace(temp, self.write_to)


def _wrap(function: Callable, probe: MemoryProbe, name: str) -> Callable:
    if inspect.iscoroutinefunction(function):

        @functools.wraps(function)
        async def async_marked(*args, **kwargs):
            with probe.phase(name):
                return await function(*args, **kwargs)

        return async_marked

    @functools.wraps(function)
    def marked(*args, **kwargs):
        with probe.phase(name):
            return function(*args, **kwargs)

    return marked


def install_phase_hooks(probe: MemoryProbe) -> None:
    """Mark the phases of ``PHASE_HOOKS``: each function is replaced where the library looks it up."""
    for module_name, attribute, phase in PHASE_HOOKS:
        owner: Any = importlib.import_module(module_name)
        *path, name = attribute.split(".")
        for part in path:
            owner = getattr(owner, part)
        if not hasattr(owner, name):
            raise RuntimeError(f"{module_name}.{attribute} is gone: update PHASE_HOOKS in {__file__}")
        setattr(owner, name, _wrap(getattr(owner, name), probe, phase))


def install_size_hooks(probe: MemoryProbe) -> None:
    """Note the most tokens held by the generators' running batch and their prefix caches, and
    how many prompt tokens the generators fed and reused (whether a bound costs prefix reuse)."""
    from cookbook_lib.generators.batch import DecodeBatch
    from cookbook_lib.generators.hf import HFGenerator
    from cookbook_lib.generators.prefix_cache import PrefixCache

    put, step, close = PrefixCache.put, DecodeBatch.step, HFGenerator.close

    def noted_put(self, prefix):
        put(self, prefix)
        probe.note_max("prefix_cache", self.num_tokens)

    def noted_step(self, version):
        probe.note_max("decode_batch", len(self) * self.columns)  # rows x columns of its KV cache
        return step(self, version)

    async def noted_close(self):
        await close(self)
        probe.note_add("fed", self.stats.prefill_tokens)
        probe.note_add("reused", self.stats.reused_tokens)

    PrefixCache.put, DecodeBatch.step, HFGenerator.close = noted_put, noted_step, noted_close


def start_in_process(result_path: str, interval_s: float = 0.05) -> MemoryProbe:
    """Start a probe with the phase hooks in this process (what a notebook's injected cell calls)."""
    probe = MemoryProbe(interval_s, write_to=Path(result_path)).start()
    install_phase_hooks(probe)
    install_size_hooks(probe)
    return probe


# --- arms ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Arm:
    name: str
    description: str
    config_overrides: dict[str, Any]
    patch: Callable[[], None] | None = None  # library settings a config cannot express


def _baseline_patch() -> None:
    """The library as it was before issue 12, where a GRPOConfig field cannot say so."""
    from cookbook_lib.generators.hf import HFGenerator
    from cookbook_lib.grpo import train, trainer
    from cookbook_lib.runtime.devices import sampling_copy

    # No memory handed back to the system between phases.
    trainer.release_memory = train.release_memory = lambda: None
    # No token bound on the prefix cache (only its 64 entries).
    HFGenerator.__init__.__kwdefaults__["prefix_cache_tokens"] = None
    # A copy of the model for the generator, lockstep too.
    train._sampling_model = lambda model, precision, config: sampling_copy(model, precision)


ARMS = {
    "default": Arm("default", "the demo as shipped", {}),
    "baseline": Arm(
        "baseline",
        "before issue 12: micro_batch_tokens=4096, no activation checkpointing, a generator copy in "
        "lockstep, no token bound on the prefix cache, no malloc_trim, two full checkpoints and the "
        "warm-started model kept",
        dict(
            micro_batch_tokens=4096,
            activation_checkpointing=False,
            keep_last_checkpoints=2,
            final_checkpoint="full",
            keep_warm_start_model=True,
        ),
        _baseline_patch,
    ),
}


def run_arm_here(arm: Arm, recipe_argv: list[str], result_path: Path) -> None:
    """Run the demo (experts, warm-start, GRPO) in this process, under the probe; write the result."""
    probe = start_in_process(str(result_path))
    if arm.patch is not None:
        arm.patch()
    from recipes import experts
    from recipes.grpo import tool_use_game

    def base_config(**overrides):
        return tool_use_game.demo_config(**(arm.config_overrides | overrides))

    runs_dir = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    os.chdir(runs_dir)  # the recipe writes runs/<run_name> under the working directory
    try:
        experts.main([])
        result = tool_use_game.main([*recipe_argv, "--run-name", arm.name], base_config=base_config)
        summary = probe.stop()
        summary["disk_gib"] = _folder_bytes(result.run_dir) / GIB
        summary["validation"] = result.validation_rewards()
        summary["arm"] = arm.name
        result_path.write_text(json.dumps(summary, indent=2))
    finally:
        os.chdir(ROOT)
        if os.environ.get(KEEP_RUNS_ENV) == "1":  # e.g. to draw docs/images from this run
            print(f"{arm.name}: run kept in {runs_dir / 'runs' / arm.name}", flush=True)
        else:
            shutil.rmtree(runs_dir, ignore_errors=True)


def _folder_bytes(folder: Path) -> int:
    return sum(item.stat().st_size for item in Path(folder).rglob("*") if item.is_file())


def run_arm(arm: Arm, recipe_argv: list[str]) -> dict[str, Any]:
    """Run ``arm`` in a fresh process; its result, or the partial figures if it died."""
    with tempfile.TemporaryDirectory(prefix="bench-memory-result-") as scratch:
        result_path = Path(scratch) / "result.json"
        command = [sys.executable, __file__, "--child", arm.name, "--result", str(result_path), "--"]
        print(f"\n=== {arm.name}: {arm.description}", flush=True)
        completed = subprocess.run([*command, *recipe_argv], cwd=ROOT, check=False)
        if not result_path.is_file():
            raise RuntimeError(f"arm {arm.name} left no figures (exit status {completed.returncode})")
        summary = json.loads(result_path.read_text())
        summary["returncode"] = completed.returncode
        return summary


def run_notebook(path: Path, timeout_s: int) -> dict[str, Any]:
    """Execute ``path`` in full mode in a fresh kernel with the probe; the kernel's figures."""
    import nbformat
    from nbclient import NotebookClient

    notebook = nbformat.read(path, as_version=4)
    with tempfile.TemporaryDirectory(prefix="bench-memory-nb-") as scratch:
        result_path = Path(scratch) / "result.json"
        probe_cell = nbformat.v4.new_code_cell(
            f"import sys\nsys.path.insert(0, {str(ROOT / 'bench')!r})\nimport bench_memory\n"
            f"_memory_probe = bench_memory.start_in_process({str(result_path)!r})"
        )
        notebook.cells = [probe_cell, *notebook.cells, nbformat.v4.new_code_cell("_memory_probe.stop()")]
        env = {key: value for key, value in os.environ.items() if not key.startswith("COOKBOOK_NB")}
        env.pop("COOKBOOK_SMALL", None)
        client = NotebookClient(
            notebook,
            timeout=timeout_s,
            kernel_name="python3",
            resources={"metadata": {"path": str(path.parent)}},
        )
        started = time.perf_counter()
        error = None
        with _environment(env):
            try:
                client.execute()
            except Exception as exc:  # the figures up to the failure are still worth printing
                error = f"{type(exc).__name__}: {str(exc)[-400:]}"
        if not result_path.is_file():
            raise RuntimeError(f"{path} left no figures: {error}")
        summary = json.loads(result_path.read_text())
        summary |= {"arm": path.name, "wall_s": round(time.perf_counter() - started, 1), "error": error}
        return summary


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """Run with ``env`` as os.environ (the kernel inherits it), then restore."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def print_table(results: list[dict[str, Any]]) -> None:
    names = [result["arm"] for result in results]
    baseline = next((r for r in results if r["arm"] == "baseline"), None)
    header = f"{'phase':<22}" + "".join(f"{name:>14}" for name in names)
    if baseline is not None and len(results) > 1:
        header += f"{'ratio':>9}"
    print("\npeak resident memory (GiB) per phase; ratio = default / baseline")
    print(header)
    rows = [(phase, lambda r, p=phase: r["peak_gib"].get(p)) for phase in PHASES]
    rows += [
        ("peak (VmHWM)", lambda r: r["vmhwm_gib"]),
        ("disk, run folder", lambda r: r.get("disk_gib")),
        ("wall time (min)", lambda r: r["wall_s"] / 60),
    ]
    for label, value in rows:
        values = [value(result) for result in results]
        if all(v is None for v in values):
            continue
        line = f"{label:<22}" + "".join(f"{v:>14.2f}" if v is not None else f"{'-':>14}" for v in values)
        default = next((r for r in results if r["arm"] == "default"), None)
        if baseline is not None and default is not None and len(results) > 1:
            b, d = value(baseline), value(default)
            line += f"{d / b:>9.2f}" if b and d is not None else f"{'':>9}"
        print(line)
    for result in results:
        if result.get("max_tokens"):
            sizes = ", ".join(f"{name} {tokens}" for name, tokens in result["max_tokens"].items())
            print(f"{result['arm']}: most tokens held in KV caches: {sizes}")
        prompt = result.get("prompt_tokens") or {}
        if prompt.get("fed") or prompt.get("reused"):
            share = prompt.get("reused", 0) / (prompt.get("fed", 0) + prompt.get("reused", 0))
            print(f"{result['arm']}: prompt tokens reused from the prefix cache: {share:.0%}")
        if result.get("validation"):
            rewards = ", ".join(f"step {s}: {v:.3f}" for s, v in result["validation"])
            print(f"{result['arm']}: validation reward {rewards}")


QUICK_ARGV = ["--steps", "2", "--val-tasks", "4"]  # the warm-start as the demo: GRPO needs its signal


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=["default", "baseline"])
    parser.add_argument("--quick", action="store_true", help="2 GRPO steps, 4 validation tasks")
    parser.add_argument("--notebook", type=Path, help="run this notebook in full mode instead of the demo")
    parser.add_argument("--timeout", type=int, default=4 * 3600, help="per notebook cell, seconds")
    parser.add_argument("--out", type=Path, help="write every figure as JSON here")
    parser.add_argument("--keep-runs", action="store_true", help="keep each arm's run folder; prints where")
    parser.add_argument("--child", choices=list(ARMS), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args, recipe_argv = parser.parse_known_args(argv)
    recipe_argv = [a for a in recipe_argv if a != "--"]
    if args.keep_runs:
        os.environ[KEEP_RUNS_ENV] = "1"  # read by each arm's child process
    if args.child:
        run_arm_here(ARMS[args.child], recipe_argv, args.result)
        return []
    import torch

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or 'cpu'}, "
        f"MALLOC_ARENA_MAX={os.environ.get('MALLOC_ARENA_MAX', 'unset')}"
    )
    if args.notebook:
        results = [run_notebook(args.notebook, args.timeout)]
    else:
        recipe_argv = (QUICK_ARGV if args.quick else []) + recipe_argv
        results = [run_arm(ARMS[name], recipe_argv) for name in args.arms]
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
