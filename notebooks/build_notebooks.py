"""Regenerate the teaching notebooks from the cell sources below (outputs are not stored).

Run from the repository root: ``.venv/bin/python notebooks/build_notebooks.py``. The test
suite executes every ``notebooks/*.ipynb`` and checks that each one is what this script
writes (tests/test_notebooks.py), so a notebook that breaks or goes stale fails CI.

Every teaching claim a notebook makes is an ``assert`` in the cell that shows it. Numerical
bounds are the float32 rows of ``parity_tests/tolerances.py``, written into the notebooks
here (a notebook runs from any folder, so it cannot import ``parity_tests``): change the
table, rerun this script.
"""

import importlib.util
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _parity_table() -> dict[str, float]:
    spec = importlib.util.spec_from_file_location("_tolerances", REPO / "parity_tests" / "tolerances.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TOLERANCES["float32"]


def tolerance_line(*names: str) -> str:
    """``TOL = {...}``: the named float32 bounds, as a line of notebook code."""
    table = _parity_table()
    values = ", ".join(f"{name!r}: {table[name]!r}" for name in names)
    return f"TOL = {{{values}}}  # float32 bounds of parity_tests/tolerances.py, never loosened\n"


def md(text: str):
    return new_markdown_cell(text.strip("\n"))


def code(text: str):
    return new_code_cell(text.strip("\n"))


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
        "from twinseq.common.data.prepare import prepare_sft_dataset\n"
        "from twinseq.common.data.lengths import profile_lengths, format_profile\n\n"
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
        "from twinseq.common.data.packing import pack_dataset\n"
        "for strategy in ['bfd', 'bfd_split', 'wrapped']:\n"
        "    _, packing_stats = pack_dataset(rows, 512, strategy, return_stats=True)\n"
        "    print(f'{strategy:9s}', packing_stats.summary())"),
    new_markdown_cell("## The document mask\n\nToken *i* may attend to *j* only if they share a "
                      "segment and *j* is not after *i* in its document."),
    new_code_cell(
        "import matplotlib.pyplot as plt\n"
        "from twinseq.common.data.batching import collate\n"
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
        "from twinseq.common.models.init import init_weights\n"
        "from twinseq.common.objectives.nll import per_document_loss\n"
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
    md("""
# 2. Losses that never hold the full logits

With a vocabulary of V = 128,256 entries, the float32 logits of 8,192 tokens take
8192 × 128256 × 4 bytes = 3.9 GiB, and their gradient as much again. twinseq has three
implementations of the same next-token loss (`loss_type`):

- `nll` computes the full `[N, V]` logits at once;
- `chunked_nll` computes them one chunk of tokens at a time, and computes each chunk again in
  the backward pass;
- `fused_linear` computes the loss and both gradients (of the hidden states and of the LM head)
  chunk by chunk inside the forward pass; the backward pass only scales them.

All three give the same loss and gradients. Every claim below is checked by an `assert` in the
cell that shows it, with the float32 bounds of the project's parity table
(`parity_tests/TOLERANCES.md` says where each comes from)."""),
    code(tolerance_line("loss_rel", "grad_rel") + """
import torch
from twinseq.torch_backend.losses import causal_lm_loss

LOSSES = ['nll', 'chunked_nll', 'fused_linear']
torch.manual_seed(0)
B, T, H, V, CHUNK = 2, 300, 64, 5000, 128
N = B * T  # rows of the full logits
hidden = torch.randn(B, T, H, requires_grad=True)
weight = (torch.randn(V, H) * 0.05).requires_grad_()
labels = torch.randint(0, V, (B, T)); labels[:, :40] = -100  # a 40-token prompt: no loss there
n = int((labels[:, 1:] != -100).sum())  # targets after the shift: the step's num_items_in_batch

def rel(a, b):
    \"\"\"||a - b|| / ||b|| in float64: the parity table's measure for losses and gradients.\"\"\"
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm()).item()

def loss_and_grads(kind, labels=labels):
    hidden.grad = weight.grad = None
    loss = causal_lm_loss(hidden, weight, labels, n, kind, chunk_size=CHUNK)
    loss.backward()
    return loss.item(), hidden.grad.clone(), weight.grad.clone()

results = {kind: loss_and_grads(kind) for kind in LOSSES}
nll = results['nll']
for kind, (loss, grad_hidden, grad_head) in results.items():
    print(f'{kind:13s} loss={loss:.6f}  vs nll: loss rel {rel(loss, nll[0]):.1e}, '
          f'grad rel hidden {rel(grad_hidden, nll[1]):.1e}, LM head {rel(grad_head, nll[2]):.1e}')
    assert rel(loss, nll[0]) <= TOL['loss_rel']
    assert rel(grad_hidden, nll[1]) <= TOL['grad_rel'] and rel(grad_head, nll[2]) <= TOL['grad_rel']"""),
    md("""
## The bounds catch a chunking bug

The 520 targets, in chunks of 128 tokens, leave a last chunk of 8. A chunk loop that forgets
the partial last chunk loses those 8 targets; ignoring them in the labels computes exactly what
that bug would. The loss and the gradients move far past their bounds."""),
    code("""
tail = n % CHUNK
print(f'{n} targets = {n // CHUNK} chunks of {CHUNK} + a last chunk of {tail}')
assert tail != 0
tail_lost = labels.clone(); tail_lost[-1, -tail:] = -100  # the last `tail` targets of the flattened rows
buggy = loss_and_grads('chunked_nll', tail_lost)
print(f'last chunk lost: loss rel {rel(buggy[0], nll[0]):.1e}, LM head grad rel {rel(buggy[2], nll[2]):.1e}')
assert rel(buggy[0], nll[0]) > TOL['loss_rel'] and rel(buggy[2], nll[2]) > TOL['grad_rel']"""),
    md("""
## What each loss creates, keeps and recomputes

A `TorchDispatchMode` (the probe of the project's loss tests) sees every tensor that an aten
operation returns, in the forward and in the backward pass. From it, three measurements:

- **the largest tensor created**: `nll` creates the full `[N, V]` logits; `chunked_nll` and
  `fused_linear` never create anything larger than one chunk of logits, `[chunk, V]`, or the
  LM head's gradient, `[V, H]`;
- **the bytes still alive between forward and backward**, not counting the inputs: what is
  kept for the backward pass. `nll` keeps the float32 `[N, V]` logits; `chunked_nll` keeps
  less than one chunk of them; `fused_linear` keeps no more than the two gradients it has
  already computed, `[N, H]` and `[V, H]` in float32;
- **the LM-head matmuls** (outputs `[rows, V]`): `chunked_nll` runs one per chunk in the
  forward pass and the same number again in the backward pass; `fused_linear` runs them in the
  forward pass only, and its backward pass runs no matmul at all."""),
    code("""
import gc, math, weakref
from torch.utils._python_dispatch import TorchDispatchMode

class OpLog(TorchDispatchMode):
    \"\"\"Every tensor an aten op returns while active: (op name, shape) and a weak reference.\"\"\"
    def __init__(self):
        super().__init__()
        self.ops, self.refs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor):
                self.ops.append((func.overloadpacket.__name__, tuple(t.shape)))
                self.refs.append(weakref.ref(t))
        return out

    def largest(self):
        return max(math.prod(shape) for _, shape in self.ops)

    def matmuls(self, out_dim=None):
        return sum(op in ('mm', 'addmm', 'addmm_') and out_dim in (None, shape[-1]) for op, shape in self.ops)

    def alive_bytes(self, *inputs):
        \"\"\"Bytes of the storages created here that are still alive, other than those of `inputs`.\"\"\"
        gc.collect()
        skip = {t.untyped_storage().data_ptr() for t in inputs}
        alive = {}
        for ref in self.refs:
            t = ref()
            if t is not None and t.untyped_storage().data_ptr() not in skip:
                alive[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return sum(alive.values())

probe = {}
for kind in LOSSES:
    hidden.grad = weight.grad = None
    with OpLog() as forward:
        loss = causal_lm_loss(hidden, weight, labels, n, kind, chunk_size=CHUNK)
    kept = forward.alive_bytes(hidden, weight, loss)
    with OpLog() as backward:
        loss.backward()
    probe[kind] = dict(largest=max(forward.largest(), backward.largest()), kept=kept,
                       head_forward=forward.matmuls(V), head_backward=backward.matmuls(V),
                       backward_matmuls=backward.matmuls())
    p = probe[kind]
    print(f'{kind:13s} largest tensor {p["largest"]:>9,d} elements, kept for backward {p["kept"] / 1e6:5.2f} MB, '
          f'LM-head matmuls forward/backward {p["head_forward"]}/{p["head_backward"]}, '
          f'all backward matmuls {p["backward_matmuls"]}')
num_chunks = -(-n // CHUNK)
print(f'full logits: {N * V:,d} elements, {4 * N * V / 1e6:.2f} MB; {num_chunks} chunks')

assert probe['nll']['largest'] >= N * V and probe['nll']['kept'] >= 4 * N * V  # the probes see the logits
for kind in ['chunked_nll', 'fused_linear']:
    assert probe[kind]['largest'] <= max(CHUNK * V, V * H) < N * V
assert probe['chunked_nll']['kept'] < 4 * CHUNK * V
assert probe['fused_linear']['kept'] <= 4 * (N * H + V * H)
assert (probe['nll']['head_forward'], probe['nll']['head_backward']) == (1, 0)
assert (probe['chunked_nll']['head_forward'], probe['chunked_nll']['head_backward']) == (num_chunks, num_chunks)
assert (probe['fused_linear']['head_forward'], probe['fused_linear']['backward_matmuls']) == (num_chunks, 0)"""),
    md("""
## At full size, without allocating it

How much scratch memory does each loss need, forward and backward, for 8,192 tokens, hidden
size 2,048 and the 128,256-entry vocabulary? XLA can answer without allocating anything:
compile the JAX backend's implementation of the same three losses for those shapes and read
`memory_analysis()`, as `benchmarks/jax_loss_memory.py` does. `nll` needs the logits and their
gradient, twice 3.9 GiB; `chunked_nll` and `fused_linear` each need less than one copy of the
logits, and `fused_linear` at most an eighth of what `nll` needs (that benchmark's acceptance
bar)."""),
    code("""
import jax
import jax.numpy as jnp
from twinseq.jax_backend.losses import causal_lm_loss as jax_causal_lm_loss

N_BIG, H_BIG, V_BIG = 8192, 2048, 128256
logits_bytes = 4 * N_BIG * V_BIG
print(f'float32 logits, {N_BIG} tokens x {V_BIG} entries: {logits_bytes / 2**30:.2f} GiB')
assert round(logits_bytes / 2**30, 1) == 3.9

def scratch_bytes(kind):
    \"\"\"XLA's temporary memory for the loss and its gradients w.r.t. hidden and head: compiled, never run.\"\"\"
    def loss(hidden_NH, head_VH, labels_N):
        return jax_causal_lm_loss(hidden_NH[None], head_VH, labels_N[None], N_BIG, kind, chunk_size=256)
    shapes = [jax.ShapeDtypeStruct((N_BIG, H_BIG), jnp.float32), jax.ShapeDtypeStruct((V_BIG, H_BIG), jnp.float32),
              jax.ShapeDtypeStruct((N_BIG,), jnp.int32)]
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*shapes).compile()
    return compiled.memory_analysis().temp_size_in_bytes

scratch = {kind: scratch_bytes(kind) for kind in LOSSES}
for kind, size in scratch.items():
    print(f'{kind:13s} scratch {size / 2**30:5.2f} GiB = {size / logits_bytes:.2f} x the logits; '
          f'nll needs {scratch["nll"] / size:4.1f} x this')
assert scratch['nll'] >= 2 * logits_bytes
assert max(scratch['chunked_nll'], scratch['fused_linear']) < logits_bytes
assert 8 * scratch['fused_linear'] <= scratch['nll']"""),
    md("""
## Gradient accumulation without the bias

Each micro-batch loss is divided by the label count of the whole optimizer step
(`num_items_in_batch`), so the accumulated loss and gradients equal the big batch's, even when
the micro-batches hold different numbers of labels. Here each row is a micro-batch, and the
second row keeps far fewer targets than the first. Dividing each micro-batch by its own count
and averaging the results (a mean of means) gives a detectably different step."""),
    code("""
uneven = labels.clone(); uneven[1, :250] = -100
counts = (uneven[:, 1:] != -100).sum(1).tolist()
n_step = sum(counts)
print('targets per micro-batch:', counts)
assert counts[0] != counts[1]

def one_step(kind, micro_batches, mean_of_means=False):
    \"\"\"(loss, grad of hidden, grad of head) accumulated over `micro_batches` row slices.\"\"\"
    hidden.grad = weight.grad = None
    total = 0.0
    for rows in micro_batches:
        num_items = sum(counts[rows]) if mean_of_means else n_step
        loss = causal_lm_loss(hidden[rows], weight, uneven[rows], num_items, kind, chunk_size=CHUNK)
        if mean_of_means:
            loss = loss / len(micro_batches)
        loss.backward()
        total += loss.item()
    return total, hidden.grad.clone(), weight.grad.clone()

for kind in LOSSES:
    big = one_step(kind, [slice(0, B)])
    accumulated = one_step(kind, [slice(i, i + 1) for i in range(B)])
    wrong = one_step(kind, [slice(i, i + 1) for i in range(B)], mean_of_means=True)
    print(f'{kind:13s} one batch {big[0]:.6f}, {B} micro-batches {accumulated[0]:.6f} '
          f'(grad rel {rel(accumulated[2], big[2]):.1e}), mean of means {wrong[0]:.6f} '
          f'(grad rel {rel(wrong[2], big[2]):.1e})')
    assert rel(accumulated[0], big[0]) <= TOL['loss_rel']
    assert rel(accumulated[1], big[1]) <= TOL['grad_rel'] and rel(accumulated[2], big[2]) <= TOL['grad_rel']
    assert rel(wrong[0], big[0]) > TOL['loss_rel'] and rel(wrong[2], big[2]) > TOL['grad_rel']"""),
]

PARITY = [
    md("""
# 3. Two frameworks, one model

The same numpy weights (`init_weights`) load, bit for bit, into a Hugging Face torch Llama and
a Flax NNX Llama. In float32, with TF32 off in torch and JAX matmuls at `highest` precision,
their logits, loss and gradients then agree within the float32 bounds of the project's parity
table (`parity_tests/TOLERANCES.md` says where each comes from): logits within 1e-5 (max abs),
the loss within 1e-6 (relative), every gradient tensor within 1e-5 (relative norm). Each claim
is checked by an `assert`."""),
    code(tolerance_line("logits_abs", "loss_rel", "grad_rel") + """
import dataclasses
import jax
jax.config.update('jax_default_matmul_precision', 'highest')
import numpy as np
import torch
torch.backends.cuda.matmul.allow_tf32 = False  # TF32 exists on GPUs only; off, a GPU run stays float32
torch.backends.cudnn.allow_tf32 = False
from twinseq.common.backend import load_backend
from twinseq.common.data.batching import collate
from twinseq.common.config import ModelConfig
from twinseq.common.models.init import init_weights

cfg = ModelConfig.preset('tiny')
weights = init_weights(cfg, seed=0)
backends = {name: load_backend(name) for name in ['torch', 'jax']}
models = {name: be.build_model(cfg, weights) for name, be in backends.items()}
for name, be in backends.items():
    exported = be.export_weights(models[name])
    same = exported.keys() == weights.keys() and all(np.array_equal(exported[k], weights[k]) for k in weights)
    print(f'{name:5s} {type(models[name]).__module__}.{type(models[name]).__name__}: weights identical: {same}')
    assert same
assert type(models['torch']).__module__.startswith('transformers.')
assert any(cls.__module__.startswith('flax.nnx') for cls in type(models['jax']).__mro__)"""),
    code("""
rng = np.random.default_rng(0)
docs = [{'input_ids': rng.integers(3, cfg.vocab_size, n).tolist()} for n in (17, 5, 30)]
batch = collate(docs, padding_free=True)  # one row, three documents, no padding

def run(name, batch):
    be, model = backends[name], models[name]
    loss, grads = be.loss_and_grads(model, batch, loss_type='fused_linear')
    logits = be.logits(model, batch)
    assert logits.dtype == np.float32 and all(g.dtype == np.float32 for g in grads.values())
    return logits, loss, grads

def gaps(a, b):
    \"\"\"The parity table's three measures between two runs (logits, loss, grads).\"\"\"
    assert a[2].keys() == b[2].keys()
    rel = lambda x, y: np.linalg.norm(np.asarray(x, np.float64) - y) / np.linalg.norm(np.asarray(y, np.float64))
    return {'logits_abs': float(np.abs(a[0] - b[0]).max()), 'loss_rel': abs(a[1] - b[1]) / abs(b[1]),
            'grad_rel': max(rel(a[2][k], b[2][k]) for k in b[2])}

out = {name: run(name, batch) for name in backends}
print('loss torch / jax:', out['torch'][1], out['jax'][1])
parity = gaps(out['jax'], out['torch'])
for measure, value in parity.items():
    print(f'{measure:10s} {value:.1e}  (bound {TOL[measure]:.0e})')
    assert value <= TOL[measure], measure"""),
    md("""
## Would the bounds catch a bug?

Give the JAX model a batch that has lost its document boundaries (one segment, positions
counting on across documents: packing without a document mask, the leak of notebook 1), while
torch gets the right one. The labels are the same, so only attention and positions differ.
Logits, loss and gradients all move far past their bounds."""),
    code("""
T = batch.shape[1]
no_boundaries = dataclasses.replace(batch, segment_ids=np.ones_like(batch.segment_ids),
                                    position_ids=np.arange(T, dtype=np.int32)[None],
                                    cu_seqlens=np.array([0, T], dtype=np.int32))
leaky_jax = run('jax', no_boundaries)
bug = gaps(leaky_jax, out['torch'])
for measure, value in bug.items():
    print(f'{measure:10s} {value:.1e}  (bound {TOL[measure]:.0e})')
    assert value > TOL[measure], measure"""),
    md("""
## Parity is not correctness

Give *both* frameworks the same wrong batch and they agree again, within the same bounds:
parity shows that the two compute the same thing, not that it is the right thing. For that,
compare with the documents run one at a time, where no mask is needed: the packed batch
matches them within the logits bound in both frameworks, the batch without boundaries does
not. (The parity suite's version of this check is a float64 numpy model,
`parity_tests/numpy_reference.py`.)"""),
    code("""
leaky_torch = run('torch', no_boundaries)
both_wrong = gaps(leaky_jax, leaky_torch)
print('same wrong batch, jax vs torch:', {k: f'{v:.1e}' for k, v in both_wrong.items()})
assert all(both_wrong[m] <= TOL[m] for m in TOL)

alone = np.concatenate([backends['torch'].logits(models['torch'], collate([d]))[0] for d in docs])
for label, logits in [('torch, packed', out['torch'][0]), ('jax, packed', out['jax'][0]),
                      ('torch, no boundaries', leaky_torch[0]), ('jax, no boundaries', leaky_jax[0])]:
    gap = np.abs(logits[0] - alone).max()
    print(f'{label:21s} max |logits - documents alone| = {gap:.1e}')
    assert (gap <= TOL['logits_abs']) == label.endswith('packed')"""),
]

FINETUNE = [
    md("""
# 4. Fine-tune, evaluate, chat

The Python front door end to end, as a TRL user writes it: a `datasets.Dataset` built in memory, an
`SFTConfig` with TRL's argument names, `SFTTrainer(...).train()` with an evaluation every few steps, then the
trained model answering. The model is the `tiny` preset (two layers, 0.99M parameters, random initial weights: no
download), so the task has to be one a tiny model learns in seconds on a CPU: **copy two words**. The prompt is
`Say apple river.` and the answer `apple river`. The held-out evaluation rows use word pairs the training rows
never contain, so a falling `eval_loss` means the model learned to copy, not to recite.
"""),
    code("""
import json
import random
from pathlib import Path
from tempfile import mkdtemp

from datasets import Dataset

WORDS = ('apple river stone cloud green music paper window silver garden yellow orange bread candle forest '
         'horse ocean pencil rabbit summer table violet winter zebra').split()
pairs = [(a, b) for a in WORDS for b in WORDS if a != b]
random.Random(0).shuffle(pairs)
held_out_pairs, train_pairs = pairs[:40], pairs[40:]

def rows(some_pairs, n, seed):
    rng = random.Random(seed)
    return [{'prompt': f'Say {a} {b}.\\n', 'completion': f'{a} {b}'} for a, b in rng.choices(some_pairs, k=n)]

train, held_out = Dataset.from_list(rows(train_pairs, 600, 1)), Dataset.from_list(rows(held_out_pairs, 40, 2))
assert not {(r['prompt']) for r in held_out} & {(r['prompt']) for r in train}, 'held-out pairs are unseen'
print(train, held_out, train[0], sep='\\n')"""),
    md("""
## Train, with an evaluation every 20 steps

`eval_on_start` adds the starting point of the curve; `eval_generate_samples` writes, at every evaluation, the
greedy answers to the first eval prompts beside their references (`samples/step_N.md`): the before and the
after. The loss is taken on the completion only (prompt-completion rows), packed without padding.
"""),
    code("""
from twinseq import SFTConfig, SFTTrainer

out_dir = Path(mkdtemp()) / 'copy-run'
args = SFTConfig(output_dir=str(out_dir), max_steps=80, max_length=64, learning_rate=3e-3,
                 lr_scheduler_type='constant', per_device_train_batch_size=16, packing=True, padding_free=True,
                 attn_implementation='varlen', eval_strategy='steps', eval_steps=20, eval_on_start=True,
                 eval_generate_samples=4, disable_tqdm=True, seed=0)
trainer = SFTTrainer(model='tiny', args=args, train_dataset=train, eval_dataset=held_out)
result = trainer.train()
print(result.global_step, round(result.training_loss, 4))"""),
    md("## The curves\n\nTraining loss at every step, evaluation loss and token accuracy on the held-out pairs."),
    code("""
import matplotlib.pyplot as plt

records = [json.loads(line) for line in (out_dir / 'metrics.jsonl').read_text().splitlines()]
train_curve = [(r['step'], r['loss']) for r in records if 'loss' in r]
evals = [(r['step'], r['eval_loss'], r['eval_mean_token_accuracy']) for r in records if 'eval_loss' in r]
fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
left.plot(*zip(*train_curve), label='train loss')
left.plot([s for s, _, _ in evals], [l for _, l, _ in evals], 'o-', label='eval loss (held-out pairs)')
left.set_yscale('log'); left.set_xlabel('optimizer step'); left.legend()
right.plot([s for s, _, _ in evals], [a for _, _, a in evals], 'o-'); right.set_ylim(0, 1)
right.set_xlabel('optimizer step'); right.set_title('eval token accuracy')
plt.tight_layout(); plt.show()
for step, loss, accuracy in evals:
    print(f'step {step:4d}: eval_loss {loss:.4f}, eval accuracy {accuracy:.3f}')
assert [s for s, _, _ in evals] == [0, 20, 40, 60, 80]
assert evals[-1][1] < 0.1 * evals[0][1], 'the held-out loss falls by more than 10x'
assert evals[-1][2] >= 0.9, 'and the model copies unseen pairs token by token'"""),
    md("## Before and after\n\nThe same held-out prompts, answered greedily at step 0 and at the last step."),
    code("""
def samples(step):
    return [json.loads(line) for line in (out_dir / 'samples' / f'step_{step}.jsonl').read_text().splitlines()]

before, after = samples(0), samples(80)
for b, a in zip(before, after):
    print(f"{b['prompt'].strip()!r:32} before: {b['completion']!r:34} after: {a['completion']!r}")
assert not any(b['completion'].strip() == b['reference'].strip() for b in before)
assert sum(a['completion'].strip() == a['reference'].strip() for a in after) >= 3"""),
    md("""
## Evaluate again, and talk to the saved model

`trainer.evaluate()` runs the evaluation on the trained model in memory: it must give the last logged
`eval_loss`. `train()` wrote the model with its tokenizer to `final/`; `Generator` (what `twinseq generate`
and `twinseq chat` run) loads that folder on either backend and answers new prompts, here on the JAX backend
from the torch-trained weights.
"""),
    code("""
from twinseq.common.run.generate import Generator

again = trainer.evaluate()
print({k: round(v, 6) for k, v in again.items() if k in ('eval_loss', 'eval_mean_token_accuracy')})
assert abs(again['eval_loss'] - evals[-1][1]) <= 1e-5 * evals[-1][1]

answers = {}
for backend in ('torch', 'jax'):
    model = Generator(out_dir / 'final', backend=backend, chat=False)
    answers[backend] = [c.completion for c in model.complete([f'Say {a} {b}.\\n' for a, b in held_out_pairs[:6]],
                                                              max_new_tokens=6)]
    print(backend, answers[backend])
assert answers['torch'] == answers['jax'], 'one folder, two backends, the same greedy answers'
right = sum(ans.strip().startswith(f'{a} {b}') for ans, (a, b) in zip(answers['torch'], held_out_pairs))
assert right >= 4, f'{right} of 6 unseen pairs copied'"""),
]

NOTEBOOKS = {"01_packing_and_document_masks": PACKING, "02_losses_without_logits": LOSSES,
             "03_torch_jax_parity": PARITY, "04_finetune_evaluate_chat": FINETUNE}


def build() -> dict[str, nbformat.NotebookNode]:
    """The notebooks, by file stem. Cell ids are fixed so that regenerating changes nothing."""
    notebooks = {}
    for name, cells in NOTEBOOKS.items():
        for index, cell in enumerate(cells):
            cell["id"] = f"{name[:2]}-{index:02d}"
        notebooks[name] = new_notebook(cells=cells, metadata={
            "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}})
    return notebooks


def main() -> None:
    for name, nb in build().items():
        nbformat.write(nb, HERE / f"{name}.ipynb")
        print("wrote", HERE / f"{name}.ipynb")


if __name__ == "__main__":
    main()
