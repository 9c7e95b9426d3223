"""Greedy decoding parity: the JAX KV-cache sampler vs Hugging Face ``generate`` on identical weights.

Inputs: a family preset, ``init_weights(seed=0)`` loaded by both backends' ``build_model``, and four prompts of
1 to 12 tokens, left-padded into one batch (so RoPE positions, the padding mask and, on sliding-window
families, the window all matter). Invariants (float32, exact matmuls):

- without EOS, every one of ``C`` greedy tokens of every row equals transformers' (its own KV cache, its own
  position ids from the attention mask);
- with an EOS id that some rows emit, the tokens up to each row's first EOS are equal and both pad after it.
"""

from __future__ import annotations

import numpy as np
import pytest

from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights

PROMPT_LENGTHS = (7, 3, 12, 1)
COMPLETION = 10


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab_size, n).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(torch_model, ids_BP: np.ndarray, mask_BP: np.ndarray, eos, pad: int) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = torch_model.eval().generate(input_ids=torch.as_tensor(ids_BP, dtype=torch.long),
                                          attention_mask=torch.as_tensor(mask_BP, dtype=torch.long),
                                          max_new_tokens=COMPLETION, min_new_tokens=0, do_sample=False,
                                          eos_token_id=eos, pad_token_id=pad, num_beams=1)
    completion_BC = out[:, ids_BP.shape[1]:].numpy().astype(np.int32)
    # generate stops once every row is done: the remaining columns are padding
    padded_BC = np.full((ids_BP.shape[0], COMPLETION), pad, np.int32)
    padded_BC[:, :completion_BC.shape[1]] = completion_BC
    return padded_BC


@pytest.mark.parametrize("preset", ["tiny", pytest.param("tiny-mistral", marks=pytest.mark.slow),
                                    pytest.param("tiny-gemma2", marks=pytest.mark.slow),
                                    pytest.param("tiny-qwen3", marks=pytest.mark.slow),
                                    pytest.param("tiny-gemma3", marks=pytest.mark.slow)])
def test_greedy_tokens_equal_hf_generate(preset, exact_fp32):
    pytest.importorskip("transformers")
    from twinseq.jax_backend import build_model as jax_build
    from twinseq.jax_backend.generation import generate
    from twinseq.torch_backend import build_model as torch_build

    cfg = ModelConfig.preset(preset)
    weights = init_weights(cfg, seed=0)
    jax_model, torch_model = jax_build(cfg, weights), torch_build(cfg, weights)
    prompts = _prompts(cfg.vocab_size)

    free = generate(jax_model, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=None)
    hf_free = _hf_greedy(torch_model, free.prompt_ids, free.prompt_mask, eos=None, pad=0)
    np.testing.assert_array_equal(free.completion_ids, hf_free)

    eos = int(free.completion_ids[0, 3])
    out = generate(jax_model, prompts, max_completion_length=COMPLETION, do_sample=False, eos_token_id=eos,
                   pad_token_id=0)
    hf_out = _hf_greedy(torch_model, out.prompt_ids, out.prompt_mask, eos=eos, pad=0)
    np.testing.assert_array_equal(out.completion_ids, hf_out)
    assert (out.completion_mask == 0).any()  # the EOS really stopped a row
