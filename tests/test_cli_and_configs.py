import subprocess
import sys
from pathlib import Path

import pytest

from twinseq.common.cli import main, parse_train_args
from twinseq.common.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))


def test_there_are_named_configs():
    assert {"tiny.yaml", "small.yaml", "demo.yaml"} <= {p.name for p in CONFIGS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_parses(path):
    cfg = TrainConfig.from_yaml(path)
    assert parse_train_args(["--config", str(path)]) == cfg


def test_flags_override_yaml_and_use_dashes():
    cfg = parse_train_args(["--config", str(ROOT / "configs/demo.yaml"), "--max-steps", "3", "--no-packing",
                            "--loss-type", "chunked_nll", "--gradient-accumulation-steps", "4"])
    assert (cfg.max_steps, cfg.data.packing, cfg.loss.loss_type, cfg.data.gradient_accumulation_steps) == \
        (3, False, "chunked_nll", 4)
    assert cfg.data.padding_free is True  # from the YAML


def test_bad_flag_value_is_a_twinseq_error():
    from twinseq.common.errors import ConfigError

    with pytest.raises(ConfigError, match="per_device_train_batch_size=0"):
        parse_train_args(["--per-device-train-batch-size", "0"])
    assert main(["train", "--per-device-train-batch-size", "0"]) == 2


def test_unknown_command_and_help(capsys):
    assert main(["frobnicate"]) == 2
    assert main(["--help"]) == 0
    assert "lengths" in capsys.readouterr().out


def test_console_entry_point_is_installed():
    out = subprocess.run([Path(sys.executable).with_name("twinseq"), "--help"], capture_output=True, text=True)
    assert out.returncode == 0 and "train" in out.stdout
