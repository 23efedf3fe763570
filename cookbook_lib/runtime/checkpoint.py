"""Checkpoints that let a killed run resume exactly: weights, optimizer, RNG, step and loop state.

Layout of ``run_dir/checkpoints/``::

    step_000004/      model/ (save_pretrained output, or model.safetensors for a plain module;
                      with the tokenizer when one is given: a complete model folder),
                      optimizer.pt, rng.pt, state.json (written last: the completeness marker)
    step_000006/      a model-only checkpoint (``optimizer=None``) has no optimizer.pt
    latest            "step_000006": for people and scripts; resume does not depend on it

A checkpoint is built in a hidden temporary folder and renamed into place, so a kill during a save
leaves the previous checkpoints untouched and at worst a temporary folder, which the next save
deletes. :func:`latest_checkpoint` takes the newest folder whose ``state.json`` exists, which also
covers a kill between the rename and the update of ``latest``.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from cookbook_lib.runtime.progress import progress_bar
from cookbook_lib.runtime.quiet import quiet_libraries

CHECKPOINTS_DIR = "checkpoints"
LATEST_FILE = "latest"
STATE_FILE = "state.json"  # written last: a folder without it is not a checkpoint
_MODEL_DIR = "model"
_PLAIN_WEIGHTS = "model.safetensors"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_SCRATCH_PREFIXES = (".tmp-", ".trash-")
_FORMAT = 1


@dataclass
class CheckpointState:
    """What :func:`load_checkpoint` hands back besides the restored objects."""

    step: int
    extra_state: dict[str, Any]
    path: Path
    optimizer_restored: bool = True
    """False for a model-only checkpoint: the optimizer keeps its fresh state (AdamW: zero moments)."""


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS_DIR / f"step_{step:06d}"


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    extra_state: dict[str, Any],
    keep_last: int = 2,
    tokenizer: Any | None = None,
) -> Path:
    """Save everything needed to continue after ``step``; keep the newest ``keep_last`` checkpoints.

    ``extra_state`` is the loop's own state (policy version, task sampler state, ...) and must be
    JSON-able; it is checked before anything is written. A peft model saves only its adapters; a
    transformers model saves with ``save_pretrained`` (safetensors), so ``model/`` loads on its own
    with ``from_pretrained``; any other module saves its ``state_dict`` as safetensors.
    ``optimizer=None`` writes a model-only checkpoint (a third of the size with AdamW): it resumes
    with the optimizer's fresh state. ``tokenizer`` is saved next to a transformers model's weights.
    """
    if keep_last < 1:
        raise ValueError(f"keep_last must be at least 1, got {keep_last}")
    state_text = json.dumps(
        {
            "format": _FORMAT,
            "step": step,
            "model_kind": _model_kind(model),
            "has_optimizer": optimizer is not None,
            "extra_state": extra_state,
        },
        allow_nan=False,
        indent=2,
    )  # raises here, before any file is written, if extra_state is not JSON-able
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    _remove_scratch(root)
    final = checkpoint_dir(run_dir, step)
    scratch = Path(tempfile.mkdtemp(dir=root, prefix=f".tmp-{final.name}-"))
    # Seconds for a small model on a CPU, longer for a large one: weights, optimizer, the rest, fsync.
    bar = progress_bar(f"saving checkpoint {final.name}", total=4, unit="part")
    try:
        with quiet_libraries():  # no "Writing model shards" bar
            _save_model(model, scratch)
            if tokenizer is not None and _model_kind(model) == "transformers":
                tokenizer.save_pretrained(scratch / _MODEL_DIR)
        bar.update()
        if optimizer is not None:
            torch.save(optimizer.state_dict(), scratch / "optimizer.pt")
        bar.update()
        torch.save(_rng_state(), scratch / "rng.pt")
        (scratch / STATE_FILE).write_text(state_text, encoding="utf-8")
        bar.update()
        _fsync_tree(scratch)
        bar.update()
        if final.exists():  # the same step saved again (after a resume): swap, never delete first
            trash = root / f".trash-{final.name}"
            os.replace(final, trash)
            os.replace(scratch, final)
            shutil.rmtree(trash)
        else:
            os.replace(scratch, final)
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise
    finally:
        bar.close()
    _write_latest(root, final.name)
    for old in _complete_checkpoints(root)[:-keep_last]:
        delete_folder(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete checkpoint of the run, or ``None`` (then the run starts from step 0)."""
    complete = _complete_checkpoints(Path(run_dir) / CHECKPOINTS_DIR)
    return complete[-1] if complete else None


def checkpoint_step(path: Path) -> int:
    """The step a complete checkpoint was saved after, read without loading any weights."""
    return int(json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))["step"])


def load_checkpoint(
    path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer, restore_rng: bool = True
) -> CheckpointState:
    """Restore a checkpoint into ``model`` and ``optimizer`` in place, and the global RNGs.

    ``model`` must be built as it was when saved (same architecture; for peft, the same adapters
    already attached): only the weights are loaded. Build the optimizer over the model's parameters
    before calling this, as a fresh run would; a model-only checkpoint leaves it as built
    (``optimizer_restored`` is then False).
    """
    path = Path(path)
    state_path = path / STATE_FILE
    if not state_path.is_file():
        raise FileNotFoundError(f"{path} is not a complete checkpoint: {STATE_FILE} is missing")
    state = json.loads(state_path.read_text(encoding="utf-8"))
    if state["model_kind"] != _model_kind(model):
        raise ValueError(
            f"{path} holds a {state['model_kind']} model but a {_model_kind(model)} model was given; "
            "build the model as the run did (e.g. attach the LoRA adapter before loading)"
        )
    _load_model(model, path)
    # Checkpoints written before "has_optimizer" existed always had the optimizer.
    has_optimizer = bool(state.get("has_optimizer", True))
    if has_optimizer:
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True))
    if restore_rng:
        _set_rng_state(torch.load(path / "rng.pt", weights_only=True))
    return CheckpointState(
        step=int(state["step"]), extra_state=state["extra_state"], path=path, optimizer_restored=has_optimizer
    )


def _model_kind(model: torch.nn.Module) -> str:
    from peft import PeftModel
    from transformers import PreTrainedModel

    if isinstance(model, PeftModel):
        return "peft"
    if isinstance(model, PreTrainedModel):
        return "transformers"
    return "torch"


def _save_model(model: torch.nn.Module, folder: Path) -> None:
    from safetensors.torch import save_model

    kind = _model_kind(model)
    if kind == "torch":
        save_model(model, str(folder / _PLAIN_WEIGHTS))  # drops tied duplicates, which safetensors rejects
    elif kind == "peft":
        model.save_pretrained(folder / _MODEL_DIR)  # the adapters only, as safetensors
    else:
        # transformers 5 always writes safetensors. save_original_format=False keeps the in-memory
        # key names (no legacy renaming), so the in-place load below finds every key.
        model.save_pretrained(folder / _MODEL_DIR, save_original_format=False)


def _load_model(model: torch.nn.Module, path: Path) -> None:
    from safetensors.torch import load_file, load_model

    kind = _model_kind(model)
    if kind == "torch":
        load_model(model, str(path / _PLAIN_WEIGHTS), strict=True)
    elif kind == "peft":
        _load_peft_adapters(model, path / _MODEL_DIR)
    else:
        weights: dict[str, torch.Tensor] = {}
        for shard in sorted((path / _MODEL_DIR).glob("*.safetensors")):
            weights.update(load_file(shard))
        _load_tied_state_dict(model, weights)


def _load_peft_adapters(model: Any, folder: Path) -> None:
    """Load every adapter's weights; ``save_pretrained`` puts non-default adapters in subfolders."""
    from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    for name in model.peft_config:
        adapter_dir = folder if name == "default" else folder / name
        saved = load_file(adapter_dir / "adapter_model.safetensors")
        expected = set(get_peft_model_state_dict(model, adapter_name=name))
        if set(saved) != expected:
            raise ValueError(
                f"adapter {name!r} in {adapter_dir} does not match the model's: missing "
                f"{sorted(expected - set(saved))[:5]}, unexpected {sorted(set(saved) - expected)[:5]}"
            )
        set_peft_model_state_dict(model, saved, adapter_name=name)


def _load_tied_state_dict(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """``load_state_dict`` that accepts the keys save_pretrained drops because they are tied.

    A key may be missing only if its tensor shares storage with a loaded one (e.g. ``lm_head``
    tied to the embeddings); anything else missing means the checkpoint does not fit the model.
    """
    result = model.load_state_dict(weights, strict=False)
    current = model.state_dict()
    loaded_storage = {current[key].untyped_storage().data_ptr() for key in weights if key in current}
    untied = [
        key for key in result.missing_keys if current[key].untyped_storage().data_ptr() not in loaded_storage
    ]
    if untied or result.unexpected_keys:
        raise ValueError(
            f"the checkpoint does not fit the model: missing {untied[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def _rng_state() -> dict[str, Any]:
    """The global RNG states, in types that ``torch.load(weights_only=True)`` accepts."""
    algorithm, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": (algorithm, keys.tolist(), position, has_gauss, cached_gaussian),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    algorithm, keys, position, has_gauss, cached_gaussian = state["numpy"]
    np.random.set_state((algorithm, np.array(keys, dtype=np.uint32), position, has_gauss, cached_gaussian))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        # A resume on fewer GPUs restores the devices it has.
        for device, cuda_state in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(cuda_state, device)


def _complete_checkpoints(root: Path) -> list[Path]:
    """Checkpoint folders that have their marker, oldest first."""
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [child for _, child in sorted(found)]


def _write_latest(root: Path, name: str) -> None:
    temp = root / f".tmp-{LATEST_FILE}-{os.getpid()}"
    temp.write_text(name + "\n", encoding="utf-8")
    os.replace(temp, root / LATEST_FILE)


def delete_folder(folder: Path) -> None:
    """Rename first, then delete: a kill mid-delete must not leave a half-deleted checkpoint or model
    where a later run would load it."""
    trash = folder.with_name(f".trash-{folder.name}")
    shutil.rmtree(trash, ignore_errors=True)  # a leftover of an earlier kill
    os.replace(folder, trash)
    shutil.rmtree(trash, ignore_errors=True)


def _remove_scratch(root: Path) -> None:
    """Delete what an interrupted save or delete left behind."""
    for child in root.iterdir():
        if child.name.startswith(_SCRATCH_PREFIXES):
            if child.is_dir():
                shutil.rmtree(child, ignore_errors=True)
            else:
                child.unlink(missing_ok=True)


def _fsync_tree(folder: Path) -> None:
    """Flush the files to disk before the rename makes them the checkpoint (power loss, not only kill)."""
    for item in folder.rglob("*"):
        if item.is_file():
            with item.open("rb") as handle:
                os.fsync(handle.fileno())
