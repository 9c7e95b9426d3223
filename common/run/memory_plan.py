"""How much memory a training run needs, per component, before it runs: ``plan_memory(config)``.

The PEFT "memory budget" idea, made specific to what twinseq's trainers keep alive:

    total = parameters (bytes by storage dtype)
          + gradients            (trainable parameters only, float32; optimizer_in_backward: one at a time)
          + optimizer state      (AdamW: 2 x float32 per trainable; adamw_bnb_8bit: 2 x 1 byte + block stats;
                                  adamw_bf16: 2 x bfloat16, with bfloat16 weights and gradients;
                                  adamw_bf16_8bit: the 8-bit moments, with bfloat16 weights and gradients)
          + activations          (per token x tokens per micro-batch, by what backward keeps)
          + the loss kernel's logits term, attention scores/masks, LoRA's own activations, DPO's reference

For a full fine-tune in float32 that is the familiar ``P x (4 + 4 + 8)`` bytes, i.e. parameters
``x (1 + 1 + 2)`` with gradients and Adam's two moments, plus activations that grow with the
tokens of one micro-batch. All numbers are bytes on one device.

Parameters
    twinseq keeps **float32 master weights** on both backends (torch: ``build_model(dtype="float32")``
    with autocast; jax: ``CausalLM(dtype="float32")`` with ``cast_floating`` inside the step); a
    bfloat16 run adds **compute-dtype copies** of the matmul weights (2 bytes each), which autograd
    keeps for backward (torch autocast's cast cache / jax's cast state). QLoRA stores every decoder
    linear weight as NF4 (0.5 byte) plus its quantisation statistics (``QUANT_STATS_BYTES``: bitsandbytes
    ``Params4bit`` defaults to double quantisation: an 8-bit absmax per block of 64 and a float32 one per 256
    blocks; qwix keeps a float32 scale per block of 64); embeddings, norms and an
    untied ``lm_head`` stay float32. A MoE layer's fused expert tensors are NF4 too, with a float32 absmax per 64
    numbers (``NF4_EXPERT_STATS_BYTES``: row ``expert weights (NF4 + absmax)``, both backends); twinseq's kernel
    dequantises at most ``NF4_EXPERTS_PER_CHUNK`` experts at a time on torch, one per scan step on jax (row ``NF4
    experts workspace (transient)``). FSDP over
    ``devices`` divides parameters, gradients and optimizer state, and adds the all-gathered full weights of two
    decoder layers (the one running and the prefetch).

Gradients and optimizer
    One float32 gradient per trainable number (``trainable_parameter_count`` for LoRA), and AdamW's
    ``exp_avg``/``exp_avg_sq`` (8 bytes); ``adamw_bnb_8bit`` keeps 2 bytes plus a float32 absmax per block
    of 256 for each tensor of at least 4096 numbers (bitsandbytes' ``min_8bit_size``), float32 below;
    ``adamw_bf16`` holds weights, gradients and both moments in bfloat16 (2 + 2 + 4 bytes; no autocast copies of
    the weights, which are already bfloat16, and the activations are bfloat16 on every device: the matmuls read
    bfloat16 weights); ``adamw_bf16_8bit`` those weights and gradients with the 8-bit moments. The optimizer step's
    float32 temporaries per number of the tensor it updates are ``UPDATE_TEMP_BYTES`` (counted, and checked with
    ``torch.profiler``'s memory timeline).
    ``optimizer_in_backward`` (torch) steps each parameter in its gradient's hook: one gradient (the largest tensor's)
    and one update's float32 temporaries are alive inside backward, and there is no optimizer-step moment.

Activations (the part that grows with the batch)
    ``tokens = rows x row_length`` of one micro-batch: ``per_device_train_batch_size x max_length``, or one
    row of that many tokens when padding-free (packing fills every row; without packing ``max_length`` is
    the upper bound a padded batch reaches). DPO doubles the rows (chosen + rejected). The JAX trainer pads
    the length to ``pad_to_multiple_of`` (default 64).

    Per decoder layer and token, the tensors autograd saves for backward, counted in the torch Hugging Face
    Llama forward (``LlamaDecoderLayer``, ``sdpa``) and checked against measurement (``LAYER_SAVED``):

    - each RMSNorm: its input, ``x * rsqrt(var)`` and its output: ``3 h`` (two norms: ``6 h``);
    - attention: rotated q, k and v repeated to the query heads (``repeat_kv``: a document mask disables
      sdpa's native GQA), the attention output and its contiguous copy for ``o_proj``: ``5 q``;
    - the gated MLP: gate, ``silu(gate)``, up and their product: ``4 i``.

    so ``a = 6 h + 5 q + 4 i`` elements per layer per token, at the compute dtype's size. With
    gradient checkpointing only each layer's input (``h``) is kept, plus one layer's full set while it is
    recomputed. jax's compiled step keeps a different set (XLA fuses the norms and keeps what it
    chooses); its coefficients were fitted to ``compiled.memory_analysis()`` of the real step and are
    listed next to torch's. The final norm and the hidden state the loss reads add ``3 h`` per token.

Attention (``attention_path``: which path each backend takes for the configured name and row length)
    Dense: torch ``sdpa``/``eager`` on CUDA or for rows shorter than ``BLOCKED_MIN_SEQ_LEN`` on CPU, jax
    ``eager``, and jax's other names for rows that fit one block (``T <= attention_block_size``).
    ``sdpa``, ``flex_attention``, ``varlen`` and flash never materialise scores. ``eager`` keeps the
    softmax output ``B x heads x T x T`` per layer; jax's dense path (no mesh) keeps the float32
    probabilities and their masked copy. torch's ``sdpa``/``eager`` also build one float additive mask
    ``B x T x T`` (4 bytes), jax a boolean one (1 byte). Blocked (torch's ``twinseq_blocked`` on CPU from
    ``BLOCKED_MIN_SEQ_LEN``, jax's ``BlockedAttention`` past one block): no ``T x T`` tensor; each layer saves a
    float32 ``B x heads x T`` log-sum-exp (q, k, v and the output are in the layer's count), and one block
    pair's backward holds ``BLOCKED_TILES`` float32 ``B x heads x block x block`` tiles. Padding-free rows make
    ``T`` the whole micro-batch, which is why dense attention and padding-free do not mix (``varlen`` is the path
    for it on torch).

The loss kernel (the logits term)
    ``nll`` materialises ``[tokens, vocab]`` float32 logits; cross-entropy keeps their log-softmax and
    backward makes the gradient of each: ``LOGITS_COPIES`` float32 copies of ``tokens x vocab``.
    ``chunked_nll``/``fused_linear``/``liger`` only ever hold one chunk (``loss_chunk_size`` tokens) of it,
    plus ``fused_linear``'s float32 gradient accumulators (the size of the hidden states and the lm_head).
    ``triton`` on CUDA holds no logits at all: a float32 hidden-state gradient and one float32 lm_head-gradient
    slice (``TRITON_DW_SLICE_BYTES``); elsewhere it runs ``fused_linear`` and is planned as such.
    The difference between ``nll`` and ``fused_linear`` is exactly this row: it is what the fused loss removes.

LoRA
    The base is frozen: its gradient and optimizer rows vanish; each adapted linear adds its dropout output
    (``in_features``, float32 + a 1-byte mask when ``lora_dropout > 0``; torch only, the jax trainer applies no
    LoRA dropout) and ``A``'s output (``r``) per token. The base keeps the full fine-tune's saved set (measured:
    freezing it frees next to nothing).

Mixture of experts (``qwen3_moe``, ``mixtral``)
    Every expert is resident: the experts' weights, gradients and optimizer state get rows of their own
    (``expert ...``, split out of the state rows, the total unchanged), whatever the routing. A MoE layer saves, in
    place of the dense MLP's ``mlp x i``, ``top_k`` routed copies of each token (``MOE_SAVED``: the gathered input,
    the experts' gate/up products, the down output the routing weight scales) and the router's logits and softmax
    (``E`` per token): rows ``routed activations (MoE)`` and ``router logits (MoE)``. On CPU and CUDA both backends
    run twinseq's grouped experts kernel (``torch_backend.moe``, ``jax_backend.moe``), which saves only each copy's
    gate/up pre-activations (``MOE_SAVED_KERNEL``); jax's per-projection path, which runs with LoRA on the experts,
    keeps the whole set. ``grouped matmul workspace (MoE)``: the permutations that sort the copies by expert; the
    grouped matmuls work in place, so no row grows with the experts.

Activation offloading (CUDA): saved decoder activations move to host memory; the device keeps two layers'
worth in flight. On CPU the host *is* the device, so it saves nothing and the plan says so.

DPO: the frozen reference is a float32 copy of the weights (none with ``precompute_ref_log_probs``, or with
PEFT, whose reference is the base with adapters off); its no-grad forward runs before the policy's, so it
adds no activations to the peak.

torch on CPU, three rows no tensor accounts for: ``runtime`` (``RUNTIME_BYTES``), ``oneDNN kernel cache (CPU
bfloat16)`` (``ONEDNN_CACHE_BYTES``: bfloat16 compute keeps a cached kernel per matmul shape; with varlen shapes
``ONEDNN_CACHE_VARYING_BYTES``, the bound of the cap twinseq sets) and, when the optimizer
step is the peak, the heap backward freed and the update cannot reuse (``HEAP_RETAINED_AT_UPDATE``, inside ``not
alive at once``); all three are fitted constants, measured with glibc's ``mallinfo2`` and the profiled tensor peak.

What is not modelled: the allocator's fragmentation and caches otherwise (CUDA's caching allocator rounds up to
2 MiB blocks and keeps freed blocks), the CPU kernel caches beyond their cap when a user raises
``ONEDNN_PRIMITIVE_CACHE_CAPACITY``/``LRU_CACHE_CAPACITY`` (with bfloat16 ``varlen`` attention and the default
1,024 entries: 18 MiB more a step on ``small``), framework code and kernels' workspaces, the data
pipeline, the model build transient (numpy weights copied into the framework), the checkpoint written at the end.
The ``benchmarks/memory_planner_check.py`` harness measures how close the plan is (docs/memory.md).

>>> from twinseq.common.config import TrainConfig
>>> plan = plan_memory(TrainConfig.from_flat(model_config="tiny", max_length=512, packing=True,
...                                          per_device_train_batch_size=8))
>>> plan.tokens
4096
>>> fused = plan_memory(TrainConfig.from_flat(model_config="tiny", max_length=512, packing=True,
...                                           per_device_train_batch_size=8, loss_type="fused_linear"))
>>> plan.total > fused.total
True
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from twinseq.common.config import (
    BLOCKED_MIN_SEQ_LEN,
    DEFAULT_ATTENTION_BLOCK_SIZE,
    JAX_DENSE_ATTN_IMPLEMENTATIONS,
    TRITON_DW_SLICE_BYTES,
)
from twinseq.common.data.prefix_sharing import prefix_sharing_off_reason
from twinseq.common.errors import ConfigError
from twinseq.common.models.configs import ModelConfig, parameter_shapes, resolve_model_config
from twinseq.common.models.peft import (
    LINEAR_MODULES,
    NF4_BLOCKSIZE,
    NF4_EXPERTS_PER_CHUNK,
    PeftConfig,
    adapter_shapes,
    base_dtype,
    expert_targets,
    lora_targets,
    nf4_expert_tensors,
)
from twinseq.common.run import adamw_8bit

__all__ = [
    "MemoryPlan",
    "MemoryRow",
    "plan_memory",
    "parse_bytes",
    "format_bytes",
    "Advice",
    "advise",
    "KNOBS",
    "DTYPE_BYTES",
    "attention_path",
]

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
NF4_BYTES = 0.5
QUANT_BLOCK = 64
QUANT_STATS_BYTES = {
    # bytes of quantisation statistics per quantised weight element
    # torch: bitsandbytes Params4bit's default compress_statistics=True (double quantisation): an 8-bit absmax
    # per block of 64 and a float32 absmax per 256 of those blocks
    "torch": 1 / QUANT_BLOCK + 4 / (QUANT_BLOCK * 256),
    "jax": 4 / QUANT_BLOCK,  # qwix NF4: one float32 scale per block of 64 input features
}
NF4_EXPERT_STATS_BYTES = 4 / NF4_BLOCKSIZE
"""Statistics per NF4 expert number, both backends: one float32 absmax per block of 64 (no double quantisation)."""
LORA_DROPOUT_APPLIED = {"torch": True, "jax": False}
"""The jax trainer does not apply LoRA dropout (jax_backend.peft), so it keeps no dropout output or mask."""
BNB_8BIT_BLOCK = adamw_8bit.BLOCK
BNB_MIN_8BIT_SIZE = adamw_8bit.MIN_8BIT_SIZE
UPDATE_CHUNK = 1 << 24
"""Numbers per chunk of ``AdamWBF16``'s update (``torch_backend.bf16_adamw.CHUNK``, ``adamw_8bit.CHUNK``)."""
UPDATE_TEMP_BYTES = {"adamw_torch": 8, "adamw_bnb_8bit": 8, "adamw_bf16": 16, "adamw_bf16_8bit": 24}
"""Bytes of temporaries per number of the tensor being updated (torch): float32 AdamW's denominator (and the norm's
float64 copy, 8); ``AdamWBF16``'s float32 moments, denominator and weight (16: the gradient's float32 copy is freed
before the denominator, the denominator before the int32 random bits of the rounding); with 8-bit moments four
float32 chunks and the int64 index ``repeat_interleave`` builds to spread the block scales (24). Checked with
``torch.profiler``'s memory timeline on ``small``: the step's tensor peak is the update of the embedding, 4 x 12 MiB
of float32 (``adamw_bf16``) and 4 x 12 + 24 MiB (``adamw_bf16_8bit``) over the weights, gradients and state."""
HEAP_RETAINED_AT_UPDATE = 20 * 2**20
"""torch on CPU, when the optimizer step is the peak: the heap the backward pass freed stays resident. glibc serves
allocations below its mmap threshold (1 MiB under the planner check's ``MALLOC_MMAP_THRESHOLD_``) from the heap, which
only shrinks from its top, so the small tensors backward frees (bfloat16 activations, per-layer gradients' scratch)
leave free heap behind, and the update's float32 chunks, above the threshold, are mapped fresh instead of reusing it.
Measured on ``small`` (``adamw_bf16``/``adamw_bf16_8bit``, 4 x 512 tokens): glibc's ``mallinfo2`` reports 22 to 26
MiB free in the heap after a step, and the step-2 peak RSS is 20 and 22 MiB above the profiled tensor peak + the
runtime + the kernel cache. Fitted constant; at the loss and in backward the same heap is reused, not added."""
LOGITS_COPIES = {"torch": 3.0, "jax": 2.5}
"""float32 copies of ``[tokens, vocab]`` alive at the loss's peak: logits/log-softmax, and in backward the
gradient of the log-softmax and of the logits (torch frees the logits after the log-softmax). jax's value is
fitted to the compiled step (XLA reuses some of those buffers: 2.1 copies on ``tiny``, 3.1 on ``small``)."""
CHUNK_COPIES = 3.0


@dataclass(frozen=True)
class MoeCoefficients:
    """Elements a mixture-of-experts layer saves per token: ``top_k * (routed_mlp * m + routed_hidden * h)`` for the
    routed copies (each token's hidden state goes through ``top_k`` experts of intermediate ``m``) and
    ``router * num_experts`` for the router, in place of the dense MLP's ``mlp * i``."""

    routed_mlp: float
    routed_hidden: float
    router: float


MOE_SAVED_KERNEL = MoeCoefficients(routed_mlp=2, routed_hidden=0, router=2)
"""On CPU and CUDA both backends run twinseq's grouped experts kernel (``torch_backend.moe``, ``jax_backend.moe``):
per token copy the gate/up pre-activations only (2m); the input is re-gathered and the rest recomputed in backward."""

MOE_SAVED = {  # the per-projection paths: jax's with expert LoRA (planned); torch's where the kernel cannot run
    # torch, transformers' grouped_mm experts (integrations.moe.grouped_mm_experts_forward), per token copy: the
    # gathered input (h), the gate_up output (2m), act(gate) (m), the gated product the down matmul reads (m) and
    # the down output the routing weight multiplies (h); per token the router's logits and float32 softmax (2 E)
    "torch": MoeCoefficients(routed_mlp=4, routed_hidden=2, router=2),
    # jax_backend.model.SparseMoeBlock's per-projection path (ragged_dot over the sorted copies): the same set, as XLA
    # keeps the dense MLP's (5 i) with its gathered input and weighted output
    "jax": MoeCoefficients(routed_mlp=5, routed_hidden=2, router=2),
}
MOE_ROWS = ("routed activations (MoE)", "router logits (MoE)")
"""The MoE layers' share of the decoder activations, reported as their own rows."""


@dataclass(frozen=True)
class LayerCoefficients:
    """Elements saved per decoder layer per token: ``norm * h + attn * q + mlp * i`` (q = heads x head_dim)."""

    norm: float
    attn: float
    mlp: float
    kv: float = 0.0
    ckpt_keep: float = 1.0
    """``x h`` kept per layer under checkpointing (the layer input)."""
    scores: float = 0.0
    """float32 ``B x heads x T x T`` tensors kept per layer on the dense path."""
    final: float = 3.0
    """``x h`` per token after the last layer (final norm, the hidden state the loss reads)."""
    work: float = 0.0
    """torch: one layer's backward working set, as a fraction of that layer's saved activations."""
    mask_per_layer: float = 0.0
    """torch sdpa/eager: mask-sized (``B x T x T`` float32) bytes each layer keeps beyond the tensors autograd
    lists as saved (fitted, not explained by the saved-tensor count)."""
    ckpt_cpu_kept: float = 1.0
    """jax on CPU: the fraction of the activations checkpointing leaves in the compiled peak."""


LAYER_SAVED = {
    # derived by counting (module docstring), checked against the measured peaks of benchmarks/memory_planner_check
    "torch": LayerCoefficients(norm=6, attn=5, mlp=4, scores=1.0, work=0.5, mask_per_layer=0.6),
    "jax": LayerCoefficients(norm=5, attn=5, mlp=5, scores=3.0, ckpt_cpu_kept=0.9),
}
BLOCKED_TILES = 4.0
"""float32 ``B x heads x block x block`` tiles alive in the blocked attention's backward of one block pair (the
scores ``s``, the probabilities ``p``, ``dp = do v^T`` and ``ds``: FlashAttention-2's backward, both backends).
Counted; a least-squares fit to ``compiled.memory_analysis()`` of jax ``tiny`` steps past one block (B x T x block
in {4, 8, 1} x {1024, 2048, 4096} x {256, 512, 1024}, the held-out planner row's shape left out) gives 3.9."""


def attention_path(
    backend: str,
    attn_implementation: str,
    row_length: int,
    device: str = "cpu",
    block_size: int = DEFAULT_ATTENTION_BLOCK_SIZE,
) -> str:
    """Which attention a step of rows of ``row_length`` tokens runs: ``"dense"`` (a ``T x T`` mask, and
    scores where the path keeps them), ``"blocked"`` (online softmax over ``block_size`` tiles, O(T x block))
    or ``"kernel"`` (torch's ``varlen``/flex/flash: no ``T x T`` tensor, nothing planned for attention).

    The backends' rules, with their constants (``common.config``):

    - jax: ``JAX_DENSE_ATTN_IMPLEMENTATIONS`` (``eager``) is always dense; every other name runs
      ``BlockedAttention``, which takes the dense path for rows that fit one block (``T <= block_size``)
      and the blocked kernel for longer ones (``jax_backend.attention``);
    - torch: ``sdpa``/``eager`` on CPU with ``T >= BLOCKED_MIN_SEQ_LEN`` run ``twinseq_blocked``
      (``torch_backend.blocked_attention.uses_blocked_attention``), shorter rows and CUDA the dense mask;
      the other implementations their own kernels.

    >>> attention_path("jax", "sdpa", 512), attention_path("jax", "sdpa", 576), attention_path("jax", "eager", 4096)
    ('dense', 'blocked', 'dense')
    >>> attention_path("torch", "sdpa", 2047), attention_path("torch", "sdpa", 2048)
    ('dense', 'blocked')
    >>> attention_path("torch", "sdpa", 4096, device="cuda"), attention_path("torch", "varlen", 4096)
    ('dense', 'kernel')
    """
    if backend == "jax":
        if attn_implementation in JAX_DENSE_ATTN_IMPLEMENTATIONS or row_length <= block_size:
            return "dense"
        return "blocked"
    if attn_implementation in ("sdpa", "eager"):
        return "blocked" if device == "cpu" and row_length >= BLOCKED_MIN_SEQ_LEN else "dense"
    return "kernel"


RUNTIME_BYTES = {("torch", "cpu"): 20 * 2**20}
"""Fitted constant: what a torch CPU step allocates besides tensors the model names (measured on a
64-token step of ``tiny`` and ``small``)."""
ONEDNN_CACHE_BYTES = 12 * 2**20
"""torch on CPU computing in bfloat16 (``adamw_bf16``/``adamw_bf16_8bit`` weights, or ``--dtype bfloat16``): bfloat16
matmuls and attention run oneDNN kernels, and two caches keep one entry per distinct problem shape alive for the
rest of the run (oneDNN's primitive cache, ``ONEDNN_PRIMITIVE_CACHE_CAPACITY``, and ideep's, ``LRU_CACHE_CAPACITY``;
``twinseq.torch_backend`` caps both at ``ONEDNN_CACHE_CAPACITY`` unless the user set them). float32 runs take MKL's
sgemm and cache nothing. Measured on ``small`` (4 x 512 wrapped rows, sdpa, fused loss, checkpointing,
``adamw_bf16``): the step-2 peak RSS is 12.7 MiB above the same run with both caches off, and stays there at step 3:
the shapes repeat (27 kernels; with 16 entries the same peak, 13 of them rebuilt a step, ~30 ms). Fitted constant for
runs whose shapes repeat; runs whose shapes change every step take ``ONEDNN_CACHE_VARYING_BYTES``."""
ONEDNN_CACHE_CAPACITY = 16
"""Entries each of oneDNN's and ideep's kernel caches keep (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``,
``LRU_CACHE_CAPACITY``; their default is 1,024), set by ``twinseq.torch_backend`` with ``os.environ.setdefault``.
Measured on ``small``, staircase "+ bf16 state" (padding-free, varlen, 8 steps): the peak RSS levels off at step 5,
228 MiB (default: 191 MiB after step 1, 404 MiB after step 8 and still growing; 64 entries: 284 MiB from step 4;
off, 0 and 1 (``LRU_CACHE_CAPACITY=0`` crashes torch 2.13): 197 MiB but twice the step time). The median step time
was not slower than the default's (9.9 s against 11.4 s, 2 loaded cores)."""
ONEDNN_CACHE_ENTRY_BYTES = 2 * 2**20
"""What one cached bfloat16 kernel keeps resident when shapes vary (primitive, packed weights, scratch): measured on
``small``'s varlen run, 31 MiB above the caches-off run with 16 entries. Fitted on ``small`` (hidden 384, 512-token
rows); larger matmuls keep larger entries."""
ONEDNN_CACHE_VARYING_BYTES = ONEDNN_CACHE_CAPACITY * ONEDNN_CACHE_ENTRY_BYTES
"""The bound the cap implies for runs whose shapes change every step (``padding_free`` with ``varlen``: the attention
runs one shape per document length), which without the cap grew 18 MiB a step on ``small``."""


@dataclass
class MemoryRow:
    component: str
    bytes: int
    note: str = ""


@dataclass
class MemoryPlan:
    """One row per component (bytes, on one device) and what the plan assumed."""

    rows: list[MemoryRow]
    backend: str
    device: str
    dtype: str
    devices: int
    tokens: int
    rows_per_micro_batch: int
    row_length: int
    trainable_parameters: int
    total_parameters: int
    notes: list[str] = field(default_factory=list)

    @property
    def total(self) -> int:
        return int(sum(r.bytes for r in self.rows))

    def get(self, component: str) -> int:
        return int(sum(r.bytes for r in self.rows if r.component == component))

    @property
    def activations(self) -> int:
        return int(sum(r.bytes for r in self.rows if r.component in ACTIVATION_ROWS))

    def table(self) -> str:
        width = max(len(r.component) for r in self.rows)
        lines = [f"{'component':<{width}}  {'memory':>10}  note", "-" * (width + 14 + 30)]
        for r in self.rows:
            lines.append(f"{r.component:<{width}}  {format_bytes(r.bytes):>10}  {r.note}")
        lines.append("-" * (width + 14 + 30))
        lines.append(
            f"{'total':<{width}}  {format_bytes(self.total):>10}  "
            f"({self.backend}, {self.device}, {self.dtype}, {self.devices} device(s), {self.tokens} tokens "
            f"per micro-batch = {self.rows_per_micro_batch} x {self.row_length})"
        )
        return "\n".join(lines + [f"note: {n}" for n in self.notes])

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in dataclasses.asdict(self).items() if k != "rows"},
            "rows": [dataclasses.asdict(r) for r in self.rows],
            "total": self.total,
        }


ACTIVATION_ROWS = (
    "activations (decoder layers)",
    "attention scores",
    "attention mask",
    "LoRA activations",
    "logits (loss kernel)",
    *MOE_ROWS,
    "grouped matmul workspace (MoE)",
)
"""The rows that grow with the tokens of a micro-batch."""


# --------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_bytes(text: Any, field_name: str = "budget") -> int:
    """``"24GiB"``, ``"24 GB"``, ``"1.5e9"``, ``512MiB`` -> bytes; anything else raises ``ConfigError``.

    >>> parse_bytes("24GiB"), parse_bytes("1.5 GB"), parse_bytes(1024)
    (25769803776, 1500000000, 1024)
    """
    if isinstance(text, (int, float)) and not isinstance(text, bool) and text > 0:
        return int(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS or float(match.group(1)) <= 0:
        raise ConfigError(
            f"{field_name}={text!r} is not a memory size; write a positive number with a unit, "
            f"e.g. 24GiB, 24GB, 512MiB (GiB/MiB are powers of 2, GB/MB powers of 10)."
        )
    return int(float(match.group(1)) * _UNITS[unit])


def format_bytes(n: float) -> str:
    """Binary units: ``format_bytes(3 * 2**30) == '3.00 GiB'``."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def _numel(shape: Sequence[int]) -> int:
    return int(math.prod(shape))


# --------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------


def _micro_batch_shape(config, backend: str) -> tuple[int, int]:
    """(rows, row length) of one micro-batch (the module docstring's rule)."""
    d = config.data
    length = d.max_length
    if length is None:
        raise ConfigError(
            "max_length=None leaves the micro-batch size unbounded, so there is nothing to plan "
            "from; set --max-length (the longest row the run will see)."
        )
    per_row = 2 if config.task == "dpo" else 1
    rows = d.per_device_train_batch_size * per_row
    shared = _shared_row_length(config)
    if shared is not None:  # prefix sharing: a pair (DPO) or a group (GRPO) is one row, its prompt written once
        rows, length = shared
    if d.padding_free:
        rows, length = 1, rows * length
    multiple = d.pad_to_multiple_of or (64 if backend == "jax" else 1)
    length = -(-length // multiple) * multiple
    return rows, length


def _shared_row_length(config) -> Optional[tuple[int, int]]:
    """(rows, row length) of a prefix-shared micro-batch (``common.data.prefix_sharing``), or None when the run does
    not share. A prompt of p tokens and its k completions of c: ``p - 1 + k * (c + 1)`` tokens (DPO: k = 2, GRPO: k =
    ``num_generations``, a micro-batch's completions grouped by prompt). The longest such row over the prompts the
    data may hold, 1 to P = ``max_prompt_length`` tokens: DPO's completions get ``c = min(max_completion_length,
    max_length - p)`` (truncation's order), so a shorter prompt leaves room for longer completions and, without
    ``max_completion_length``, the longest row is a one-token prompt's, ``2 x max_length``; GRPO's completions are
    ``max_completion_length`` long (``max_length - p`` when unset). The rule is piecewise linear in p: its maximum is
    at p = 1, P or ``max_length - max_completion_length``."""
    d = config.data
    if prefix_sharing_off_reason(config) is not None or d.max_prompt_length is None:
        return None
    top = min(d.max_prompt_length, d.max_length)
    c_max = d.max_completion_length
    if config.task == "dpo":
        k, rows = 2, d.per_device_train_batch_size

        def completion(p: int) -> int:
            return min(c_max, d.max_length - p) if c_max is not None else d.max_length - p
    else:
        k = min(config.grpo.num_generations, d.per_device_train_batch_size)
        rows = -(-d.per_device_train_batch_size // k)

        def completion(p: int) -> int:
            return c_max if c_max is not None else d.max_length - p

    candidates = {1, top} | ({min(max(d.max_length - c_max, 1), top)} if c_max is not None else set())
    return rows, max(p - 1 + k * (completion(p) + 1) for p in candidates)


def _quant_stats_key(backend: str) -> str:
    return "jax" if backend == "jax" else "torch"


def _bnb_state_bytes(shapes: Sequence[tuple[int, ...]]) -> int:
    total = 0
    for shape in shapes:
        n = _numel(shape)
        if n >= BNB_MIN_8BIT_SIZE:
            total += 2 * n + 2 * 4 * -(-n // BNB_8BIT_BLOCK)
        else:
            total += 8 * n
    return total


def _moe_elems(cfg: ModelConfig, moe: MoeCoefficients) -> tuple[float, float]:
    """(routed, router) elements one MoE layer saves per token (``MoeCoefficients``)."""
    k, m, h = cfg.num_experts_per_tok, cfg.expert_intermediate_size, cfg.hidden_size
    return k * (moe.routed_mlp * m + moe.routed_hidden * h), moe.router * cfg.num_experts


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name


def _nf4_experts_workspace(
    cfg: ModelConfig, shapes: dict[str, tuple[int, ...]], nf4_experts: set[str], expert_lora: bool, backend: str
) -> MemoryRow:
    """The float32 experts one chunk of twinseq's NF4 kernel holds: ``min(E, NF4_EXPERTS_PER_CHUNK)`` experts (torch;
    one, jax's scan step) of both tensors of one layer (4 B per number), plus, for the larger tensor, the
    dequantisation's int32 index per byte (2 B per number) or, with LoRA on the experts, its weight gradient in
    backward (4 B per number)."""
    per_expert = {n.rsplit(".", 1)[-1]: _numel(shapes[n][1:]) for n in nf4_experts}
    chunk = min(cfg.num_experts, 1 if backend == "jax" else NF4_EXPERTS_PER_CHUNK)
    largest = max(per_expert.values())
    work = chunk * (4 * sum(per_expert.values()) + (4 if expert_lora else 2) * largest)
    note = f"{chunk} of {cfg.num_experts} experts dequantised to float32 at a time" + (
        " (+ their LoRA weight gradient)" if expert_lora else ""
    )
    return MemoryRow("NF4 experts workspace (transient)", int(work), note)


def _split_expert_rows(rows: list[MemoryRow], shapes: dict[str, tuple[int, ...]], split: dict[str, float]) -> None:
    """Moves the experts' share of each state row named in ``split`` (component -> bytes per expert number, ``-1``
    for the 8-bit optimizer's block rule) into an ``expert ...`` row of its own, in place; the total is unchanged."""
    expert_shapes = [s for n, s in shapes.items() if _is_expert(n)]
    expert_elems = sum(map(_numel, expert_shapes))
    if not expert_elems:
        return
    for index in range(len(rows) - 1, -1, -1):
        row = rows[index]
        per_number = split.get(row.component)
        if per_number is None:
            continue
        part = _bnb_state_bytes(expert_shapes) if per_number < 0 else expert_elems * per_number
        part = min(int(part), row.bytes)
        row.bytes -= part
        note = f"{expert_elems / 1e6:.2f}M expert numbers: every expert resident, routed or not"
        rows.insert(index + 1, MemoryRow("expert " + row.component, part, note))


def _moe_rows(
    rows: list[MemoryRow],
    cfg: ModelConfig,
    n_moe: int,
    tokens: int,
    per_elem: float,
    routed_elems: float,
    router_elems: float,
    backend: str,
    one_layer: bool,
    device: str,
    act_bytes: int,
) -> float:
    """Moves the MoE layers' ``routed``/``router`` elements (``per_elem`` bytes each: the decoder row's bytes per
    element of its layer-averaged count) out of ``rows[-1]`` (the decoder activations) into ``MOE_ROWS``, and
    appends the grouped matmul's workspace: the permutations that sort each layer's token copies by expert (torch:
    int64 sort order and its inverse, both kept for backward; jax: int32 order and token index). Returns the
    workspace bytes."""
    decoder = rows[-1]
    k, e, m = cfg.num_experts_per_tok, cfg.num_experts, cfg.expert_intermediate_size
    routed = int(per_elem * n_moe * routed_elems)
    router = int(per_elem * n_moe * router_elems)
    decoder.bytes -= routed + router
    what = "1 layer recomputed" if one_layer else f"{n_moe} MoE layers"
    rows.append(MemoryRow(MOE_ROWS[0], routed, f"{what}: top_k={k} copies of {tokens} tokens, {m}-wide experts"))
    rows.append(MemoryRow(MOE_ROWS[1], router, f"{what}: [{tokens}, {e}] logits and float32 softmax"))
    per_copy = 16 if backend == "torch" else 8
    work = tokens * k * per_copy * (1 if one_layer else n_moe)
    note = f"{per_copy} B per token copy: the sort by expert"
    rows.append(MemoryRow("grouped matmul workspace (MoE)", work, note))
    return float(work)


def plan_memory(
    config,
    *,
    dtype: Optional[str] = None,
    devices: int = 1,
    device: str = "cpu",
    backend: Optional[str] = None,
    model: Optional[ModelConfig] = None,
) -> MemoryPlan:
    """The ``MemoryPlan`` of one training step of ``config`` (a ``TrainConfig``) on one of ``devices``.

    ``dtype`` overrides ``config.model.dtype`` (the compute dtype), ``backend`` ``config.backend``;
    ``device`` is ``cpu`` or ``cuda`` (offloading only saves memory on ``cuda``); ``model`` overrides the
    ``ModelConfig`` that ``config.model.model_config`` names.
    """
    backend = backend or config.backend
    dtype = dtype or config.model.dtype
    if backend not in LAYER_SAVED:
        raise ConfigError(f"backend={backend!r} is not one twinseq plans for; use torch or jax.")
    if dtype not in DTYPE_BYTES:
        raise ConfigError(f"dtype={dtype!r} is not planned; use one of {sorted(DTYPE_BYTES)}.")
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r} is not planned; use cpu or cuda.")
    if not isinstance(devices, int) or devices < 1:
        raise ConfigError(
            f"devices={devices!r} is not valid; pass a positive integer (the FSDP world size), e.g. --devices 8."
        )
    cfg = model or resolve_model_config(config.model.model_config)
    peft: PeftConfig = config.peft
    coef = LAYER_SAVED[backend]
    act_bytes = DTYPE_BYTES[dtype]
    notes: list[str] = []
    rows: list[MemoryRow] = []
    shard = devices if (config.parallel.fsdp or devices > 1) else 1
    if devices > 1 and not config.parallel.fsdp:
        notes.append(
            f"devices={devices}: a multi-process torch launch always shards with FSDP2, so states are "
            f"divided by {devices}."
        )

    shapes = parameter_shapes(cfg)
    total_params = sum(_numel(s) for s in shapes.values())
    targets = lora_targets(cfg, peft) if peft.use_peft else {}
    quantised: set[str] = set()
    if peft.use_peft and peft.load_in_4bit:
        # QLoRA quantises every decoder linear, adapted or not (bitsandbytes/qwix replace all of them)
        quantised = {n for n, s in shapes.items() if len(s) == 2 and n.split(".")[-2] in LINEAR_MODULES}
    nf4_experts = set(nf4_expert_tensors(cfg)) if peft.use_peft and peft.load_in_4bit else set()
    dense_elems = sum(_numel(s) for n, s in shapes.items() if n not in quantised | nf4_experts)
    quant_elems = sum(_numel(shapes[n]) for n in quantised)
    expert_quant_elems = sum(_numel(shapes[n]) for n in nf4_experts)

    # --- parameters ------------------------------------------------------------------
    if quant_elems:
        stats = QUANT_STATS_BYTES[_quant_stats_key(backend)]
        rows.append(
            MemoryRow(
                "weights (NF4 + absmax)",
                int(quant_elems * (NF4_BYTES + stats) / shard),
                f"{quant_elems / 1e6:.1f}M decoder linear weights x ({NF4_BYTES} + {stats:.4f}) B",
            )
        )
    if expert_quant_elems:
        rows.append(
            MemoryRow(
                "expert weights (NF4 + absmax)",
                int(expert_quant_elems * (NF4_BYTES + NF4_EXPERT_STATS_BYTES) / shard),
                f"{expert_quant_elems / 1e6:.1f}M expert numbers x ({NF4_BYTES} + {NF4_EXPERT_STATS_BYTES:.4f}) B, "
                "every expert resident",
            )
        )
    optimizer = config.optim.optimizer
    bf16_state = optimizer in ("adamw_bf16", "adamw_bf16_8bit")
    if bf16_state and backend != "torch":
        raise ConfigError(
            f"optimizer={optimizer!r} (bfloat16 weights, stochastically rounded) is torch only today; use "
            f"--optimizer adamw_torch (or adamw_bnb_8bit) on the jax backend."
        )
    if bf16_state:
        # bfloat16 weights compute in bfloat16, whatever --dtype says, on CPU too: every matmul reads bfloat16
        # weights and writes bfloat16 activations (measured: small, fixed shapes, with the CPU kernel caches off,
        # 185 MiB against 176 planned; the caches are their own row, ONEDNN_CACHE_BYTES)
        act_bytes = DTYPE_BYTES["bfloat16"]
    if bf16_state and peft.use_peft:
        raise ConfigError(
            f"optimizer={optimizer!r} trains full bfloat16 weights, but use_peft=True trains float32 adapters over a "
            f"frozen base; drop --use-peft (full fine-tune) or use --optimizer adamw_torch with adapters."
        )
    in_bwd = config.optim.optimizer_in_backward
    if in_bwd and backend != "torch":
        raise ConfigError(
            "optimizer_in_backward=True is a torch option (a per-parameter step in each gradient's hook); drop "
            "--optimizer-in-backward on the jax backend."
        )
    if in_bwd and optimizer == "adamw_bnb_8bit":
        raise ConfigError(
            "optimizer_in_backward=True steps one parameter at a time with twinseq's AdamW, and "
            "optimizer='adamw_bnb_8bit' is bitsandbytes' optimizer; use --optimizer adamw_bf16_8bit or drop "
            "--optimizer-in-backward."
        )
    if in_bwd and (config.data.gradient_accumulation_steps > 1 or config.optim.max_grad_norm is not None):
        raise ConfigError(
            f"optimizer_in_backward=True steps each parameter inside backward, so it needs "
            f"gradient_accumulation_steps=1 (got {config.data.gradient_accumulation_steps}) and max_grad_norm=None "
            f"(got {config.optim.max_grad_norm}); pass --gradient-accumulation-steps 1 --max-grad-norm None."
        )
    # the stored weights: bfloat16 under adamw_bf16; under adapters the frozen base in the compute dtype
    # (common.models.peft.base_dtype); float32 master weights otherwise
    weight_dtype = "bfloat16" if bf16_state else base_dtype(peft, dtype)
    weight_bytes = DTYPE_BYTES[weight_dtype]
    rows.append(
        MemoryRow(
            f"weights ({weight_dtype})",
            int(dense_elems * weight_bytes / shard),
            f"{dense_elems / 1e6:.2f}M numbers x {weight_bytes} B"
            + ("" if not quant_elems else " (embeddings, norms, lm_head)"),
        )
    )
    if peft.use_peft:
        adapters = adapter_shapes(cfg, peft)
        trainable_shapes = list(adapters.values())
        rows.append(
            MemoryRow(
                "LoRA adapters (float32)",
                int(sum(map(_numel, trainable_shapes)) * 4 / shard),
                f"r={peft.lora_r} on {len(targets)} linear layers",
            )
        )
    else:
        trainable_shapes = list(shapes.values())
    trainable = int(sum(map(_numel, trainable_shapes)))
    # the matmul weights autocast casts: decoder linears and the lm_head (a tied embedding is one; an untied
    # embedding is a lookup, never cast)
    lookup = set() if cfg.tie_word_embeddings else {"model.embed_tokens.weight"}
    matmul_elems = sum(_numel(s) for n, s in shapes.items() if len(s) == 2 and n not in quantised | lookup)
    copies_all = copies_layer = 0
    if dtype != "float32" and weight_dtype != dtype:  # weights already in the compute dtype are not cast
        copies_all = int(matmul_elems * act_bytes / shard)
        layer_matmul = sum(
            _numel(s)
            for n, s in shapes.items()
            if n.startswith("model.layers.0.") and len(s) == 2 and n not in quantised
        )
        head = shapes.get("lm_head.weight", shapes["model.embed_tokens.weight"])
        copies_layer = int((layer_matmul + _numel(head)) * act_bytes)
        rows.append(
            MemoryRow(
                f"{dtype} weight copies",
                copies_all,
                "compute-dtype casts of the matmul weights (torch: autocast's cache, or saved for "
                "backward; with checkpointing one layer's at a time in backward)",
            )
        )
    if quant_elems:
        # both backends dequantise one linear layer's weight right before its matmul and again for its
        # backward (jax: jax_backend.peft._nf4_matmul, whose dequantisations are tied to the layer's input so
        # that XLA cannot merge them into one value alive from forward to backward; measured on CPU, staircase
        # small and llama-100m: the QLoRA step is LoRA's less the float32-vs-NF4 storage plus exactly one
        # largest linear's float32 weight, 1.5 and 7.5 MiB)
        biggest = max(_numel(shapes[n]) for n in quantised)
        rows.append(
            MemoryRow(
                "dequantised weight (transient)", int(biggest * act_bytes), "one linear layer dequantised at a time"
            )
        )
    if expert_quant_elems:
        rows.append(_nf4_experts_workspace(cfg, shapes, nf4_experts, bool(expert_targets(cfg, peft)), backend))

    # --- gradients and optimizer --------------------------------------------------------
    grad_bytes = 2 if bf16_state else 4
    largest_numel = max(map(_numel, trainable_shapes))
    if in_bwd:
        # each parameter steps in its gradient's hook and frees it there: one gradient is alive at a time
        gradients = largest_numel * grad_bytes
        rows.append(
            MemoryRow(
                f"gradients ({'bfloat16' if bf16_state else 'float32'}, one at a time)",
                int(gradients),
                f"optimizer in backward: the largest trainable tensor's, {largest_numel / 1e6:.2f}M numbers",
            )
        )
    else:
        gradients = trainable * grad_bytes
        rows.append(
            MemoryRow(
                f"gradients ({'bfloat16' if bf16_state else 'float32'})",
                int(gradients / shard),
                f"{trainable / 1e6:.2f}M trainable",
            )
        )
    if optimizer == "adamw_bf16":
        rows.append(
            MemoryRow("optimizer state (AdamW bfloat16)", int(trainable * 4 / shard), "exp_avg + exp_avg_sq, bfloat16")
        )
    elif optimizer in ("adamw_bnb_8bit", "adamw_bf16_8bit"):
        rows.append(
            MemoryRow(
                "optimizer state (AdamW 8-bit)",
                int(_bnb_state_bytes(trainable_shapes) / shard),
                f"2 x 1 B + float32 absmax per {BNB_8BIT_BLOCK}",
            )
        )
    else:
        rows.append(MemoryRow("optimizer state (AdamW)", int(trainable * 8 / shard), "exp_avg + exp_avg_sq, float32"))
    if shard > 1:
        layer_elems = sum(_numel(s) for n, s in shapes.items() if n.startswith("model.layers.0."))
        per_elem = (NF4_BYTES + QUANT_STATS_BYTES[_quant_stats_key(backend)]) if quant_elems else 4
        rows.append(
            MemoryRow(
                "FSDP all-gather buffers",
                int(2 * layer_elems * per_elem),
                f"full weights of 2 decoder layers (sharded over {shard})",
            )
        )
    if config.task == "dpo" and not config.dpo.precompute_ref_log_probs and not peft.use_peft:
        rows.append(MemoryRow("reference model (DPO)", int(total_params * 4 / shard), "frozen float32 copy"))
    split = {f"weights ({weight_dtype})": weight_bytes / shard}
    if not peft.use_peft and not in_bwd:
        split[f"gradients ({'bfloat16' if bf16_state else 'float32'})"] = grad_bytes / shard
        optimizer_per_number = {"adamw_bf16": 4.0, "adamw_bnb_8bit": -1.0, "adamw_bf16_8bit": -1.0}
        state_name = {"adamw_bf16": "AdamW bfloat16", "adamw_bnb_8bit": "AdamW 8-bit", "adamw_bf16_8bit": "AdamW 8-bit"}
        per_number = optimizer_per_number.get(optimizer, 8.0)
        split[f"optimizer state ({state_name.get(optimizer, 'AdamW')})"] = per_number / shard if per_number > 0 else -1
    # NF4 experts have their own row; only their float neighbours (gpt_oss's biases) split off the weights row
    _split_expert_rows(rows, {n: s for n, s in shapes.items() if n not in nf4_experts}, split)

    # --- activations ------------------------------------------------------------------------
    b, t = _micro_batch_shape(config, backend)
    tokens = b * t
    h, i, v = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    assert cfg.head_dim is not None  # ModelConfig.__post_init__ fills head_dim
    q = cfg.num_attention_heads * cfg.head_dim
    layers = cfg.num_hidden_layers
    # MoE layers save their routed copies and the router's logits in place of the dense MLP's (MOE_SAVED); the
    # per-layer figure is the mean over the layers, so ``layers x per_layer`` is their sum
    n_moe = sum(cfg.layer_is_moe(k) for k in range(layers))
    saved = MOE_SAVED["jax"] if backend == "jax" and peft.lora_target_parameters else MOE_SAVED_KERNEL
    routed_elems, router_elems = _moe_elems(cfg, saved) if n_moe else (0.0, 0.0)
    mlp_elems = ((layers - n_moe) * coef.mlp * i + n_moe * (routed_elems + router_elems)) / layers
    down_in = ((layers - n_moe) * i + n_moe * cfg.num_experts_per_tok * cfg.expert_intermediate_size) / layers
    per_layer = coef.norm * h + coef.attn * q + mlp_elems + coef.kv * cfg.num_key_value_heads * cfg.head_dim
    if cfg.gemma:
        per_layer += coef.norm * h  # two more norms
    # Under LoRA the frozen base's linears could skip saving their inputs, but measurement says the saved set
    # barely shrinks (tiny, no dropout: the same activations as a full fine-tune within 2 %); the plan keeps the
    # full fine-tune's set and adds the adapters' own tensors ("LoRA activations").
    # bytes per saved number: jax casts the whole state to the compute dtype; torch autocast keeps the residual
    # stream, the norms and RoPE's products in float32 and saves compute-dtype casts of each linear's input
    layer_bytes = per_layer * act_bytes
    resid_bytes = act_bytes
    if backend == "torch" and dtype != "float32" and not bf16_state:  # (bfloat16 weights: a bfloat16 stream)
        resid_bytes = 4
        casts = 2 * h + q + down_in
        layer_bytes = coef.norm * h * 4 + casts * act_bytes + (coef.attn * q + mlp_elems) * act_bytes + 2 * q * 4
    ckpt = config.memory.gradient_checkpointing
    offload = config.memory.activation_offloading
    if offload and device == "cpu":
        notes.append("activation_offloading on CPU moves activations to the same RAM: no saving is planned.")
    offloaded = offload and device == "cuda"
    # what stays saved for backward once the forward is done, and what one layer's recompute adds back
    if ckpt and backend == "jax" and device == "cpu":
        kept_per_token = layers * layer_bytes * coef.ckpt_cpu_kept
        recompute = 0.0
        how = (
            f"{layers} layers x {per_layer:.0f} numbers per token, x {coef.ckpt_cpu_kept:g} with remat "
            f"(XLA:CPU schedules the recompute early)"
        )
        notes.append(
            "jax on CPU: jax.checkpoint barely lowers the compiled peak (XLA:CPU hoists the "
            "recomputation); on GPU the plan's checkpointing saving is the theoretical one."
        )
    elif ckpt:
        kept_per_token = layers * coef.ckpt_keep * h * resid_bytes
        recompute = tokens * layer_bytes
        how = f"{layers} layer inputs + 1 layer recomputed"
    else:
        kept_per_token = layers * layer_bytes
        recompute = 0.0
        how = f"{layers} layers x {per_layer:.0f} numbers per token"
    if offloaded:
        kept_per_token = min(2, layers) * (coef.ckpt_keep * h * resid_bytes if ckpt else layer_bytes)
        how += ", offloaded to host (2 layers in flight)"
    kept = tokens * (kept_per_token + coef.final * h * resid_bytes)
    rows.append(MemoryRow("activations (decoder layers)", int(kept + recompute), f"{tokens} tokens, {how}"))
    moe_work = 0.0
    if n_moe:
        layers_kept = recompute + (
            0.0 if ckpt and not (backend == "jax" and device == "cpu") else tokens * kept_per_token
        )
        moe_work = _moe_rows(
            rows,
            cfg,
            n_moe,
            tokens,
            layers_kept / (layers * per_layer),
            routed_elems,
            router_elems,
            backend,
            one_layer=bool(ckpt and recompute),
            device=device,
            act_bytes=act_bytes,
        )

    attn = config.model.attn_implementation
    heads = cfg.num_attention_heads
    path = attention_path(backend, attn, t, device, config.memory.attention_block_size)
    scores_kept = scores_recompute = blocked_work = 0.0
    # kept per layer, and what one layer adds back when checkpointing recomputes it (not on jax CPU: XLA keeps
    # every layer's there, remat or not, as for the layers above)
    recomputed = ckpt and not (backend == "jax" and device == "cpu")
    kept_layers = 0 if recomputed else (min(2, layers) if offloaded else layers)
    if path == "dense" and (backend == "jax" or attn == "eager"):
        one = coef.scores * b * heads * t * t * 4
        scores_recompute = one if recomputed else 0.0
        scores_kept = one * kept_layers
        rows.append(
            MemoryRow(
                "attention scores",
                int(scores_kept + scores_recompute),
                f"{'jax dense' if backend == 'jax' else 'eager'}: {coef.scores:g} x {b} x {heads} x "
                f"{t} x {t} float32 per layer{' (one layer, recomputed)' if scores_recompute else ''}",
            )
        )
    elif path == "blocked":
        block = config.memory.attention_block_size
        padded = -(-t // block) * block  # jax pads T to a multiple of the block; torch's last block is short
        lse = b * heads * padded * 4  # the float32 log-sum-exp each layer saves for its backward
        tile = b * heads * block * block * 4
        # the lse is kept like the activations; the block pair's tiles live inside one layer's attention
        # backward (jax: inside the compiled step's peak; torch: the backward moment below)
        scores_kept = lse * kept_layers
        scores_recompute = lse if recomputed else 0.0
        blocked_work = BLOCKED_TILES * tile
        rows.append(
            MemoryRow(
                "attention scores",
                int(scores_kept + scores_recompute + blocked_work),
                f"blocked, T={t} in {block}-token blocks: {BLOCKED_TILES:g} x {b} x {heads} x {block} x {block} "
                f"float32 (one block pair's "
                f"backward) + a float32 [{b}, {heads}, {padded}] log-sum-exp per layer",
            )
        )
    mask: float = 0
    if path == "dense" and (backend == "jax" or attn in ("sdpa", "eager")):
        mask_bytes = 1 if backend == "jax" else 4
        sliding = [cfg.layer_is_sliding(k) for k in range(layers)]
        n_masks = 2 if any(sliding) and not all(sliding) else 1
        mask = n_masks * b * t * t * mask_bytes
        note = f"{b} x {t} x {t} x {mask_bytes} B"
        if backend == "torch" and coef.mask_per_layer:
            mask_layers = layers if not ckpt else 1
            mask += coef.mask_per_layer * b * t * t * mask_bytes * mask_layers
            note += f", + {coef.mask_per_layer:g} of it per layer (fitted)"
        rows.append(MemoryRow("attention mask", int(mask), note))

    lora_kept = lora_recompute = 0.0
    if peft.use_peft:
        dropout = peft.lora_dropout > 0 and LORA_DROPOUT_APPLIED[backend]
        per_token = 0.0
        for fan_in, _fan_out in targets.values():
            per_token += peft.lora_r * act_bytes + (fan_in * (act_bytes + 1) if dropout else 0)
        if ckpt and not (backend == "jax" and device == "cpu"):
            lora_recompute = tokens * per_token / layers
        else:  # (XLA:CPU keeps every layer's, remat or not, as for the layers above)
            lora_kept = tokens * per_token * (min(2, layers) / layers if offloaded else 1)
        rows.append(
            MemoryRow(
                "LoRA activations",
                int(lora_kept + lora_recompute),
                f"A x per adapted linear{', dropout(x) + its mask' if dropout else ''}",
            )
        )

    loss_type = config.loss.loss_type
    head_grad = 0 if peft.use_peft else v * h * grad_bytes  # the lm_head/embedding gradient, made by the loss
    if loss_type == "nll":
        logits = LOGITS_COPIES[backend] * tokens * v * 4
        note = f"{LOGITS_COPIES[backend]:g} x [{tokens}, {v}] float32"
    elif loss_type == "triton" and device == "cuda":
        head_slice = 0 if peft.use_peft else min(TRITON_DW_SLICE_BYTES, v * h * 4)
        logits = tokens * h * 4 + head_slice
        note = "no logits: the float32 hidden-state gradient + one float32 lm_head-gradient slice"
    else:
        chunk = min(config.loss.loss_chunk_size, tokens)
        logits = CHUNK_COPIES * chunk * v * 4 + tokens * h * 4
        note = f"{CHUNK_COPIES:g} x [{chunk}, {v}] float32 (one chunk) + the float32 hidden-state gradient"
    rows.append(MemoryRow("logits (loss kernel)", int(logits), f"{loss_type}: {note}"))

    runtime = RUNTIME_BYTES.get((backend, device), 0)
    if runtime:
        rows.append(MemoryRow("runtime", int(runtime), "fitted: autograd engine, kernels' scratch (torch CPU)"))
    if backend == "torch" and device == "cpu" and act_bytes < 4:
        varying_shapes = config.data.padding_free and attn == "varlen"
        rows.append(
            MemoryRow(
                "oneDNN kernel cache (CPU bfloat16)",
                ONEDNN_CACHE_VARYING_BYTES if varying_shapes else ONEDNN_CACHE_BYTES,
                f"{ONEDNN_CACHE_CAPACITY} cached kernels x {ONEDNN_CACHE_ENTRY_BYTES // 2**20} MiB (the cap twinseq "
                "sets): varlen shapes change every step"
                if varying_shapes
                else "fitted: one cached kernel per bfloat16 matmul shape (the shapes repeat)",
            )
        )
    if backend == "torch":
        work = tokens * coef.work * layer_bytes
        rows.append(
            MemoryRow(
                "backward working set",
                int(work),
                f"one layer's activation gradients ({coef.work:g} x a layer's activations)",
            )
        )
        # torch frees as it goes: the peak is the largest of three moments, not the sum of every row
        alive = kept + mask + scores_kept + lora_kept + moe_work
        # autocast caches the casts of trainable weights until the forward ends; frozen weights' casts are only
        # kept when saved for backward (not under checkpointing)
        copies_at_loss = copies_layer if (ckpt and peft.use_peft) else copies_all
        copies_in_backward = copies_layer if ckpt else copies_all
        at_loss = alive + logits + head_grad + copies_at_loss
        in_backward = (
            alive
            + recompute
            + scores_recompute
            + blocked_work
            + lora_recompute
            + work
            + head_grad
            + tokens * h * 4
            + copies_in_backward
        )

        # the float64 copy of one gradient the norm takes (vector_norm with dtype=float64 casts the whole tensor
        # first: 8 bytes per number), or the update's float32 temporaries of one chunk
        def update_work(numel: int) -> int:
            return max(8 * numel, min(numel, UPDATE_CHUNK) * UPDATE_TEMP_BYTES[optimizer])

        if in_bwd:
            # one parameter at a time, its gradient freed after its update: inside the layers' backward, a decoder
            # layer's largest tensor (or an untied lm_head, whose gradient is complete right after the loss); the
            # embedding's (tied: the lm_head's too) is complete last, once the activations are freed
            named = adapters if peft.use_peft else shapes
            layer_numel = max((_numel(s) for n, s in named.items() if n.startswith("model.layers.")), default=0)
            head_numel = 0 if peft.use_peft or cfg.tie_word_embeddings else _numel(shapes["lm_head.weight"])
            last_numel = 0 if peft.use_peft else _numel(shapes["model.embed_tokens.weight"])
            in_backward += max(n * grad_bytes + update_work(n) for n in (layer_numel, head_numel))
            at_update = last_numel * grad_bytes + update_work(last_numel)
        else:  # every gradient, then the norm or the update
            at_update = gradients + update_work(largest_numel)
        if device == "cpu":
            at_update += HEAP_RETAINED_AT_UPDATE
        peak = max(at_loss, in_backward, at_update)
        moment = {at_loss: "the loss", in_backward: "the backward pass", at_update: "the optimizer step"}[peak]
        listed = (
            sum(r.bytes for r in rows if r.component in ACTIVATION_ROWS + ("backward working set",))
            + gradients
            + copies_all
        )
        rows.append(
            MemoryRow(
                "not alive at once",
                int(peak - listed),
                f"rows above freed before the peak, at {moment} (torch frees saved tensors as "
                f"backward consumes them; gradients appear as activations go)",
            )
        )
    return MemoryPlan(
        rows=rows,
        backend=backend,
        device=device,
        dtype=dtype,
        devices=devices,
        tokens=tokens,
        rows_per_micro_batch=b,
        row_length=t,
        trainable_parameters=trainable,
        total_parameters=total_params,
        notes=notes,
    )


# --------------------------------------------------------------------------------------
# The budget advisor
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Knob:
    name: str
    cost: float
    """Expected cost of turning it on (the ordering below): 0 free, 1-9 compute for memory, 10+ changes what
    trains."""
    why: str


KNOBS = (
    Knob("loss_type=fused_linear", 0.0, "free: same loss and gradients, no [tokens, vocab] logits"),
    Knob("padding_free", 0.1, "free: no padding tokens (varlen attention on torch)"),
    Knob("fsdp", 1.0, "communication: shard weights, gradients and optimizer over the devices"),
    Knob("gradient_checkpointing", 3.0, "compute: about one more forward per step (~30% slower)"),
    Knob("activation_offloading", 2.0, "host transfers, overlapped on a side stream (CUDA only)"),
    Knob("micro_batch", 4.0, "compute: smaller micro-batches, more accumulation, same effective batch"),
    Knob("optimizer_in_backward", 4.5, "exact updates, but no global-norm clipping and no accumulation (torch)"),
    Knob("adamw_bnb_8bit", 5.0, "8-bit optimizer moments: a small change in the update"),
    Knob("adamw_bf16", 6.0, "bfloat16 weights and moments, stochastically rounded (torch, full fine-tune)"),
    Knob("adamw_bf16_8bit", 7.0, "bfloat16 weights, 8-bit moments (torch, full fine-tune)"),
    Knob("use_peft", 10.0, "changes what trains: LoRA adapters on a frozen base"),
    Knob("load_in_4bit", 12.0, "changes the base: NF4-quantised frozen weights (QLoRA)"),
)
"""The advisor's cost ordering: free knobs first (same model, same numbers), then compute-for-memory, then
knobs that change what trains. The cheapest fitting set minimises the summed costs; among sets of equal cost the
one with the smallest plan wins (so the free knobs come along whenever something has to change).

Packing is not a memory knob here: the plan takes ``max_length`` as the row length a micro-batch reaches,
padded or packed, so packing changes tokens per second, not the planned peak. Padding-free saves the
``B x T x T`` mask on torch (it switches to ``varlen``), and costs a ``(B T)^2`` one on jax's dense path."""


@dataclass
class Advice:
    fits: bool
    plan: MemoryPlan
    changes: dict[str, Any]
    knobs: list[str]
    cost: float
    flags: list[str]
    budget: int
    minimum: Optional[MemoryPlan] = None

    def text(self) -> str:
        if not self.changes:
            return f"fits as is: {format_bytes(self.plan.total)} <= budget {format_bytes(self.budget)}."
        return (
            f"cheapest set that fits {format_bytes(self.budget)}: {', '.join(self.knobs)} -> "
            f"{format_bytes(self.plan.total)}\nadd: {' '.join(self.flags)}"
        )


def _flags(changes: dict[str, Any]) -> list[str]:
    out = []
    for k, val in changes.items():
        flag = "--" + k.replace("_", "-")
        if isinstance(val, bool):
            out.append(flag if val else "--no-" + k.replace("_", "-"))
        else:
            out += [flag, str(val)]
    return out


def _candidates(config, backend: str, device: str, devices: int):
    """Every combination of knobs that applies, as (knob names, flat changes, cost)."""
    d = config.data
    options: list[list[tuple[Optional[str], dict]]] = []
    if config.loss.loss_type == "nll":
        options.append([(None, {}), ("loss_type=fused_linear", {"loss_type": "fused_linear"})])
    if not d.padding_free:
        change: dict[str, Any] = {"padding_free": True}
        if backend == "torch" and config.model.attn_implementation in ("sdpa", "eager"):
            change["attn_implementation"] = "varlen"
        options.append([(None, {}), ("padding_free", change)])
    if not config.memory.gradient_checkpointing:
        options.append([(None, {}), ("gradient_checkpointing", {"gradient_checkpointing": True})])
    if device == "cuda" and not config.memory.activation_offloading and backend == "torch":
        options.append([(None, {}), ("activation_offloading", {"activation_offloading": True})])
    if devices > 1 and not config.parallel.fsdp and backend == "torch":
        options.append([(None, {}), ("fsdp", {"fsdp": True})])
    # (the planner refuses what cannot combine: a bfloat16 state on jax or with adapters, in-backward with
    # accumulation; the advisor skips those sets)
    optimizers = [o for o in ("adamw_bnb_8bit", "adamw_bf16", "adamw_bf16_8bit") if o != config.optim.optimizer]
    options.append([(None, {}), *((o, {"optimizer": o}) for o in optimizers)])
    if backend == "torch" and not config.optim.optimizer_in_backward:
        in_bwd = {"optimizer_in_backward": True, "max_grad_norm": None}
        options.append([(None, {}), ("optimizer_in_backward", in_bwd)])
    peft_opts: list[tuple[Optional[str], dict]] = [(None, {})]
    if not config.peft.use_peft:
        peft_opts.append(("use_peft", {"use_peft": True}))
        peft_opts.append(("use_peft+load_in_4bit", {"use_peft": True, "load_in_4bit": True}))
    elif not config.peft.load_in_4bit:
        peft_opts.append(("load_in_4bit", {"load_in_4bit": True}))
    options.append(peft_opts)
    bs, ga = d.per_device_train_batch_size, d.gradient_accumulation_steps
    micro: list[tuple[Optional[str], dict]] = [(None, {})]
    k = 2
    while bs % k == 0:
        micro.append(
            (
                f"micro_batch={bs // k}x{ga * k}",
                {"per_device_train_batch_size": bs // k, "gradient_accumulation_steps": ga * k},
            )
        )
        k *= 2
    options.append(micro)
    costs = {kn.name: kn.cost for kn in KNOBS}
    for combo in itertools.product(*options):
        names = [n for n, _ in combo if n]
        changes: dict[str, Any] = {}
        for _, c in combo:
            changes.update(c)
        cost = 0.0
        for n in names:
            if n.startswith("micro_batch="):
                cost += costs["micro_batch"] * math.log2(bs // changes["per_device_train_batch_size"])
            elif n == "use_peft+load_in_4bit":
                cost += costs["use_peft"] + costs["load_in_4bit"]
            else:
                cost += costs[n]
        yield names, changes, cost


def advise(
    config,
    budget: Any,
    *,
    dtype: Optional[str] = None,
    devices: int = 1,
    device: str = "cpu",
    backend: Optional[str] = None,
) -> Advice:
    """The cheapest set of knobs (``KNOBS``' ordering) under which ``plan_memory`` fits ``budget`` (bytes or
    ``"24GiB"``). Raises ``ConfigError`` naming the minimum when nothing fits."""
    budget_bytes = parse_bytes(budget)
    backend = backend or config.backend
    kw: dict[str, Any] = dict(dtype=dtype, devices=devices, device=device, backend=backend)
    base = plan_memory(config, **kw)
    if base.total <= budget_bytes:
        return Advice(True, base, {}, [], 0.0, [], budget_bytes)
    best: Optional[tuple] = None
    smallest: Optional[MemoryPlan] = None
    for names, changes, cost in _candidates(config, backend, device, devices):
        if not changes:
            continue
        try:
            plan = plan_memory(config.replace(**changes), **kw)
        except ConfigError:
            continue
        if smallest is None or plan.total < smallest.total:
            smallest = plan
        if plan.total <= budget_bytes:
            key = (cost, plan.total, len(names))
            if best is None or key < best[0]:
                best = (key, names, changes, plan)
    if best is None:
        minimum = smallest or base
        raise ConfigError(
            f"budget={format_bytes(budget_bytes)} is below the smallest this run can plan to: "
            f"{format_bytes(minimum.total)} with every knob on (fused loss, padding-free, "
            f"checkpointing, QLoRA, micro-batch 1, ...); raise --budget to at least "
            f"{format_bytes(minimum.total)}, or shorten --max-length or pick a smaller model."
        )
    (cost, _, _), names, changes, plan = best
    return Advice(True, plan, changes, names, cost, _flags(changes), budget_bytes)
