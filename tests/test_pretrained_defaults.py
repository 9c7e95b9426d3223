"""Defaults for pretrained checkpoints (issue 26, item 4): TRL's per-task learning rates, TRL's
``--model-name-or-path``, and the refusal of an ``output_dir`` that already holds a run."""

from __future__ import annotations

import json

import pytest

from twinseq.common.cli import main, parse_train_args
from twinseq.common.config import DEFAULT_LEARNING_RATES, TASKS, TrainConfig
from twinseq.common.errors import ConfigError
from twinseq.common.run.runner import check_previous_run, previous_run

GRPO = dict(per_device_train_batch_size=8, num_generations=8)


def _flat(task: str, **kw) -> dict:
    return dict(task=task, **(GRPO if task == "grpo" else {}), **kw)


# --------------------------------------------------------------------------------------
# Per-task learning rates
# --------------------------------------------------------------------------------------


def test_the_table_is_trls():
    assert {t: DEFAULT_LEARNING_RATES[(t, False)] for t in TASKS} == {"sft": 2e-5, "dpo": 1e-6, "grpo": 1e-6,
                                                                        "rloo": 1e-6, "kto": 1e-6}
    assert DEFAULT_LEARNING_RATES[("sft", True)] == 1e-4  # TRL's PEFT guides: LoRA ~10x full fine-tuning
    for task in ("dpo", "grpo", "rloo", "kto"):
        assert DEFAULT_LEARNING_RATES[(task, True)] == pytest.approx(10 * DEFAULT_LEARNING_RATES[(task, False)])


@pytest.mark.parametrize("task", TASKS)
@pytest.mark.parametrize("use_peft", [False, True])
def test_no_learning_rate_means_the_tasks_and_the_number_is_stored(task, use_peft):
    cfg = TrainConfig.from_flat(**_flat(task, use_peft=use_peft))
    want = DEFAULT_LEARNING_RATES[(task, use_peft)]
    assert cfg.optim.learning_rate == want and cfg.task_defaults() == ["learning_rate"]
    saved = cfg.to_dict()  # what a checkpoint's trainer_state.json holds
    assert saved["optim"]["learning_rate"] == want
    assert TrainConfig.from_dict(json.loads(json.dumps(saved))).optim.learning_rate == want


def test_a_given_learning_rate_is_kept():
    cfg = TrainConfig.from_flat(task="dpo", learning_rate=1e-3)
    assert cfg.optim.learning_rate == 1e-3 and cfg.task_defaults() == []
    assert cfg.replace(task="sft").optim.learning_rate == 1e-3
    assert TrainConfig(learning_rate=5e-4).optim.learning_rate == 5e-4


def test_a_copy_for_another_task_takes_that_tasks_rate():
    cfg = TrainConfig.from_flat(task="sft")
    assert cfg.replace(task="dpo").optim.learning_rate == 1e-6
    assert cfg.replace(use_peft=True).optim.learning_rate == 1e-4
    cfg.optim.learning_rate = 3e-4  # set by hand after validation: no longer the default
    assert cfg.task_defaults() == [] and cfg.replace(task="dpo").optim.learning_rate == 3e-4


def test_the_cli_resolves_the_rate_for_the_task_its_flags_give(tmp_path):
    assert parse_train_args([]).optim.learning_rate == 2e-5
    assert parse_train_args(["--task", "dpo"]).optim.learning_rate == 1e-6
    assert parse_train_args(["--task", "dpo", "--use-peft"]).optim.learning_rate == 1e-5
    assert parse_train_args(["--learning-rate", "1e-3", "--task", "dpo"]).optim.learning_rate == 1e-3
    yaml = tmp_path / "run.yaml"
    yaml.write_text("task: sft\nmax_length: 64\n")
    assert parse_train_args(["--config", str(yaml), "--task", "dpo"]).optim.learning_rate == 1e-6
    yaml.write_text("task: sft\nlearning_rate: 3.0e-3\n")
    assert parse_train_args(["--config", str(yaml), "--task", "dpo"]).optim.learning_rate == 3e-3


def test_the_run_says_which_rate_it_took(tmp_path, caplog):
    from twinseq.common.run.runner import preflight

    with caplog.at_level("INFO", logger="twinseq.common.run.runner"):
        preflight(TrainConfig.from_flat(output_dir=str(tmp_path / "a")), _cpu())
    assert "learning_rate=2e-05: the default of task='sft'" in caplog.text and "random weights" in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="twinseq.common.run.runner"):
        preflight(TrainConfig.from_flat(output_dir=str(tmp_path / "b"), learning_rate=1e-3), _cpu())
    assert "learning_rate=" not in caplog.text


def _cpu():
    from twinseq.common.run.capabilities import Runtime

    return Runtime("torch", "cpu", 1, accelerator=False)


def test_the_shipped_configs_keep_their_tuned_rates():
    """configs/*.yaml train random tiny models, where these were tuned: each names its rate."""
    from pathlib import Path

    for path in sorted((Path(__file__).parents[1] / "configs").glob("*.yaml")):
        cfg = TrainConfig.from_yaml(path)
        assert cfg.task_defaults() == [], path.name
        assert cfg.optim.learning_rate >= 1e-3, path.name


# --------------------------------------------------------------------------------------
# --model-name-or-path
# --------------------------------------------------------------------------------------


def test_model_name_or_path_is_an_alias_of_model_config(tmp_path):
    assert TrainConfig.from_flat(model_name_or_path="small").model.model_config == "small"
    assert TrainConfig(model_name_or_path="small").model.model_config == "small"
    yaml = tmp_path / "run.yaml"
    yaml.write_text("model_name_or_path: small\n")
    assert TrainConfig.from_yaml(yaml).model.model_config == "small"
    assert parse_train_args(["--model-name-or-path", "small"]).model.model_config == "small"
    assert parse_train_args(["--model-config", "small"]).model.model_config == "small"


def test_the_alias_flag_is_listed_by_help(capsys):
    with pytest.raises(SystemExit) as stop:
        parse_train_args(["--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--model-name-or-path" in out and "--model-config" in out and "--overwrite-output-dir" in out


def test_a_misspelt_alias_flag_gets_a_suggestion(capsys):
    assert main(["train", "--model-name-or-pat", "small"]) == 2
    assert "--model-name-or-path" in capsys.readouterr().err


# --------------------------------------------------------------------------------------
# An output_dir that holds a run
# --------------------------------------------------------------------------------------


def _old_run(folder, *, checkpoint: bool = True, final: bool = True):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    if checkpoint:
        (folder / "checkpoint-20").mkdir()
        (folder / "checkpoint-20" / "trainer_state.json").write_text("{}")
    if final:
        (folder / "final").mkdir()
    return folder


def test_what_a_previous_run_left_is_named(tmp_path):
    assert previous_run(tmp_path / "missing") == [] and previous_run(tmp_path) == []
    (tmp_path / "notes.txt").write_text("mine")  # a folder with other files is not a run
    assert previous_run(tmp_path) == []
    assert previous_run(_old_run(tmp_path)) == ["metrics.jsonl", "checkpoint-20", "final/"]


def test_a_folder_holding_a_run_is_refused_naming_both_fixes(tmp_path):
    out = _old_run(tmp_path / "runs" / "a")
    with pytest.raises(ConfigError) as err:
        check_previous_run(TrainConfig.from_flat(output_dir=str(out)))
    message = str(err.value)
    assert str(out) in message and "metrics.jsonl, checkpoint-20, final/" in message
    assert "--overwrite-output-dir" in message and "--resume-from-checkpoint latest" in message
    assert "\n" not in message


@pytest.mark.parametrize("allow", [dict(overwrite_output_dir=True), dict(resume_from_checkpoint="latest")])
def test_overwrite_or_resume_is_allowed(tmp_path, allow):
    check_previous_run(TrainConfig.from_flat(output_dir=str(_old_run(tmp_path)), **allow))


def test_a_fresh_or_foreign_folder_is_allowed(tmp_path):
    check_previous_run(TrainConfig.from_flat(output_dir=str(tmp_path / "new")))
    (tmp_path / "lengths.png").write_bytes(b"")  # `twinseq lengths --output runs/demo/lengths.png` first
    check_previous_run(TrainConfig.from_flat(output_dir=str(tmp_path)))


@pytest.mark.parametrize("backend", ["torch", "jax"])
def test_the_cli_refuses_it_with_one_line_and_status_2(tmp_path, capsys, backend):
    out = _old_run(tmp_path / "run", checkpoint=False, final=False)
    assert main(["train", "--backend", backend, "--output-dir", str(out), "--max-steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("twinseq train: error: output_dir=")
    assert "already holds a run (metrics.jsonl)" in err and "--overwrite-output-dir" in err
    assert "--resume-from-checkpoint latest" in err
