"""Invariants of ``common.run.memory_plan``: what each knob must do to the plan, whatever the coefficients.

No framework is imported: the plan is arithmetic on the config. How close the plan is to measured peaks is
``tests/test_memory_planner_accuracy.py``'s business.
"""

from __future__ import annotations

import pytest

from twinseq.common.config import BLOCKED_MIN_SEQ_LEN, DEFAULT_ATTENTION_BLOCK_SIZE, TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.models.configs import ModelConfig, parameter_shapes
from twinseq.common.models.peft import LINEAR_MODULES, PeftConfig, trainable_parameter_count
from twinseq.common.run.memory_plan import (
    ACTIVATION_ROWS,
    BLOCKED_TILES,
    CHUNK_COPIES,
    HEAP_RETAINED_AT_UPDATE,
    LAYER_SAVED,
    LOGITS_COPIES,
    NF4_BYTES,
    ONEDNN_CACHE_BYTES,
    ONEDNN_CACHE_CAPACITY,
    ONEDNN_CACHE_ENTRY_BYTES,
    ONEDNN_CACHE_VARYING_BYTES,
    QUANT_STATS_BYTES,
    RUNTIME_BYTES,
    advise,
    attention_path,
    format_bytes,
    parse_bytes,
    plan_memory,
)

BASE = dict(model_config="tiny", max_length=512, packing=True, per_device_train_batch_size=8)
BACKENDS = ("torch", "jax")


def plan(backend="torch", **kw):
    return plan_memory(TrainConfig.from_flat(**{**BASE, "backend": backend, **kw}))


def rows(p, skip=("not alive at once",)):
    return {r.component: r.bytes for r in p.rows if r.component not in skip}


@pytest.mark.parametrize("backend", BACKENDS)
def test_full_fine_tune_states_are_four_times_the_parameters(backend):
    """float32 master weights + float32 gradients + AdamW's two float32 moments: P x (1 + 1 + 2) x 4 bytes."""
    p = plan(backend)
    n = ModelConfig.preset("tiny").num_parameters()
    assert p.trainable_parameters == p.total_parameters == n
    assert p.get("weights (float32)") == p.get("gradients (float32)") == 4 * n
    assert p.get("optimizer state (AdamW)") == 8 * n


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_loss_removes_exactly_the_logits_term(backend):
    nll, fused = plan(backend, loss_type="nll"), plan(backend, loss_type="fused_linear")
    tokens, v, h = nll.tokens, 8192, 96
    assert nll.get("logits (loss kernel)") == LOGITS_COPIES[backend] * tokens * v * 4
    assert fused.get("logits (loss kernel)") == CHUNK_COPIES * 256 * v * 4 + tokens * h * 4
    others = lambda p: {k: b for k, b in rows(p).items() if k != "logits (loss kernel)"}  # noqa: E731
    assert others(nll) == others(fused)
    term = nll.get("logits (loss kernel)") - fused.get("logits (loss kernel)")
    # here the logits are the peak's largest term, so the whole saving is the logits term
    assert nll.total - fused.total == term > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("loss_type", ["nll", "fused_linear"])
def test_checkpointing_reduces_activations(backend, loss_type):
    off, on = plan(backend, loss_type=loss_type), plan(backend, loss_type=loss_type, gradient_checkpointing=True)
    assert on.get("activations (decoder layers)") < off.get("activations (decoder layers)")
    assert on.total < off.total
    for row in ("weights (float32)", "gradients (float32)", "optimizer state (AdamW)", "logits (loss kernel)"):
        assert on.get(row) == off.get(row)


@pytest.mark.parametrize("backend", BACKENDS)
def test_activations_grow_linearly_with_rows(backend):
    """Without a T x T term (sdpa on torch), doubling the rows doubles the decoder activations."""
    one, two = plan(backend, per_device_train_batch_size=4), plan(backend, per_device_train_batch_size=8)
    assert 2 * one.get("activations (decoder layers)") == two.get("activations (decoder layers)")
    assert two.tokens == 2 * one.tokens == 4096


def test_fsdp_divides_weights_gradients_and_optimizer():
    one, four = plan(), plan_memory(TrainConfig.from_flat(**BASE, fsdp=True), devices=4)
    for row in ("weights (float32)", "gradients (float32)", "optimizer state (AdamW)"):
        assert four.get(row) == pytest.approx(one.get(row) / 4, abs=1)
    for row in ACTIVATION_ROWS:
        assert four.get(row) == one.get(row)  # activations are per device
    assert four.get("FSDP all-gather buffers") > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("targets", [["all-linear"], ["q_proj", "v_proj"]])
def test_lora_trains_only_the_adapters(backend, targets):
    p = plan(backend, use_peft=True, lora_r=8, lora_alpha=16.0, lora_target_modules=targets, lora_dropout=0.0)
    count = trainable_parameter_count(ModelConfig.preset("tiny"),
                                      PeftConfig(use_peft=True, lora_r=8, lora_alpha=16.0, lora_target_modules=targets))
    assert p.trainable_parameters == count
    assert p.get("gradients (float32)") == 4 * count
    assert p.get("optimizer state (AdamW)") == 8 * count
    assert p.get("LoRA adapters (float32)") == 4 * count
    assert p.get("weights (float32)") == 4 * ModelConfig.preset("tiny").num_parameters()  # the frozen base
    assert p.total < plan(backend).total
    assert p.get("activations (decoder layers)") == plan(backend).get("activations (decoder layers)")


def test_lora_dropout_copies_the_adapted_inputs():
    """PEFT's dropout makes a new tensor (and a mask) per adapted linear: on a tiny model with a big batch that
    costs more than the states LoRA saves; the jax trainer applies no LoRA dropout."""
    no, yes = plan(use_peft=True, lora_dropout=0.0), plan(use_peft=True, lora_dropout=0.1)
    assert yes.get("LoRA activations") > no.get("LoRA activations")
    assert plan("jax", use_peft=True, lora_dropout=0.1).get("LoRA activations") == \
        plan("jax", use_peft=True, lora_dropout=0.0).get("LoRA activations")


@pytest.mark.parametrize("backend", BACKENDS)
def test_qlora_stores_decoder_linears_in_nf4_and_keeps_the_rest_float32(backend):
    cfg = ModelConfig.preset("tiny")
    shapes = parameter_shapes(cfg)
    linear = sum(a * b for n, (a, *rest) in shapes.items() if rest and n.split(".")[-2] in LINEAR_MODULES
                 for b in rest)
    p = plan(backend, use_peft=True, load_in_4bit=True)
    assert p.get("weights (NF4 + absmax)") == int(linear * (NF4_BYTES + QUANT_STATS_BYTES[backend]))
    assert p.get("weights (float32)") == 4 * (cfg.num_parameters() - linear)  # embeddings and norms
    on_gpu = lambda **kw: plan_memory(TrainConfig.from_flat(**{**BASE, "backend": backend, "use_peft": True, **kw}),  # noqa: E731
                                      device="cuda")
    assert on_gpu(load_in_4bit=True).total < on_gpu().total
    # one linear layer dequantised at a time, on both backends (jax: measured on CPU since the NF4 matmul ties
    # each dequantisation to its layer's input), so QLoRA's plan is below LoRA's on CPU too
    biggest = max(a * b for n, (a, *rest) in shapes.items() if rest and n.split(".")[-2] in LINEAR_MODULES
                  for b in rest)
    assert p.get("dequantised weight (transient)") == 4 * biggest
    assert p.total < plan(backend, use_peft=True).total


@pytest.mark.parametrize("backend", BACKENDS)
def test_8bit_adam_keeps_a_quarter_of_the_moments(backend):
    adam, bnb = plan(backend), plan(backend, optimizer="adamw_bnb_8bit")
    ratio = bnb.get("optimizer state (AdamW 8-bit)") / adam.get("optimizer state (AdamW)")
    assert 0.25 < ratio < 0.26  # 2 bytes + a float32 absmax per 256 instead of 8 bytes (norms stay 32-bit)
    with pytest.raises(ConfigError, match="adamw_bf16"):
        plan("jax", optimizer="adamw_bf16")


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_shrinks_activations_and_adds_weight_copies(backend):
    f32, bf16 = plan(backend), plan(backend, dtype="bfloat16")
    act = lambda p: p.get("activations (decoder layers)")  # noqa: E731
    if backend == "jax":  # the whole state is cast: every saved number is half the size
        assert 2 * act(bf16) == act(f32)
    else:  # autocast keeps the residual stream and norms float32
        assert act(f32) / 2 < act(bf16) < act(f32)
    assert bf16.get("bfloat16 weight copies") > 0
    assert bf16.get("weights (float32)") == f32.get("weights (float32)")  # master weights stay float32


def test_bfloat16_varlen_on_cpu_plans_the_capped_kernel_cache():
    """Padding-free ``varlen`` attention meets new shapes every step: its kernel-cache row is the bound of the cap
    ``twinseq.torch_backend`` sets (entries x bytes an entry), not the fixed-shape constant. Negative control: the
    same bfloat16 run on padded sdpa rows keeps the fixed-shape row."""
    flat = dict(model_config="small", per_device_train_batch_size=4, loss_type="fused_linear",
                gradient_checkpointing=True, optimizer="adamw_bf16")
    varlen = plan(**flat, padding_free=True, attn_implementation="varlen")
    sdpa = plan(**flat, attn_implementation="sdpa")
    assert ONEDNN_CACHE_VARYING_BYTES == ONEDNN_CACHE_CAPACITY * ONEDNN_CACHE_ENTRY_BYTES
    assert varlen.get("oneDNN kernel cache (CPU bfloat16)") == ONEDNN_CACHE_VARYING_BYTES
    assert sdpa.get("oneDNN kernel cache (CPU bfloat16)") == ONEDNN_CACHE_BYTES != ONEDNN_CACHE_VARYING_BYTES


def test_bfloat16_state_on_cpu_computes_in_bfloat16_plus_the_cpu_rows():
    """``adamw_bf16`` on CPU: bfloat16 activations as on CUDA, so the CPU plan differs from the CUDA plan only by the
    CPU rows (runtime, oneDNN kernel cache and, its peak being the optimizer step, the heap backward left); a float32
    run has no kernel cache, peaks in backward and differs by the runtime only (the negative control)."""
    small = dict(model_config="small", per_device_train_batch_size=4, loss_type="fused_linear",
                 gradient_checkpointing=True)
    config = TrainConfig.from_flat(**{**BASE, **small, "backend": "torch", "optimizer": "adamw_bf16"})
    cpu, cuda = plan_memory(config), plan_memory(config, device="cuda")
    assert cpu.get("activations (decoder layers)") == cuda.get("activations (decoder layers)") > 0
    assert cpu.get("oneDNN kernel cache (CPU bfloat16)") == ONEDNN_CACHE_BYTES
    assert cuda.get("oneDNN kernel cache (CPU bfloat16)") == 0
    assert "optimizer step" in next(r.note for r in cpu.rows if r.component == "not alive at once")
    # (CUDA's peak is the update's or, a little above it, backward's: the same bytes on both devices)
    cpu_only = RUNTIME_BYTES[("torch", "cpu")] + ONEDNN_CACHE_BYTES
    assert cpu_only < cpu.total - cuda.total <= cpu_only + HEAP_RETAINED_AT_UPDATE
    f32 = TrainConfig.from_flat(**{**BASE, **small, "backend": "torch"})
    f32_cpu, f32_cuda = plan_memory(f32), plan_memory(f32, device="cuda")
    assert f32_cpu.get("oneDNN kernel cache (CPU bfloat16)") == 0
    assert "backward" in next(r.note for r in f32_cpu.rows if r.component == "not alive at once")
    assert f32_cpu.total - f32_cuda.total == RUNTIME_BYTES[("torch", "cpu")]
    # the float32 activations are twice the bfloat16 state's
    assert f32_cpu.get("activations (decoder layers)") == 2 * cpu.get("activations (decoder layers)")


def test_eager_attention_materialises_scores_sdpa_does_not():
    sdpa, eager = plan(attn_implementation="sdpa"), plan(attn_implementation="eager")
    assert sdpa.get("attention scores") == 0
    assert eager.get("attention scores") == 8 * 4 * 512 * 512 * 4 * 2  # B x heads x T x T float32, 2 layers
    assert plan("jax").get("attention scores") > 0  # T=512 fits one block: jax's dense path (no mesh) does


def attention_term(p):
    """What the plan charges for attention: the scores (dense) or tiles + log-sum-exp (blocked), and the mask."""
    return p.get("attention scores") + p.get("attention mask")


@pytest.mark.parametrize("backend,blocked_kw,dense_kw", [
    ("jax", dict(attn_implementation="sdpa"), dict(attn_implementation="eager")),  # eager: dense at every T
    ("torch", dict(device="cpu"), dict(device="cuda")),  # sdpa's dense mask on CUDA, the blocked kernel on CPU
])
def test_blocked_attention_grows_linearly_in_t_dense_quadratically(backend, blocked_kw, dense_kw):
    """Past the switch-over, doubling the row length T -> 2T -> 4T: the blocked term's increments double
    (affine in T: a fixed block pair of tiles plus a per-token log-sum-exp), the dense term's quadruple."""
    def term(t, kw):
        config = TrainConfig.from_flat(**{**BASE, "backend": backend, "max_length": t,
                                          "per_device_train_batch_size": 1,
                                          "attn_implementation": kw.get("attn_implementation", "sdpa")})
        p = plan_memory(config, device=kw.get("device", "cpu"))
        return attention_term(p), p
    lengths = (BLOCKED_MIN_SEQ_LEN, 2 * BLOCKED_MIN_SEQ_LEN, 4 * BLOCKED_MIN_SEQ_LEN)
    for t in lengths:
        assert attention_path(backend, blocked_kw.get("attn_implementation", "sdpa"), t,
                              blocked_kw.get("device", "cpu")) == "blocked"
    (b1, p1), (b2, _), (b4, _) = (term(t, blocked_kw) for t in lengths)
    (d1, _), (d2, _), (d4, _) = (term(t, dense_kw) for t in lengths)
    assert p1.get("attention mask") == 0  # no T x T mask on the blocked path
    assert 0 < b2 - b1 and b4 - b2 == 2 * (b2 - b1)
    assert 0 < d2 - d1 and abs((d4 - d2) - 4 * (d2 - d1)) <= 4  # bytes: torch's fitted mask share is int()-ed
    assert b1 < d1


@pytest.mark.parametrize("block", [DEFAULT_ATTENTION_BLOCK_SIZE, 256])
def test_jax_switches_to_blocked_past_one_block(block):
    """jax's ``BlockedAttention``: rows that fit one block (T <= attention_block_size) take the dense path,
    T x T scores and mask; one pad multiple (64) more and the plan is the block pair's tiles, no mask."""
    def at(t):
        return plan("jax", max_length=t, per_device_train_batch_size=1, attention_block_size=block)
    dense, blocked = at(block), at(block + 64)
    assert dense.row_length == block and blocked.row_length == block + 64
    assert dense.get("attention mask") == block * block  # bool [B, T, T]
    assert dense.get("attention scores") == LAYER_SAVED["jax"].scores * 4 * block * block * 4 * 2  # 2 layers
    assert blocked.get("attention mask") == 0
    heads, layers, padded = 4, 2, 2 * block
    assert blocked.get("attention scores") == BLOCKED_TILES * heads * block * block * 4 + layers * heads * padded * 4
    # eager never switches
    assert plan("jax", max_length=block + 64, per_device_train_batch_size=1, attention_block_size=block,
                attn_implementation="eager").get("attention mask") == (block + 64) ** 2


def test_torch_switches_to_blocked_from_blocked_min_seq_len():
    """torch: ``sdpa``/``eager`` on CPU run ``twinseq_blocked`` from ``BLOCKED_MIN_SEQ_LEN`` tokens on, with the
    default block; one token shorter keeps the dense float mask; varlen never plans a T x T tensor."""
    for attn in ("sdpa", "eager"):
        short = plan(max_length=BLOCKED_MIN_SEQ_LEN - 1, per_device_train_batch_size=1, attn_implementation=attn)
        long = plan(max_length=BLOCKED_MIN_SEQ_LEN, per_device_train_batch_size=1, attn_implementation=attn)
        assert short.get("attention mask") > 4 * (BLOCKED_MIN_SEQ_LEN - 1) ** 2  # + the fitted per-layer share
        assert long.get("attention mask") == 0
        tile = 4 * DEFAULT_ATTENTION_BLOCK_SIZE ** 2 * 4  # B=1 x heads x block x block float32
        assert long.get("attention scores") == BLOCKED_TILES * tile + 2 * 4 * BLOCKED_MIN_SEQ_LEN * 4
        assert long.total < short.total
    varlen = plan(max_length=BLOCKED_MIN_SEQ_LEN, per_device_train_batch_size=1, attn_implementation="varlen")
    assert attention_term(varlen) == 0


def test_offloading_saves_on_cuda_only():
    base = plan()
    assert plan(activation_offloading=True).total == base.total
    assert any("offloading" in n for n in plan(activation_offloading=True).notes)
    on_gpu = plan_memory(TrainConfig.from_flat(**BASE, activation_offloading=True), device="cuda")
    assert on_gpu.get("activations (decoder layers)") <= base.get("activations (decoder layers)")


def test_dpo_doubles_tokens_and_keeps_a_reference():
    dpo = plan_memory(TrainConfig.from_flat(model_config="tiny", task="dpo", max_length=256,
                                            per_device_train_batch_size=4, share_prefix=False))
    assert dpo.tokens == 2 * 4 * 256
    assert dpo.get("reference model (DPO)") == 4 * dpo.total_parameters
    pre = plan_memory(TrainConfig.from_flat(model_config="tiny", task="dpo", max_length=256,
                                            per_device_train_batch_size=4, precompute_ref_log_probs=True))
    assert pre.get("reference model (DPO)") == 0


@pytest.mark.parametrize("padding_free", [False, True])
def test_prefix_sharing_writes_each_prompt_once(padding_free):
    """DPO: P - 1 + 2 (C + 1) tokens a pair instead of 2 (P + C); GRPO: P - 1 + G (C + 1) a group instead of
    G (P + C) (the planner's unshared GRPO row is max_length long); off with --no-share-prefix or under CP. The
    planned row is the longest the data may hold: DPO without max_completion_length, a one-token prompt's completions
    fill max_length each (2 x max_length, no saving)."""
    def plan(task, **kw):
        return plan_memory(TrainConfig.from_flat(model_config="tiny", task=task, max_length=640, max_prompt_length=512,
                                                 per_device_train_batch_size=16, padding_free=padding_free, **kw))

    assert plan("dpo", max_completion_length=128).tokens == 16 * (511 + 2 * 129)
    assert plan("dpo", max_completion_length=64).tokens == 16 * (511 + 2 * 65)  # P stays the longest prompt
    assert plan("dpo").tokens == 16 * 2 * 640  # the shortest prompt leaves max_length to each completion
    assert plan("dpo", share_prefix=False).tokens == 16 * 2 * 640
    grpo = dict(num_generations=8, max_completion_length=64)
    assert plan("grpo", **grpo).tokens == 2 * (511 + 8 * 65)
    assert plan("grpo", share_prefix=False, **grpo).tokens == 16 * 640
    assert plan("grpo", **grpo).activations < plan("grpo", share_prefix=False, **grpo).activations / 4
    assert plan("sft").tokens == 16 * 640  # negative control: one completion per prompt, nothing to share


def test_the_rows_add_up_to_the_total_and_print():
    p = plan()
    assert sum(r.bytes for r in p.rows) == p.total
    text = p.table()
    assert "logits (loss kernel)" in text and format_bytes(p.total) in text


def test_parse_bytes():
    assert parse_bytes("24GiB") == 24 * 2 ** 30
    assert parse_bytes("1.5 GB") == 1_500_000_000
    assert parse_bytes("512mib") == 512 * 2 ** 20
    for bad in ("24 GB?", "", "GiB", "-3GB", "0", "12 parsecs"):
        with pytest.raises(ConfigError, match="not a memory size"):
            parse_bytes(bad)


def test_advice_fits_and_prefers_free_knobs():
    cfg = TrainConfig.from_flat(**BASE)
    full = plan_memory(cfg)
    fused = plan(loss_type="fused_linear")
    advice = advise(cfg, (full.total + fused.total) // 2)
    assert advice.plan.total <= advice.budget
    assert advice.knobs == ["loss_type=fused_linear"] and advice.flags == ["--loss-type", "fused_linear"]
    assert advise(cfg, full.total).changes == {}  # fits as is


def test_advice_keeps_the_effective_batch():
    """Every other knob already on: only a smaller micro-batch (with more accumulation) can fit."""
    cfg = TrainConfig.from_flat(**{**BASE, "model_config": "small", "max_length": 2048, "loss_type": "fused_linear",
                                   "gradient_checkpointing": True, "use_peft": True, "load_in_4bit": True,
                                   "padding_free": True, "attn_implementation": "varlen",
                                   "optimizer": "adamw_bnb_8bit"})
    advice = advise(cfg, plan_memory(cfg.replace(per_device_train_batch_size=2, gradient_accumulation_steps=4)).total)
    d = advice.plan
    assert advice.knobs == ["micro_batch=2x4"], advice.knobs
    new = cfg.replace(**advice.changes)
    assert (new.data.per_device_train_batch_size * new.data.gradient_accumulation_steps
            == cfg.data.per_device_train_batch_size * cfg.data.gradient_accumulation_steps)
    assert d.total <= advice.budget


def test_budget_below_the_minimum_names_the_minimum():
    with pytest.raises(ConfigError, match=r"smallest this run can plan to: [0-9.]+ MiB"):
        advise(TrainConfig.from_flat(**BASE), "1MiB")


def test_max_length_none_is_refused():
    with pytest.raises(ConfigError, match="max_length"):
        plan_memory(TrainConfig.from_flat(model_config="tiny", max_length=None))


# --------------------------------------------------------------------------------------
# twinseq memory
# --------------------------------------------------------------------------------------


def test_cli_prints_the_table_and_the_flags_to_add(capsys):
    from twinseq.common.cli import main

    argv = ["memory", "--model-config", "tiny", "--max-length", "512", "--packing", "--per-device-train-batch-size",
            "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "logits (loss kernel)" in out and "total" in out
    budget = (plan().total + plan(loss_type="fused_linear").total) // 2
    assert main(argv + ["--budget", str(budget)]) == 0
    out = capsys.readouterr().out
    assert "does not fit" in out and "add: --loss-type fused_linear" in out


def test_cli_plans_fsdp_and_bfloat16(capsys):
    from twinseq.common.cli import main

    assert main(["memory", "--model-config", "tiny", "--dtype", "bfloat16", "--devices", "4", "--device", "cuda"]) == 0
    out = capsys.readouterr().out
    assert "bfloat16 weight copies" in out and "FSDP all-gather buffers" in out and "4 device(s)" in out


@pytest.mark.parametrize("argv, message", [
    (["--budget", "24 GB?"], "--budget='24 GB?' is not a memory size"),
    (["--budget", "1MiB"], "smallest this run can plan to"),
    (["--devices", "zero"], "--devices 'zero' is not a positive integer"),
    (["--device", "tpu"], "--device 'tpu' is not planned"),
])
def test_cli_bad_input_is_one_clear_line(capsys, argv, message):
    from twinseq.common.cli import main

    assert main(["memory", "--model-config", "tiny", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_advice_offers_the_training_state_rungs_on_torch_only():
    """A full fine-tune whose activations are already small: the state is what is left to shrink. Just below the
    plan, the cheapest fitting knob is optimizer_in_backward (one gradient at a time), with the clipping it needs off;
    far lower, the bfloat16 8-bit state joins it; jax is never offered either."""
    kw = dict(BASE, model_config="small", max_length=128, per_device_train_batch_size=1, loss_type="fused_linear",
              gradient_checkpointing=True, padding_free=True, attn_implementation="varlen")
    cfg = TrainConfig.from_flat(**kw)
    full = plan_memory(cfg, device="cuda")
    advice = advise(cfg, full.total - 1, device="cuda")
    assert advice.knobs == ["optimizer_in_backward"], advice.knobs
    assert advice.flags == ["--optimizer-in-backward", "--max-grad-norm", "None"]
    state = plan_memory(cfg.replace(optimizer="adamw_bf16_8bit", optimizer_in_backward=True, max_grad_norm=None),
                        device="cuda")
    deep = advise(cfg, state.total, device="cuda")
    assert deep.plan.total <= state.total and deep.changes, deep.knobs
    assert "use_peft" in deep.changes or deep.changes.get("optimizer") == "adamw_bf16_8bit", deep.knobs
    jax = advise(TrainConfig.from_flat(**{**kw, "backend": "jax"}), full.total // 2)
    assert "optimizer_in_backward" not in jax.knobs and jax.changes.get("optimizer") in (None, "adamw_bnb_8bit")
    # and the planner refuses what the trainer refuses
    with pytest.raises(ConfigError, match="drop --use-peft"):
        plan_memory(cfg.replace(optimizer="adamw_bf16_8bit", use_peft=True))
    with pytest.raises(ConfigError, match="--max-grad-norm None"):
        plan_memory(cfg.replace(optimizer_in_backward=True))
