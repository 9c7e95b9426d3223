"""Regenerate the teaching notebooks from the cell sources below (outputs are not stored).

Run: ``.venv/bin/python notebooks/build_notebooks.py``. The test suite executes every
``notebooks/*.ipynb`` (tests/test_notebooks.py), so a notebook that breaks fails CI.
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

PACKING = [
    new_markdown_cell(
        "# 1. Packing without leaking documents\n\n"
        "Short sequences padded to a long `max_length` waste most of a batch on padding. Packing "
        "puts several documents in one row; padding-free batching puts a whole micro-batch in one "
        "row. Both are only correct if a token never attends to, or predicts, another document. "
        "This notebook shows the length profile of the embedded data, packs it, and checks on a "
        "real Hugging Face Llama that a packed batch gives the same per-document loss as running "
        "each document alone, and that a plain causal mask does not."),
    new_code_cell(
        "import numpy as np\n"
        "from twinseq.common.config import TrainConfig\n"
        "from twinseq.common.data import prepare_sft_dataset\n"
        "from twinseq.common.lengths import profile_lengths, format_profile\n\n"
        "rows, tok, stats = prepare_sft_dataset(TrainConfig.from_flat(max_length=None))\n"
        "lengths = np.array([len(x) for x in rows['input_ids']])\n"
        "print(stats)\n"
        "print(format_profile(profile_lengths(lengths, [128, 256, 512, 1024], batch_size=8)))"),
    new_markdown_cell("## Packing: best-fit-decreasing, split, wrapped\n\n"
                      "`bfd` truncates documents longer than the row, `bfd_split` cuts them into "
                      "fragments and keeps every token, `wrapped` concatenates and cuts. Keeping every "
                      "token is not keeping every target: a fragment is a new document, whose first "
                      "token nothing predicts, so each cut loses one target (none if the cut falls in "
                      "a masked prompt). `lost ... loss targets` counts them, read from the completion mask."),
    new_code_cell(
        "from twinseq.common.packing import pack_dataset\n"
        "for strategy in ['bfd', 'bfd_split', 'wrapped']:\n"
        "    _, packing_stats = pack_dataset(rows, 512, strategy, return_stats=True)\n"
        "    print(f'{strategy:9s}', packing_stats.summary())"),
    new_markdown_cell("## The document mask\n\nToken *i* may attend to *j* only if they share a "
                      "segment and *j* is not after *i* in its document."),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "from twinseq.common.batching import collate\n"
        "docs = [{'input_ids': list(range(10, 10 + n))} for n in (6, 4, 8)]\n"
        "batch = collate(docs, padding_free=True, pad_to_multiple_of=4)\n"
        "print('segment_ids ', batch.segment_ids[0])\n"
        "print('position_ids', batch.position_ids[0])\n"
        "print('labels      ', batch.labels[0])\n"
        "plt.imshow(batch.attention_allowed()[0], cmap='Blues'); plt.title('allowed attention (query x key)')\n"
        "plt.xlabel('key'); plt.ylabel('query'); plt.show()"),
    new_markdown_cell("## Packed equals separate, on a real model\n\nThe same three documents, "
                      "once packed in one row and once one by one. With twinseq's document mask "
                      "the per-document losses agree to float32 precision; with a plain causal mask "
                      "(what packing without FlashAttention does in TRL, issues #1230/#3910) they do not."),
    new_code_cell(
        "import torch\n"
        "from twinseq.common.config import ModelConfig\n"
        "from twinseq.common.init import init_weights\n"
        "from twinseq.common.loss import per_document_loss\n"
        "from twinseq.torch_backend import build_model, logits\n\n"
        "cfg = ModelConfig.preset('tiny')\n"
        "model = build_model(cfg, init_weights(cfg, seed=0), attn_implementation='sdpa')\n"
        "packed = logits(model, batch)\n"
        "separate = [logits(model, collate([d])) for d in docs]\n"
        "def mean_doc_loss(lg, b):\n"
        "    out = per_document_loss(lg, b.labels, b.segment_ids)\n"
        "    return (out['nll_sum'] / out['count']).round(6).tolist()\n"
        "print('packed   per-document loss:', mean_doc_loss(packed, batch))\n"
        "print('separate per-document loss:', sum((mean_doc_loss(l, collate([d])) for l, d in zip(separate, docs)), []))"),
    new_code_cell(
        "with torch.no_grad():\n"
        "    ids = torch.as_tensor(batch.input_ids, dtype=torch.long)\n"
        "    pos = torch.as_tensor(batch.position_ids, dtype=torch.long)\n"
        "    # A 2-D mask of ones, as a padding collator passes it: plain causal attention over the row.\n"
        "    # (With no mask at all, transformers 5 infers documents from restarting position_ids.)\n"
        "    leaky = model(input_ids=ids, position_ids=pos, attention_mask=torch.ones_like(ids)).logits.numpy()\n"
        "start, n = 6, 4  # the second document\n"
        "masked = np.abs(packed[0, start:start+n] - separate[1][0]).max()\n"
        "plain = np.abs(leaky[0, start:start+n] - separate[1][0]).max()\n"
        "print('max |logit diff| with document mask :', masked)\n"
        "print('max |logit diff| plain causal mask  :', plain)\n"
        "assert masked < 1e-5 < 1e-2 < plain  # the notebook's claim, checked when the test suite runs it"),
]

LOSSES = [
    new_markdown_cell(
        "# 2. Losses that never hold the full logits\n\n"
        "For a 128k vocabulary, the logits of 8192 tokens take 4 GiB in float32, and their gradient "
        "as much again. `chunked_nll` recomputes them chunk by chunk; `fused_linear` computes the loss "
        "and both gradients chunk by chunk inside the forward pass. All three agree."),
    new_code_cell(
        "import torch\n"
        "from twinseq.torch_backend.losses import causal_lm_loss\n"
        "torch.manual_seed(0)\n"
        "B, T, H, V = 2, 300, 64, 5000\n"
        "hidden = torch.randn(B, T, H, requires_grad=True)\n"
        "weight = (torch.randn(V, H) * 0.05).requires_grad_()\n"
        "labels = torch.randint(0, V, (B, T)); labels[:, :40] = -100\n"
        "n = int((labels[:, 1:] != -100).sum())\n"
        "results = {}\n"
        "for kind in ['nll', 'chunked_nll', 'fused_linear']:\n"
        "    hidden.grad = weight.grad = None\n"
        "    loss = causal_lm_loss(hidden, weight, labels, n, kind, chunk_size=128)\n"
        "    loss.backward()\n"
        "    results[kind] = (loss.item(), hidden.grad.clone(), weight.grad.clone())\n"
        "    print(f'{kind:13s} loss={loss.item():.6f}')\n"
        "for kind in ['chunked_nll', 'fused_linear']:\n"
        "    rel = (results[kind][2] - results['nll'][2]).norm() / results['nll'][2].norm()\n"
        "    print(f'{kind:13s} relative grad diff vs nll: {rel:.2e}')"),
    new_markdown_cell("## What each loss keeps for backward\n\nThe largest tensor autograd saves "
                      "between forward and backward, counted with `saved_tensors_hooks`. `fused_linear` "
                      "saves none: its forward already produced the gradients of `hidden` and of the "
                      "head weight (their own sizes), and backward only scales them."),
    new_code_cell(
        "def largest_saved(kind):\n"
        "    sizes = []\n"
        "    def pack(t):\n"
        "        sizes.append(t.numel()); return t\n"
        "    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):\n"
        "        causal_lm_loss(hidden, weight, labels, n, kind, chunk_size=128)\n"
        "    return max(sizes, default=0)\n"
        "for kind in ['nll', 'chunked_nll', 'fused_linear']:\n"
        "    print(f'{kind:13s} largest saved tensor: {largest_saved(kind):>9,d} elements  (full logits: {B*T*V:,d})')"),
    new_markdown_cell("## Gradient accumulation without the bias\n\nEach micro-batch loss is divided "
                      "by the label count of the whole optimizer step, so accumulated gradients equal "
                      "the big batch's even when micro-batches hold different numbers of labels."),
    new_code_cell(
        "big = causal_lm_loss(hidden, weight, labels, n, 'nll')\n"
        "parts = sum(causal_lm_loss(hidden[i:i+1], weight, labels[i:i+1], n, 'nll') for i in range(B))\n"
        "print(f'one batch: {big.item():.6f}   two micro-batches: {parts.item():.6f}')"),
]

PARITY = [
    new_markdown_cell(
        "# 3. Two frameworks, one model\n\n"
        "The same numpy weights (`init_weights`) load into a Hugging Face torch Llama and a Flax NNX "
        "Llama. In float32, with TF32 off and JAX matmuls at highest precision, their logits, "
        "losses and gradients agree to about 1e-6."),
    new_code_cell(
        "import jax\n"
        "jax.config.update('jax_default_matmul_precision', 'highest')\n"
        "import numpy as np\n"
        "from twinseq.common.backend import load_backend\n"
        "from twinseq.common.batching import collate\n"
        "from twinseq.common.config import ModelConfig\n"
        "from twinseq.common.init import init_weights\n\n"
        "cfg = ModelConfig.preset('tiny')\n"
        "weights = init_weights(cfg, seed=0)\n"
        "rng = np.random.default_rng(0)\n"
        "docs = [{'input_ids': rng.integers(3, cfg.vocab_size, n).tolist()} for n in (17, 5, 30)]\n"
        "batch = collate(docs, padding_free=True)\n"
        "out = {}\n"
        "for name in ['torch', 'jax']:\n"
        "    be = load_backend(name)\n"
        "    model = be.build_model(cfg, weights)\n"
        "    loss, grads = be.loss_and_grads(model, batch, loss_type='fused_linear')\n"
        "    out[name] = (be.logits(model, batch), loss, grads)\n"
        "print('max |logits diff|:', np.abs(out['torch'][0] - out['jax'][0]).max())\n"
        "print('loss torch / jax :', out['torch'][1], out['jax'][1])\n"
        "worst = max(np.linalg.norm(out['torch'][2][k] - out['jax'][2][k]) / np.linalg.norm(out['torch'][2][k])\n"
        "            for k in out['torch'][2])\n"
        "print('worst relative gradient diff over all tensors:', worst)"),
]


def main() -> None:
    for name, cells in [("01_packing_and_document_masks", PACKING), ("02_losses_without_logits", LOSSES),
                        ("03_torch_jax_parity", PARITY)]:
        nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                                "language": "python"}})
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
