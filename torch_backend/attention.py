"""Document-masked attention for every attention path of every family, and ``forward_hidden``.

The rule (``common.data.batching.Batch``): token i may attend to token j iff
``segment_ids[i] == segment_ids[j] != 0`` and ``position_ids[j] <= position_ids[i]``; in a
sliding-window layer also ``position_ids[i] - position_ids[j] < sliding_window`` (transformers'
``sliding_window_overlay``, counted in positions within the document). Padded, packed and
padding-free batches all go through it, so no path leaks across documents (TRL #1230/#3910 only
warn; here a path that cannot mask refuses to run). With ``Batch.parent_ids`` (shared prefixes,
``common.data.prefix_sharing``) token i also attends to j when ``segment_ids[j] == parent_ids[i] != 0`` (same
position rule and window): the dense and flex masks gain that term, ``varlen`` gathers each document's keys as
``[parent; own]`` (``shared_varlen_plan``), the blocked attention masks and keeps the parent's block pairs, and the
flash paths refuse such a batch. ``parent_ids`` None (or all 0) leaves every path as it is without it.

Which layers slide is the family's business (``mask_layout``): none in Llama, every layer in
Mistral, Qwen3-MoE and Mixtral (one mask for the model; the MoE block is transformers' own and attention-free),
the ``sliding_attention`` entries of ``layer_types`` in Qwen2, Qwen3, Gemma 2 and Gemma 3, whose models take a
mask per layer type as a dict
``{"full_attention": m, "sliding_attention": m}`` (transformers' ``causal_mask_mapping``).
Gemma 2 also soft-caps the attention scores (``softcap * tanh(scores / softcap)``). gpt-oss (``gpt_oss``) adds a
learned logit per query head to every softmax denominator, an attention *sink* with no value (transformers passes it
as ``s_aux``): ``out = softmax([scores, sink]) @ [V; 0]``. Every path here carries it: eager (transformers' own
gpt-oss function; ``sdpa`` runs it, as transformers refuses sdpa for gpt-oss), ``varlen`` and the dense fallbacks
(``sink_attention``: one more key whose score is the sink and whose value is zero), the blocked and the
allgather/ulysses CP attention (the online softmax starts from the sink), flex on CUDA (transformers' LSE rescale);
the flash paths, flex on CPU and the ring refuse a model with sinks (``check_sink_support``).

How each ``attn_implementation`` gets the rule:

- ``sdpa``, ``eager``: a 4-D *float* additive mask [B, 1, T, T] per layer type (0 allowed,
  dtype-min not). ``masking_utils._preprocess_mask_arguments`` returns any 4-D mask untouched.
  Float, not bool: eager adds the mask to the scores, and a bool mask added as 0/1 is a no-op
  (ANCHORS failure 1). Padding queries attend to themselves only, so no row is empty (no NaN).
  ``sdpa`` cannot soft-cap scores (HF marks Gemma 2 ``_supports_sdpa=False``): a model that
  soft-caps runs ``eager`` instead, with the same mask, and says so in the log once.
- ``flex_attention``: a ``BlockMask`` per layer type from ``create_block_mask`` (also passed
  through as is); HF's flex function soft-caps in its ``score_mod``.
- ``varlen``: ``twinseq_varlen``, registered in ``transformers.AttentionInterface``. It cuts
  q/k/v into documents (a ``VarlenPlan``, passed down the model's ``**kwargs``), groups
  documents of similar length into buckets, pads within a bucket and runs causal
  ``F.scaled_dot_product_attention`` per bucket: no work on masked blocks or on padding. The
  layer's ``sliding_window`` becomes a band mask per bucket, its ``softcap`` a score computation
  with ``tanh`` (``softcapped_attention``).
- ``sdpa``/``eager`` on CPU with long rows (``T >= BLOCKED_MIN_SEQ_LEN``): the blocked
  attention of ``blocked_attention.py`` (online softmax over key blocks of
  ``attention_block_size`` tokens, masks built per block pair, backward recomputed block by
  block): no [T, T] mask or score matrix, memory linear in T. See ``uses_blocked_attention``.
- ``flash_attention_2``/``_3``: HF's flash varlen path, given ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` over the flattened batch (CUDA + flash-attn only); HF passes each layer's
  ``sliding_window`` and ``softcap`` to the kernel.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import create_block_mask
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from twinseq.common.config import ATTN_IMPLEMENTATIONS
from twinseq.common.data.batching import Batch, check_batch
from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models.configs import MODEL_TYPES, SLIDES_EVERY_LAYER
from twinseq.torch_backend.blocked_attention import (
    BLOCKED_HF_NAME,
    attention_modules,
    blocked_model_inputs,
    switch_to_blocked,
    uses_blocked_attention,
)
from twinseq.torch_backend.unwrap import causal_lm_of

logger = logging.getLogger(__name__)

VARLEN_HF_NAME = "twinseq_varlen"
PLAN_KWARG = "twinseq_varlen_plan"
# The blocked attention's names (BLOCKED_HF_NAME, BLOCKED_KWARG) and its threshold BLOCKED_MIN_SEQ_LEN live in
# blocked_attention, which this module builds on.
DEFAULT_BUCKET_RATIO = 1.25
SMALL_DOC_LEN = 16  # documents up to this length share one bucket: padding them costs next to nothing
_FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}
# families whose HF model takes one mask per layer type ({"full_attention": .., "sliding_attention": ..})
_MASK_MAPPING_FAMILIES = ("qwen2", "qwen3", "gemma2", "gemma3_text", "gpt_oss")
# families whose attention adds a learned sink logit per head to the softmax (transformers' ``s_aux``)
SINK_FAMILIES = ("gpt_oss",)
# flash-attn 2 releases that first took window_size (HF drops the window silently below) and softcap
_FLASH2_MIN_VERSION = {"sliding windows": (2, 3), "soft-capping": (2, 6)}


# --------------------------------------------------------------------------------------
# Which path may run where
# --------------------------------------------------------------------------------------


def check_attention_supported(
    attn_implementation: str, padding_free: bool = False, device: Any = "cpu", *, requires_grad: bool = True
) -> None:
    """Raise ``ValueError`` when ``attn_implementation`` cannot run, or cannot mask documents, here.

    ``padding_free`` means rows hold several documents (packing or padding-free). Every path
    masks documents when it runs at all; a flash path without CUDA/flash-attn would fall back
    to something else in HF, so it is refused instead of risking a silent leak.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} is unknown; choose one of {', '.join(ATTN_IMPLEMENTATIONS)}."
        )
    device_type = torch.device(device).type
    what = "padding-free/packed batches" if padding_free else "this run"
    if attn_implementation in _FLASH_MODULES:
        module = _FLASH_MODULES[attn_implementation]
        if device_type != "cuda":
            raise ConfigError(
                f"attn_implementation={attn_implementation!r} needs a CUDA device (got "
                f"{device_type!r}); refusing {what} rather than attending across documents. "
                f"Use attn_implementation='varlen' (padding-free, document-masked) or 'sdpa'."
            )
        if importlib.util.find_spec(module) is None:
            raise ConfigError(
                f"attn_implementation={attn_implementation!r} needs the {module!r} package, which is "
                f"not installed; refusing {what} rather than attending across documents. Install "
                f"it with `pip install -e '.[gpu]'` or use attn_implementation='varlen'."
            )
    if attn_implementation == "flex_attention" and device_type == "cpu" and requires_grad:
        raise ConfigError(
            "attn_implementation='flex_attention' cannot train on CPU: torch "
            f"{torch.__version__} has no FlexAttention backward on CPU. Use 'varlen' or 'sdpa' on "
            "CPU, or flex_attention on CUDA (forward-only CPU use works under torch.no_grad())."
        )


def hf_attn_name(attn_implementation: str) -> str:
    """The name HF's ``AttentionInterface`` knows: ``varlen`` is registered as ``twinseq_varlen``."""
    if attn_implementation == "varlen":
        register_varlen()
        return VARLEN_HF_NAME
    return attn_implementation


def twinseq_attn_name(hf_name: str) -> str:
    return {VARLEN_HF_NAME: "varlen", BLOCKED_HF_NAME: "sdpa"}.get(hf_name, hf_name)


def register_varlen() -> None:
    """Register ``twinseq_varlen`` with transformers (idempotent; called lazily, never at import)."""
    if VARLEN_HF_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_HF_NAME, varlen_attention_forward)


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    logger.warning(message)


def resolve_attn_implementation(attn_implementation: str, config: Any) -> str:
    """The path that runs ``attn_implementation`` for a model of HF ``config``: itself, except ``sdpa`` for a
    model that soft-caps attention scores (Gemma 2), which runs ``eager`` with the same document mask.

    ``F.scaled_dot_product_attention`` has no score modifier, so sdpa cannot compute ``softcap *
    tanh(scores / softcap)``; transformers refuses sdpa for Gemma 2 for that reason. The fallback is
    logged once per message (a warning: the user asked for another kernel).
    """
    if attn_implementation == "sdpa" and has_sinks(config):
        _warn_once(
            f"attn_implementation='sdpa' has no attention-sink term (model_type {config.model_type!r}; transformers "
            f"refuses sdpa for it); running 'eager' instead, transformers' own gpt-oss attention with the same "
            f"document mask. Pass 'varlen' for a kernel that skips masked blocks."
        )
        return "eager"
    cap = getattr(config, "attn_logit_softcapping", None)
    if attn_implementation != "sdpa" or cap is None:
        return attn_implementation
    _warn_once(
        f"attn_implementation='sdpa' cannot soft-cap attention scores (model_type "
        f"{config.model_type!r}, attn_logit_softcapping={cap}); running 'eager' instead, with the same "
        f"document mask. Pass 'varlen' or 'flex_attention' for a kernel that skips masked blocks."
    )
    return "eager"


@dataclass(frozen=True)
class MaskLayout:
    """How the HF model of a family takes its attention mask, read from its config (``mask_layout``)."""

    mapping: bool  # one mask per layer type in a dict (qwen2, qwen3, gemma2, gemma3_text), else one mask
    sliding_window: Optional[int]  # window of the sliding layers (mistral: of every layer); None: none slides
    softcap: Optional[float]  # attention score soft-cap (gemma2), else None
    sinks: bool = False  # a learned sink logit per head in every softmax (gpt_oss)


def has_sinks(config: Any) -> bool:
    """Whether a model of HF ``config`` adds attention sinks (``s_aux``) to its softmax: gpt-oss."""
    return getattr(config, "model_type", None) in SINK_FAMILIES


def mask_layout(config: Any) -> MaskLayout:
    """The ``MaskLayout`` of an HF model config; ``ConfigError`` for a family twinseq does not build.

    >>> from transformers import AutoConfig
    >>> mask_layout(AutoConfig.for_model("mistral", sliding_window=8))
    MaskLayout(mapping=False, sliding_window=8, softcap=None, sinks=False)
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"model_type={model_type!r} is not supported; twinseq builds {', '.join(MODEL_TYPES)}: use a "
            f"checkpoint of one of those (model_type in config.json)."
        )
    window = getattr(config, "sliding_window", None)
    cap = getattr(config, "attn_logit_softcapping", None)
    if model_type == "gemma3_text":  # transformers' Gemma 3 attention passes no soft-cap (q/k norms instead)
        cap = None
    if model_type in SLIDES_EVERY_LAYER:  # one mask, and HF passes config.sliding_window to every layer
        return MaskLayout(False, window, cap)
    if model_type in _MASK_MAPPING_FAMILIES:
        slides = "sliding_attention" in (getattr(config, "layer_types", None) or ())
        return MaskLayout(True, window if slides else None, cap, has_sinks(config))
    return MaskLayout(False, None, cap)


def per_layer_type(layout: MaskLayout, make: Callable[[Optional[int]], Any]) -> Any:
    """The ``attention_mask`` argument of the model: ``make(window)`` once, or per layer type in a dict.

    ``make(None)`` builds the document mask, ``make(w)`` the same mask within a window of ``w``.
    """
    if not layout.mapping:
        return make(layout.sliding_window)
    masks = {"full_attention": make(None)}
    if layout.sliding_window is not None:
        masks["sliding_attention"] = make(layout.sliding_window)
    return masks


# --------------------------------------------------------------------------------------
# Dense and block masks
# --------------------------------------------------------------------------------------


def allowed_mask(
    segment_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    sliding_window: Optional[int] = None,
    parent_ids_BT: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """bool [B, T, T]: the document-causal rule (within ``sliding_window`` positions when given; with
    ``parent_ids_BT``, a query also sees its parent segment's keys), plus the diagonal of padding queries.

    >>> seg, pos = torch.tensor([[1, 1, 2, 0]]), torch.tensor([[0, 1, 0, 0]])
    >>> allowed_mask(seg, pos).int()[0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    >>> allowed_mask(torch.ones(1, 3, dtype=torch.long), torch.arange(3)[None], sliding_window=2).int()[0].tolist()
    [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    seg_q, seg_k = segment_ids_BT[:, :, None], segment_ids_BT[:, None, :]
    same_doc = (seg_q == seg_k) & (seg_q != 0)
    if parent_ids_BT is not None:
        same_doc = same_doc | ((parent_ids_BT[:, :, None] == seg_k) & (seg_k != 0))
    distance = position_ids_BT[:, :, None] - position_ids_BT[:, None, :]
    causal = distance >= 0
    if sliding_window is not None:
        causal = causal & (distance < sliding_window)
    # padding queries get themselves as their only key: no empty softmax row, hence no NaN
    eye = torch.eye(segment_ids_BT.shape[1], dtype=torch.bool, device=segment_ids_BT.device)
    return (same_doc & causal) | (eye & (seg_q == 0))


def document_mask(
    segment_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    dtype: torch.dtype = torch.float32,
    sliding_window: Optional[int] = None,
    parent_ids_BT: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Additive float mask [B, 1, T, T]: 0 where ``allowed_mask`` holds, ``finfo(dtype).min`` elsewhere."""
    allowed = allowed_mask(segment_ids_BT, position_ids_BT, sliding_window, parent_ids_BT)[:, None]
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def document_block_mask(
    segment_ids_BT: torch.Tensor,
    position_ids_BT: torch.Tensor,
    sliding_window: Optional[int] = None,
    parent_ids_BT: Optional[torch.Tensor] = None,
):
    """FlexAttention ``BlockMask`` of ``allowed_mask`` (blocks fully outside a document, or a window, are skipped)."""
    seg, pos, par = segment_ids_BT, position_ids_BT, parent_ids_BT

    def mask_mod(b, h, q_idx, kv_idx):
        same_doc = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] != 0)
        pad_self = (seg[b, q_idx] == 0) & (q_idx == kv_idx)
        return (same_doc & (pos[b, kv_idx] <= pos[b, q_idx])) | pad_self

    def parent_mask_mod(b, h, q_idx, kv_idx):
        sees_parent = (par[b, q_idx] == seg[b, kv_idx]) & (seg[b, kv_idx] != 0) & (pos[b, kv_idx] <= pos[b, q_idx])
        return mask_mod(b, h, q_idx, kv_idx) | sees_parent

    def window_mask_mod(b, h, q_idx, kv_idx):
        # a padding query's own key is at distance 0, inside every window
        return mask_mod(b, h, q_idx, kv_idx) & (pos[b, q_idx] - pos[b, kv_idx] < sliding_window)

    def parent_window_mask_mod(b, h, q_idx, kv_idx):
        return parent_mask_mod(b, h, q_idx, kv_idx) & (pos[b, q_idx] - pos[b, kv_idx] < sliding_window)

    B, T = seg.shape
    if par is None:
        mod = mask_mod if sliding_window is None else window_mask_mod
    else:
        mod = parent_mask_mod if sliding_window is None else parent_window_mask_mod
    return create_block_mask(mod, B, None, T, T, device=seg.device)


def softcapped_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: Optional[float],
    softcap: Optional[float],
    dropout: float = 0.0,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention with soft-capped scores, as transformers' eager Gemma 2: q [..., H, L, D], k/v [..., KV, S, D]
    -> [..., H, L, Dv]. ``mask`` is a bool ``allowed`` mask or an additive float one, broadcast to the scores;
    ``sinks`` [H] (or None) a sink logit per head, a column of the softmax with no value (``sink_attention``).

    Naive equivalent::

        scores = softcap * tanh((q @ k.T * scaling) / softcap) + mask
        out = softmax(scores, -1, dtype=float32).to(q.dtype) @ v

    (scores of masked keys become ``finfo.min``: soft-capping before masking keeps them masked).
    """
    groups = query.shape[-3] // key.shape[-3]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=-3), value.repeat_interleave(groups, dim=-3)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    if sinks is not None:
        column = sinks.to(scores.dtype).view(-1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    if dropout > 0:
        probs = F.dropout(probs, p=dropout, training=True)
    return torch.matmul(probs, value)


def sink_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: Optional[float],
    sinks: torch.Tensor,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Attention with a learned sink logit per query head (gpt-oss's ``s_aux``): q [..., H, L, D], k/v [..., KV, S, D]
    -> [..., H, L, Dv]. ``mask``: a bool ``allowed`` mask or an additive float one, broadcast to [..., H, L, S];
    ``sinks`` [H].

    Naive equivalent (transformers' eager gpt-oss)::

        scores = q @ k.T * scaling + mask
        probs = softmax(cat([scores, sinks[:, None, None]], -1))[..., :-1]   # the sink takes its share, no value
        out = probs @ v

    Run by ``F.scaled_dot_product_attention`` with one more key: a zero key whose additive mask is the sink and whose
    value is zero; the sink's gradient flows through that mask column. No row is empty (the sink is always there).
    """
    H, L, S = query.shape[-3], query.shape[-2], key.shape[-2]
    if mask.dtype == torch.bool:
        zero = torch.zeros((), dtype=query.dtype, device=query.device)
        mask = torch.where(mask, zero, float("-inf"))
    mask = mask.to(query.dtype).expand(*query.shape[:-3], H, L, S)
    column = sinks.to(query.dtype).view(H, 1, 1).expand(*query.shape[:-3], H, L, 1)
    return F.scaled_dot_product_attention(
        query,
        F.pad(key, (0, 0, 0, 1)),
        F.pad(value, (0, 0, 0, 1)),
        attn_mask=torch.cat([mask, column], dim=-1),
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=key.shape[-3] != H,
    )


# --------------------------------------------------------------------------------------
# varlen: documents cut out of the flattened batch, bucketed by length
# --------------------------------------------------------------------------------------


@dataclass
class VarlenPlan:
    """How to cut a [B, T] batch into documents: built once per forward, used by every layer.

    All buckets are gathered with one ``index_select`` (so backward is one ``index_add``):
    ``slot_index`` lists, bucket after bucket, the flattened token index of every slot of the
    padded [n, L] bucket; padding slots repeat a valid index of their document.
    """

    slot_index: torch.Tensor  # long [S = sum n*L]
    bucket_shapes: list  # [(n, L)] per bucket, in slot_index order
    gather_idx: torch.Tensor  # long [B*T]: each token's slot; padding tokens -> S (a zero row)
    num_rows: int  # B
    seq_len: int  # T
    cu_seqlens: torch.Tensor  # int32 [num_runs+1] over the flattened batch, padding runs included (flash)
    max_seqlen: int
    # shared prefixes (``shared_varlen_plan``) only; None: each bucket's keys are its queries, causal by slot
    key_index: Optional[torch.Tensor] = None  # long [Sk = sum n*Lk]: each document's keys, [parent; own] tokens
    key_lengths: Optional[list] = None  # [Lk] per bucket
    distances: Optional[list] = None  # per bucket int32 [n, L, Lk]: pos_q - pos_k; -1 for padding keys


def _runs(segment_ids_BT: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Maximal runs of one segment id within a row, over the flattened batch: (start, length, segment)."""
    B, T = segment_ids_BT.shape
    flat = segment_ids_BT.reshape(-1)
    change = np.ones(B * T, dtype=bool)
    change[1:] = flat[1:] != flat[:-1]
    change[::T] = True
    starts = np.flatnonzero(change)
    lengths = np.diff(np.append(starts, B * T))
    return starts, lengths, flat[starts]


def _bucket_documents(lengths: np.ndarray, ratio: float) -> list[np.ndarray]:
    """Group document indices so that in each group ``max_len <= max(ratio * min_len, SMALL_DOC_LEN)``.

    >>> [b.tolist() for b in _bucket_documents(np.array([3, 40, 5, 41, 100]), 1.25)]
    [[0, 2], [1, 3], [4]]
    """
    order = np.argsort(lengths, kind="stable")
    groups, current, first = [], [], 0
    for i in order:
        if current and lengths[i] > max(ratio * first, SMALL_DOC_LEN):
            groups.append(np.array(current))
            current = []
        if not current:
            first = lengths[i]
        current.append(i)
    if current:
        groups.append(np.array(current))
    return groups


def _document_runs(segment_ids_BT: np.ndarray, position_ids_BT: np.ndarray):
    """(document starts, document lengths, all run lengths incl. padding) over the flattened batch,
    or ``None`` unless every document is one run with positions 0, 1, 2, ..."""
    starts, lengths, segs = _runs(segment_ids_BT)
    flat_pos = position_ids_BT.reshape(-1)
    is_doc = segs != 0
    offsets = np.arange(len(flat_pos)) - np.repeat(starts, lengths)
    in_doc = np.repeat(is_doc, lengths)
    if not np.array_equal(flat_pos[in_doc], offsets[in_doc]):
        return None
    rows = starts // segment_ids_BT.shape[1]
    if len(set(zip(rows[is_doc].tolist(), segs[is_doc].tolist()))) != int(is_doc.sum()):
        return None  # one document split into several runs of a row: not contiguous
    return starts[is_doc], lengths[is_doc], lengths


def varlen_plan(
    segment_ids_BT: np.ndarray,
    position_ids_BT: np.ndarray,
    device: Any = "cpu",
    bucket_ratio: float = DEFAULT_BUCKET_RATIO,
) -> Optional[VarlenPlan]:
    """Plan the per-document attention of a batch, or ``None`` if documents are not contiguous runs
    with positions 0, 1, 2, ... (then only the dense mask implements the rule).

    >>> plan = varlen_plan(np.array([[1, 1, 1, 2, 2, 0]]), np.array([[0, 1, 2, 0, 1, 0]]))
    >>> plan.bucket_shapes, plan.slot_index.tolist()  # one bucket [2 documents, 3 slots], shortest first
    ([(2, 3)], [3, 4, 3, 0, 1, 2])
    >>> plan.gather_idx.tolist(), plan.cu_seqlens.tolist()  # token -> slot; padding -> zero row 6
    ([3, 4, 5, 0, 1, 6], [0, 3, 5, 6])
    """
    segment_ids_BT = np.asarray(segment_ids_BT)
    runs = _document_runs(segment_ids_BT, np.asarray(position_ids_BT))
    if runs is None:
        return None
    doc_starts, doc_lengths, lengths = runs
    slots, shapes, num_slots = [], [], 0
    gather_idx = np.full(segment_ids_BT.size, -1, dtype=np.int64)
    for group in _bucket_documents(doc_lengths, bucket_ratio):
        L = int(doc_lengths[group].max())
        slot = np.arange(L)
        valid_nL = slot[None, :] < doc_lengths[group][:, None]
        # padding slots point at their document's first token: causal attention never lets a
        # real query see a later slot, so their content is irrelevant
        index_nL = doc_starts[group][:, None] + np.where(valid_nL, slot[None, :], 0)
        gather_idx[index_nL[valid_nL]] = num_slots + np.flatnonzero(valid_nL)
        slots.append(index_nL.reshape(-1))
        shapes.append((len(group), L))
        num_slots += index_nL.size
    gather_idx[gather_idx < 0] = num_slots
    slot_index = np.concatenate(slots) if slots else np.zeros(0, np.int64)
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    return VarlenPlan(
        torch.as_tensor(slot_index, device=device),
        shapes,
        torch.as_tensor(gather_idx, device=device),
        segment_ids_BT.shape[0],
        segment_ids_BT.shape[1],
        torch.as_tensor(cu_seqlens, dtype=torch.int32, device=device),
        int(lengths.max(initial=0)),
    )


def _segment_tokens(segment_ids_BT: np.ndarray) -> tuple[list[np.ndarray], dict[tuple[int, int], int]]:
    """The flattened token indices of every (row, segment) of real tokens, in order, and its index by key."""
    B, T = segment_ids_BT.shape
    flat = segment_ids_BT.reshape(-1)
    real = np.flatnonzero(flat != 0)
    keys = (real // T) * (int(flat.max(initial=0)) + 1) + flat[real]
    uniq, inverse = np.unique(keys, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    tokens = np.split(real[order], np.cumsum(np.bincount(inverse))[:-1]) if real.size else []
    index = {(int(t[0]) // T, int(flat[t[0]])): d for d, t in enumerate(tokens)}
    return tokens, index


def shared_varlen_plan(
    segment_ids_BT: np.ndarray,
    position_ids_BT: np.ndarray,
    parent_ids_BT: np.ndarray,
    device: Any = "cpu",
    bucket_ratio: float = DEFAULT_BUCKET_RATIO,
) -> VarlenPlan:
    """Plan of a batch with shared prefixes (``Batch.parent_ids``): every segment is a document whose queries
    attend to its keys gathered as ``[parent tokens; own tokens]``; causality (and a window) from positions.

    >>> seg, pos, par = np.array([[1, 1, 2, 2, 3]]), np.array([[0, 1, 2, 3, 2]]), np.array([[0, 0, 1, 1, 1]])
    >>> plan = shared_varlen_plan(seg, pos, par)
    >>> plan.bucket_shapes, plan.slot_index.tolist()  # one bucket [3 documents, 2 slots], fewest keys first
    ([(3, 2)], [0, 1, 4, 4, 2, 3])
    >>> plan.key_index.tolist()  # segment 1: keys [0 1]; segment 3: [0 1 4]; segment 2: [0 1 2 3]
    [0, 1, 0, 0, 0, 1, 4, 0, 0, 1, 2, 3]
    >>> plan.distances[0][1].tolist()  # segment 3's slot 0 sees keys 0, 1, 4; slot 1 (padding) repeats it
    [[2, 1, 0, -1], [2, 1, 0, -1]]
    """
    seg_BT, pos_BT, par_BT = (np.asarray(x) for x in (segment_ids_BT, position_ids_BT, parent_ids_BT))
    T, flat_pos, flat_par = seg_BT.shape[1], pos_BT.reshape(-1), par_BT.reshape(-1)
    own, index = _segment_tokens(seg_BT)
    keys = []
    for t in own:
        parent = int(flat_par[t[0]])
        keys.append(np.concatenate([own[index[(int(t[0]) // T, parent)]], t]) if parent else t)
    q_slots, k_slots, shapes, key_lengths, distances = [], [], [], [], []
    gather_idx, num_slots = np.full(seg_BT.size, -1, dtype=np.int64), 0
    for group in _bucket_documents(np.array([k.size for k in keys], dtype=np.int64), bucket_ratio):
        q_nL = _padded([own[d] for d in group])
        k_nS = _padded([keys[d] for d in group])
        valid_nL = np.arange(q_nL.shape[1])[None, :] < np.array([own[d].size for d in group])[:, None]
        valid_nS = np.arange(k_nS.shape[1])[None, :] < np.array([keys[d].size for d in group])[:, None]
        gather_idx[q_nL[valid_nL]] = num_slots + np.flatnonzero(valid_nL)
        distance = flat_pos[q_nL][:, :, None] - flat_pos[k_nS][:, None, :]
        distances.append(
            torch.as_tensor(np.where(valid_nS[:, None, :], distance, -1), dtype=torch.int32, device=device)
        )
        q_slots.append(q_nL.reshape(-1))
        k_slots.append(k_nS.reshape(-1))
        shapes.append(q_nL.shape)
        key_lengths.append(k_nS.shape[1])
        num_slots += q_nL.size
    gather_idx[gather_idx < 0] = num_slots
    lengths = _runs(seg_BT)[1]
    return VarlenPlan(
        torch.as_tensor(np.concatenate(q_slots) if q_slots else np.zeros(0, np.int64), device=device),
        shapes,
        torch.as_tensor(gather_idx, device=device),
        seg_BT.shape[0],
        T,
        torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device),
        int(lengths.max(initial=0)),
        torch.as_tensor(np.concatenate(k_slots) if k_slots else np.zeros(0, np.int64), device=device),
        key_lengths,
        distances,
    )


def _padded(token_lists: list[np.ndarray]) -> np.ndarray:
    """int64 [n, max length]: each list, padded with its own first index."""
    out = np.empty((len(token_lists), max(t.size for t in token_lists)), dtype=np.int64)
    for i, t in enumerate(token_lists):
        out[i] = t[0]
        out[i, : t.size] = t
    return out


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


def _plan_from_position_ids(position_ids: torch.Tensor, batch_size: int) -> VarlenPlan:
    """Documents as the runs where positions count 0, 1, 2, ...: for a model called without a plan."""
    pos_BT = position_ids.expand(batch_size, -1).cpu().numpy()
    restart_BT = np.ones_like(pos_BT, dtype=bool)
    restart_BT[:, 1:] = pos_BT[:, 1:] != pos_BT[:, :-1] + 1
    seg_BT = np.cumsum(restart_BT, axis=1)
    idx_T = np.arange(pos_BT.shape[1])
    run_start_BT = np.maximum.accumulate(np.where(restart_BT, idx_T, 0), axis=1)
    plan = varlen_plan(seg_BT, idx_T - run_start_BT, position_ids.device)
    assert plan is not None, "runs built from position_ids are contiguous by construction"
    return plan


_UNSUPPORTED_KWARGS = ("position_bias",)


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention function ``twinseq_varlen``: q [B, H, T, D], k/v [B, KV, T, D] -> out [B, T, H, D].

    ``sliding_window`` and ``softcap`` are the layer's (HF's attention modules pass them: Mistral,
    Qwen2/3 and Gemma 2 the window of a sliding layer, Gemma 2 its score cap), ``s_aux`` its attention sinks
    [H] (gpt-oss; ``sink_attention``). Naive equivalent: eager attention with ``document_mask(..., sliding_window)``,
    the soft-cap and the sinks, on real tokens; padding tokens get a zero output (they attend to nothing and nothing
    attends to them).
    """
    unsupported = sorted(k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None)
    if unsupported or kwargs.get("is_causal") is False:
        raise ConfigError(
            f"attn_implementation='varlen' got {unsupported or 'is_causal=False'} from "
            f"{type(module).__name__}, which it cannot compute; use attn_implementation='eager'."
        )
    plan: Optional[VarlenPlan] = kwargs.get(PLAN_KWARG)
    if plan is None and attention_mask is None and key.shape[2] != query.shape[2]:
        # decoding over a KV cache (generate, which left-pads its prompts; transformers passes this function no
        # mask): one sequence per row, its last query at position_ids[:, -1], so the row's sequence is the last
        # position + 1 keys and the rest is padding
        attention_mask = decode_mask(
            query.shape[2], key.shape[2], sliding_window, query.device, kwargs.get("position_ids")
        )
    sinks: Optional[torch.Tensor] = kwargs.get("s_aux")
    if plan is None and attention_mask is not None:
        # the dense fallback of model_inputs: this layer type's mask already holds the window
        if softcap is None and sinks is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
        p = dropout if module.training else 0.0
        if softcap is None:
            out = sink_attention(query, key, value, attention_mask, scaling, sinks, p)
        else:
            out = softcapped_attention(query, key, value, attention_mask, scaling, softcap, p, sinks)
        return out.transpose(1, 2).contiguous(), None
    if plan is None:
        if kwargs.get("position_ids") is None:
            raise ConfigError(
                "attn_implementation='varlen' needs document boundaries: call "
                "twinseq.torch_backend.attention.forward_hidden(model, batch), or pass position_ids "
                "that restart at 0 for each document."
            )
        _log_once(
            "twinseq_varlen called without a VarlenPlan: documents taken from position_ids restarts "
            "(use forward_hidden to pass segment_ids)."
        )
        plan = _plan_from_position_ids(kwargs["position_ids"], query.shape[0])
    B, H, T, D = query.shape
    assert (plan.num_rows, plan.seq_len) == (B, T), "VarlenPlan built for another batch shape"
    out_NHD = _bucketed_attention(
        query, key, value, plan, scaling, dropout if module.training else 0.0, sliding_window, softcap, sinks
    )
    return out_NHD.view(B, T, H, value.shape[-1]), None


def decode_mask(
    num_queries: int,
    num_keys: int,
    sliding_window: Optional[int],
    device: Any,
    position_ids: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """bool [B or 1, 1, Q, K]: the last ``Q`` positions of a ``K``-long cache, each seeing itself and the keys
    before it (within ``sliding_window`` positions when given), and, with ``position_ids`` [B, Q] of a left-padded
    batch, none of a row's keys before its first token (row ``b`` holds the last ``position_ids[b, -1] + 1`` keys).

    >>> decode_mask(1, 3, None, "cpu").int().tolist(), decode_mask(2, 3, 2, "cpu").int().tolist()
    ([[[[1, 1, 1]]]], [[[[1, 1, 0], [0, 1, 1]]]])
    >>> decode_mask(1, 4, None, "cpu", torch.tensor([[1], [3]])).int().tolist()  # row 0: two pads, then 2 tokens
    [[[[0, 0, 1, 1]]], [[[1, 1, 1, 1]]]]
    """
    offset = num_keys - num_queries
    ones = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    allowed = ones.tril(offset)
    if sliding_window is not None:
        allowed &= ~ones.tril(offset - sliding_window)
    allowed = allowed[None, None]
    if position_ids is not None:
        first_key = num_keys - (position_ids[:, -1].to(device) + 1)  # [B]
        keys = torch.arange(num_keys, device=device)
        allowed = allowed & (keys[None, :] >= first_key[:, None])[:, None, None, :]
    return allowed


def _band(L: int, sliding_window: int, device: Any) -> torch.Tensor:
    """bool [L, L]: slot i sees slot j iff ``0 <= i - j < sliding_window`` (slots are document positions)."""
    distance = torch.arange(L, device=device)[:, None] - torch.arange(L, device=device)[None, :]
    return (distance >= 0) & (distance < sliding_window)


BUCKET_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA's kernels for a bucket on CUDA: FlashAttention first, never cuDNN. A bucket's shape ``[n, H, L, D]`` changes
from step to step with the documents packed, and cuDNN builds a graph for every new shape: 50-85 ms of host time
each, measured on an H100 (torch 2.11), which left the GPU idle for half of a Llama-3.2-3B SFT step. Flash has no
per-shape set-up and takes grouped-query heads as they are."""


def _bucket_attention(q, k, v, scaling, dropout, sliding_window, softcap, sinks=None) -> torch.Tensor:
    """One bucket: q [n, H, L, D], k/v [n, KV, L, D] -> [n, H, L, Dv], causal within each row (slot = position)."""
    L = q.shape[2]
    window = sliding_window if sliding_window is not None and L > sliding_window else None
    if softcap is not None or sinks is not None:
        allowed = _band(L, L if window is None else window, q.device)
        if softcap is None:
            return sink_attention(q, k, v, allowed, scaling, sinks, dropout)
        return softcapped_attention(q, k, v, allowed, scaling, softcap, dropout, sinks)
    if window is None:
        with sdpa_kernel(BUCKET_BACKENDS) if q.is_cuda else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
            )
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=_band(L, window, q.device),
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=k.shape[1] != q.shape[1],
    )


def _bucketed_attention(
    query, key, value, plan: VarlenPlan, scaling, dropout, sliding_window=None, softcap=None, sinks=None
) -> torch.Tensor:
    """[B, H, T, D] q and [B, KV, T, D] k/v -> [B*T, H, Dv]: causal attention inside each document (within
    ``sliding_window`` positions, with soft-capped scores, with attention sinks [H] when given)."""
    if plan.key_index is not None:
        return _shared_bucketed_attention(query, key, value, plan, scaling, dropout, sliding_window, softcap, sinks)
    B, H, T, D = query.shape
    dv = value.shape[-1]
    q_HS, k_KS, v_KS = (
        x.transpose(0, 1).reshape(x.shape[1], B * T, x.shape[-1]).index_select(1, plan.slot_index)
        for x in (query, key, value)
    )
    sizes = [n * L for n, L in plan.bucket_shapes]
    outs = []
    for (n, L), q, k, v in zip(plan.bucket_shapes, q_HS.split(sizes, 1), k_KS.split(sizes, 1), v_KS.split(sizes, 1)):
        q, k, v = (x.view(x.shape[0], n, L, x.shape[-1]).transpose(0, 1) for x in (q, k, v))
        o_nHLD = _bucket_attention(q, k, v, scaling, dropout, sliding_window, softcap, sinks)
        outs.append(o_nHLD.transpose(1, 2).reshape(n * L, H, dv))
    outs.append(query.new_zeros(1, H, dv))  # the zero row padding tokens read
    return torch.cat(outs).index_select(0, plan.gather_idx)


def _shared_bucketed_attention(
    query, key, value, plan: VarlenPlan, scaling, dropout, sliding_window, softcap, sinks=None
):
    """``_bucketed_attention`` of a ``shared_varlen_plan``: per bucket, queries [n, H, L] over their gathered keys
    [n, KV, Lk], allowed where ``0 <= pos_q - pos_k`` (``< sliding_window``)."""
    B, H, T, D = query.shape
    dv = value.shape[-1]
    q_HS, k_KS, v_KS = (
        x.transpose(0, 1).reshape(x.shape[1], B * T, x.shape[-1]).index_select(1, index)
        for x, index in ((query, plan.slot_index), (key, plan.key_index), (value, plan.key_index))
    )
    q_sizes = [n * L for n, L in plan.bucket_shapes]
    k_sizes = [n * Lk for (n, _), Lk in zip(plan.bucket_shapes, plan.key_lengths)]
    outs = []
    buckets = zip(plan.bucket_shapes, plan.key_lengths, plan.distances, q_HS.split(q_sizes, 1))
    for ((n, L), Lk, distance, q), k, v in zip(buckets, k_KS.split(k_sizes, 1), v_KS.split(k_sizes, 1)):
        q = q.view(H, n, L, D).transpose(0, 1)
        k, v = (x.view(x.shape[0], n, Lk, x.shape[-1]).transpose(0, 1) for x in (k, v))
        allowed = distance >= 0
        if sliding_window is not None:
            allowed = allowed & (distance < sliding_window)
        allowed = allowed[:, None]
        if softcap is not None:
            o_nHLD = softcapped_attention(q, k, v, allowed, scaling, softcap, dropout, sinks)
        elif sinks is not None:
            o_nHLD = sink_attention(q, k, v, allowed, scaling, sinks, dropout)
        else:
            o_nHLD = F.scaled_dot_product_attention(
                q, k, v, attn_mask=allowed, dropout_p=dropout, scale=scaling, enable_gqa=k.shape[1] != H
            )
        outs.append(o_nHLD.transpose(1, 2).reshape(n * L, H, dv))
    outs.append(query.new_zeros(1, H, dv))  # the zero row padding tokens read
    return torch.cat(outs).index_select(0, plan.gather_idx)


# --------------------------------------------------------------------------------------
# The model call
# --------------------------------------------------------------------------------------


def _mask_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next(model.parameters()).dtype


def _dense_attn_of(model: torch.nn.Module) -> str:
    """The dense path (``sdpa``/``eager``) a model switched to ``twinseq_blocked`` runs for short rows."""
    return getattr(attention_modules(model)[0], "_twinseq_dense_attn", "sdpa")


def _ensure_attn(model: torch.nn.Module, attn_implementation: Optional[str]) -> str:
    current = twinseq_attn_name(model.config._attn_implementation)
    if model.config._attn_implementation == BLOCKED_HF_NAME:  # switched by a long batch: its dense path
        current = _dense_attn_of(model)
    if attn_implementation is None or attn_implementation == current:
        return current
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} is unknown; choose one of {', '.join(ATTN_IMPLEMENTATIONS)}."
        )
    resolved = resolve_attn_implementation(attn_implementation, model.config)
    if resolved != current:
        logger.info("switching the model's attention from %r to %r as requested", current, resolved)
        model.set_attn_implementation(hf_attn_name(resolved))
    return resolved


def check_flash_features(attn_implementation: str, layout: MaskLayout) -> None:
    """``ConfigError`` when the installed flash-attn 2 would drop the model's sliding window or soft-cap.

    transformers passes ``window_size`` only when the kernel accepts it and otherwise attends to
    the whole document without a word; flash-attn 2 took ``window_size`` in 2.3 and ``softcap`` in 2.6.
    """
    if attn_implementation != "flash_attention_2":
        return
    try:
        version = importlib.metadata.version("flash_attn")
    except importlib.metadata.PackageNotFoundError:
        raise MissingDependencyError(
            "attn_implementation='flash_attention_2' needs the flash-attn package; "
            "install it with `pip install -e '.[gpu]'` or use attn_implementation='varlen'."
        ) from None
    have = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    for feature, on in (("sliding windows", layout.sliding_window is not None), ("soft-capping", layout.softcap)):
        if on and have < _FLASH2_MIN_VERSION[feature]:
            need = ".".join(map(str, _FLASH2_MIN_VERSION[feature]))
            raise ConfigError(
                f"attn_implementation='flash_attention_2': flash-attn {version} has no {feature}, "
                f"which this model uses; upgrade to flash-attn>={need} or use "
                f"attn_implementation='varlen'."
            )


def check_sink_support(attn_implementation: str, layout: MaskLayout, device: Any = "cpu") -> None:
    """``ConfigError`` when ``attn_implementation`` would drop the attention sinks of a model that has them.

    transformers hands ``s_aux`` only to hub flash kernels that take a learnable sink (vLLM's FA3, FA4) and drops it
    for the others; twinseq's flash paths run the ``flash_attn`` / ``flash_attn_interface`` varlen kernels, so a
    gpt-oss model would lose its sinks there. transformers' flex function rescales by the sinks from the kernel's
    log-sum-exp, which it does not request on CPU (torch's CPU flex cannot return it).
    """
    if not layout.sinks:
        return
    if attn_implementation in _FLASH_MODULES:
        raise ConfigError(
            f"attn_implementation={attn_implementation!r} cannot compute attention sinks (a learned logit per head "
            f"in every softmax, as gpt-oss has): the flash-attn varlen kernel it runs has no sink term. Use "
            f"attn_implementation='varlen' (document-masked, carries the sinks) or 'eager'."
        )
    if attn_implementation == "flex_attention" and torch.device(device).type == "cpu":
        raise ConfigError(
            "attn_implementation='flex_attention' cannot compute attention sinks on CPU (the sink rescale needs "
            "FlexAttention's log-sum-exp, which transformers does not request on CPU). Use "
            "attn_implementation='varlen' or 'eager' on CPU, or flex_attention on CUDA."
        )


def model_inputs(
    batch: Batch,
    attn_implementation: str,
    device: Any,
    mask_dtype: torch.dtype = torch.float32,
    layout: MaskLayout = MaskLayout(False, None, None),
) -> dict[str, Any]:
    """Keyword arguments for the HF decoder's ``forward`` that implement the document rule on one path.

    ``layout`` (``mask_layout`` of the model's config) says which layers slide and how the model
    takes its masks; the default is Llama's (one mask, no window).
    """
    device = torch.device(device)
    seg_BT = torch.as_tensor(batch.segment_ids, dtype=torch.long, device=device)
    pos_BT = torch.as_tensor(batch.position_ids, dtype=torch.long, device=device)
    inputs: dict[str, Any] = {
        "input_ids": torch.as_tensor(batch.input_ids, dtype=torch.long, device=device),
        "position_ids": pos_BT,
        "use_cache": False,
    }

    par_BT = _parent_ids(batch, device)

    def dense(window: Optional[int]) -> torch.Tensor:
        return document_mask(seg_BT, pos_BT, mask_dtype, window, par_BT)

    if attn_implementation in ("sdpa", "eager"):
        inputs["attention_mask"] = per_layer_type(layout, dense)
    elif attn_implementation == "flex_attention":
        inputs["attention_mask"] = per_layer_type(layout, lambda w: document_block_mask(seg_BT, pos_BT, w, par_BT))
    elif par_BT is not None:
        if attn_implementation in _FLASH_MODULES:
            raise ConfigError(
                f"attn_implementation={attn_implementation!r} cannot run a batch with shared prefixes "
                f"(Batch.parent_ids): a completion's keys [prompt; completion] are not one contiguous run of the "
                f"flattened batch. Collate with share_prefix=False, or use attn_implementation='varlen' or 'sdpa'."
            )
        inputs[PLAN_KWARG] = shared_varlen_plan(batch.segment_ids, batch.position_ids, batch.parent_ids, device)
    else:
        plan = varlen_plan(batch.segment_ids, batch.position_ids, device)
        if plan is None and attn_implementation in _FLASH_MODULES:
            raise ConfigError(
                f"attn_implementation={attn_implementation!r} needs contiguous documents with "
                f"position_ids 0, 1, 2, ... (as common.data.batching.collate builds them); this batch "
                f"has other positions. Use attn_implementation='sdpa'."
            )
        if plan is None:
            logger.info(
                "varlen: documents are not contiguous runs with positions 0..n-1; using the dense "
                "document mask for this batch"
            )
            inputs["attention_mask"] = per_layer_type(layout, dense)
        elif attn_implementation == "varlen":
            inputs[PLAN_KWARG] = plan
        else:
            inputs.update(
                cu_seq_lens_q=plan.cu_seqlens,
                cu_seq_lens_k=plan.cu_seqlens,
                max_length_q=plan.max_seqlen,
                max_length_k=plan.max_seqlen,
            )
    return inputs


def _parent_ids(batch: Batch, device: torch.device) -> Optional[torch.Tensor]:
    """long [B, T] ``batch.parent_ids`` when some token has a parent segment, else None (every path unchanged)."""
    if not getattr(batch, "shares_prefix", False):
        return None
    return torch.as_tensor(batch.parent_ids, dtype=torch.long, device=device)


def forward_hidden(model: torch.nn.Module, batch: Batch, attn_implementation: Optional[str] = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] of ``batch`` (no lm_head), documents masked on every path,
    sliding-window layers within their window.

    ``attn_implementation`` defaults to the model's; a different one switches the model to it
    (``sdpa`` on a model with soft-capped attention scores runs ``eager``, logged once).
    """
    return forward_outputs(model, batch, attn_implementation).last_hidden_state


def forward_outputs(
    model: torch.nn.Module, batch: Batch, attn_implementation: Optional[str] = None, output_router_logits: bool = False
) -> Any:
    """The decoder's output object of ``batch`` as ``forward_hidden`` runs it (``.last_hidden_state``); with
    ``output_router_logits`` (a MoE model) also ``.router_logits``, one ``[B * T, E]`` tensor per MoE layer."""
    check_batch(batch, model.config.vocab_size)
    layout = mask_layout(model.config)
    attn = _ensure_attn(model, attn_implementation)
    device = next(model.parameters()).device
    check_attention_supported(
        attn,
        padding_free=int(batch.segment_ids.max(initial=0)) > 1,
        device=device,
        requires_grad=torch.is_grad_enabled(),
    )
    check_flash_features(attn, layout)
    check_sink_support(attn, layout, device)
    if uses_blocked_attention(attn, device, batch.input_ids.shape[1]):
        switch_to_blocked(model, attn)
        inputs = blocked_model_inputs(model, batch, device)
    else:
        inputs = model_inputs(batch, attn, device, _mask_dtype(model, device), layout)
    if output_router_logits:
        inputs["output_router_logits"] = True
    # an adapter model: the HF model inside PEFT's wrapper
    return causal_lm_of(model).model(**inputs)
