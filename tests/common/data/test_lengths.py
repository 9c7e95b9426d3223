"""The length profiler: exact numbers on a hand-made distribution, and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest

from twinseq.common.data.lengths import default_candidates, format_profile, main, profile_lengths

# 10 sequences, 250 tokens. Batches of 4 in order: [3, 5, 8, 10], [12, 20, 30, 40], [50, 72].
LENGTHS = [3, 5, 8, 10, 12, 20, 30, 40, 50, 72]


def test_percentiles_are_order_statistics():
    p = profile_lengths(LENGTHS, candidates=[16], batch_size=4, with_bfd=False)
    assert (p.count, p.total_tokens, p.max, p.mean) == (10, 250, 72, 25.0)
    # inverted_cdf: the smallest length that at least p % of sequences do not exceed
    assert p.percentiles == {50: 12, 90: 50, 95: 72, 99: 72}


def test_candidate_table_exact():
    p = profile_lengths(LENGTHS, candidates=[32, 16, 64], batch_size=4, with_bfd=False)
    c16, c32, c64 = p.candidates  # sorted
    # L=16: kept = 3+5+8+10+12+16*5 = 118
    assert c16.max_length == 16
    assert c16.tokens_lost_share == pytest.approx(1 - 118 / 250)
    assert c16.examples_truncated_share == pytest.approx(0.5)
    # batches padded to their longest after truncation: 4*10 + 4*16 + 2*16 = 136 slots
    assert c16.padding_share_batch == pytest.approx(1 - 118 / 136)
    assert c16.mean_padded_batch_tokens == pytest.approx(136 / 3)
    assert c16.padding_share_fixed == pytest.approx(1 - 118 / 160)
    assert c16.packed_rows_lower_bound == 8  # ceil(118 / 16)
    assert c16.batch_tokens == 64
    # L=32: kept = 3+5+8+10+12+20+30+32*3 = 184; slots 4*10 + 4*32 + 2*32 = 232
    assert c32.tokens_lost_share == pytest.approx(1 - 184 / 250)
    assert c32.padding_share_batch == pytest.approx(1 - 184 / 232)
    assert c32.packed_rows_lower_bound == 6
    # L=64: kept = 250 - 8 = 242; slots 4*10 + 4*40 + 2*64 = 328
    assert c64.tokens_lost_share == pytest.approx(8 / 250)
    assert c64.padding_share_batch == pytest.approx(1 - 242 / 328)
    assert c64.packed_rows_lower_bound == 4


def test_recommendation_is_smallest_candidate_keeping_99_percent():
    p = profile_lengths(LENGTHS, candidates=[16, 64, 72, 128], batch_size=4, with_bfd=False)
    assert p.recommended == 72
    p = profile_lengths(LENGTHS, candidates=[16, 32], batch_size=4, with_bfd=False)
    assert p.recommended == 32
    assert "no candidate keeps 99%" in format_profile(p)


def test_bfd_rows_are_at_least_the_lower_bound():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(4.0, 1.0, size=500).astype(int), 1, 4000)
    p = profile_lengths(lengths, candidates=[128, 512], batch_size=8)
    for c in p.candidates:
        if c.packed_rows_bfd is not None:
            assert c.packed_rows_lower_bound <= c.packed_rows_bfd <= 1.01 * c.packed_rows_lower_bound + 1


def test_padding_shrinks_and_loss_grows_monotonically():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 3000, size=500)
    p = profile_lengths(lengths, candidates=[64, 128, 256, 512, 1024, 2048, 4096], batch_size=8, with_bfd=False)
    lost = [c.tokens_lost_share for c in p.candidates]
    assert lost == sorted(lost, reverse=True) and lost[-1] == 0.0
    fixed = [c.padding_share_fixed for c in p.candidates]
    assert fixed == sorted(fixed)


def test_default_candidates():
    assert default_candidates(np.array([40, 50, 3000])) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert default_candidates(np.array([100, 120, 130])) == [64, 128, 256]
    assert len(default_candidates(np.array([2, 2, 100000]))) == 8


def test_cli_on_a_local_file(tmp_path, capsys, embedded_tokenizer):
    path = tmp_path / "d.jsonl"
    rows = [{"prompt": "Explain this.\n", "completion": "word " * n} for n in (1, 3, 10, 30, 100)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = tmp_path / "out" / "hist.png"
    assert main([str(path), "--candidates", "16,64,256", "--batch-size", "2", "--output", str(png)]) == 0
    out = capsys.readouterr().out
    assert "5 sequences" in out and "p50=" in out and "max_length" in out
    assert "recommended max_length: 256" in out
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_default_output_dir(tmp_path, capsys, embedded_tokenizer):
    assert main(["embedded-preference", "--split", "train[:50]", "--output-dir", str(tmp_path)]) == 0
    assert (tmp_path / "lengths.png").is_file()
    assert "100 sequences" in capsys.readouterr().out  # chosen and rejected, each with its prompt
