"""The policy trainer: gradient steps on packed samples, for GRPO and for the SFT warm-start.

A step packs its samples into micro-batches by a token budget, each one a prefix tree where the
model allows (:mod:`.shared_prefix`: every shared prefix forwarded once, the same gradients) or
else padded rows, accumulates gradients over them with normalisers taken over the whole step (so
accumulation is exact), clips the gradient and steps AdamW (fused; its learning rate warmed up over
the first ``warmup_steps`` updates if asked). A non-finite loss or gradient
skips the optimizer step, leaving the weights untouched, and says so in the step's metrics.

Log-probs are computed from ``logits / temperature``: the generator reports the sampled tokens'
log-probs under the same tempered distribution, so the importance ratio starts at 1.

Precision (``cookbook_lib.runtime.devices``): the weights and AdamW's state stay float32; with a bf16
policy the forward and backward run under autocast, and the logits are upcast to float32 before
any log-softmax, so the loss itself is always computed in float32.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch
import torch.utils.checkpoint
from transformers import PreTrainedModel

from cookbook_lib.grpo.loss_settings import LossSettings
from cookbook_lib.grpo.losses import compute_loss, masked_sum, row_entropies, token_logprobs
from cookbook_lib.grpo.samples import LossCounts, TrainingSample, collate, pack_micro_batches
from cookbook_lib.grpo.shared_prefix import (
    attention_mask_4d,
    build_prefix_tree,
    pack_shared_micro_batches,
    tree_attention_unsupported,
)
from cookbook_lib.grpo.tree_attention import SEGMENTS_KWARG, TreeSegments
from cookbook_lib.grpo.tree_attention import install as install_tree_attention
from cookbook_lib.rollout.episode import EndCause, TokenSequence
from cookbook_lib.runtime.block_cache import install_block_cache
from cookbook_lib.runtime.cpu_share import fit_threads
from cookbook_lib.runtime.devices import Precision, autocast
from cookbook_lib.runtime.file_mapped import copy_file_mapped_parameters
from cookbook_lib.runtime.memory import large_blocks_mapped, release_memory
from cookbook_lib.runtime.onednn_linear import onednn_linears, recompute_as_forward
from cookbook_lib.runtime.progress import progress_bar
from cookbook_lib.runtime.quiet import quiet_libraries

logger = logging.getLogger(__name__)

Batch = dict[str, torch.Tensor]
# Trained positions per LM-head chunk: [128, 49k] fp32 logits are 25 MB. Measured on a demo
# step trained on the generator's thread: 512 rows peaked 0.43 GB higher (docs/benchmarks.md).
HEAD_CHUNK_ROWS = 128


def enable_activation_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each decoder layer's activations in the backward pass instead of keeping them.

    Only each layer's input stays alive between the forward and the backward pass: on the
    embedded model 72 KB per token instead of 1.4 MB, for one more forward pass per step. It acts
    in training mode only, so a generator sampling from the same model (eval mode) is unaffected.
    Non-reentrant checkpointing needs no input that requires grad, so it works under LoRA too.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"{type(model).__name__} does not support activation checkpointing; "
            "set activation_checkpointing=False in the GRPOConfig"
        )
    settings = {"use_reentrant": False, "context_fn": recompute_as_forward}
    with quiet_libraries():
        if hasattr(model, "activation_checkpointing_enable"):  # its newer name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=settings)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=settings)


def _fused_adamw_works(parameters: Sequence[torch.nn.Parameter]) -> bool:
    """Whether AdamW's fused kernel takes these parameters: floating point, on a CPU or a CUDA device."""
    return bool(parameters) and all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in parameters
    )


class PolicyTrainer:
    """Holds the trained model (full weights or LoRA), its optimizer and the reference model."""

    def __init__(
        self,
        model: PreTrainedModel,
        *,
        pad_token_id: int,
        learning_rate: float,
        warmup_steps: int = 0,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_tokens: int = 2048,
        temperature: float = 1.0,
        use_lora: bool = False,
        lora_rank: int = 16,
        lora_alpha: float = 32.0,
        reference_model: PreTrainedModel | None = None,
        precision: Precision | None = None,
        activation_checkpointing: bool = False,
        shared_prefix: bool = True,
    ) -> None:
        if activation_checkpointing:
            enable_activation_checkpointing(model)  # on the base model, before LoRA wraps it
        if use_lora:
            from peft import LoraConfig, get_peft_model

            lora = LoraConfig(
                r=lora_rank, lora_alpha=lora_alpha, target_modules="all-linear", lora_dropout=0.0
            )
            with quiet_libraries():  # transformers' FutureWarnings about its own internals
                model = get_peft_model(model, lora)
        self.model = model
        self.learning_rate = learning_rate
        self.warmup_steps = warmup_steps
        self.use_lora = use_lora
        self.pad_token_id = pad_token_id
        self.max_grad_norm = max_grad_norm
        self.micro_batch_tokens = micro_batch_tokens
        self.temperature = temperature
        self.reference_model = reference_model
        # Why this model pads instead of packing prefix trees (None: it packs them).
        self.shared_prefix_unsupported = tree_attention_unsupported(model.config) if shared_prefix else "off"
        if shared_prefix and self.shared_prefix_unsupported:
            logger.info("training on padded rows: %s", self.shared_prefix_unsupported)
        # Weights still in the pages of their safetensors file would each fault as copy-on-write
        # in the first update, with a TLB flush on every CPU (runtime/file_mapped.py).
        copy_file_mapped_parameters(model)
        trainable = [p for p in model.parameters() if p.requires_grad]
        # The fused kernel updates each tensor in one pass instead of ~8 elementwise ones: on a
        # CPU a 135M-parameter step took 0.09 s instead of 0.31 s (bench/bench_step.py).
        self.optimizer = torch.optim.AdamW(
            trainable, lr=learning_rate, weight_decay=weight_decay, fused=_fused_adamw_works(trainable)
        )
        self.device = next(model.parameters()).device
        if self.device.type == "cpu":
            # A step's freed activations are reused with their pages instead of faulting in again.
            install_block_cache()
        # Default: float32 on the model's device, i.e. no autocast.
        self.precision = precision or Precision(self.device, torch.float32, torch.float32)
        # On a CPU, SDPA over a tree's segments (tree_attention) scores ~4x fewer pairs than the
        # dense block mask: a demo step trained in 0.84x the time (bench_step.py). On CUDA the
        # dense mask stays: the segments are a loop of small kernels per layer, not measured there.
        self.segmented_tree_attention = (
            self.packs_prefix_trees
            and self.device.type == "cpu"
            and model.config._attn_implementation == "sdpa"
            and install_tree_attention()
        )
        if self.precision.device != self.device:
            raise ValueError(
                f"the model is on {self.device} but the precision policy says {self.precision.device}; "
                "load the model on the configured device"
            )

    # --- forward ---------------------------------------------------------------------------------
    def _trained_hidden(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.nn.Module]:
        """The last hidden states ``[N, H]`` at the N trained positions only, and the LM head.

        Only ~10% of a tool-use episode's tokens are sampled ones, and ``[B, T, V]`` logits over a
        49k vocabulary are the largest tensor of the step: running the LM head on just the
        trained positions saves most of its memory and time.
        """
        causal_lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        with autocast(self.precision):
            if "tree_input_ids" in batch:
                hidden_NH = self._tree_hidden(causal_lm, batch)
            else:
                hidden_BTH = causal_lm.base_model(
                    input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False
                ).last_hidden_state
                hidden_NH = hidden_BTH[batch["loss_mask"]]
        return hidden_NH, causal_lm.get_output_embeddings()

    def _head_logprobs(
        self, head: torch.nn.Module, hidden_NH: torch.Tensor, target_N: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tempered log-probs of the targets and, without gradient, the distributions' entropies.

        The head runs in float32 outside autocast, as the generator's does (devices.Float32Head):
        bf16 logits would put the two log-probs of a token tenths apart. The loss is then fp32.
        """
        logits_NV = head(hidden_NH.to(head.weight.dtype)).float() / self.temperature
        return token_logprobs(logits_NV.unsqueeze(0), target_N.unsqueeze(0))[0], row_entropies(logits_NV)

    def _tree_hidden(self, causal_lm: PreTrainedModel, batch: Batch) -> torch.Tensor:
        """Hidden states ``[N, H]`` at the trained positions, from one packed prefix-tree forward."""
        mask = attention_mask_4d(
            batch["tree_ancestors"], causal_lm.config._attn_implementation, torch.float32
        )
        # The dense mask goes too: an attention layer that never sees the segments applies it.
        segments = {}
        if self.segmented_tree_attention:
            segments[SEGMENTS_KWARG] = TreeSegments.from_tensors(
                batch["tree_segments"], batch["tree_segment_keys"]
            )
        hidden_LH = causal_lm.base_model(
            input_ids=batch["tree_input_ids"][None],
            position_ids=batch["tree_position_ids"][None],
            attention_mask=mask,
            use_cache=False,
            **segments,
        ).last_hidden_state[0]
        # Indexing a shared position more than once sums its gradients in the backward pass.
        return hidden_LH[batch["tree_index"][batch["loss_mask"]]]

    def _token_logprobs(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs ``[B, T]`` (0 off the mask) and the trained positions' entropies ``[N]``.

        The head runs on ``HEAD_CHUNK_ROWS`` positions at a time, each chunk recomputed in the
        backward pass: only one chunk's ``[rows, V]`` logits are alive at once (a prefix-tree
        micro-batch holds every trained position of a step: 1.2k positions' logits and their
        gradients were ~1 GB on the embedded model), for one more head forward per chunk.
        """
        hidden_NH, head = self._trained_hidden(model, batch)
        mask_BT = batch["loss_mask"]
        target_N = batch["target_ids"][mask_BT]
        picked, entropies = [], []
        for start in range(0, max(target_N.shape[0], 1), HEAD_CHUNK_ROWS):
            rows = slice(start, start + HEAD_CHUNK_ROWS)
            if torch.is_grad_enabled():
                chunk = torch.utils.checkpoint.checkpoint(
                    self._head_logprobs,
                    head,
                    hidden_NH[rows],
                    target_N[rows],
                    use_reentrant=False,
                    context_fn=recompute_as_forward,
                )
            else:
                chunk = self._head_logprobs(head, hidden_NH[rows], target_N[rows])
            picked.append(chunk[0])
            entropies.append(chunk[1])
        picked_N = torch.cat(picked)
        logprobs_BT = torch.zeros(mask_BT.shape, dtype=picked_N.dtype, device=picked_N.device)
        return logprobs_BT.masked_scatter(mask_BT, picked_N), torch.cat(entropies)

    @property
    def packs_prefix_trees(self) -> bool:
        """Whether micro-batches are packed as prefix trees (else padded rows)."""
        return self.shared_prefix_unsupported is None

    def _collate(self, micro_batch: Sequence[TrainingSample]) -> Batch:
        """``collate``'s tensors on the trainer's device, with the micro-batch's prefix tree when
        the trainer packs trees."""
        batch = collate(micro_batch, self.pad_token_id)
        if self.packs_prefix_trees:
            tree = build_prefix_tree(micro_batch)
            batch |= {
                "tree_input_ids": tree.input_ids_L,
                "tree_position_ids": tree.position_ids_L,
                "tree_ancestors": tree.ancestors_LL,
                "tree_index": tree.index_BT,
                "tree_segments": tree.segments_S3,
                "tree_segment_keys": tree.segment_keys_K,
            }
        return {key: value.to(self.device) for key, value in batch.items()}

    # --- steps -----------------------------------------------------------------------------------
    def grpo_step(
        self, samples: Sequence[TrainingSample], settings: LossSettings, counts: LossCounts | None = None
    ) -> dict[str, float]:
        """One optimizer step of the GRPO loss on ``samples`` (a whole step's batch), its
        aggregation normalised by ``counts`` (default: the samples' own tokens and sequences)."""
        counts = counts or LossCounts.of(samples)
        num_tokens, num_sequences = float(counts.tokens), float(counts.sequences)

        def micro_loss(batch: Batch, logprobs_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            reference_BT = None
            if settings.kl_coef > 0:
                reference_BT = self._reference_logprobs(batch)
            loss, metrics = compute_loss(
                logprobs_BT,
                batch["sampling_logprobs"],
                batch["advantages"],
                batch["loss_mask"],
                settings,
                num_tokens_total=num_tokens,
                num_sequences_total=num_sequences,
                ref_logprobs_BT=reference_BT,
            )
            return loss, metrics

        # Freed activations go back to the system at once; the matmuls run where they are fastest.
        with large_blocks_mapped(), onednn_linears(self.device):
            return self._step(list(samples), micro_loss, progress="training")

    def sft_step(self, sequences: Sequence[TokenSequence]) -> dict[str, float]:
        """One optimizer step of cross-entropy on the assistant tokens of ``sequences``."""
        samples = [
            TrainingSample(
                tokens_T=seq.tokens_T,
                loss_mask_T=seq.assistant_mask_T,
                sampling_logprobs_T=[0.0] * len(seq),
                policy_versions_T=[0] * len(seq),
                advantage=0.0,
                group_index=0,
                episode_index=i,
                end_cause=EndCause.TERMINATED,
                reward=0.0,
            )
            for i, seq in enumerate(sequences)
        ]
        num_tokens = float(sum(sample.num_loss_tokens for sample in samples))

        def micro_loss(batch: Batch, logprobs_BT: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
            loss = -masked_sum(logprobs_BT, batch["loss_mask"]) / num_tokens
            return loss, {"sft_loss": loss.item()}

        with large_blocks_mapped(), onednn_linears(self.device):
            return self._step(samples, micro_loss)

    def _step(
        self,
        samples: list[TrainingSample],
        micro_loss: Callable[[Batch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]],
        progress: str | None = None,
    ) -> dict[str, float]:
        """One optimizer step; ``progress`` names a bar over its micro-batches (None: no bar)."""
        if not samples:
            raise ValueError("a training step needs at least one sample")
        # What sampling freed (KV caches, on the generator's thread) goes back first.
        release_memory(full_collection=False)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        totals: dict[str, float] = {}
        entropy_weighted, trained_tokens = 0.0, 0
        finite = True
        packs_trees = self.packs_prefix_trees
        pack = pack_shared_micro_batches if packs_trees else pack_micro_batches
        micro_batches = pack(samples, self.micro_batch_tokens)
        forwarded_tokens = 0
        shown = progress_bar(progress or "", iterable=micro_batches, unit="micro-batch", show=bool(progress))
        for micro_batch in shown:
            fit_threads(self.device)  # a shared CPU's free cores, re-read once a second
            batch = self._collate(micro_batch)
            forwarded_tokens += int(
                batch["tree_input_ids"].numel() if packs_trees else batch["input_ids"].numel()
            )
            logprobs_BT, entropy_N = self._token_logprobs(self.model, batch)
            loss, metrics = micro_loss(batch, logprobs_BT)
            if not torch.isfinite(loss):
                finite = False
                break
            loss.backward()
            # Losses are already normalised over the whole step: micro-batch parts add up.
            for key, value in metrics.items():
                weight = 1.0 if key.endswith("loss") else float(batch["loss_mask"].sum())
                totals[key] = totals.get(key, 0.0) + value * weight
            entropy_weighted += float(entropy_N.sum())
            trained_tokens += int(batch["loss_mask"].sum())
            # Not kept alive while the next micro-batch computes its own.
            del batch, logprobs_BT, entropy_N, loss
        grad_norm = self._clip_gradients() if finite else math.nan
        skipped = not finite or not math.isfinite(grad_norm)
        if skipped:
            # Never let a NaN or inf reach the weights or AdamW's moments.
            self.optimizer.zero_grad(set_to_none=True)
            logger.warning("skipping the optimizer step: non-finite loss or gradient")
        else:
            self._set_learning_rate(self.updates_taken() + 1)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.eval()
        release_memory(full_collection=False)  # the step's activations and gradients, before sampling
        result = {
            key: (value if key.endswith("loss") else value / max(trained_tokens, 1))
            for key, value in totals.items()
        }
        result.update(
            grad_norm=grad_norm,
            entropy=entropy_weighted / max(trained_tokens, 1),
            trained_tokens=float(trained_tokens),
            forwarded_tokens=float(forwarded_tokens),
            skipped_step=float(skipped),
            learning_rate=self.optimizer.param_groups[0]["lr"],
        )
        return result

    def updates_taken(self) -> int:
        """Optimizer updates so far: AdamW's own count, which a checkpoint's optimizer state restores
        (the largest over the parameters: one that had no gradient in an update was not counted)."""
        counts = [int(state["step"]) for state in self.optimizer.state.values() if "step" in state]
        return max(counts, default=0)

    def learning_rate_at(self, update: int) -> float:
        """The learning rate of optimizer update ``update`` (counted from 1): warmed up linearly
        over the first ``warmup_steps`` updates, then constant."""
        if self.warmup_steps <= 0:
            return self.learning_rate
        return self.learning_rate * min(1.0, update / self.warmup_steps)

    def _set_learning_rate(self, update: int) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate_at(update)

    def _clip_gradients(self) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else math.inf
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))

    @torch.no_grad()
    def _reference_logprobs(self, batch: Batch) -> torch.Tensor:
        if self.reference_model is not None:
            return self._token_logprobs(self.reference_model, batch)[0]
        if self.use_lora:
            # The starting model is the base model with the adapters switched off: no copy needed.
            with self.model.disable_adapter():
                return self._token_logprobs(self.model, batch)[0]
        raise ValueError("kl_coef > 0 needs a reference model (full-weight training) or use_lora=True")

    # --- weights for the generator -----------------------------------------------------------------
    @torch.no_grad()
    def export_weights(self, copy: bool = False) -> dict[str, torch.Tensor]:
        """The current policy as a plain model's state dict (LoRA merged in), for the generator.

        Full weights are views of the trained parameters unless ``copy``: a deferred publication
        reads them while the next step trains, so it needs a copy. LoRA exports are always copies.
        """
        if not self.use_lora:
            state = self.model.state_dict()
            return {name: (t.detach().clone() if copy else t.detach()) for name, t in state.items()}
        self.model.merge_adapter()
        try:
            merged = {}
            for name, tensor in self.model.state_dict().items():
                if "lora_" in name:
                    continue
                plain = name.removeprefix("base_model.model.").replace(".base_layer", "")
                merged[plain] = tensor.detach().clone()
            return merged
        finally:
            self.model.unmerge_adapter()
