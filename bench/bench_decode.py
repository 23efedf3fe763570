"""One CPU decode step of the embedded model: the concatenating KV cache, the in-place one, oneDNN linears.

    python bench/bench_decode.py                    # 16 rows, a 440-token prompt, 24 steps, 4 rounds
    python bench/bench_decode.py --rows 8 --quick

``DynamicLayer`` (transformers) concatenates every layer's cache each step; ``SlackLayer``
(cookbook_lib/generators/kv_cache.py) writes into spare columns; the third arm adds
``onednn_linears`` (cookbook_lib.runtime.onednn_linear.py), which sends the linears to oneDNN
instead of MKL through a torch function mode (which runs Python for every op of the step), and the
fourth routes each linear layer to oneDNN itself (``runtime/routed_linear.py``): what ``HFGenerator``
runs on a CPU where oneDNN measured faster, on a model it shares with the trainer. Where it did
(AMD), the next arm is the float32
copy a generator owns (an async run's, an evaluation's), its linears prepacked for oneDNN and
grouped (``runtime/packed_linear.py``); elsewhere float32 is not packed and the arm is left out.
The last arm is the
sampling copy a bf16 run decodes with (``devices.sampling_copy``: bf16 weights and KV cache, the
output layer in float32), what ``dtype="auto"`` picks on a CPU with native bf16, first with plain
weights, then with its linears prepacked for oneDNN (``runtime/packed_linear.py``) one by one, then
with a layer's q/k/v and gate/up projections packed together, as a run's generator holds them. The
arms run the same prompt and greedy tokens, alternating, and the bench prints the median step time
of each, its ratio to the first and its largest logit difference from the first (0: the same
numbers). It also times the step's matmuls alone, each of the model's weight shapes at these rows,
through MKL and through oneDNN, and the machine's limit: the bytes a step in the dtype that
``dtype="auto"`` picks here must read (every weight once, the KV cache once) over this machine's
measured streaming read rate. Where bf16 is native (the Xeon with AMX) that memory traffic is the
floor at 16 rows; in float32 on an AVX2 CPU the matmuls' arithmetic is (the bench prints both).
Timings on a shared machine are noisy: compare the ratios of one run.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time
from collections.abc import Callable

import torch
from transformers import DynamicCache

from cookbook_lib.generators import kv_cache
from cookbook_lib.runtime.devices import Float32Head, Precision, resolve_precision, sampling_copy
from cookbook_lib.runtime.models import load_model
from cookbook_lib.runtime.onednn_linear import onednn_linears
from cookbook_lib.runtime.openmp_team import release_openmp_team
from cookbook_lib.runtime.packed_linear import pack_linears
from cookbook_lib.runtime.routed_linear import route_linears, routed_linears


def decode(model, prompt_BT: torch.Tensor, make_cache, steps: int) -> tuple[float, torch.Tensor]:
    """Median step time (ms) of ``steps`` greedy decode steps after the prompt, and every logit row."""
    keyword = kv_cache.cache_keyword(model)
    with torch.inference_mode():
        cache = make_cache()
        out = model(input_ids=prompt_BT, use_cache=True, **{keyword: cache})
        logits, times = [out.logits[:, -1]], []
        for _ in range(steps):
            token_B1 = logits[-1].argmax(-1, keepdim=True)
            started = time.perf_counter()
            out = model(input_ids=token_B1, use_cache=True, **{keyword: cache})
            times.append(time.perf_counter() - started)
            logits.append(out.logits[:, -1])
    return 1000 * statistics.median(times), torch.stack(logits)


def matmul_floor_ms(model, rows: int, linears_context: Callable, repeats: int = 10) -> float:
    """The step's ``F.linear`` calls alone on the real weights (median of ``repeats``), in ms."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear | Float32Head)]
    inputs = [torch.randn(rows, m.weight.shape[1], dtype=m.weight.dtype) for m in linears]
    times = []
    with torch.inference_mode(), linears_context():
        for _ in range(repeats):
            started = time.perf_counter()
            for module, x in zip(linears, inputs, strict=True):
                torch.nn.functional.linear(x, module.weight)
            times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=440)
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--quick", action="store_true", help="a 120-token prompt, 8 steps, 2 rounds")
    parser.add_argument(
        "--bf16", action="store_true", help="run the bf16 arms also where dtype='auto' picks float32"
    )
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens, args.steps, args.rounds = 120, 8, 2
    torch.manual_seed(0)
    model = load_model().eval()
    prompt_BT = torch.randint(100, model.config.vocab_size - 100, (args.rows, args.prompt_tokens))
    bf16 = sampling_copy(model, Precision(torch.device("cpu"), torch.bfloat16, torch.bfloat16))
    packed = sampling_copy(model, Precision(torch.device("cpu"), torch.bfloat16, torch.bfloat16))
    pack_linears(packed, group=False)
    grouped = sampling_copy(model, Precision(torch.device("cpu"), torch.bfloat16, torch.bfloat16))
    pack_linears(grouped)
    routed = copy.deepcopy(model).eval()
    routes = route_linears(routed) > 0  # where oneDNN's linear is chosen
    float32_packed = copy.deepcopy(model).eval()
    float32_packs = pack_linears(float32_packed) > 0  # where the trainer's linears run in oneDNN
    release_openmp_team()  # the copies' casts gave this thread a team; the steps below run here anyway
    plain = contextlib.nullcontext

    def onednn() -> contextlib.AbstractContextManager:
        return onednn_linears("cpu")

    arms: dict[str, tuple[torch.nn.Module, Callable, Callable]] = {  # name: (model, new cache, linears)
        "concatenating (DynamicLayer)": (model, lambda: DynamicCache(config=model.config), plain),
        "in place (SlackLayer)": (model, lambda: kv_cache.new_cache(model), plain),
        "in place + oneDNN linears": (model, lambda: kv_cache.new_cache(model), onednn),
        "in place + routed linears": (routed, lambda: kv_cache.new_cache(routed), routed_linears),
        "float32, packed, grouped": (float32_packed, lambda: kv_cache.new_cache(float32_packed), plain),
        "in place, bf16 (head in float32)": (bf16, lambda: kv_cache.new_cache(bf16), plain),
        "in place, bf16, packed": (packed, lambda: kv_cache.new_cache(packed), plain),
        "bf16, packed, grouped": (grouped, lambda: kv_cache.new_cache(grouped), plain),
    }
    if not routes:
        del arms["in place + routed linears"]
    if not float32_packs:
        del arms["float32, packed, grouped"]
    auto = resolve_precision("cpu", "auto")
    if auto.sample_dtype == torch.float32 and not args.bf16:
        # Where bf16 matmuls are slow (no native bf16), its arms take minutes a round and no run uses them.
        print(f"bf16 arms left out ({auto.auto_reason}); --bf16 runs them")
        for name in [name for name in arms if "bf16" in name]:
            del arms[name]
    threads = torch.get_num_threads()
    print(f"{args.rows} rows, {args.prompt_tokens}-token prompt, {args.steps} steps, {threads} threads")
    results: dict[str, list[float]] = {name: [] for name in arms}
    differences: dict[str, float] = {name: 0.0 for name in arms}
    for _ in range(args.rounds):
        logits = {}
        for name, (arm_model, make_cache, linears_context) in arms.items():
            with linears_context():
                ms, logits[name] = decode(arm_model, prompt_BT, make_cache, args.steps)
            results[name].append(ms)
        first = next(iter(logits.values()))
        for name, rows in logits.items():
            differences[name] = max(differences[name], (rows - first).abs().max().item())
        print("  " + " | ".join(f"{n} {r[-1]:.1f} ms" for n, r in results.items()))
    medians = {name: statistics.median(times) for name, times in results.items()}
    base = next(iter(medians.values()))
    for name, ms in medians.items():
        print(
            f"{name:>30}: {ms:6.1f} ms per step, {ms / base:.2f}x, {args.rows * 1000 / ms:4.0f} tok/s,"
            f" max |dlogit| {differences[name]:.1e}"
        )
    mkl, onednn = (matmul_floor_ms(model, args.rows, c) for c in (plain, onednn))
    bf16_floor = matmul_floor_ms(bf16, args.rows, plain)
    print(
        f"the step's matmuls alone: {mkl:.1f} ms through MKL, {onednn:.1f} ms through oneDNN (float32); "
        f"{bf16_floor:.1f} ms in bf16 (head in float32)"
    )
    sampled = bf16 if auto.sample_dtype == torch.bfloat16 else model
    dtype_name = str(auto.sample_dtype).removeprefix("torch.")
    embeddings = sampled.get_input_embeddings().weight
    weights = sum(t.numel() * t.element_size() for t in sampled.state_dict().values()) - (
        embeddings.numel() * embeddings.element_size()  # looked up, not read whole (a tied head is
    )  # in the state dict under its own name too, so it is still counted once)
    config = sampled.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    columns = args.prompt_tokens + args.steps // 2
    kv_bytes = 2 if auto.sample_dtype == torch.bfloat16 else 4
    kv = 2 * config.num_hidden_layers * args.rows * config.num_key_value_heads * columns * head_dim * kv_bytes
    bandwidth = read_bandwidth_gbs()
    limit = (weights + kv) / bandwidth / 1e6
    print(
        f"the machine's limit for a {dtype_name} step (dtype='auto' samples in it here):"
        f" {weights / 1e6:.0f} MB of weights + {kv / 1e6:.0f} MB of KV cache at {bandwidth:.1f} GB/s read"
        f" = {limit:.1f} ms"
        f" ({args.rows * 1000 / limit:.0f} tok/s; {limit / medians[next(iter(medians))]:.2f}x the first arm)"
    )


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """This machine's read bandwidth on all torch threads: a sum over a touched tensor (GB/s, best of)."""
    data = torch.rand(megabytes * 1024 * 1024 // 4)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        data.sum()
        times.append(time.perf_counter() - started)
    return data.numel() * 4 / min(times) / 1e9


if __name__ == "__main__":
    main()
