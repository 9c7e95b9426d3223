"""What a user sees on a ``twinseq train`` run (issue 26, "a clean terminal"): the CLI runs in a fresh process, as a
user runs it, and its stdout + stderr hold twinseq's lines and the bar only.

- no line from a dependency (DeepSpeed's accelerator warning, ``datasets``' version notices, bitsandbytes' kernel
  warning, a FutureWarning of transformers): only twinseq's loggers speak below WARNING, and a run that quantizes
  nothing never imports bitsandbytes (``torch_backend.peft.bitsandbytes_hidden``);
- every frame of the bar shows the values of the step it counts, so its last loss is the last one of metrics.jsonl;
- the end-of-run summary fits the task: GRPO's names the reward, DPO's the reward accuracy.

The in-process tests below cover the same rules on ``common.run.report`` in milliseconds.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from twinseq.common.run.report import RunLogger, bar_postfix, summarize_run

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--model-config", "tiny", "--max-length", "128", "--per-device-train-batch-size", "2"]
GRPO = ["--task", "grpo", "--max-completion-length", "8", "--num-generations", "2"]

# A line a dependency printed: its logger's name, its own log format, or a Python warning.
DEPENDENCY_LINE = re.compile(
    r"deepspeed|real_accelerator|bitsandbytes|kernels-community|\bdatasets\b|JAX version|"
    r"^(DEBUG|INFO|WARNING|ERROR|CRITICAL) (?!twinseq\.)|Warning: ",
    re.IGNORECASE,
)
# A frame of the bar: "sft[torch]:  67%|...| 2/3 [00:01<00:00, 1.9it/s, loss=8.9369, tok/s=..., peak=...]".
FRAME = re.compile(r"\| (\d+)/(\d+) \[[^\]]*?, (\w+=[^\]]*)\]")


def train(tmp_path: Path, *flags: str) -> tuple[str, list[dict]]:
    """``twinseq train`` in a fresh interpreter -> (stdout + stderr, the records of metrics.jsonl)."""
    out_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "twinseq.common.cli", "train", *TINY, "--output-dir", str(out_dir), *flags]
    done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-3000:]
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return text, records


def lines_of(text: str) -> list[str]:
    """The lines as a terminal would show them one after the other: the bar redraws itself after each ``\\r``."""
    return [line.strip() for line in re.split(r"[\r\n]", text) if line.strip()]


def dependency_lines(text: str) -> list[str]:
    return [line for line in lines_of(text) if DEPENDENCY_LINE.search(line) and not FRAME.search(line)]


def frames(text: str) -> list[tuple[int, dict[str, str]]]:
    """Each drawn frame of the bar -> (its step count, its ``name=value`` fields)."""
    out = []
    for match in FRAME.finditer(text):
        fields = dict(item.strip().split("=", 1) for item in match.group(3).split(", ") if "=" in item)
        out.append((int(match.group(1)), fields))
    return out


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_an_sft_run_shows_twinseq_lines_and_a_bar_of_the_current_step(tmp_path):
    text, records = train(tmp_path, "--max-steps", "3")
    assert not dependency_lines(text), dependency_lines(text)
    drawn = [(n, fields) for n, fields in frames(text) if n > 0]
    assert drawn, f"no bar frame with a step in: {text[-2000:]}"
    for n, fields in drawn:  # the frame of step n shows step n's loss, not step n-1's
        assert float(fields["loss"]) == round(records[n - 1]["loss"], 4), (n, fields, [r["loss"] for r in records])
    assert drawn[-1][0] == 3 and float(drawn[-1][1]["loss"]) == round(records[-1]["loss"], 4)
    assert "loss: first step" in text and "final/first" in text


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_a_peft_run_imports_no_bitsandbytes_and_prints_no_dependency_line(tmp_path):
    text, records = train(tmp_path, "--max-steps", "2", "--use-peft", "--disable-tqdm")
    assert not dependency_lines(text), dependency_lines(text)
    assert len(records) == 2 and not frames(text)


@pytest.mark.slow  # the fast tier is at its budget, about 12 minutes; make test-all runs it
def test_a_grpo_run_shows_the_reward_on_its_bar_and_in_its_summary(tmp_path):
    text, records = train(tmp_path, "--max-steps", "2", *GRPO)
    assert not dependency_lines(text), dependency_lines(text)
    drawn = [(n, fields) for n, fields in frames(text) if n > 0]
    assert drawn and float(drawn[-1][1]["reward"]) == round(records[-1]["reward"], 4)
    assert float(drawn[-1][1]["loss"]) == round(records[-1]["loss"], 4)
    summary = [line for line in lines_of(text) if line.startswith("reward: first step")]
    assert summary and "final/first" not in text, text[-1500:]


@pytest.mark.slow  # fast-tier budget: runs in make test-all and CI
def test_bitsandbytes_is_hidden_only_while_peft_builds_plain_adapters():
    """In one process: LoRA without quantisation leaves bitsandbytes unimported, and a QLoRA model built afterwards
    still gets its NF4 layers (the block is lifted)."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    code = """
import sys
from twinseq.common.models.configs import ModelConfig
from twinseq.common.models.init import init_weights
from twinseq.common.models.peft import PeftConfig
from twinseq.torch_backend import add_adapters, build_model
cfg = ModelConfig.preset("tiny")
add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, PeftConfig(use_peft=True))
assert "bitsandbytes" not in sys.modules, "a LoRA model without load_in_4bit imported bitsandbytes"
model = add_adapters(build_model(cfg, init_weights(cfg, seed=0)), cfg, PeftConfig(use_peft=True, load_in_4bit=True))
assert any(type(m).__name__ == "Linear4bit" for m in model.modules()), "QLoRA built no NF4 layer"
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stdout + done.stderr[-3000:]


# --------------------------------------------------------------------------------------
# common.run.report in process
# --------------------------------------------------------------------------------------


def step(n: int, **extra) -> dict:
    return {"step": n, "num_tokens": 10, "tokens_per_second": 100.0, "peak_memory_bytes": 2**30, **extra}


def test_the_bar_fields_fit_the_task():
    assert list(bar_postfix(step(1, loss=2.5))) == ["loss", "tok/s", "peak"]
    grpo = bar_postfix(step(1, loss=0.0, reward=0.5, kl=1.6e-8))
    assert list(grpo) == ["reward", "kl", "loss", "tok/s", "peak"] and grpo["kl"] == "1.6e-08"
    dpo = bar_postfix(step(1, loss=0.69, **{"rewards/accuracies": 0.75, "rewards/margins": 0.1}))
    assert list(dpo) == ["loss", "acc", "margin", "tok/s", "peak"] and dpo["peak"] == "1.0GiB"


def test_the_summary_fits_the_task():
    sft = summarize_run([step(i, loss=loss) for i, loss in enumerate([4.0, 3.0, 2.0, 1.0], 1)])
    assert sft.startswith("loss: first step 4.0000, final step 1.0000 (final/first = 0.250)")
    grpo = summarize_run([step(i, loss=0.0, reward=r, kl=0.01 * i) for i, r in enumerate([0.2, 0.4, 0.6], 1)])
    assert grpo.startswith("reward: first step 0.2000, final step 0.6000;") and "kl 0.01 -> 0.03" in grpo
    assert "final/first" not in grpo and "ratio" not in grpo
    dpo = summarize_run([step(i, loss=0.69 - 0.1 * i, **{"rewards/accuracies": a, "rewards/margins": a / 10})
                         for i, a in enumerate([0.0, 0.5, 1.0], 1)])
    assert dpo.startswith("loss: first step 0.5900, final step 0.3900;")
    assert "reward accuracy 0.0000 -> 1.0000" in dpo and "reward margin 0.0000 -> 0.1000" in dpo
    assert summarize_run([]) is None


def test_log_lines_and_warnings_go_above_the_bar_and_the_handlers_get_their_streams_back(tmp_path, capsys):
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
    dep = logging.getLogger("a_dependency")
    dep.addHandler(handler)
    dep.propagate = False
    try:
        log = RunLogger(tmp_path, max_steps=2)
        log.log_step(step(1, loss=2.0))
        dep.warning("something happened")
        log.log_step(step(2, loss=1.0))
        log.close()
        assert handler.stream is sys.stderr
    finally:
        dep.removeHandler(handler)
        dep.propagate = True
    err = capsys.readouterr().err
    # tqdm.write clears the bar first: the line starts a row of its own instead of following the bar's text
    assert re.search(r"\r\s*\rWARNING a_dependency: something happened\n", err), repr(err)
    assert [(n, f["loss"]) for n, f in frames(err)][-1] == (2, "1.0000")


def test_the_cli_logging_setup(monkeypatch):
    """twinseq's INFO on rank 0 only; dependencies from WARNING up; dependencies' deprecation notices dropped."""
    from twinseq.common import cli

    root, ours = logging.getLogger(), logging.getLogger("twinseq")
    saved = root.level, ours.level
    try:
        with warnings.catch_warnings():
            monkeypatch.setenv("RANK", "1")
            cli._setup_logging(debug=False)
            assert not logging.getLogger("twinseq.common.run").isEnabledFor(logging.INFO)
            assert logging.getLogger("twinseq.common.run").isEnabledFor(logging.WARNING)
            monkeypatch.setenv("RANK", "0")
            cli._setup_logging(debug=False)
            assert logging.getLogger("twinseq.common.run").isEnabledFor(logging.INFO)
            assert not logging.getLogger("a_dependency.config").isEnabledFor(logging.INFO)
            assert any(f[0] == "ignore" and f[2] is FutureWarning for f in warnings.filters)
            cli._setup_logging(debug=True)
            assert logging.getLogger("a_dependency.config").isEnabledFor(logging.INFO)
    finally:
        root.setLevel(saved[0])
        ours.setLevel(saved[1])
        logging.captureWarnings(False)
