"""The inputs every parity and jax-backend test shares: the same documents in two layouts."""

from __future__ import annotations

import numpy as np

from twinseq.common.data.batching import Batch, collate

LAYOUTS = ("padded", "padding_free")
CHUNK_SIZE = 8  # the 48-token padded batch spans 6 chunks, the last one all-ignored (padding)


def parity_examples(vocab_size: int, seed: int = 1) -> list[dict]:
    """Four documents of lengths 7, 12, 3, 9; the 12-token one masks a 5-token prompt."""
    rng = np.random.default_rng(seed)
    docs = [{"input_ids": rng.integers(3, vocab_size, n).tolist()} for n in (7, 12, 3, 9)]
    docs[1]["completion_mask"] = [0] * 5 + [1] * 7
    return docs


def parity_batches(vocab_size: int) -> dict[str, Batch]:
    """``padded`` [4, 12] and ``padding_free`` [1, 32] (31 tokens + 1 padding) of the same documents."""
    examples = parity_examples(vocab_size)
    return {"padded": collate(examples),
            "padding_free": collate(examples, padding_free=True, pad_to_multiple_of=8)}


def valid_positions(batch: Batch) -> np.ndarray:
    """bool [B, T]: non-padding tokens (padding outputs are defined to mean nothing)."""
    return batch.segment_ids != 0


def rel_norm(a: np.ndarray, b: np.ndarray) -> float:
    """||a - b|| / ||b|| in float64 (||a - b|| when b is 0)."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    denom = np.linalg.norm(b64)
    diff = np.linalg.norm(a64 - b64)
    return float(diff / denom) if denom else float(diff)
