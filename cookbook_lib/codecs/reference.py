"""The chat templates of today's open model families, as they ship, on the embedded tokenizer.

No model hub is reachable here, so the exact templates come from a pinned package that ships
them: TRL's wheel holds byte-for-byte copies in ``trl/chat_templates/*.jinja`` (each named with the
model repository and revision it was taken from in that folder's README). TRL is not imported: its
files are read from an installed ``trl`` distribution, or else from the wheel itself, which
``bash setup.sh`` (or the first use) downloads from PyPI, the file alone, into ``<cache>/reference/``.

:func:`reference_tokenizer` puts one such template on the embedded SmolLM2 tokenizer together with
the special tokens that template writes (as the real tokenizer has them, one token each), and
sets BOS/EOS as the model family does. The vocabulary is SmolLM2's, so token ids differ from the
real model's, but every codec path (rendering, stop tokens, parsing, continuation) runs as it
would on the real tokenizer. For tests, notebook 02 and ``python -m cookbook_lib.codecs.check``.
"""

from __future__ import annotations

import copy
import functools
import importlib.metadata
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from transformers import PreTrainedTokenizerBase

TRL_VERSION = "1.16.0"
TRL_WHEEL = f"trl-{TRL_VERSION}-py3-none-any.whl"
_TEMPLATE_DIR = "trl/chat_templates"


@dataclass(frozen=True)
class ReferenceTemplate:
    """One shipped template: its file in TRL's folder, the tokens it writes, and the family's BOS/EOS."""

    file: str
    family: str
    special_tokens: tuple[str, ...]
    bos: str | None = None
    eos: str | None = None


_QWEN = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<think>", "</think>", "<tool_call>",
         "</tool_call>", "<tool_response>", "</tool_response>")  # fmt: skip
_LLAMA = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
          "<|python_tag|>")  # fmt: skip
_HARMONY = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>",
            "<|endoftext|>")  # fmt: skip
_GEMMA4 = ("<bos>", "<eos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>", "<tool_call|>",
           "<|tool_response>", "<tool_response|>", "<|channel>", "<channel|>", "<|think|>", '<|"|>',
           "<|image|>", "<|audio|>", "<|video|>")  # fmt: skip
_GLM = ("[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<|endoftext|>",
        "<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
        "</arg_value>", "<tool_response>", "</tool_response>")  # fmt: skip
_LFM = ("<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
        "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_response_start|>", "<|tool_response_end|>",
        "<think>", "</think>")  # fmt: skip

# Name -> template. Names are TRL's file names without ".jinja".
REFERENCE_TEMPLATES: dict[str, ReferenceTemplate] = {
    "qwen2_5": ReferenceTemplate("qwen2_5.jinja", "Qwen2.5", _QWEN, eos="<|im_end|>"),
    "qwen3": ReferenceTemplate("qwen3.jinja", "Qwen3 (thinking)", _QWEN, eos="<|im_end|>"),
    "qwen3_instruct_2507": ReferenceTemplate(
        "qwen3_instruct_2507.jinja", "Qwen3-2507 Instruct", _QWEN, eos="<|im_end|>"
    ),
    "qwen3_5_think": ReferenceTemplate(
        "qwen3_5_think.jinja", "Qwen3.5 (4B and larger)", _QWEN, eos="<|im_end|>"
    ),
    "qwen3_5_nothink": ReferenceTemplate(
        "qwen3_5_nothink.jinja", "Qwen3.5 (2B and smaller)", _QWEN, eos="<|im_end|>"
    ),
    "qwen3_6": ReferenceTemplate("qwen3_6.jinja", "Qwen3.6", _QWEN, eos="<|im_end|>"),
    "qwen3_8": ReferenceTemplate("qwen3_8.jinja", "Qwen3.8", _QWEN, eos="<|im_end|>"),
    "llama3_1": ReferenceTemplate(
        "llama3_1.jinja", "Llama 3.1 / 3.3", _LLAMA, bos="<|begin_of_text|>", eos="<|eot_id|>"
    ),
    "llama3_2": ReferenceTemplate(
        "llama3_2.jinja", "Llama 3.2", _LLAMA, bos="<|begin_of_text|>", eos="<|eot_id|>"
    ),
    "gptoss": ReferenceTemplate("gptoss.jinja", "gpt-oss", _HARMONY, eos="<|return|>"),
    "gemma4": ReferenceTemplate("gemma4_v5.jinja", "Gemma 4", _GEMMA4, bos="<bos>", eos="<eos>"),
    "glm4moe": ReferenceTemplate("glm4moe.jinja", "GLM-4.5 / 4.6", _GLM, eos="<|endoftext|>"),
    "lfm2_5": ReferenceTemplate("lfm2_2_5_v2.jinja", "LFM2.5", _LFM, bos="<|startoftext|>", eos="<|im_end|>"),
    # Earlier revisions and relatives: the same forms written by other template text, which a
    # codec chosen by exact template match would miss.
    "gemma4_release": ReferenceTemplate(
        "gemma4_v2.jinja", "Gemma 4 (release revision)", _GEMMA4, bos="<bos>", eos="<eos>"
    ),
    "lfm2_5_release": ReferenceTemplate(
        "lfm2_2_5.jinja", "LFM2.5 (release revision)", _LFM, bos="<|startoftext|>", eos="<|im_end|>"
    ),
    "lfm2": ReferenceTemplate("lfm2_v2.jinja", "LFM2", _LFM, bos="<|startoftext|>", eos="<|im_end|>"),
    "nemotron_3_nano": ReferenceTemplate("nemotron_3_nano.jinja", "Nemotron 3 Nano", _QWEN, eos="<|im_end|>"),
}


class ReferenceTemplatesMissingError(FileNotFoundError):
    """Neither TRL nor its wheel is on this machine; the message says how to get the wheel."""


def wheel_dir() -> Path:
    from cookbook_lib.runtime.models import cache_dir

    return cache_dir() / "reference"


def download_command() -> str:
    return f"python -m pip download --no-deps trl=={TRL_VERSION} -d {wheel_dir()}"


def ensure_reference_wheel() -> Path:
    """Download TRL's wheel (the file only, ~0.6 MB: nothing is installed) unless it is here."""
    wheel = wheel_dir() / TRL_WHEEL
    if not wheel.is_file():
        wheel.parent.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                   "--no-deps", f"trl=={TRL_VERSION}", "-d", str(wheel.parent)]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not wheel.is_file():
            raise ReferenceTemplatesMissingError(
                f"could not download TRL {TRL_VERSION}'s wheel (for its chat templates): "
                f"{done.stderr.strip()[-500:]}\n"
                f"On a machine with PyPI access run:\n  {download_command()}"
            )
    return wheel


@functools.cache
def _template_source(file: str) -> str:
    try:
        distribution = importlib.metadata.distribution("trl")
        path = Path(str(distribution.locate_file(f"{_TEMPLATE_DIR}/{file}")))
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except importlib.metadata.PackageNotFoundError:
        pass
    wheel = ensure_reference_wheel()
    with zipfile.ZipFile(wheel) as archive:
        return archive.read(f"{_TEMPLATE_DIR}/{file}").decode("utf-8")


def shipped_template_files() -> list[str]:
    """Every chat template file TRL ships (training variants left out), e.g. ``"qwen3_6.jinja"``."""
    try:
        distribution = importlib.metadata.distribution("trl")
        names = [Path(str(f)).name for f in distribution.files or () if str(f).startswith(_TEMPLATE_DIR)]
    except importlib.metadata.PackageNotFoundError:
        with zipfile.ZipFile(ensure_reference_wheel()) as archive:
            names = [Path(n).name for n in archive.namelist() if n.startswith(_TEMPLATE_DIR)]
    return sorted(n for n in names if n.endswith(".jinja") and not n.endswith("_training.jinja"))


def shipped_template_text(file: str) -> str:
    """The text of one of :func:`shipped_template_files`."""
    return _template_source(file)


def reference_template_text(name: str) -> str:
    """The template text of ``name`` (a key of :data:`REFERENCE_TEMPLATES`), exactly as shipped."""
    return _template_source(_entry(name).file)


def reference_tokenizer(name: str, base: PreTrainedTokenizerBase | None = None) -> PreTrainedTokenizerBase:
    """The embedded tokenizer (or a copy of ``base``) carrying template ``name`` and its tokens."""
    from cookbook_lib.runtime.models import load_tokenizer

    entry = _entry(name)
    tokenizer = copy.deepcopy(base) if base is not None else load_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": list(entry.special_tokens)})
    tokenizer.chat_template = reference_template_text(name)
    if entry.bos is not None:
        tokenizer.bos_token = entry.bos
    if entry.eos is not None:
        tokenizer.eos_token = entry.eos
    return tokenizer


def _entry(name: str) -> ReferenceTemplate:
    if name not in REFERENCE_TEMPLATES:
        raise KeyError(f"unknown reference template {name!r}; known: {', '.join(REFERENCE_TEMPLATES)}")
    return REFERENCE_TEMPLATES[name]
