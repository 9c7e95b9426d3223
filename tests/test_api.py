"""The Python front door: ``SFTTrainer`` / ``DPOTrainer`` / ``GRPOTrainer`` in TRL's shape, on both backends.

The README's script runs as a user runs it (a file, a fresh python); the rest drives the classes in process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from twinseq import (
    DPOConfig,
    DPOTrainer,
    GRPOConfig,
    GRPOTrainer,
    KTOConfig,
    KTOTrainer,
    RLOOConfig,
    RLOOTrainer,
    SFTConfig,
    SFTTrainer,
    TrainerCallback,
)
from twinseq.common.api import peft_fields
from twinseq.common.errors import CheckpointError, ConfigError, ConfigTypeError, DataTypeError

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ["torch", "jax"]

SFT_SCRIPT = """\
from datasets import Dataset
from peft import LoraConfig
from twinseq import SFTConfig, SFTTrainer

rows = [{"text": f"{n} plus one is {n + 1}."} for n in range(200)]
train, held_out = Dataset.from_list(rows[:160]), Dataset.from_list(rows[160:])
args = SFTConfig(output_dir="out", max_steps=24, max_length=64, learning_rate=3e-3, eval_strategy="steps",
                 eval_steps=8, per_device_train_batch_size=8)
trainer = SFTTrainer(model="tiny", args=args, train_dataset=train, eval_dataset=held_out,
                     peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear"), backend=BACKEND)
print(trainer.train())
"""


def _rows(n: int = 48) -> list[dict]:
    return [{"text": f"The number {i} is {'even' if i % 2 == 0 else 'odd'}."} for i in range(n)]


def _args(cls, tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), max_steps=3, max_length=64, per_device_train_batch_size=4,
                learning_rate=1e-3, disable_tqdm=True)
    return cls(**{**base, **kw})


def _metrics(path) -> list[dict]:
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_readme_sft_script_trains_lora_and_eval_loss_falls(backend, tmp_path):
    script = SFT_SCRIPT.replace("BACKEND", repr(backend))
    assert len(script.strip().splitlines()) <= 12
    readme = (REPO / "README.md").read_text()
    assert SFT_SCRIPT.replace("BACKEND", '"jax"') in readme, "the README shows this script"
    (tmp_path / "train.py").write_text(script)
    proc = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "TrainOutput(global_step=24" in proc.stdout
    evals = [r["eval_loss"] for r in _metrics(tmp_path / "out/metrics.jsonl") if "eval_loss" in r]
    assert len(evals) >= 3 and evals[-1] < evals[0], evals
    assert (tmp_path / "out/final/adapter_config.json").is_file()


@pytest.mark.parametrize("backend", BACKENDS)
def test_sft_trainer_takes_a_dataset_and_a_lora_config(backend, tmp_path):
    from datasets import Dataset
    from peft import LoraConfig

    trainer = SFTTrainer(model="tiny", args=_args(SFTConfig, tmp_path), train_dataset=Dataset.from_list(_rows()),
                         peft_config=LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
                         backend=backend)
    assert trainer.args.peft.use_peft and trainer.args.peft.lora_r == 4
    assert trainer.args.data.dataset_name == "<Dataset: 48 rows>"
    out = trainer.train()
    lines = _metrics(trainer.metrics_path)
    assert out.global_step == 3 == lines[-1]["step"]
    assert out.training_loss == pytest.approx(sum(r["loss"] for r in lines) / 3)
    assert trainer.model is not None
    saved = trainer.save_model(str(tmp_path / "export"))
    config = json.loads((saved / "adapter_config.json").read_text())
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]


def test_evaluate_after_training_is_the_last_evaluation(tmp_path):
    """``trainer.evaluate()`` on the trained model gives what the run's last evaluation logged (same weights, same
    eval set); before ``train()`` it is refused."""
    rows = _rows(64)
    args = _args(SFTConfig, tmp_path, max_steps=4, eval_strategy="steps", eval_steps=4)
    trainer = SFTTrainer(args=args, train_dataset=rows[:48], eval_dataset=rows[48:])
    with pytest.raises(ConfigError, match=r"evaluate\(\) needs a trained model; call train\(\) first"):
        trainer.evaluate()
    trainer.train()
    logged = [r for r in _metrics(trainer.metrics_path) if "eval_loss" in r][-1]
    again = trainer.evaluate()
    assert again["eval_loss"] == pytest.approx(logged["eval_loss"], rel=1e-6)
    assert 0 <= again["eval_mean_token_accuracy"] <= 1


def test_dpo_trainer_on_rows_in_memory(tmp_path):
    rows = [{"prompt": f"Q{i}: is {i} even?", "chosen": " yes" if i % 2 == 0 else " no",
             "rejected": " no" if i % 2 == 0 else " yes"} for i in range(32)]
    trainer = DPOTrainer(model="tiny", args=_args(DPOConfig, tmp_path), train_dataset=rows)
    out = trainer.train()
    assert out.global_step == 3 and "rewards/accuracies" in _metrics(trainer.metrics_path)[-1]


@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_kto_trainer_on_unpaired_rows_in_memory_evaluates(backend, tmp_path):
    """Before the first update the policy is its reference: every row's loss is 1 - σ(0) = 0.5 and the KL estimate
    is 0, so the eval loss on start is 0.5 exactly (to float32 rounding); after training it has moved."""
    rows = [{"prompt": f"Q{i}: is {i} even?", "completion": " yes" if i % 3 else " no", "label": i % 3 != 0}
            for i in range(40)]
    args = _args(KTOConfig, tmp_path, eval_fraction=0.2, eval_strategy="steps", eval_steps=3, eval_on_start=True)
    trainer = KTOTrainer(model="tiny", args=args, train_dataset=rows, backend=backend)
    out = trainer.train()
    lines = _metrics(trainer.metrics_path)
    train, evals = [r for r in lines if "loss" in r], [r for r in lines if "eval_loss" in r]
    assert out.global_step == 3 and {"kl", "rewards/chosen", "count/desirable"} <= set(train[-1])
    assert [r["step"] for r in evals] == [0, 3]
    assert evals[0]["eval_loss"] == pytest.approx(0.5, abs=1e-6) and evals[0]["eval_kl"] == 0.0
    assert evals[1]["eval_loss"] != pytest.approx(0.5, abs=1e-4) and "eval_rewards/margins" in evals[1]


# fast-tier budget: the jax case runs in make test-all and CI
@pytest.mark.parametrize("backend", ["torch", pytest.param("jax", marks=pytest.mark.slow)])
def test_grpo_trainer_with_a_python_reward_function(backend, tmp_path):
    calls = []

    def short_is_good(prompts, completions, **columns):
        calls.append((len(prompts), sorted(columns)))
        return [1.0 / (1 + len(c)) for c in completions]

    rows = [{"prompt": f"Say a number after {i}:", "answer": str(i + 1)} for i in range(16)]
    args = _args(GRPOConfig, tmp_path, max_steps=2, num_generations=2, max_completion_length=8)
    trainer = GRPOTrainer(model="tiny", reward_funcs=short_is_good, args=args, train_dataset=rows, backend=backend)
    out = trainer.train()
    assert out.global_step == 2
    assert calls and calls[0][0] == 4 and "answer" in calls[0][1]  # TRL's signature: extra columns as keywords
    assert "reward" in _metrics(trainer.metrics_path)[-1]


def test_rloo_trainer_with_a_python_reward_function_and_the_kl_penalty(tmp_path):
    def short_is_good(prompts, completions, **columns):
        return [1.0 / (1 + len(c)) for c in completions]

    rows = [{"prompt": f"Say a number after {i}:", "answer": str(i + 1)} for i in range(16)]
    args = _args(RLOOConfig, tmp_path, max_steps=2, num_generations=2, max_completion_length=8, rloo_beta=0.1)
    assert args.task == "rloo" and args.rloo.rloo_beta == 0.1
    trainer = RLOOTrainer(model="tiny", reward_funcs=short_is_good, args=args, train_dataset=rows)
    assert trainer.train().global_step == 2
    last = _metrics(trainer.metrics_path)[-1]
    assert "reward" in last and last["kl"] > 0  # the second step's policy has moved from its reference
    with pytest.raises(ConfigError, match="task='rloo'"):
        RLOOConfig(task="grpo")


def test_a_transformers_model_object_trains_in_place(tmp_path):
    from transformers import AutoModelForCausalLM

    from twinseq.common.config import ModelConfig
    from twinseq.common.models.init import init_weights
    from twinseq.torch_backend.checkpoint import save_pretrained
    from twinseq.torch_backend.model import build_model

    cfg = ModelConfig.preset("tiny")
    save_pretrained(build_model(cfg, init_weights(cfg, seed=3)), tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    before = model.model.norm.weight.detach().clone()
    trainer = SFTTrainer(model=model, args=_args(SFTConfig, tmp_path), train_dataset=_rows())
    assert trainer.args.model.model_config == str(tmp_path / "model")  # its own folder describes the run
    trainer.train()
    assert trainer.model is model and not bool((model.model.norm.weight == before).all())

    built = build_model(cfg, init_weights(cfg, seed=4))  # no folder of its own: written once beside the run
    trainer = SFTTrainer(model=built, args=_args(SFTConfig, tmp_path / "b"), train_dataset=_rows())
    assert Path(trainer.args.model.model_config) == tmp_path / "b/out/base_model"
    with pytest.raises(ConfigError, match="backend='torch'"):
        SFTTrainer(model=built, args=_args(SFTConfig, tmp_path / "c"), backend="jax")


def test_callbacks_see_each_step_and_can_stop_the_run(tmp_path):
    class Recorder(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_step_end(self, args, state, control, **kw):
            self.events.append(("step", state.global_step))
            control.should_training_stop = state.global_step == 2

        def on_log(self, args, state, control, logs=None, **kw):
            self.events.append(("log", logs["step"]))

    recorder = Recorder()
    trainer = SFTTrainer(args=_args(SFTConfig, tmp_path, max_steps=5), train_dataset=_rows(), callbacks=[recorder])
    out = trainer.train()
    assert out.global_step == 2
    assert recorder.events == [("log", 1), ("step", 1), ("log", 2), ("step", 2)]
    assert (tmp_path / "out/checkpoint-2").is_dir() and (tmp_path / "out/final").is_dir()


def test_processing_class_tokenises_as_the_run_would(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from twinseq.common.data.prepare import run_tokenizer
    from twinseq.common.data.tokenizer import embedded_tokenizer_dir, load_tokenizer

    folder = embedded_tokenizer_dir()
    hf = PreTrainedTokenizerFast.from_pretrained(str(folder))
    ours = run_tokenizer(SFTConfig(), hf)
    embedded = load_tokenizer("embedded")
    text = "The number 12 is even."
    assert ours.encode(text) == embedded.encode(text)
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (
        embedded.bos_token_id, embedded.eos_token_id, embedded.pad_token_id)
    with pytest.raises(DataTypeError, match="processing_class=dict"):
        run_tokenizer(SFTConfig(), {"not": "a tokenizer"})


def test_datasets_of_every_kind(tmp_path):
    from datasets import Dataset, DatasetDict, IterableDataset

    from twinseq.common.data.loading import resolve_dataset

    rows = _rows(5)
    assert len(resolve_dataset(rows, "train_dataset")) == 5
    assert len(resolve_dataset({"text": [r["text"] for r in rows]}, "train_dataset")) == 5
    assert len(resolve_dataset(IterableDataset.from_generator(lambda: iter(rows)), "train_dataset")) == 5
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert len(resolve_dataset(str(path), "train_dataset")) == 5
    with pytest.raises(DataTypeError, match=r"splits \['test', 'train'\].*dataset\['test'\]"):
        resolve_dataset(DatasetDict(train=Dataset.from_list(rows), test=Dataset.from_list(rows)), "train_dataset")


def test_a_lora_config_is_translated_or_refused_by_field():
    from peft import LoraConfig

    fields = peft_fields(LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, use_dora=True, task_type="CAUSAL_LM"))
    assert fields == {"use_peft": True, "lora_r": 8, "lora_alpha": 16, "lora_dropout": 0.1,
                      "lora_target_modules": ["q_proj", "v_proj"], "use_rslora": False, "use_dora": True}
    with pytest.raises(ConfigError, match=r"modules_to_save=\['lm_head'\].*drop it"):
        peft_fields(LoraConfig(modules_to_save=["lm_head"]))
    with pytest.raises(ConfigError, match="bias='all'"):
        peft_fields(LoraConfig(bias="all"))
    with pytest.raises(ConfigError, match="regular expression"):
        peft_fields(LoraConfig(target_modules=r".*proj"))
    with pytest.raises(ConfigTypeError, match="peft_config=dict"):
        peft_fields({"r": 8})


def test_config_classes_fix_their_task():
    assert SFTConfig().task == "sft" and DPOConfig(beta=0.2).dpo.beta == 0.2 and GRPOConfig().task == "grpo"
    assert isinstance(SFTConfig(max_length=128).replace(max_steps=7), SFTConfig)
    with pytest.raises(ConfigError, match=r"SFTConfig\(task='dpo'\)"):
        SFTConfig(task="dpo")
    with pytest.raises(ConfigError, match="args.task='dpo' does not fit SFTTrainer"):
        SFTTrainer(args=DPOConfig())
    with pytest.raises(ConfigError, match="max_lenght.*did you mean 'max_length'"):
        SFTConfig(max_lenght=12)


def test_a_hub_id_resolves_from_the_local_cache_only(tmp_path, monkeypatch):
    from twinseq.common.config import ModelConfig
    from twinseq.common.models.hf_folder import resolve_model_source, write_hf_checkpoint
    from twinseq.common.models.init import init_weights

    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    repo = cache / "models--acme--tiny-llama"
    snapshot = repo / "snapshots" / ("a" * 40)
    cfg = ModelConfig.preset("tiny")
    write_hf_checkpoint(cfg, init_weights(cfg, seed=0), snapshot)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs/main").write_text("a" * 40)
    source = resolve_model_source("acme/tiny-llama")
    assert source.weights_folder == snapshot and source.config == cfg
    with pytest.raises(CheckpointError, match=r"'acme/missing' is not a preset or a local folder.*hf download acme/mi"):
        resolve_model_source("acme/missing")


def test_the_cli_is_the_same_classes(tmp_path, monkeypatch):
    """``twinseq train`` builds the config and hands it to the task's trainer class (one path, the same checks)."""
    from twinseq.common import cli
    from twinseq.common.api import TRAINERS

    seen = []

    def train(self, resume_from_checkpoint=None):
        seen.append((type(self).__name__, self.args.task, self.args.max_steps))
        self.metrics_path = tmp_path / "metrics.jsonl"

    monkeypatch.setattr(DPOTrainer, "train", train)
    assert cli.main(["train", "--task", "dpo", "--max-steps", "4", "--output-dir", str(tmp_path / "o")]) == 0
    assert seen == [("DPOTrainer", "dpo", 4)]
    assert TRAINERS == {"sft": SFTTrainer, "dpo": DPOTrainer, "grpo": GRPOTrainer, "rloo": RLOOTrainer,
                        "kto": KTOTrainer}
