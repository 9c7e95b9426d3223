"""Document-masked attention for every attention path of the HF Llama, and ``forward_hidden``.

The rule (``common.batching.Batch``): token i may attend to token j iff
``segment_ids[i] == segment_ids[j] != 0`` and ``position_ids[j] <= position_ids[i]``.
Padded, packed and padding-free batches all go through it, so no path leaks across
documents (TRL #1230/#3910 only warn; here a path that cannot mask refuses to run).

How each ``attn_implementation`` gets the rule:

- ``sdpa``, ``eager``: a 4-D *float* additive mask [B, 1, T, T] (0 allowed, dtype-min
  not). ``masking_utils._preprocess_mask_arguments`` returns any 4-D mask untouched. Float,
  not bool: eager adds the mask to the scores, and a bool mask added as 0/1 is a no-op
  (ANCHORS failure 1). Padding queries attend to themselves only, so no row is empty (no NaN).
- ``flex_attention``: a ``BlockMask`` from ``create_block_mask`` (also passed through as is).
- ``varlen``: ``twinseq_varlen``, registered in ``transformers.AttentionInterface``. It cuts
  q/k/v into documents (a ``VarlenPlan``, passed down the model's ``**kwargs``), groups
  documents of similar length into buckets, pads within a bucket and runs causal
  ``F.scaled_dot_product_attention`` per bucket: no work on masked blocks or on padding.
- ``flash_attention_2``/``_3``: HF's flash varlen path, given ``cu_seq_lens_q/k`` and
  ``max_length_q/k`` over the flattened batch (CUDA + flash-attn only).
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F

from twinseq.common.batching import Batch, check_batch
from twinseq.common.config import ATTN_IMPLEMENTATIONS
from twinseq.common.errors import ConfigError

logger = logging.getLogger(__name__)

VARLEN_HF_NAME = "twinseq_varlen"
PLAN_KWARG = "twinseq_varlen_plan"
DEFAULT_BUCKET_RATIO = 1.25
SMALL_DOC_LEN = 16  # documents up to this length share one bucket: padding them costs next to nothing
_FLASH_MODULES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


# --------------------------------------------------------------------------------------
# Which path may run where
# --------------------------------------------------------------------------------------


def check_attention_supported(attn_implementation: str, padding_free: bool = False,
                              device: Any = "cpu", *, requires_grad: bool = True) -> None:
    """Raise ``ValueError`` when ``attn_implementation`` cannot run, or cannot mask documents, here.

    ``padding_free`` means rows hold several documents (packing or padding-free). Every path
    masks documents when it runs at all; a flash path without CUDA/flash-attn would fall back
    to something else in HF, so it is refused instead of risking a silent leak.
    """
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation={attn_implementation!r} is unknown; choose one of "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)}.")
    device_type = torch.device(device).type
    what = "padding-free/packed batches" if padding_free else "this run"
    if attn_implementation in _FLASH_MODULES:
        module = _FLASH_MODULES[attn_implementation]
        if device_type != "cuda":
            raise ConfigError(f"attn_implementation={attn_implementation!r} needs a CUDA device (got "
                              f"{device_type!r}); refusing {what} rather than attending across documents. "
                              f"Use attn_implementation='varlen' (padding-free, document-masked) or 'sdpa'.")
        if importlib.util.find_spec(module) is None:
            raise ConfigError(f"attn_implementation={attn_implementation!r} needs the {module!r} package, which is "
                              f"not installed; refusing {what} rather than attending across documents. Install "
                              f"it with `pip install -e '.[gpu]'` or use attn_implementation='varlen'.")
    if attn_implementation == "flex_attention" and device_type == "cpu" and requires_grad:
        raise ConfigError("attn_implementation='flex_attention' cannot train on CPU: torch "
                          f"{torch.__version__} has no FlexAttention backward on CPU. Use 'varlen' or 'sdpa' on "
                          "CPU, or flex_attention on CUDA (forward-only CPU use works under torch.no_grad()).")


def hf_attn_name(attn_implementation: str) -> str:
    """The name HF's ``AttentionInterface`` knows: ``varlen`` is registered as ``twinseq_varlen``."""
    if attn_implementation == "varlen":
        register_varlen()
        return VARLEN_HF_NAME
    return attn_implementation


def twinseq_attn_name(hf_name: str) -> str:
    return "varlen" if hf_name == VARLEN_HF_NAME else hf_name


def register_varlen() -> None:
    """Register ``twinseq_varlen`` with transformers (idempotent; called lazily, never at import)."""
    from transformers import AttentionInterface

    if VARLEN_HF_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(VARLEN_HF_NAME, varlen_attention_forward)


# --------------------------------------------------------------------------------------
# Dense and block masks
# --------------------------------------------------------------------------------------


def allowed_mask(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor) -> torch.Tensor:
    """bool [B, T, T]: the document-causal rule, plus the diagonal of padding queries.

    >>> seg, pos = torch.tensor([[1, 1, 2, 0]]), torch.tensor([[0, 1, 0, 0]])
    >>> allowed_mask(seg, pos).int()[0].tolist()
    [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    """
    seg_q, seg_k = segment_ids_BT[:, :, None], segment_ids_BT[:, None, :]
    same_doc = (seg_q == seg_k) & (seg_q != 0)
    causal = position_ids_BT[:, None, :] <= position_ids_BT[:, :, None]
    # padding queries get themselves as their only key: no empty softmax row, hence no NaN
    eye = torch.eye(segment_ids_BT.shape[1], dtype=torch.bool, device=segment_ids_BT.device)
    return (same_doc & causal) | (eye & (seg_q == 0))


def document_mask(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Additive float mask [B, 1, T, T]: 0 where ``allowed_mask`` holds, ``finfo(dtype).min`` elsewhere."""
    allowed = allowed_mask(segment_ids_BT, position_ids_BT)[:, None]
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)


def document_block_mask(segment_ids_BT: torch.Tensor, position_ids_BT: torch.Tensor):
    """FlexAttention ``BlockMask`` of ``allowed_mask`` (blocks fully outside a document are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    seg, pos = segment_ids_BT, position_ids_BT

    def mask_mod(b, h, q_idx, kv_idx):
        same_doc = (seg[b, q_idx] == seg[b, kv_idx]) & (seg[b, q_idx] != 0)
        pad_self = (seg[b, q_idx] == 0) & (q_idx == kv_idx)
        return (same_doc & (pos[b, kv_idx] <= pos[b, q_idx])) | pad_self

    B, T = seg.shape
    return create_block_mask(mask_mod, B, None, T, T, device=seg.device)


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

    slot_index: torch.Tensor    # long [S = sum n*L]
    bucket_shapes: list         # [(n, L)] per bucket, in slot_index order
    gather_idx: torch.Tensor    # long [B*T]: each token's slot; padding tokens -> S (a zero row)
    num_rows: int               # B
    seq_len: int                # T
    cu_seqlens: torch.Tensor    # int32 [num_runs+1] over the flattened batch, padding runs included (flash)
    max_seqlen: int


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


def varlen_plan(segment_ids_BT: np.ndarray, position_ids_BT: np.ndarray, device: Any = "cpu",
                bucket_ratio: float = DEFAULT_BUCKET_RATIO) -> Optional[VarlenPlan]:
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
    return VarlenPlan(torch.as_tensor(slot_index, device=device), shapes, torch.as_tensor(gather_idx, device=device),
                      segment_ids_BT.shape[0], segment_ids_BT.shape[1],
                      torch.as_tensor(cu_seqlens, dtype=torch.int32, device=device), int(lengths.max(initial=0)))


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


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                             dropout: float = 0.0, scaling: Optional[float] = None,
                             **kwargs) -> tuple[torch.Tensor, None]:
    """HF attention function ``twinseq_varlen``: q [B, H, T, D], k/v [B, KV, T, D] -> out [B, T, H, D].

    Naive equivalent: ``sdpa(q, k, v, attn_mask=document_mask(...))`` on real tokens; padding
    tokens get a zero output (they attend to nothing and nothing attends to them).
    """
    plan: Optional[VarlenPlan] = kwargs.get(PLAN_KWARG)
    if plan is None and attention_mask is not None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling)
    if plan is None:
        if kwargs.get("position_ids") is None:
            raise ConfigError("attn_implementation='varlen' needs document boundaries: call "
                              "twinseq.torch_backend.attention.forward_hidden(model, batch), or pass position_ids "
                              "that restart at 0 for each document.")
        _log_once("twinseq_varlen called without a VarlenPlan: documents taken from position_ids restarts "
                  "(use forward_hidden to pass segment_ids).")
        plan = _plan_from_position_ids(kwargs["position_ids"], query.shape[0])
    B, H, T, D = query.shape
    assert (plan.num_rows, plan.seq_len) == (B, T), "VarlenPlan built for another batch shape"
    out_NHD = _bucketed_attention(query, key, value, plan, scaling, dropout if module.training else 0.0)
    return out_NHD.view(B, T, H, value.shape[-1]), None


def _bucketed_attention(query, key, value, plan: VarlenPlan, scaling, dropout) -> torch.Tensor:
    """[B, H, T, D] q and [B, KV, T, D] k/v -> [B*T, H, Dv]: causal attention inside each document."""
    B, H, T, D = query.shape
    num_kv, dv = key.shape[1], value.shape[-1]
    q_HS, k_KS, v_KS = (x.transpose(0, 1).reshape(x.shape[1], B * T, x.shape[-1]).index_select(1, plan.slot_index)
                        for x in (query, key, value))
    sizes = [n * L for n, L in plan.bucket_shapes]
    outs = []
    for (n, L), q, k, v in zip(plan.bucket_shapes, q_HS.split(sizes, 1), k_KS.split(sizes, 1),
                               v_KS.split(sizes, 1)):
        q, k, v = (x.view(x.shape[0], n, L, x.shape[-1]).transpose(0, 1) for x in (q, k, v))
        o_nHLD = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, is_causal=True, scale=scaling,
                                                enable_gqa=num_kv != H)
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


def _ensure_attn(model: torch.nn.Module, attn_implementation: Optional[str]) -> str:
    current = twinseq_attn_name(model.config._attn_implementation)
    if attn_implementation is None or attn_implementation == current:
        return current
    if attn_implementation not in ATTN_IMPLEMENTATIONS:
        raise ConfigError(f"attn_implementation={attn_implementation!r} is unknown; choose one of "
                          f"{', '.join(ATTN_IMPLEMENTATIONS)}.")
    logger.info("switching the model's attention from %r to %r as requested", current, attn_implementation)
    model.set_attn_implementation(hf_attn_name(attn_implementation))
    return attn_implementation


def model_inputs(batch: Batch, attn_implementation: str, device: Any,
                 mask_dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Keyword arguments for ``LlamaModel.forward`` that implement the document rule on one path."""
    device = torch.device(device)
    seg_BT = torch.as_tensor(batch.segment_ids, dtype=torch.long, device=device)
    pos_BT = torch.as_tensor(batch.position_ids, dtype=torch.long, device=device)
    inputs: dict[str, Any] = {"input_ids": torch.as_tensor(batch.input_ids, dtype=torch.long, device=device),
                              "position_ids": pos_BT, "use_cache": False}
    if attn_implementation in ("sdpa", "eager"):
        inputs["attention_mask"] = document_mask(seg_BT, pos_BT, mask_dtype)
    elif attn_implementation == "flex_attention":
        inputs["attention_mask"] = document_block_mask(seg_BT, pos_BT)
    else:
        plan = varlen_plan(batch.segment_ids, batch.position_ids, device)
        if plan is None and attn_implementation in _FLASH_MODULES:
            raise ConfigError(f"attn_implementation={attn_implementation!r} needs contiguous documents with "
                              f"position_ids 0, 1, 2, ... (as common.batching.collate builds them); this batch "
                              f"has other positions. Use attn_implementation='sdpa'.")
        if plan is None:
            logger.info("varlen: documents are not contiguous runs with positions 0..n-1; using the dense "
                        "document mask for this batch")
            inputs["attention_mask"] = document_mask(seg_BT, pos_BT, mask_dtype)
        elif attn_implementation == "varlen":
            inputs[PLAN_KWARG] = plan
        else:
            inputs.update(cu_seq_lens_q=plan.cu_seqlens, cu_seq_lens_k=plan.cu_seqlens,
                          max_length_q=plan.max_seqlen, max_length_k=plan.max_seqlen)
    return inputs


def forward_hidden(model: torch.nn.Module, batch: Batch, attn_implementation: Optional[str] = None) -> torch.Tensor:
    """Final-norm hidden states [B, T, H] of ``batch`` (no lm_head), documents masked on every path.

    ``attn_implementation`` defaults to the model's; a different one switches the model to it.
    """
    check_batch(batch, model.config.vocab_size)
    attn = _ensure_attn(model, attn_implementation)
    device = next(model.parameters()).device
    check_attention_supported(attn, padding_free=int(batch.segment_ids.max(initial=0)) > 1, device=device,
                              requires_grad=torch.is_grad_enabled())
    inputs = model_inputs(batch, attn, device, _mask_dtype(model, device))
    return model.model(**inputs).last_hidden_state
