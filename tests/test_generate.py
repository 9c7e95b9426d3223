"""``twinseq generate`` and ``twinseq chat`` (issue 26, item 5), run the way users run them: a fresh
``python -m twinseq.common.cli`` process per call.

Invariants:
- it answers from a model folder and from a PEFT adapter folder (``base_model_name_or_path``, or the folder's own
  ``base/`` once the base path is gone), on both backends, one stdout line per prompt;
- greedy decoding of the same folder gives the same tokens on torch and jax. The folders of the fast tests hold
  random ``tiny-qwen3`` weights (untied, so greedy decoding wanders over the vocabulary instead of repeating the last
  token): 16 varied tokens must agree, which a float-level disagreement between the backends would break;
- the adapters are applied as PEFT applies them: the torch CLI's merged completion equals the completion of
  ``peft.PeftModel.from_pretrained`` on the base;
- ``--chat`` renders the tokenizer's chat template with the generation prompt; ``--no-chat`` starts from
  ``[bos] + text``; ``chat`` carries the conversation on, one reply per stdin line;
- a user error is one line on stderr and exit status 2;
- slow: folders trained by ``twinseq train`` (a full run on torch, a ``--use-peft`` run on jax) answer on both
  backends, identically.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from twinseq.common.data.corpus import load_embedded
from twinseq.common.data.tokenizer import load_tokenizer
from twinseq.common.errors import CheckpointError, ConfigError
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.hf_folder import write_hf_checkpoint
from twinseq.common.models.init import init_weights
from twinseq.common.models.peft import PeftConfig, init_adapters, save_adapters
from twinseq.common.run.generate import check_sampling, escape_line, resolve_model_folder

BACKENDS = ("torch", "jax")
PROMPTS = ("How do I read a file?", "def add(a, b):")
NEW_TOKENS = 16


def cli(*args: str, stdin: str | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "twinseq.common.cli", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, "HF_HUB_DISABLE_PROGRESS_BARS": "1"})


_RUNS: dict[tuple, list[dict]] = {}  # each distinct call runs once per session: a call is a fresh process


def generate_json(model: Path, backend: str, *extra: str, prompts=PROMPTS) -> list[dict]:
    key = (str(model), backend, extra, tuple(prompts))
    if key not in _RUNS:
        args = ["generate", "--model", str(model), "--backend", backend, "--max-new-tokens", str(NEW_TOKENS), "--json"]
        proc = cli(*args, *[a for p in prompts for a in ("--prompt", p)], *extra)
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = proc.stdout.splitlines()
        assert len(lines) == len(prompts), proc.stdout
        _RUNS[key] = [json.loads(line) for line in lines]
    return _RUNS[key]


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, Path]:
    """A model folder and an adapter folder on it (random tiny-qwen3 weights, non-zero LoRA B), both with the
    embedded tokenizer, as a run's ``final/`` holds them."""
    root = tmp_path_factory.mktemp("generate")
    cfg = ModelConfig.preset("tiny-qwen3")
    tok = load_tokenizer("embedded")
    model = write_hf_checkpoint(cfg, init_weights(cfg, seed=3), root / "model")
    tok.save_pretrained(model)
    peft = PeftConfig(use_peft=True, lora_r=4, lora_alpha=8.0)
    adapters = save_adapters(root / "adapters", cfg, peft, init_adapters(cfg, peft, seed=1, lora_b_std=0.5),
                             base_model_name_or_path=str(model))
    tok.save_pretrained(adapters)
    return {"model": model, "adapters": adapters}


@pytest.mark.parametrize("kind", ["model", pytest.param("adapters", marks=pytest.mark.slow)])  # budget
def test_generate_answers_on_both_backends_with_the_same_greedy_tokens(folders, kind):
    out = {backend: generate_json(folders[kind], backend) for backend in BACKENDS}
    for torch_row, jax_row, prompt in zip(out["torch"], out["jax"], PROMPTS):
        assert torch_row["prompt"] == prompt
        assert torch_row["completion_ids"] == jax_row["completion_ids"], (kind, prompt)
        assert torch_row["completion"] == jax_row["completion"]
        ids = torch_row["completion_ids"]
        assert 1 <= len(ids) <= NEW_TOKENS and torch_row["finish_reason"] in ("eos", "length")
        assert len(ids) < NEW_TOKENS or len(set(ids)) > 4, f"a degenerate completion makes a weak parity check: {ids}"


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_the_adapters_change_the_completion_as_peft_applies_them(folders):
    """The CLI folds the adapters into the base in numpy; PEFT's own loader, generating through its LoRA layers,
    must give the same greedy tokens (and they differ from the base's)."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    from twinseq.torch_backend.generation import generate

    base_out = generate_json(folders["model"], "torch")
    cli_out = generate_json(folders["adapters"], "torch")
    assert [r["completion_ids"] for r in base_out] != [r["completion_ids"] for r in cli_out]

    tok = load_tokenizer(str(folders["adapters"]))
    base = AutoModelForCausalLM.from_pretrained(str(folders["model"]), local_files_only=True)
    model = peft.PeftModel.from_pretrained(base, str(folders["adapters"]))
    for prompt, row in zip(PROMPTS, cli_out):
        ids = tok.encode(tok.render_prompt([{"role": "user", "content": prompt}]))
        ref = generate(model, [ids], max_completion_length=NEW_TOKENS, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, greedy=True).completion_ids[0].tolist()
        assert ref[: len(row["completion_ids"])] == row["completion_ids"]


def test_the_default_output_is_one_line_per_prompt(folders):
    """Without --json: each completion on its own line, its newlines escaped (``escape_line``)."""
    tok = load_tokenizer("embedded")
    proc = cli("generate", "--model", str(folders["model"]), "--max-new-tokens", str(NEW_TOKENS),
               *[a for p in PROMPTS for a in ("--prompt", p)], "--backend", "jax")
    assert proc.returncode == 0, proc.stderr[-3000:]
    expected = [escape_line(tok.decode(r["completion_ids"], skip_special_tokens=True))
                for r in generate_json(folders["model"], "jax")]
    assert proc.stdout.splitlines() == expected


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_plain_text_prompts_are_not_wrapped_by_the_chat_template(folders):
    chat = generate_json(folders["model"], "jax")
    plain = generate_json(folders["model"], "jax", "--no-chat")
    assert [r["completion_ids"] for r in chat] != [r["completion_ids"] for r in plain]


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_chat_replies_to_each_stdin_line_and_carries_the_conversation_on(folders):
    args = ("chat", "--model", str(folders["model"]), "--backend", "jax", "--max-new-tokens", str(NEW_TOKENS))
    proc = cli(*args, "--json", stdin=f"{PROMPTS[0]}\n\n{PROMPTS[1]}\n")
    assert proc.returncode == 0, proc.stderr[-3000:]
    replies = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["prompt"] for r in replies] == list(PROMPTS)  # the empty line is skipped
    alone = generate_json(folders["model"], "jax")
    assert replies[0] == alone[0]  # the first turn is the prompt alone
    assert replies[1]["completion_ids"] != alone[1]["completion_ids"]  # the second one follows the first turn


@pytest.mark.slow
def test_sampling_is_seeded(folders):
    for backend in BACKENDS:
        once = generate_json(folders["model"], backend, "--temperature", "1.0", "--seed", "7")
        again = generate_json(folders["model"], backend, "--seed", "7", "--temperature", "1.0")
        assert once == again
        assert once != generate_json(folders["model"], backend)


@pytest.mark.parametrize("args, fragment", [
    (["--model", "{root}/missing", "--prompt", "x"], "is not a folder"),
    (["--model", "{root}", "--prompt", "x"], "neither config.json"),
    (["--model", "{model}"], "--prompt"),
    (["--model", "{model}", "--prompt", "x", "--temperature", "-1"], "--temperature -1.0"),
    (["--model", "{model}", "--prompt", "x", "--backend", "tf"], "--backend"),
    (["--model", "{model}", "--prompt", "x", "--max-new-tokens", "0"], "--max-new-tokens 0"),
])
def test_user_errors_are_one_line_and_exit_2(folders, args, fragment, capsys):
    """In-process (``cli.main``, what the console script calls): these stop before any backend is imported."""
    from twinseq.common.cli import main

    root = folders["model"].parent
    assert main(["generate", *[a.format(root=root, model=folders["model"]) for a in args]]) == 2
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if not line.startswith("INFO")]
    assert out == "" and len(lines) == 1, err
    assert lines[0].startswith("twinseq generate: error: ") and fragment in lines[0], lines


def test_resolve_model_folder_finds_every_part(folders, tmp_path):
    assert resolve_model_folder(folders["adapters"]).weights == folders["model"]
    moved = tmp_path / "final"  # a run's final/ moved elsewhere: its adapter_config.json names a path that is gone
    shutil.copytree(folders["adapters"], moved)
    shutil.copytree(folders["model"], moved / "base")
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone" / "base")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert resolve_model_folder(moved).weights == moved / "base"
    (moved / "base" / "config.json").unlink()
    with pytest.raises(CheckpointError, match="--base-model"):
        resolve_model_folder(moved)
    bare = tmp_path / "bare"
    shutil.copytree(folders["model"], bare)
    (bare / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="--tokenizer"):
        resolve_model_folder(bare)
    assert resolve_model_folder(bare, tokenizer="embedded").tokenizer == Path("embedded")
    with pytest.raises(ConfigError, match="--max-new-tokens"):
        check_sampling(0, 0.0)
    assert escape_line("a\\b\nc\r") == "a\\\\b\\nc\\r"


# --------------------------------------------------------------------------------------
# Trained folders (slow: two tiny training runs)
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("trained")
    data = root / "sft.jsonl"
    rows = load_embedded("embedded-sft").select(range(16))
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "completion": r["completion"]}) + "\n" for r in rows))
    common = ["train", "--dataset-name", str(data), "--max-steps", "2", "--max-length", "64",
              "--per-device-train-batch-size", "4", "--disable-tqdm", "--no-save-final-checkpoint"]
    runs = {"full": ["--backend", "torch"], "peft": ["--backend", "jax", "--use-peft", "--lora-r", "4"]}
    for name, extra in runs.items():
        proc = cli(*common, "--output-dir", str(root / name), *extra, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert (root / "peft" / "final" / "adapter_config.json").is_file() and (root / "peft" / "final" / "base").is_dir()
    return {name: root / name / "final" for name in runs}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["full", "peft"])
def test_trained_final_folders_answer_on_both_backends_identically(trained, kind):
    out = {backend: generate_json(trained[kind], backend) for backend in BACKENDS}
    assert [r["completion_ids"] for r in out["torch"]] == [r["completion_ids"] for r in out["jax"]]
    assert all(r["completion_ids"] for r in out["torch"])
    proc = cli("generate", "--model", str(trained[kind]), "--prompt", PROMPTS[0], "--max-new-tokens", "4")
    assert proc.returncode == 0 and len(proc.stdout.splitlines()) == 1, proc.stderr[-2000:]
    assert np.all([r["finish_reason"] in ("eos", "length") for r in out["jax"]])
