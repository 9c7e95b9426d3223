"""Segment and position ids of packed rows, shared by the attention tests."""

import numpy as np


def packed_ids(rows, seq_len):
    """numpy int32 [B, T] segment and position ids; row b packs documents of the lengths ``rows[b]`` (segments
    1, 2, ...; positions from 0 in each), padded with segment 0 to ``seq_len``."""
    seg, pos = np.zeros((len(rows), seq_len), np.int32), np.zeros((len(rows), seq_len), np.int32)
    for b, lengths in enumerate(rows):
        start = 0
        for d, n in enumerate(lengths):
            seg[b, start:start + n], pos[b, start:start + n] = d + 1, np.arange(n)
            start += n
        assert start <= seq_len
    return seg, pos
