"""Every ```bash and ```python block of README.md and docs/*.md runs as a user pastes it.

The blocks are read from the files at import time, so a block added later is a case of its own (id ``FILE:LINE``,
the line of its opening fence) without touching this file. Each case either runs its block or finds it in
``CANNOT_RUN``, a short table of blocks this machine cannot run, each with its reason and a check of what can be
checked here (the Makefile target exists and ``make -n`` prints its commands, twinseq refuses the command on a CPU
with exit status 2 naming the reason, the launcher's ``--help`` parses), or of blocks another test already runs
verbatim (checked: the block is, character for character, the script that test runs). A block that is neither fails.

How a block runs:

- shell: ``bash -e -o pipefail -c BLOCK`` in a fresh folder holding links to the repository's top-level entries
  (``.venv``, ``configs/``, ``benchmarks/``, ...) and a ``runs/`` of its own, so nothing is written into the
  repository; ``HF_HUB_OFFLINE=1``; ``PATH`` without the virtual environment's ``bin`` (a bare ``twinseq`` or
  ``torchrun`` is "command not found", as in a fresh shell).
- The one change to a command: every ``twinseq train`` (or ``-m twinseq.common.cli train``) gets
  ``--max-steps 2`` appended at the end of its command line (tyro: the later flag wins, which the check below
  proves), so a run takes seconds. After the block, each such run's ``metrics.jsonl`` must end at step 2.
- python: the block as a file, run by the virtual environment's python in a fresh folder like the shell
  blocks' (nothing imported for it: a snippet that uses a name it never imports fails).
- ``PLACEHOLDERS``: paths the docs use for "your own checkpoint" (``path/to/Qwen2.5-0.5B-Instruct``); the test
  builds a small folder of that kind at that path in the block's folder, and the command runs unchanged.

Every runnable block is ``slow`` (the full tier, ``make test-all``; the fast tier is at its budget, about 12 minutes);
the fast tier keeps the checks of the table, the step cap and the command parsing.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
SHELL_LANGS = {"bash", "sh", "shell"}
PYTHON_LANGS = {"python", "py"}
# Fence languages that are not run: "" (diagrams, output transcripts, formulas). Anything else must be added here
# or to the two sets above, so that a ```console block (say) cannot slip past unrun.
NOT_CODE_LANGS = {"", "text", "yaml", "json", "jinja"}
STEP_CAP = 2
TIMEOUT_S = 600
VENV_BINS = {REPO / ".venv" / "bin", REPO / ".venv-vllm" / "bin", Path(sys.executable).parent}
SHELL_WORDS = set("for do done if then fi else while cd export echo printf test true false set source [ [[".split())
TRAIN_CMD = re.compile(r"(?:\btwinseq|-m\s+twinseq\.common\.cli)\s+train\b")


# --- reading the blocks -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    file: str  # relative to the repository
    line: int  # 1-based line of the opening fence
    lang: str
    code: str

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}"


def parse_blocks(path: Path) -> list[Block]:
    """Every fenced block of a markdown file (``` fences, any language), in order."""
    blocks, open_at, lang, body = [], None, "", []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        fence = re.match(r"^\s*```\s*([\w+-]*)\s*$", line)
        if open_at is None:
            if fence:
                open_at, lang, body = number, fence.group(1).lower(), []
        elif line.strip() == "```":
            blocks.append(Block(str(path.relative_to(REPO)), open_at, lang, "\n".join(body) + "\n"))
            open_at = None
        else:
            body.append(line)
    assert open_at is None, f"{path.relative_to(REPO)}:{open_at}: a fence that is never closed"
    return blocks


ALL_BLOCKS = [b for path in DOC_FILES for b in parse_blocks(path)]
BLOCKS = [b for b in ALL_BLOCKS if b.lang in SHELL_LANGS | PYTHON_LANGS]


# --- shell text: comments, command boundaries, the step cap ------------------------------------------------------


def logical_lines(code: str) -> list[str]:
    """The block's command lines: backslash continuations joined, comments and blank lines dropped."""
    lines = []
    for line in code.replace("\\\n", " ").splitlines():
        text = line[: _scan(line)[0]].strip()
        if text:
            lines.append(text)
    return lines


def _scan(line: str) -> tuple[int, list[int]]:
    """(where an unquoted comment starts, else len(line); the unquoted command boundaries | ; & > < before it)."""
    quote, boundaries = None, []
    for i, ch in enumerate(line):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return i, boundaries
        elif ch in "|;&<>":
            boundaries.append(i)
    return len(line), boundaries


def cap_train_steps(code: str, steps: int = STEP_CAP) -> tuple[str, int]:
    """``code`` with `` --max-steps N`` at the end of every ``twinseq train`` command (not ``--help``); the count."""
    out, count = [], 0
    for line in code.replace("\\\n", " ").splitlines():
        end, boundaries = _scan(line)
        match = TRAIN_CMD.search(line[:end])
        if match:
            stop = min([b for b in boundaries if b > match.end()] + [end])
            if "--help" not in line[match.end() : stop].split():
                line = f"{line[:stop].rstrip()} --max-steps {steps} {line[stop:]}".rstrip()
                count += 1
        out.append(line)
    return "\n".join(out) + "\n", count


def train_output_dirs(code: str, root: Path) -> list[Path]:
    """The output folder of each ``twinseq train`` command: the last ``--output-dir``, else its ``--config``'s
    ``output_dir``, else the default ``runs/latest``."""
    dirs = []
    for line in logical_lines(code):
        for segment in re.split(r"\|\||&&|[|;]", line):
            if not TRAIN_CMD.search(segment) or "--help" in segment:
                continue
            words = shlex.split(segment)
            flags = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("--")}
            out = flags.get("--output-dir")
            if out is None and "--config" in flags:
                out = yaml.safe_load((root / flags["--config"]).read_text()).get("output_dir")
            dirs.append(root / (out or "runs/latest"))
    return dirs


def first_words(code: str) -> list[str]:
    """The command word of every simple command in a shell block (after ``VAR=value`` assignments)."""
    words = []
    for line in logical_lines(code):
        for segment in re.split(r"\|\||&&|[|;]", line):
            try:
                parts = shlex.split(segment)
            except ValueError:
                parts = segment.split()
            while parts and re.match(r"^[A-Za-z_]\w*=", parts[0]):
                parts = parts[1:]
            if parts:
                words.append(parts[0])
    return words


# --- the environment of a pasted block ----------------------------------------------------------------------------


def user_env() -> dict[str, str]:
    """The environment of a user's fresh shell: no virtual environment on PATH, offline, none of the test suite's
    own settings (JAX's 8 forced host devices, Triton's interpreter, a default backend)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "TWINSEQ_BACKEND", "VIRTUAL_ENV"))}
    env.pop("TRITON_INTERPRET", None)
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", env.get("XLA_FLAGS", "")).strip()
    env["XLA_FLAGS"] = flags
    if not flags:
        env.pop("XLA_FLAGS")
    clean = [p for p in env.get("PATH", "").split(os.pathsep) if p and Path(p).resolve() not in _resolved_bins()]
    env["PATH"] = os.pathsep.join(clean)
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def _resolved_bins() -> set[Path]:
    return {p.resolve() for p in VENV_BINS if p.exists()}


def make_workspace(root: Path) -> Path:
    """A folder that looks like the repository to a command (links to its top-level entries) with its own runs/."""
    root.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name not in {".git", "runs"}:
            (root / entry.name).symlink_to(entry)
    (root / "runs").mkdir()
    return root


def run_shell(code: str, cwd: Path, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", code],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_python(code: str, cwd: Path, timeout: int = TIMEOUT_S) -> subprocess.CompletedProcess:
    script = cwd / "_doc_block.py"
    script.write_text(code)
    return subprocess.run(
        [str(REPO / ".venv" / "bin" / "python"), script.name],
        cwd=cwd,
        env=user_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _explain(proc: subprocess.CompletedProcess) -> str:
    return (
        f"exit status {proc.returncode}\n--- stdout (end) ---\n{proc.stdout[-3000:]}\n--- stderr (end) ---\n"
        f"{proc.stderr[-5000:]}"
    )


# --- placeholders: "your own checkpoint" paths, built here ------------------------------------------------------


def _qwen2_checkpoint(folder: Path) -> None:
    """A Qwen2-family checkpoint as a user brings one: config.json + model.safetensors + a ChatML tokenizer."""
    from tests.common.data.chat_fixtures import save_tokenizer_folder
    from twinseq.common.models.configs import ModelConfig
    from twinseq.common.models.hf_folder import write_hf_checkpoint
    from twinseq.common.models.init import init_weights

    cfg = ModelConfig.preset("tiny-qwen2")
    write_hf_checkpoint(cfg, init_weights(cfg, seed=0), folder)
    save_tokenizer_folder(folder, "chatml")


def _config_only(folder: Path) -> None:
    """A folder holding only a hand-written config.json (the ``tiny-mistral`` preset's)."""
    from twinseq.common.models.configs import ModelConfig, to_hf_config

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(to_hf_config(ModelConfig.preset("tiny-mistral")), indent=2))


PLACEHOLDERS: dict[str, Callable[[Path], None]] = {
    "path/to/Qwen2.5-0.5B-Instruct": _qwen2_checkpoint,
    "my-config-dir": _config_only,
    "path/to/Llama-3.2-3B": lambda folder: shutil.copytree(REPO / "benchmarks/models/llama-3.2-3b", folder),
}


# --- blocks this machine cannot run: the reason, and what is checked instead -------------------------------------


def _make_dry_run(target: str, *expected: str) -> None:
    makefile = (REPO / "Makefile").read_text()
    assert re.search(rf"^{re.escape(target)}:", makefile, re.M), f"the Makefile has no target {target!r}"
    proc = subprocess.run(["make", "-n", target], cwd=REPO, env=user_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, _explain(proc)
    for text in expected:
        assert text in proc.stdout, f"`make -n {target}` does not run {text!r}:\n{proc.stdout[-2000:]}"


def check_make_demo_and_test(block: Block, tmp_path: Path) -> None:
    assert first_words(block.code) == ["make", "make"] and "make demo" in block.code and "make test" in block.code
    _make_dry_run("demo", "twinseq lengths embedded", "twinseq train --config configs/demo.yaml")
    _make_dry_run("test", 'pytest -q -m "not slow"')


def check_two_gpu_launches(block: Block, tmp_path: Path) -> None:
    """The ring command, verbatim, on this CPU: both ranks refuse it before any work (exit 2, naming CUDA);
    the accelerate command: its config file exists and asks for 2 processes of FSDP2, and the launcher parses."""
    root = make_workspace(tmp_path / "ws")
    ring = [c for c in logical_lines(block.code) if "--context-parallel-strategy ring" in c]
    assert len(ring) == 1, ring
    proc = run_shell(ring[0], root, timeout=300)
    assert proc.returncode != 0, _explain(proc)
    refusal = "context_parallel_strategy='ring' uses torch's ring attention, which needs CUDA SDPA"
    assert proc.stderr.count(refusal) == 2, _explain(proc)
    assert re.search(r"exitcode\s*:\s*2\b", proc.stderr), f"a rank did not exit with status 2:\n{_explain(proc)}"

    launch = [c for c in logical_lines(block.code) if "accelerate launch" in c]
    assert len(launch) == 1, launch
    words = shlex.split(launch[0])
    config = yaml.safe_load((REPO / words[words.index("--config_file") + 1]).read_text())
    assert config["num_processes"] == 2 and config["distributed_type"] == "FSDP"
    assert config["fsdp_config"]["fsdp_version"] == 2
    assert config["parallelism_config"]["parallelism_config_cp_size"] == 2
    proc = run_shell(f"{words[0]} launch --help", root, timeout=120)
    assert proc.returncode == 0 and "--config_file" in proc.stdout, _explain(proc)


def check_vllm(block: Block, tmp_path: Path) -> None:
    """Without .venv-vllm the same command in .venv is refused (exit 2, naming vLLM); with it, the block runs."""
    root = make_workspace(tmp_path / "ws")
    assert re.search(r"^setup-vllm:", (REPO / "Makefile").read_text(), re.M), "the Makefile has no setup-vllm"
    (command,) = logical_lines(block.code)
    assert command.startswith(".venv-vllm/bin/twinseq train"), command
    proc = run_shell(command.replace(".venv-vllm/bin/", ".venv/bin/", 1), root, timeout=300)
    assert proc.returncode == 2 and "use_vllm=True needs vLLM, which is not installed" in proc.stderr, _explain(proc)
    if (REPO / ".venv-vllm" / "bin" / "twinseq").exists():
        run_block_and_check(block, root)


def check_gpu_lane(block: Block, tmp_path: Path) -> None:
    _make_dry_run("gpu-wheels", "bash benchmarks/gpu/fetch_wheels.sh")
    assert "benchmarks/gpu/wheels.txt" in (REPO / "benchmarks/gpu/fetch_wheels.sh").read_text()
    assert (REPO / "benchmarks/gpu/wheels.txt").is_file()
    proc = run_shell("bash benchmarks/gpu/run_all.sh --help", REPO, timeout=60)
    assert proc.returncode == 0 and "lane" in proc.stdout and "bench" in proc.stdout, _explain(proc)
    proc = run_shell("bash benchmarks/gpu/run_all.sh", REPO, timeout=60)
    assert proc.returncode == 2 and "usage" in proc.stderr, _explain(proc)


def check_run_by_test_api(block: Block, tmp_path: Path) -> None:
    """The README's SFTTrainer script is ``SFT_SCRIPT`` of tests/test_api.py, which runs it as a file in a fresh
    python on both backends and checks more than that it runs (24 steps, a falling ``eval_loss``, the adapter
    saved): a third run here would add half a minute and no claim. Checked: the block is that script (jax
    backend) character for character, and the test that runs it still exists."""
    tree = ast.parse((REPO / "tests" / "test_api.py").read_text())
    scripts = [
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and [t.id for t in node.targets if isinstance(t, ast.Name)] == ["SFT_SCRIPT"]
    ]
    assert len(scripts) == 1, "tests/test_api.py has no SFT_SCRIPT: run this block here again (drop its entry)"
    assert block.code == scripts[0].replace("BACKEND", '"jax"'), (
        f"{block.id} differs from tests/test_api.py's SFT_SCRIPT: make them the same script again"
    )
    tests = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    assert "test_the_readme_sft_script_trains_lora_and_eval_loss_falls" in tests, sorted(tests)


@dataclass(frozen=True)
class CannotRun:
    file: str
    marker: str  # a piece of text that only this block of that file holds
    reason: str
    check: Callable[[Block, Path], None]
    slow: bool = False


CANNOT_RUN = [
    CannotRun(
        "README.md",
        "make demo",
        "make demo / make test set up .venv (network) and make test runs this suite "
        "(recursive); checked: both targets exist and `make -n` prints their commands",
        check_make_demo_and_test,
    ),
    CannotRun(
        "README.md",
        "accelerate launch",
        "needs 2 CUDA GPUs (accelerate FSDP2 config; torch's ring attention); "
        "checked: the ring command is refused on CPU by both ranks with exit 2 naming CUDA, the accelerate "
        "config asks for 2 FSDP2 processes with cp=2, `accelerate launch --help` parses",
        check_two_gpu_launches,
        slow=True,
    ),
    CannotRun(
        "README.md",
        ".venv-vllm/bin/twinseq",
        "needs .venv-vllm (`make setup-vllm`: network, 3.5 GB); "
        "checked: .venv refuses --use-vllm with exit 2 naming vLLM, and the block runs when .venv-vllm exists",
        check_vllm,
        slow=True,
    ),
    CannotRun(
        "README.md",
        "make gpu-wheels",
        "needs the network (make gpu-wheels) and a CUDA GPU (run_all.sh); "
        "checked: the target exists and `make -n` prints it, run_all.sh --help parses and a bare call exits 2",
        check_gpu_lane,
    ),
    CannotRun(
        "README.md",
        'rows = [{"text": f"{n} plus one is {n + 1}."}',
        "run verbatim by tests/test_api.py::test_the_readme_sft_script_trains_lora_and_eval_loss_falls (a file, a "
        "fresh python, both backends); checked: the block is that test's script",
        check_run_by_test_api,
        slow=True,
    ),
]


def cannot_run_entry(block: Block) -> CannotRun | None:
    hits = [c for c in CANNOT_RUN if c.file == block.file and c.marker in block.code]
    assert len(hits) <= 1, f"{block.id}: several CANNOT_RUN entries match"
    return hits[0] if hits else None


# --- running a block and checking its runs ------------------------------------------------------------------------


def trains(block: Block) -> bool:
    if block.lang in SHELL_LANGS:
        return any(TRAIN_CMD.search(c) and "--help" not in c for c in logical_lines(block.code))
    return bool(re.search(r"\.train\(|twinseq\.train\(", block.code))


def run_block_and_check(block: Block, root: Path) -> None:
    for placeholder, build in PLACEHOLDERS.items():
        if placeholder in block.code:
            build(root / placeholder)
    if block.lang in PYTHON_LANGS:
        proc = run_python(block.code, root)
        assert proc.returncode == 0, f"{block.id} does not run as pasted:\n{_explain(proc)}"
        assert "Traceback" not in proc.stderr, _explain(proc)
        return
    code, capped = cap_train_steps(block.code)
    proc = run_shell(code, root)
    assert proc.returncode == 0, f"{block.id} does not run as pasted (train steps capped):\n{code}\n{_explain(proc)}"
    assert "Traceback" not in proc.stderr, _explain(proc)
    dirs = train_output_dirs(block.code, root)
    assert len(dirs) == capped, (dirs, capped)
    for out in dirs:
        metrics = out / "metrics.jsonl"
        assert metrics.is_file(), f"{block.id}: no {metrics.relative_to(root)} after the block ran"
        steps = [json.loads(x)["step"] for x in metrics.read_text().splitlines() if x.strip() and '"loss"' in x]
        assert steps and steps[-1] == STEP_CAP, (
            f"{block.id}: {out.relative_to(root)} ended at step {steps[-1:]} "
            f"(expected the appended --max-steps {STEP_CAP} to win)"
        )


def _param(block: Block):
    entry = cannot_run_entry(block)
    slow = entry.slow if entry else True  # every runnable block: the full tier (the fast one is at its budget)
    return pytest.param(block, id=block.id, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_block(block: Block, tmp_path):
    entry = cannot_run_entry(block)
    if entry is not None:
        entry.check(block, tmp_path)
    else:
        run_block_and_check(block, make_workspace(tmp_path / "ws"))


# --- invariants of the collection itself (fast) -------------------------------------------------------------------


def test_every_block_is_collected_and_the_tables_are_live():
    """The docs hold shell and python blocks, every fence language is one this file knows, and every CANNOT_RUN and
    PLACEHOLDERS entry still matches a block (a stale entry would excuse nothing)."""
    unknown = [(b.id, b.lang) for b in ALL_BLOCKS if b.lang not in SHELL_LANGS | PYTHON_LANGS | NOT_CODE_LANGS]
    assert not unknown, f"fences in a language this test neither runs nor knows to skip: {unknown}"
    files = {b.file for b in BLOCKS}
    assert {"README.md", "docs/memory.md", "docs/models.md", "docs/peft.md"} <= files, files
    assert sum(b.lang in SHELL_LANGS for b in BLOCKS) >= 15 and sum(b.lang in PYTHON_LANGS for b in BLOCKS) >= 5
    for entry in CANNOT_RUN:
        matches = [b.id for b in BLOCKS if b.file == entry.file and entry.marker in b.code]
        assert len(matches) == 1, f"CANNOT_RUN entry {entry.marker!r} matches {matches} (exactly one block expected)"
    for placeholder in PLACEHOLDERS:
        assert any(placeholder in b.code for b in BLOCKS), f"placeholder {placeholder!r} is in no block"
    assert len(CANNOT_RUN) <= 6, "the cannot-run table is meant to stay small"


@pytest.mark.parametrize("block", [pytest.param(b, id=b.id) for b in BLOCKS if b.lang in SHELL_LANGS])
def test_shell_block_commands_resolve_in_a_fresh_shell(block: Block):
    """Every command of a shell block (run or not) is a path (``.venv/bin/twinseq``), a shell word, or on the PATH
    of a shell without the virtual environment: ``twinseq``, ``torchrun``, ``accelerate`` alone are not."""
    path = user_env()["PATH"]
    words = [w for w in first_words(block.code) if "/" not in w and w not in SHELL_WORDS]
    missing = [w for w in words if not shutil.which(w, path=path)]
    assert not missing, f"{block.id}: not found in a fresh shell: {missing} (write .venv/bin/NAME)"


def test_the_step_cap_goes_at_the_end_of_each_train_command():
    code = (
        ".venv/bin/twinseq train --model-config tiny \\\n    --output-dir runs/a  # a comment\n"
        "printf 'x' | .venv/bin/twinseq chat --model runs/a/final\n"
        ".venv/bin/twinseq train --help\n"
        "WANDB_MODE=offline .venv/bin/twinseq train --run-name 'a # b' | tee log\n"
        ".venv/bin/torchrun --nproc-per-node 2 -m twinseq.common.cli train --config configs/tiny.yaml\n"
    )
    capped, count = cap_train_steps(code, 7)
    assert count == 3
    assert capped.splitlines() == [
        ".venv/bin/twinseq train --model-config tiny      --output-dir runs/a --max-steps 7 # a comment",
        "printf 'x' | .venv/bin/twinseq chat --model runs/a/final",
        ".venv/bin/twinseq train --help",
        "WANDB_MODE=offline .venv/bin/twinseq train --run-name 'a # b' --max-steps 7 | tee log",
        ".venv/bin/torchrun --nproc-per-node 2 -m twinseq.common.cli train --config configs/tiny.yaml --max-steps 7",
    ]
    assert first_words(code) == [
        ".venv/bin/twinseq",
        "printf",
        ".venv/bin/twinseq",
        ".venv/bin/twinseq",
        ".venv/bin/twinseq",
        "tee",
        ".venv/bin/torchrun",
    ]
    assert [d.name for d in train_output_dirs(code, REPO)] == ["a", "latest", "tiny"]


def test_a_block_run_elsewhere_must_be_that_tests_script():
    """The README's SFTTrainer block passes the check as it is; the same block with one number changed does not
    (it would then be a script no test runs)."""
    (block,) = [b for b in BLOCKS if cannot_run_entry(b) and cannot_run_entry(b).check is check_run_by_test_api]
    check_run_by_test_api(block, Path("."))
    changed = Block(block.file, block.line, block.lang, block.code.replace("max_steps=24", "max_steps=25"))
    assert changed.code != block.code
    with pytest.raises(AssertionError, match="differs from tests/test_api.py's SFT_SCRIPT"):
        check_run_by_test_api(changed, Path("."))
