"""Every bad input gets a one-line answer, on both backends where the input applies.

Each case runs ``twinseq train`` (in process, through ``twinseq.common.cli.main``) or a Python API
call with one mistake a user makes, and asserts:

- the CLI exits with status 2 and prints exactly one error line, ``twinseq train: error: ...``;
- the line names the field, file or row at fault (the case's fragment);
- no traceback is printed (a traceback means a bug);
- in the Python API, the exception is one of twinseq's own (``TwinseqError``).

The cases span config, YAML and flags; runtime options; output folders; model folders;
checkpoints; data files and rows; and the Python API.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from twinseq.common.cli import main
from twinseq.common.config import ModelConfig
from twinseq.common.errors import TwinseqError
from twinseq.common.models.hf_folder import write_hf_checkpoint
from twinseq.common.models.init import init_weights

BACKENDS = ("torch", "jax")
TINY = ModelConfig.preset("tiny")


def run_cli(argv: list[str], capsys) -> str:
    """The one error line of a CLI run that must fail with status 2."""
    code = main(argv)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2, text[-2000:]
    assert "Traceback" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if line.startswith("twinseq train: error: ")]
    assert len(errors) == 1, text[-2000:]
    return errors[0]


def train_args(tmp_path: Path, *extra: str, backend: str = "torch") -> list[str]:
    return ["train", "--backend", backend, "--output-dir", str(tmp_path / "out"), "--max-steps", "1",
            "--model-config", "tiny", "--max-length", "64", "--dataset-split", "train[:16]",
            "--per-device-train-batch-size", "2", "--disable-tqdm", *extra]


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    return str(path)


# --------------------------------------------------------------------------------------
# Config, YAML and flags (the same parser for both backends: checked once)
# --------------------------------------------------------------------------------------

CONFIG_CASES = {
    "int flag not a number": (["--max-steps", "abc"], "--max-steps"),
    "int flag zero": (["--max-steps", "0"], "max_steps=0"),
    "float flag nan": (["--learning-rate", "nan"], "learning_rate=nan"),
    "float flag inf": (["--learning-rate", "inf"], "learning_rate=inf"),
    "float flag a word": (["--learning-rate", "fast"], "--learning-rate"),
    "float batch size": (["--per-device-train-batch-size", "2.5"], "--per-device-train-batch-size"),
    "choice not allowed": (["--loss-type", "fused"], "loss_type='fused'"),
    "unknown flag": (["--max-stepz", "3"], "--max-stepz (did you mean --max-steps?)"),
    "boolean given a word": (["--packing", "no"], "unrecognized argument(s) no"),
    "flag without value": (["--learning-rate"], "--learning-rate is missing its value"),
    "adam beta1 = 1": (["--adam-beta1", "1.0"], "adam_beta1=1.0"),
    "adam beta2 < 0": (["--adam-beta2", "-0.5"], "adam_beta2=-0.5"),
    "warmup ratio > 1": (["--warmup-ratio", "1.5"], "warmup_ratio=1.5"),
    "dpo knob on sft": (["--beta", "0.5"], "beta is read by task='dpo' or 'kto' only"),
    "packing with dpo": (["--task", "dpo", "--packing"], "packing=True does not apply to DPO"),
    "packing without max_length": (["--packing", "--max-length", "None"], "packing=True needs max_length"),
    "liger flag with another kernel": (["--use-liger-kernel", "--loss-type", "fused_linear"], "use_liger_kernel=True"),
    "report_to unsupported": (["--report-to", "mlflow"], "report_to"),
    "dpo loss unknown": (["--task", "dpo", "--dpo-loss-type", "foo"], "loss_type='foo'"),
    "label smoothing > 0.5": (["--task", "dpo", "--label-smoothing", "0.7"], "label_smoothing=0.7"),
    "exo without smoothing": (["--task", "dpo", "--dpo-loss-type", "exo_pair"], "label_smoothing=0.0 is not valid"),
    "save_total_limit 0": (["--save-total-limit", "0"], "save_total_limit=0"),
    "backend unknown": (["--backend", "tf"], "backend='tf'"),
    "liger dpo padding-free": (["--task", "dpo", "--loss-type", "liger", "--padding-free"], "padded batches"),
    "negative seed type": (["--seed", "1.5"], "--seed"),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_bad_flags(case, tmp_path, capsys):
    extra, fragment = CONFIG_CASES[case]
    assert fragment in run_cli(train_args(tmp_path, *extra), capsys)


YAML_CASES = {
    "missing file": (None, "does not exist"),
    "syntax error": ("max_steps: 3\nlearning_rate: [1e-3\n", "bad.yaml:3"),
    "top level list": ("- max_steps: 3\n", "must hold a mapping"),
    "unknown key": ("max_stepz: 3\n", "unknown field(s) max_stepz (did you mean 'max_steps'?)"),
    "string for int": ("max_steps: ten\n", "max_steps='ten'"),
    "string for bool": ("packing: 'no'\n", "packing='no'"),
    "nested unknown key": ("data:\n  learning_rate: 0.1\n", "data.learning_rate"),
    "section not a mapping": ("optim: 3\n", "optim"),
}


@pytest.mark.parametrize("case", sorted(YAML_CASES))
def test_bad_yaml(case, tmp_path, capsys):
    text, fragment = YAML_CASES[case]
    path = str(tmp_path / "missing.yaml") if text is None else _yaml(tmp_path, text)
    assert fragment in run_cli(train_args(tmp_path, "--config", path), capsys)


# --------------------------------------------------------------------------------------
# Runtime options: the same refusal on both backends, before any work
# --------------------------------------------------------------------------------------

RUNTIME_CASES = {
    "liger on cpu": (BACKENDS, ["--loss-type", "liger"], "loss_type='liger'"),
    "offloading on cpu": (BACKENDS, ["--activation-offloading"], "activation_offloading=True"),
    "cp larger than the world": (BACKENDS, ["--context-parallel-size", "16"], "context_parallel_size=16 is larger"),
    "cp padding multiple": (("jax",), ["--context-parallel-size", "2", "--pad-to-multiple-of", "6"],
                            "--pad-to-multiple-of 12"),
    "dpo with cp": (("jax",), ["--task", "dpo", "--context-parallel-size", "2"], "not implemented for DPO"),
    "torch_compile on jax": (("jax",), ["--torch-compile"], "torch_compile=True is a torch option"),
    "fsdp on jax": (("jax",), ["--fsdp"], "fsdp=True is a torch option"),
    "flash attention on cpu": (BACKENDS, ["--attn-implementation", "flash_attention_2"], "flash_attention_2"),
    "flex attention training on cpu": (BACKENDS, ["--attn-implementation", "flex_attention"], "flex_attention"),
    "dpo with torch_compile": (("torch",), ["--task", "dpo", "--torch-compile"], "torch_compile=True"),
}


@pytest.mark.parametrize("case, backend", [(c, b) for c in sorted(RUNTIME_CASES) for b in RUNTIME_CASES[c][0]])
def test_bad_runtime_options(case, backend, tmp_path, capsys):
    _, extra, fragment = RUNTIME_CASES[case]
    argv = train_args(tmp_path, *extra, "--dataset-name", str(tmp_path / "never-read.jsonl"), backend=backend)
    assert fragment in run_cli(argv, capsys)
    assert not (tmp_path / "out").exists(), "refused before any work"


# --------------------------------------------------------------------------------------
# Output folders
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_output_dir_that_cannot_be_a_folder(backend, where, tmp_path, capsys):
    blocker = tmp_path / "blocker"
    blocker.write_text("x")
    out = blocker if where == "a file" else blocker / "run"
    argv = train_args(tmp_path, backend=backend)
    argv[argv.index("--output-dir") + 1] = str(out)
    assert str(out) in run_cli(argv + ["--dataset-name", str(tmp_path / "never-read.jsonl")], capsys)


# --------------------------------------------------------------------------------------
# Model folders
# --------------------------------------------------------------------------------------


def _model_folder(tmp_path: Path, cfg: ModelConfig = TINY) -> Path:
    return write_hf_checkpoint(cfg, init_weights(cfg, seed=0), tmp_path / "model")


def _break_model(kind: str, folder: Path) -> None:
    weights = folder / "model.safetensors"
    if kind == "no config.json":
        (folder / "config.json").unlink()
    elif kind == "corrupt config.json":
        (folder / "config.json").write_text('{"model_type": "llama",\n  "hidden_size": }')
    elif kind == "unsupported architecture":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    elif kind == "index lists a missing shard":  # (a folder with config.json alone trains from random weights)
        weights.unlink()
        (folder / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {"model.embed_tokens.weight": "model-00001-of-00002.safetensors"}}))
    elif kind == "truncated weights":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif kind == "not safetensors":
        weights.write_bytes(b"PK\x03\x04 a zip file, not safetensors")
    elif kind == "shapes differ from config.json":
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "intermediate_size": 128}))
    else:
        raise AssertionError(kind)


MODEL_CASES = {
    "no config.json": "has no config.json",
    "corrupt config.json": "config.json:2: not valid JSON",
    "unsupported architecture": "model_type='gpt2'",
    "index lists a missing shard": "model-00001-of-00002.safetensors is listed in model.safetensors.index.json but missing",
    "truncated weights": "model.safetensors is truncated",
    "not safetensors": "not a readable safetensors file",
    "shapes differ from config.json": "do not match config.json",
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(MODEL_CASES))
def test_broken_model_folder_is_refused_before_loading(case, backend, tmp_path, capsys):
    folder = _model_folder(tmp_path)
    _break_model(case, folder)
    argv = train_args(tmp_path, "--dataset-name", str(tmp_path / "never-read.jsonl"), backend=backend)
    argv[argv.index("--model-config") + 1] = str(folder)
    assert MODEL_CASES[case] in run_cli(argv, capsys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_folder_with_nan_weights(backend, tmp_path, capsys):
    weights = init_weights(TINY, seed=0)
    weights["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    folder = write_hf_checkpoint(TINY, weights, tmp_path / "model")
    argv = train_args(tmp_path, backend=backend)
    argv[argv.index("--model-config") + 1] = str(folder)
    assert "model.layers.1.mlp.up_proj.weight holds NaN or Inf" in run_cli(argv, capsys)


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_vocabulary_smaller_than_the_tokenizer(backend, tmp_path, capsys):
    folder = _model_folder(tmp_path, ModelConfig.preset("tiny", vocab_size=256))
    argv = train_args(tmp_path, backend=backend)
    argv[argv.index("--model-config") + 1] = str(folder)
    assert "vocab_size=256 but the tokenizer has 8192" in run_cli(argv, capsys)


def test_model_config_neither_preset_nor_folder(tmp_path, capsys):
    argv = train_args(tmp_path)
    argv[argv.index("--model-config") + 1] = "llama-70b"
    assert "model_config='llama-70b' is neither a preset" in run_cli(argv, capsys)


# --------------------------------------------------------------------------------------
# Checkpoints
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def checkpoint(request, tmp_path_factory):
    """(backend, a real checkpoint-1 folder of a 1-step run)."""
    out = tmp_path_factory.mktemp(f"ckpt-{request.param}")
    argv = ["train", "--backend", request.param, "--output-dir", str(out), "--max-steps", "1", "--model-config",
            "tiny", "--max-length", "64", "--dataset-split", "train[:16]", "--per-device-train-batch-size", "2",
            "--disable-tqdm"]
    assert main(argv) == 0
    return request.param, out / "checkpoint-1"


def _break_checkpoint(kind: str, folder: Path) -> None:
    state, arrays = folder / "trainer_state.json", folder / "training_state.safetensors"
    if kind == "no trainer_state.json":
        state.unlink()
    elif kind == "corrupt trainer_state.json":
        state.write_text(state.read_text()[:50])
    elif kind == "interrupted save":
        state.write_text(json.dumps({**json.loads(state.read_text()), "complete": False}))
    elif kind == "truncated arrays":
        arrays.write_bytes(arrays.read_bytes()[:1000])
    elif kind == "another run's config":
        meta = json.loads(state.read_text())
        meta["config"]["data"]["max_length"] = 32
        state.write_text(json.dumps(meta))
    else:
        raise AssertionError(kind)


CHECKPOINT_CASES = {
    "no trainer_state.json": "holds no trainer_state.json",
    "corrupt trainer_state.json": "trainer_state.json is corrupt",
    "interrupted save": "is incomplete",
    "truncated arrays": "training_state.safetensors cannot be read",
    "another run's config": "was written by another run (max_length: 32 -> 64)",
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_broken_checkpoint_is_refused(checkpoint, case, tmp_path, capsys):
    backend, original = checkpoint
    folder = tmp_path / "checkpoint-1"
    shutil.copytree(original, folder)
    _break_checkpoint(case, folder)
    argv = train_args(tmp_path, "--max-steps", "2", "--resume-from-checkpoint", str(folder), backend=backend)
    assert CHECKPOINT_CASES[case] in run_cli(argv, capsys)


def test_checkpoint_of_the_other_backend_is_refused(checkpoint, tmp_path, capsys):
    backend, original = checkpoint
    other = "jax" if backend == "torch" else "torch"
    argv = train_args(tmp_path, "--max-steps", "2", "--resume-from-checkpoint", str(original), backend=other)
    assert f"backend: {backend!r} -> {other!r}" in run_cli(argv, capsys)


def test_missing_checkpoint_folder(tmp_path, capsys):
    argv = train_args(tmp_path, "--resume-from-checkpoint", str(tmp_path / "checkpoint-9"))
    assert "checkpoint-9" in run_cli(argv, capsys) and not (tmp_path / "out").exists()


# --------------------------------------------------------------------------------------
# Data files and rows
# --------------------------------------------------------------------------------------


def _data_file(tmp_path: Path, kind: str) -> str:
    files = {
        "missing file": ("gone.jsonl", None),
        "unsupported extension": ("data.txt", "prompt\tcompletion\n"),
        "json syntax error": ("data.json", '[{"prompt": "q", "completion": "a"},\n {"prompt": "q2",\n  "completion"}]'),
        "jsonl bad line": ("data.jsonl", '{"prompt": "q", "completion": "a"}\n{"prompt": "q2", completion: 1}\n'),
        "jsonl line not an object": ("data.jsonl", '{"prompt": "q", "completion": "a"}\n["q2", "a2"]\n'),
        "json top level not rows": ("data.json", '"just a string"'),
        "wrong columns": ("data.jsonl", '{"question": "q", "answer": "a"}\n'),
        "prompt not a string": ("data.jsonl", '{"prompt": "q", "completion": "a"}\n{"prompt": 7, "completion": "b"}\n'),
        "bad message role": ("data.jsonl", '{"messages": [{"role": "human", "content": "hi"}]}\n'),
        "token id out of vocabulary": ("data.jsonl", '{"input_ids": [1, 5, 99999]}\n'),
        "every row empty": ("data.jsonl", '{"text": ""}\n{"text": "  "}\n'),
        "dpo without rejected": ("data.jsonl", '{"prompt": "q", "chosen": "a"}\n'),
        "mixed column types": ("data.jsonl", '{"prompt": "q", "completion": "a"}\n{"prompt": ["x"], "completion": "b"}\n'),
    }
    name, text = files[kind]
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    return str(path)


DATA_CASES = {
    "missing file": ("sft", "gone.jsonl"),
    "unsupported extension": ("sft", "unsupported extension '.txt'"),
    "json syntax error": ("sft", "data.json:3:"),
    "jsonl bad line": ("sft", "data.jsonl:2: not valid JSON"),
    "jsonl line not an object": ("sft", "data.jsonl:2: the line holds a list"),
    "json top level not rows": ("sft", "the top level is a str"),
    "wrong columns": ("sft", "SFT data needs a 'messages', a 'prompt'+'completion' or a 'text' column"),
    "prompt not a string": ("sft", "data.jsonl"),
    "bad message role": ("sft", "row 0 (line 1 of a JSONL file): messages[0]['role']='human'"),
    "token id out of vocabulary": ("sft", "row 0 (line 1 of a JSONL file): input_ids hold 99999"),
    "every row empty": ("sft", "no example of dataset_name="),
    "dpo without rejected": ("dpo", "DPO data needs the column(s) ['rejected']"),
    "mixed column types": ("sft", "data.jsonl"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data(case, backend, tmp_path, capsys):
    task, fragment = DATA_CASES[case]
    argv = train_args(tmp_path, "--task", task, "--dataset-name", _data_file(tmp_path, case), "--dataset-split",
                      "train", backend=backend)
    assert fragment in run_cli(argv, capsys)


def test_bad_split(tmp_path, capsys):
    argv = train_args(tmp_path, "--dataset-split", "validation")
    assert "dataset_split='validation'" in run_cli(argv, capsys)


# --------------------------------------------------------------------------------------
# The Python API: the same exception family
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=BACKENDS)
def backend_and_model(request):
    from twinseq.common.backend import load_backend

    be = load_backend(request.param)
    return be, be.build_model(TINY)


def _api_cases(be, model, tmp_path):
    from twinseq.common.data.batching import collate
    from twinseq.common.config import TrainConfig

    batch = collate([{"input_ids": [5, 6, 7]}])
    big = collate([{"input_ids": [5, TINY.vocab_size + 3, 7]}])
    missing = {k: v for k, v in init_weights(TINY).items() if k != "model.norm.weight"}
    blocker = tmp_path / "file"
    blocker.write_text("x")
    return {
        "batch is a dict": (lambda: be.logits(model, {"input_ids": [[5, 6]]}), "Batch"),
        "token id out of vocabulary": (lambda: be.logits(model, big), "input_ids hold 8195"),
        "label out of vocabulary": (lambda: be.loss_and_grads(model, collate([{"input_ids": [5, 6, 7],
                                                                              "labels": [5, 9000, 7]}])), "9000"),
        "unknown loss type": (lambda: be.loss_and_grads(model, batch, "focal"), "loss_type='focal'"),
        "weights miss a tensor": (lambda: be.build_model(TINY, missing), "model.norm.weight"),
        "empty collate": (lambda: collate([]), "collate() needs a non-empty list"),
        "config of the wrong type": (lambda: TrainConfig.from_flat(max_length="x"), "max_length='x'"),
        "missing model folder": (lambda: be.load_pretrained(tmp_path / "nowhere"), "nowhere"),
        "train into a file": (lambda: be.train(TrainConfig.from_flat(output_dir=str(blocker))), "is a file"),
    }


API_CASES = ("batch is a dict", "token id out of vocabulary", "label out of vocabulary", "unknown loss type",
             "weights miss a tensor", "empty collate", "config of the wrong type", "missing model folder",
             "train into a file")


@pytest.mark.parametrize("case", API_CASES)
def test_python_api_raises_twinseq_errors(backend_and_model, case, tmp_path):
    be, model = backend_and_model
    call, fragment = _api_cases(be, model, tmp_path)[case]
    with pytest.raises(TwinseqError) as err:
        call()
    assert isinstance(err.value, (ValueError, TypeError, ImportError))
    assert fragment in str(err.value)


def test_debug_shows_the_traceback(tmp_path):
    with pytest.raises(TwinseqError, match="max_steps=0"):
        main([*train_args(tmp_path, "--max-steps", "0"), "--debug"])


def test_the_suite_has_sixty_cases_or_more():
    runtime = sum(len(b) for b, _, _ in RUNTIME_CASES.values())
    total = (len(CONFIG_CASES) + len(YAML_CASES) + runtime + 2 * 2 + 2 * len(MODEL_CASES) + 2 * 2 + 1
             + 2 * len(CHECKPOINT_CASES) + 2 + 1 + 2 * len(DATA_CASES) + 1 + 2 * len(API_CASES))
    assert total >= 60, total


def test_empty_dataset_name(tmp_path, capsys):
    """``--dataset-name ''`` was read as the current folder and failed inside ``datasets`` with a traceback."""
    argv = train_args(tmp_path, "--dataset-name", "")
    assert "dataset_name='' is empty" in run_cli(argv, capsys)


@pytest.mark.parametrize("where", ["parent is a file", "output is a folder"])
def test_lengths_output_that_cannot_be_written(where, tmp_path, capsys):
    """``twinseq lengths --output`` under a file (was a FileExistsError traceback after the tokenising) or onto a
    folder: one line, exit 2, before any work."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    output = blocker / "sub" / "lengths.png" if where == "parent is a file" else tmp_path
    code = main(["lengths", "embedded", "--output", str(output)])
    text = capsys.readouterr().err
    assert code == 2 and "Traceback" not in text
    (line,) = [ln for ln in text.splitlines() if ln.startswith("twinseq lengths: error: ")]
    assert f"--output={str(output)!r}" in line
    assert ("is a file, so no folder can be made" if where == "parent is a file" else "is a folder") in line


@pytest.mark.parametrize("backend", BACKENDS)
def test_model_folder_without_weights_is_refused_unless_random_is_asked(backend, tmp_path, capsys):
    """A folder whose safetensors were forgotten used to train a random model with an INFO line among many."""
    folder = _model_folder(tmp_path)
    (folder / "model.safetensors").unlink()
    argv = train_args(tmp_path, backend=backend)
    argv[argv.index("--model-config") + 1] = str(folder)
    line = run_cli(argv, capsys)
    assert f"model_config={str(folder)!r} has a config.json but no weights" in line
    assert "model.safetensors" in line and "--init-weights random" in line
    assert main([*argv, "--init-weights", "random"]) == 0  # asked for: that architecture, random weights
