"""Blocked document attention: flash-style online softmax over key blocks, no T x T tensor anywhere.

The dense paths build a float mask [B, 1, T, T] and (on CPU) a score matrix [B, H, T, T]: memory
quadratic in the row length. Here queries and keys are cut into blocks of ``block_size`` tokens;
for one query block the key blocks are visited in turn, keeping a running max ``m``, a running
sum ``l`` and a running output ``acc`` (online softmax), so the largest temporary is one block
pair of scores [B, H, block, block]. The mask of a block pair is built from the segment and
position ids of its tokens (the DESIGN.md rule), so packed rows, zigzag-reordered CP shards and
sliding windows all go through the same code. Block pairs with no allowed (query, key) pair are
skipped: a cheap range test on each block's segments and positions, then the exact mask.

Naive equivalent (what the tests compare against, on real tokens)::

    s = (q @ k^T) * scaling                      # GQA: each K/V head serves H / KV query heads
    s = softcap * tanh(s / softcap)              # only with softcap (Gemma 2)
    allowed = seg_k[j] != 0 and seg_k[j] in (seg_q[i], par_q[i]) and 0 <= pos_q[i] - pos_k[j] (< sliding_window)
    out = softmax(where(allowed, s, -inf)) @ v   # a query with no allowed key (padding) -> 0

With attention sinks (gpt-oss's ``s_aux``, a logit per query head with no value) the softmax has one more column:
``out = softmax([where(allowed, s, -inf), sink]) @ [v; 0]``. The online softmax starts from it (``m = sink``,
``l = 1``, ``acc = 0``), so a padding query gets 0 and every other row the sink's share taken off.

Backward recomputes the scores block by block from q, k, v, the output and the per-row
log-sum-exp ``lse`` (the only things saved), as FlashAttention-2 does:
``p = exp(s - lse)``, ``dv += p^T do``, ``ds = p * (do v^T - rowsum(do * out))``, then
``dq += ds k``, ``dk += ds^T q`` (times ``scaling``, and the soft-cap's ``1 - tanh^2``). The sink's column has
a zero value, so its ``ds`` is ``p_sink * (0 - rowsum(do * out))``: ``d sink = -sum(exp(sink - lse) * delta)`` over
the rows of its head.

Memory: saved ``out`` [B, H, L, D] and ``lse`` [B, H, L] (fp32), plus one block pair of
temporaries: O(L x D + block^2), linear in the row length. Work is in fp32 per block.
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass, field
from typing import Optional

import torch
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from twinseq.common.config import BLOCKED_MIN_SEQ_LEN, DEFAULT_ATTENTION_BLOCK_SIZE
from twinseq.common.errors import ConfigError
from twinseq.torch_backend.unwrap import causal_lm_of

logger = logging.getLogger(__name__)

BLOCKED_HF_NAME = "twinseq_blocked"
BLOCKED_KWARG = "twinseq_blocked_plan"
# BLOCKED_MIN_SEQ_LEN (from this row length on, sdpa/eager on CPU run the blocked attention) and
# DEFAULT_ATTENTION_BLOCK_SIZE come from common.config, where the memory planner reads them too;
# uses_blocked_attention reads this module's name (tests monkeypatch it).


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    logger.info(message)


@dataclass
class BlockedPlan:
    """The ids a blocked attention call masks with, and which block pairs hold an allowed pair.

    ``seg_q``/``pos_q`` [B, L] belong to the queries, ``seg_k``/``pos_k`` [B, S] to the keys (the
    same tensors without context parallelism; the gathered row's with ``allgather`` CP). ``par_q`` [B, L]
    (or None) is the queries' parent segment (``Batch.parent_ids``), whose keys they also see. Built once
    per forward and shared by every layer; the block-pair lists are cached per sliding window.
    """

    seg_q: torch.Tensor
    pos_q: torch.Tensor
    seg_k: torch.Tensor
    pos_k: torch.Tensor
    block_size: int
    par_q: Optional[torch.Tensor] = None
    _pairs: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(
                f"attention_block_size={self.block_size!r} is not valid; pass a positive integer (tokens per "
                f"query and key block of the blocked attention), e.g. the default 512."
            )

    def pairs(self, sliding_window: Optional[int]) -> list[list[tuple[int, bool]]]:
        """For every query block, ``(key block, full)`` for the key blocks that may hold an allowed pair (a
        superset: exact masks follow, except for ``full`` pairs, where every pair is allowed)."""
        if sliding_window not in self._pairs:
            self._pairs[sliding_window] = _candidate_pairs(self, sliding_window)
        return self._pairs[sliding_window]

    def allowed(self, qs: slice, ks: slice, sliding_window: Optional[int]) -> torch.Tensor:
        """bool [B, 1, 1, bq, bk]: the exact mask of query block ``qs`` and key block ``ks``."""
        par = None if self.par_q is None else self.par_q[:, qs]
        ok = _allowed(self.seg_q[:, qs], self.pos_q[:, qs], self.seg_k[:, ks], self.pos_k[:, ks], sliding_window, par)
        return ok[:, None, None]


def _block_reduce(x_BT: torch.Tensor, block: int, fill: int, op) -> torch.Tensor:
    """``op`` (torch.min/max) over each block of ``x_BT`` [B, T] -> [B, nb]; the last block padded with ``fill``."""
    B, T = x_BT.shape
    nb = -(-T // block)
    x = torch.nn.functional.pad(x_BT.long(), (0, nb * block - T), value=fill).view(B, nb, block)
    return op(x, dim=-1).values


def _block_ranges(seg_BT: torch.Tensor, pos_BT: torch.Tensor, block: int):
    """Per row and block, over real tokens (segment != 0): min and max segment and position, [B, nb] each;
    and whether the block is one document with no padding. A block with no real token gets empty ranges
    (min > max), so it pairs with nothing."""
    real = seg_BT != 0
    big = 1 << 40  # beyond any position or segment id; exact in the float F.pad takes, no overflow on subtraction

    def masked(x: torch.Tensor, fill: int) -> torch.Tensor:
        return torch.where(real, x.long(), torch.full_like(x, fill, dtype=torch.long))

    seg_min, seg_max = (
        _block_reduce(masked(seg_BT, big), block, big, torch.min),
        _block_reduce(masked(seg_BT, -big), block, -big, torch.max),
    )
    one_doc = (_block_reduce(seg_BT, block, big, torch.min) == seg_max) & (seg_max > 0)  # a 0 would be the min
    return (
        seg_min,
        seg_max,
        _block_reduce(masked(pos_BT, big), block, big, torch.min),
        _block_reduce(masked(pos_BT, -big), block, -big, torch.max),
        one_doc,
    )


def _candidate_pairs(plan: BlockedPlan, sliding_window: Optional[int]) -> list[list[tuple[int, bool]]]:
    """Per query block, ``(key block, full)``: the pair may hold an allowed (query, key) pair; ``full``: every
    pair of it is allowed in every row (one document on both sides, keys before queries), so no mask is built."""
    sq_min, sq_max, pq_min, pq_max, q_one = _block_ranges(plan.seg_q, plan.pos_q, plan.block_size)
    sk_min, sk_max, pk_min, pk_max, k_one = _block_ranges(plan.seg_k, plan.pos_k, plan.block_size)
    ok = (sq_min[:, :, None] <= sk_max[:, None, :]) & (sk_min[:, None, :] <= sq_max[:, :, None])
    if plan.par_q is not None:  # or some query's parent segment among the keys' segments
        par_min, par_max = _block_ranges(plan.par_q, plan.pos_q, plan.block_size)[:2]  # tokens with a parent only
        ok |= (par_min[:, :, None] <= sk_max[:, None, :]) & (sk_min[:, None, :] <= par_max[:, :, None])
    ok &= pk_min[:, None, :] <= pq_max[:, :, None]  # some key not after some query
    full = q_one[:, :, None] & k_one[:, None, :] & (sq_min[:, :, None] == sk_min[:, None, :])
    full &= pk_max[:, None, :] <= pq_min[:, :, None]  # every key not after every query
    if sliding_window is not None:  # some key within the window
        ok &= pq_min[:, :, None] - pk_max[:, None, :] < sliding_window
        full &= pq_max[:, :, None] - pk_min[:, None, :] < sliding_window
    ok_QK, full_QK = ok.any(0).cpu(), full.all(0).cpu()
    return [
        [(kj, bool(full_QK[qi, kj])) for kj in torch.nonzero(ok_QK[qi]).flatten().tolist()]
        for qi in range(ok_QK.shape[0])
    ]


def _allowed(seg_q, pos_q, seg_k, pos_k, sliding_window: Optional[int], par_q=None) -> torch.Tensor:
    """bool [B, bq, bk] of one block pair: same real document (or the query's parent segment), key not after
    query (within the window)."""
    same_doc = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] != 0)
    if par_q is not None:
        same_doc |= (par_q[:, :, None] == seg_k[:, None, :]) & (seg_k[:, None, :] != 0)
    distance = pos_q[:, :, None] - pos_k[:, None, :]
    ok = same_doc & (distance >= 0)
    if sliding_window is not None:
        ok &= distance < sliding_window
    return ok


def _work_dtype(x: torch.Tensor) -> torch.dtype:
    """fp32 for fp32 and lower precisions (bf16 scores lose the softmax), fp64 for fp64."""
    return torch.promote_types(x.dtype, torch.float32)


def _scores(q_BKGqD, k_BKkD, scaling: float, softcap: Optional[float]):
    """Scores [B, KV, G, bq, bk] of one block pair (fp32) and, with a soft-cap, its ``tanh`` for backward."""
    s = torch.einsum("bkgqd,bknd->bkgqn", q_BKGqD, k_BKkD) * scaling
    if softcap is None:
        return s, None
    t = torch.tanh(s / softcap)
    return t * softcap, t


class _BlockedAttention(torch.autograd.Function):
    """q [B, H, L, D], k/v [B, KV, S, D] -> out [B, H, L, Dv]; see the module docstring."""

    @staticmethod
    def forward(
        ctx,
        q,
        k,
        v,
        plan: BlockedPlan,
        scaling: float,
        sliding_window: Optional[int],
        softcap: Optional[float],
        sinks: Optional[torch.Tensor],
    ):
        B, H, L, D = q.shape
        KV, Dv, bs = k.shape[1], v.shape[-1], plan.block_size
        G, wd = H // KV, _work_dtype(q)
        q5 = q.view(B, KV, G, L, D)
        out = torch.zeros(B, KV, G, L, Dv, dtype=wd, device=q.device)
        lse = torch.zeros(B, KV, G, L, dtype=wd, device=q.device)
        sink_KG1 = None if sinks is None else sinks.detach().to(wd).view(KV, G, 1)
        for qi, key_blocks in enumerate(plan.pairs(sliding_window)):
            qs = slice(qi * bs, (qi + 1) * bs)
            q_blk = q5[:, :, :, qs].to(wd)
            bq = q_blk.shape[3]
            m = torch.full((B, KV, G, bq), float("-inf"), dtype=wd, device=q.device)
            l = torch.zeros(B, KV, G, bq, dtype=wd, device=q.device)
            if sink_KG1 is not None:  # the sink is the first column: m = sink, l = exp(sink - m) = 1
                m, l = sink_KG1.expand(B, KV, G, bq).clone(), l + 1.0
            acc = torch.zeros(B, KV, G, bq, Dv, dtype=wd, device=q.device)
            for kj, full in key_blocks:
                ks = slice(kj * bs, (kj + 1) * bs)
                s, _ = _scores(q_blk, k[:, :, ks].to(wd), scaling, softcap)
                if not full:
                    s = s.masked_fill(~plan.allowed(qs, ks, sliding_window), float("-inf"))
                m_new = torch.maximum(m, s.amax(-1))
                m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)  # rows with nothing allowed yet
                p = torch.exp(s - m_safe[..., None])
                alpha = torch.exp(m - m_safe)
                l = l * alpha + p.sum(-1)
                acc = acc * alpha[..., None] + p @ v[:, :, None, ks].to(wd)
                m = m_new
            empty = l == 0
            out[:, :, :, qs] = acc / torch.where(empty, 1.0, l)[..., None]
            # an empty row (padding query) keeps lse = +inf: exp(s - lse) is 0 for it in backward
            lse[:, :, :, qs] = torch.where(empty, float("inf"), m + torch.log(l))
        out = out.view(B, H, L, Dv).to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.plan, ctx.scaling, ctx.window, ctx.softcap = plan, scaling, sliding_window, softcap
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        plan, scaling, window, cap = ctx.plan, ctx.scaling, ctx.window, ctx.softcap
        B, H, L, D = q.shape
        KV, Dv, bs = k.shape[1], v.shape[-1], plan.block_size
        G, wd = H // KV, _work_dtype(q)
        q5, do5 = q.view(B, KV, G, L, D), grad_out.reshape(B, KV, G, L, Dv)
        delta = (do5.to(wd) * out.view(B, KV, G, L, Dv).to(wd)).sum(-1)  # rowsum(do * out)
        dq = torch.zeros(B, KV, G, L, D, dtype=wd, device=q.device)
        dk = torch.zeros(k.shape, dtype=wd, device=q.device)
        dv = torch.zeros(v.shape, dtype=wd, device=q.device)
        for qi, key_blocks in enumerate(plan.pairs(window)):
            qs = slice(qi * bs, (qi + 1) * bs)
            q_blk, do_blk = q5[:, :, :, qs].to(wd), do5[:, :, :, qs].to(wd)
            lse_blk, delta_blk = lse[:, :, :, qs, None], delta[:, :, :, qs, None]
            for kj, full in key_blocks:
                ks = slice(kj * bs, (kj + 1) * bs)
                k_blk, v_blk = k[:, :, ks].to(wd), v[:, :, ks].to(wd)
                s, t = _scores(q_blk, k_blk, scaling, cap)
                p = torch.exp(s - lse_blk)  # [B, KV, G, bq, bk]
                if not full:
                    p = torch.where(plan.allowed(qs, ks, window), p, 0.0)
                dv[:, :, ks] += torch.einsum("bkgqn,bkgqd->bknd", p, do_blk)
                ds = p * (torch.einsum("bkgqd,bknd->bkgqn", do_blk, v_blk) - delta_blk)
                if t is not None:
                    ds = ds * (1.0 - t * t)
                ds = ds * scaling
                dq[:, :, :, qs] += torch.einsum("bkgqn,bknd->bkgqd", ds, k_blk)
                dk[:, :, ks] += torch.einsum("bkgqn,bkgqd->bknd", ds, q_blk)
        dsinks = None
        if sinks is not None:  # the sink column: value 0, so ds = p_sink * (0 - delta); lse = +inf rows give 0
            p_sink = torch.exp(sinks.to(wd).view(1, KV, G, 1) - lse)
            dsinks = -(p_sink * delta).sum((0, 3)).reshape(H).to(sinks.dtype)
        return dq.view(B, H, L, D).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, dsinks


def blocked_attention(
    q_BHLD: torch.Tensor,
    k_BKSD: torch.Tensor,
    v_BKSD: torch.Tensor,
    plan: BlockedPlan,
    scaling: Optional[float] = None,
    sliding_window: Optional[int] = None,
    softcap: Optional[float] = None,
    sinks: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """[B, H, L, Dv]: document attention of ``plan``'s queries over its keys, block by block (module docstring);
    ``sinks`` [H]: a sink logit per query head in every softmax (gpt-oss), None: none.

    >>> seg, pos = torch.tensor([[1, 1, 2, 0]]), torch.tensor([[0, 1, 0, 0]])
    >>> q = k = torch.zeros(1, 1, 4, 2); v = torch.arange(4.0).view(1, 1, 4, 1)
    >>> blocked_attention(q, k, v, BlockedPlan(seg, pos, seg, pos, 2)).flatten().tolist()  # padding -> 0
    [0.0, 0.5, 2.0, 0.0]
    """
    B, H, L, D = q_BHLD.shape
    assert H % k_BKSD.shape[1] == 0, "query heads must be a multiple of the K/V heads (GQA)"
    assert tuple(plan.seg_q.shape) == (B, L) and tuple(plan.seg_k.shape) == (B, k_BKSD.shape[2]), (
        "BlockedPlan built for another batch shape"
    )
    scale = D**-0.5 if scaling is None else float(scaling)
    assert sinks is None or tuple(sinks.shape) == (H,), "one attention sink per query head"
    return _BlockedAttention.apply(q_BHLD, k_BKSD, v_BKSD, plan, scale, sliding_window, softcap, sinks)


# --------------------------------------------------------------------------------------
# The HF attention function ``twinseq_blocked`` and when it runs
# --------------------------------------------------------------------------------------


def attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The ``self_attn`` of every decoder layer (each HF family twinseq builds names it so)."""
    layers = causal_lm_of(model).model.layers
    return [layer.self_attn for layer in layers]


def set_attention_block_size(model: torch.nn.Module, block_size: int) -> None:
    """Use blocks of ``block_size`` tokens (``MemoryConfig.attention_block_size``) in the blocked attention of
    ``model`` (single process and ``allgather`` CP). Kept on the modules, not in the HF config, so it never
    reaches a saved ``config.json``."""
    BlockedPlan(torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), torch.zeros(1, 1), block_size)  # checks
    causal_lm_of(model)._twinseq_attention_block_size = block_size
    for module in attention_modules(model):
        module._twinseq_attention_block_size = block_size


def attention_block_size(model_or_module: torch.nn.Module) -> int:
    return getattr(model_or_module, "_twinseq_attention_block_size", DEFAULT_ATTENTION_BLOCK_SIZE)


def uses_blocked_attention(attn_implementation: str, device: torch.device, seq_len: int) -> bool:
    """The rule: ``sdpa`` or ``eager`` on CPU with rows of at least ``BLOCKED_MIN_SEQ_LEN`` tokens.

    Below it the dense mask is small and the dense kernels are faster (and the pinned golden
    trajectories stay bit-identical). ``varlen`` keeps its own per-document kernel (it never
    builds a [T, T] mask); on CUDA, ``flex_attention`` and the flash paths skip masked blocks.
    """
    return (
        attn_implementation in ("sdpa", "eager")
        and torch.device(device).type == "cpu"
        and seq_len >= BLOCKED_MIN_SEQ_LEN
    )


def register_blocked() -> None:
    """Register ``twinseq_blocked`` with transformers (idempotent; called lazily, never at import)."""
    if BLOCKED_HF_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(BLOCKED_HF_NAME, blocked_attention_forward)


def switch_to_blocked(model: torch.nn.Module, dense_attn: str) -> None:
    """Make ``model``'s attention ``twinseq_blocked``, which runs ``dense_attn`` (``sdpa``/``eager``) for a call
    without a ``BlockedPlan``. Stays switched: a graph recomputed in backward (checkpointing) must meet the
    function its forward met; short batches then take the dense path through it, unchanged."""
    causal_lm = causal_lm_of(model)
    for module in attention_modules(model):
        module._twinseq_dense_attn = dense_attn
    if causal_lm.config._attn_implementation != BLOCKED_HF_NAME:
        register_blocked()
        causal_lm.set_attn_implementation(BLOCKED_HF_NAME)
    _log_once(
        f"attention: rows of >= BLOCKED_MIN_SEQ_LEN tokens on CPU run the blocked attention (blocks of "
        f"{attention_block_size(causal_lm)} tokens, no [T, T] mask) in place of {dense_attn!r}; shorter rows "
        f"keep {dense_attn!r} with the dense document mask."
    )


def _dense_function(module: torch.nn.Module, name: str):
    if name == "eager":  # the family's own eager function (Gemma 2's soft-caps)
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[name]


def blocked_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """HF attention ``twinseq_blocked``: q [B, H, T, D], k/v [B, KV, T, D] -> out [B, T, H, Dv].

    With a ``BlockedPlan`` in ``twinseq_blocked_plan``: ``blocked_attention`` with the layer's
    ``sliding_window`` and ``softcap``. Without one (a short batch, dense mask given): exactly the
    dense function the model was switched from, called as HF would have called it.
    """
    plan: Optional[BlockedPlan] = kwargs.pop(BLOCKED_KWARG, None)
    sinks: Optional[torch.Tensor] = kwargs.pop("s_aux", None)
    if plan is None:
        # transformers' sdpa has no sink term: a model with sinks (gpt-oss) takes its family's eager function
        name = "eager" if sinks is not None else getattr(module, "_twinseq_dense_attn", "sdpa")
        if sinks is not None:
            kwargs["s_aux"] = sinks
        dense = _dense_function(module, name)
        return dense(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if dropout > 0 and module.training:
        raise ConfigError(
            f"the blocked attention has no attention dropout (got {dropout} from "
            f"{type(module).__name__}); set attention_dropout=0 or use rows shorter than "
            f"BLOCKED_MIN_SEQ_LEN."
        )
    out_BHTD = blocked_attention(
        query, key, value, plan, scaling, kwargs.get("sliding_window"), kwargs.get("softcap"), sinks
    )
    return out_BHTD.transpose(1, 2).contiguous(), None


def blocked_model_inputs(model: torch.nn.Module, batch, device) -> dict:
    """Keyword arguments for the HF decoder's ``forward`` on the blocked path: no mask, one ``BlockedPlan``."""
    seg_BT = torch.as_tensor(batch.segment_ids, dtype=torch.long, device=device)
    pos_BT = torch.as_tensor(batch.position_ids, dtype=torch.long, device=device)
    par_BT = None
    if getattr(batch, "shares_prefix", False):
        par_BT = torch.as_tensor(batch.parent_ids, dtype=torch.long, device=device)
    plan = BlockedPlan(seg_BT, pos_BT, seg_BT, pos_BT, attention_block_size(causal_lm_of(model)), par_BT)
    return {
        "input_ids": torch.as_tensor(batch.input_ids, dtype=torch.long, device=device),
        "position_ids": pos_BT,
        "use_cache": False,
        BLOCKED_KWARG: plan,
    }
