"""The model families under test: one tiny config per case, random-weight checkpoints saved by transformers,
and documents that exercise what each family adds (a document longer than the sliding window, positions
past ``max_position_embeddings`` for dynamic RoPE).

Every test of a family, in either backend or across them, takes its model from here, so "the Qwen3
case" means the same checkpoint everywhere. Building a checkpoint needs torch and transformers; the
configs and documents need only ``common``.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from twinseq.common.data.batching import Batch, collate
from twinseq.common.models.configs import ModelConfig, to_hf_config

VOCAB = 512
"""Small enough to keep every family test fast; the per-token NLL (~ln 512 = 6.2) then sits where float32
spacing is 4.8e-7, under the 1e-6 token-loss bound (see TOLERANCES.md)."""

FAMILY_CASES: dict[str, ModelConfig] = {
    "llama3": ModelConfig.preset("tiny-llama3", vocab_size=VOCAB),
    "llama-linear-rope": ModelConfig.preset("tiny", vocab_size=VOCAB, rope_type="linear", rope_factor=4.0),
    # max_position_embeddings below the longest document, so the NTK stretch is active
    "llama-dynamic-rope": ModelConfig.preset("tiny", vocab_size=VOCAB, rope_type="dynamic", rope_factor=2.0,
                                             max_position_embeddings=20),
    "llama-biases": ModelConfig.preset("tiny", vocab_size=VOCAB, attention_bias=True, mlp_bias=True),
    "qwen2": ModelConfig.preset("tiny-qwen2", vocab_size=VOCAB),
    "qwen2-sliding": ModelConfig.preset("tiny-qwen2", vocab_size=VOCAB, sliding_window=8,
                                        layer_types=["full_attention", "sliding_attention"]),
    "qwen3": ModelConfig.preset("tiny-qwen3", vocab_size=VOCAB),
    "mistral": ModelConfig.preset("tiny-mistral", vocab_size=VOCAB, sliding_window=8),
    # caps near the size of the values they cap, so that tanh bends them (Gemma 2's 50 and 30 leave the
    # scores and logits of a random tiny model almost linear, and a missing cap would hide in rounding)
    "gemma2": ModelConfig.preset("tiny-gemma2", vocab_size=VOCAB, sliding_window=8, attn_logit_softcapping=0.5,
                                 final_logit_softcapping=1.5),
    # as the text-only Gemma 3 checkpoints (270M, 1B): base 1e6 on the global layers, 1e4 on the sliding ones,
    # no RoPE scaling, no soft-caps (tests/torch_backend/test_families.py adds a final cap and linear scaling)
    "gemma3": ModelConfig.preset("tiny-gemma3", vocab_size=VOCAB, sliding_window=8),
    # four experts, top-2, renormalised; layer 1 sparse, layer 0 dense (mlp_only_layers), so both MLP kinds run
    "qwen3_moe": ModelConfig.preset("tiny-qwen3-moe", vocab_size=VOCAB, num_hidden_layers=3, mlp_only_layers=[0]),
    # four experts, top-2, every layer sparse; Mistral's window on every layer
    "mixtral": ModelConfig.preset("tiny-mixtral", vocab_size=VOCAB, sliding_window=8),
    # sinks, q/k/v/o biases, sliding then full layer, YaRN, four biased experts top-2; a SwiGLU limit near the gate's
    # spread (~0.5 in a perturbed tiny model), so that the clamps bend it (gpt-oss's 7.0 would never bite here)
    "gpt_oss": ModelConfig.preset("tiny-gpt-oss", vocab_size=VOCAB, sliding_window=8, swiglu_limit=0.5),
}
"""name -> config. Windows of 8 positions, so the 23-token document of ``family_examples`` crosses them."""

FAMILIES = tuple(FAMILY_CASES)
DOC_LENGTHS = (23, 9, 14)
"""The first document is longer than every sliding window (8) and than the dynamic-RoPE case's
``max_position_embeddings`` (20); the others fit inside both."""


def family_examples(vocab_size: int = VOCAB, seed: int = 3) -> list[dict]:
    """Three documents of ``DOC_LENGTHS``; the 14-token one masks a 4-token prompt."""
    rng = np.random.default_rng(seed)
    docs = [{"input_ids": rng.integers(3, vocab_size, n).tolist()} for n in DOC_LENGTHS]
    docs[2]["completion_mask"] = [0] * 4 + [1] * 10
    return docs


def family_batches(vocab_size: int = VOCAB) -> dict[str, Batch]:
    """``padded`` [3, 23], ``packed`` [1, 48] (46 tokens + 2 padding), and ``separate``: one [1, n] batch
    per document, each normalised by the whole step's label count so that losses and gradients add up."""
    examples = family_examples(vocab_size)
    padded = collate(examples)
    separate = [collate([ex], num_items_in_batch=padded.num_items_in_batch) for ex in examples]
    return {"padded": padded, "packed": collate(examples, padding_free=True, pad_to_multiple_of=16),
            "separate": separate}


def perturb_(model, seed: int = 0, scale: float = 0.05) -> None:
    """Add N(0, scale) noise to every parameter of a torch model, in place: norm scales, biases and
    Gemma's zero-initialised norms all differ from their initial values, so a backend that drops or
    misplaces any of them fails the comparison."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            param.add_(torch.randn(param.shape, generator=generator, dtype=param.dtype) * scale)


def hf_random_checkpoint(name: str, directory: Path, seed: int = 0) -> Path:
    """Build the ``name`` case with transformers (``AutoModelForCausalLM.from_config``), perturb every weight,
    and ``save_pretrained`` it as float32 safetensors in ``directory``: a checkpoint no twinseq code wrote."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    values = to_hf_config(FAMILY_CASES[name])
    values.pop("architectures")
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    perturb_(model, seed)
    directory = Path(directory)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_document_logits(model, input_ids: list[int]) -> np.ndarray:
    """float32 [n, V] logits of one document alone, from the transformers model's own forward
    (its own masks and RoPE, no twinseq code): the reference every backend is compared with."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.tensor([input_ids]), use_cache=False)
    return out.logits[0].float().numpy()
