"""The training methods are data (``common.tasks.TaskSpec``): every per-task list is derived from the registry, and
no module outside a method's own files lists the tasks again.

What is checked:
- no tuple, list, set or dict literal in ``common``, ``torch_backend`` or ``jax_backend`` names two or more tasks,
  outside the ``TaskSpec(...)`` declarations and a short allow-list with its reasons (the scanner finds a planted
  list: negative control);
- the config's task choices, sections, learning rates, online and reference tasks are the specs';
- each spec's builder resolves in both backend packages, its evaluator in ``common``, its API classes are
  ``twinseq``'s;
- a task without hand-written API classes gets generated ones that train (the recipe's "nothing else lists it").
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import twinseq
from twinseq.common import api
from twinseq.common.config import (
    DEFAULT_LEARNING_RATES,
    ONLINE_TASKS,
    REFERENCE_TASKS,
    TASK_SECTIONS,
    TASKS,
    TrainConfig,
)
from twinseq.common.errors import ConfigError
from twinseq.common.tasks import TaskSpec, resolve, task_spec, task_specs

ROOT = Path(__file__).resolve().parents[1]
ALLOWED = {
    "common/objectives/grpo_loss.py": "loss types named after the methods (loss_type='rloo'), not a task list",
    "torch_backend/recipes.py": "the ZeRO-3 variant's own builder table: the tasks DeepSpeed runs",
}


def task_lists(source: str, names: set[str]) -> list[int]:
    """Lines of collection literals naming two or more of ``names``, outside ``TaskSpec(...)`` calls."""
    tree = ast.parse(source)
    inside_spec = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TaskSpec":
            inside_spec.update(id(n) for n in ast.walk(node))
    lines = []
    for node in ast.walk(tree):
        if id(node) in inside_spec:
            continue
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            elts = node.elts
        elif isinstance(node, ast.Dict):
            elts = [k for k in node.keys if k is not None]
        else:
            continue
        if len({e.value for e in elts if isinstance(e, ast.Constant) and e.value in names}) >= 2:
            lines.append(node.lineno)
    return lines


def test_the_scanner_finds_a_task_list():
    names = set(TASKS)
    assert task_lists('ONLINE = ("grpo", "rloo")\n', names) == [1]
    assert task_lists('RATES = {"sft": 1, "dpo": 2}\n', names) == [1]
    assert task_lists('spec = TaskSpec(name="kto", sections=("dpo", "kto"))\n', names) == []
    assert task_lists('one = ("grpo", "other")\n', names) == []


def test_no_module_lists_the_tasks_outside_the_registry():
    found = []
    for layer in ("common", "torch_backend", "jax_backend"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel not in ALLOWED:
                found += [f"{rel}:{line}" for line in task_lists(path.read_text(), set(TASKS))]
    assert not found, f"per-task lists outside common.tasks' registry (declare a TaskSpec field instead): {found}"


def test_the_config_reads_the_registry():
    specs = task_specs()
    assert TASKS == tuple(s.name for s in specs) == ("sft", "dpo", "grpo", "rloo", "kto")
    assert ONLINE_TASKS == tuple(s.name for s in specs if s.online)
    assert REFERENCE_TASKS == tuple(s.name for s in specs if s.reference)
    for spec in specs:
        for section in spec.sections:
            assert spec.name in TASK_SECTIONS[section]
            assert section in TrainConfig.__dataclass_fields__
        assert DEFAULT_LEARNING_RATES[(spec.name, False)] == spec.learning_rate
        assert DEFAULT_LEARNING_RATES[(spec.name, True)] == spec.peft_learning_rate
    # a section is refused on the tasks whose spec does not list it
    with pytest.raises(ConfigError, match="kto_loss_type"):
        TrainConfig.from_flat(task="dpo", kto_loss_type="apo_zero_unpaired")


@pytest.mark.parametrize("spec", task_specs(), ids=lambda s: s.name)
def test_each_spec_resolves_everywhere(spec):
    assert callable(resolve(spec.builder, "twinseq.torch_backend"))
    assert callable(resolve(spec.builder, "twinseq.jax_backend"))
    assert spec.evaluator is None or callable(resolve(spec.evaluator))
    trainer = api.TRAINERS[spec.name]
    assert trainer.__name__ == spec.trainer and getattr(twinseq, spec.trainer) is trainer
    assert trainer.config_class.__name__ == spec.config_name and trainer.config_class.TASK == spec.name
    if spec.kl_beta is not None:
        name = spec.kl_beta.split(".")[1]
        assert TrainConfig.from_flat(task=spec.name, **{name: 0.05}).reference_kl_beta == 0.05


def test_an_unknown_task_is_refused_with_the_choices():
    with pytest.raises(ConfigError, match=r"task='ppo' is not a twinseq task; choose one of \['sft', 'dpo'"):
        task_spec("ppo")
    with pytest.raises(AttributeError, match="module 'twinseq' has no attribute 'PPOTrainer'"):
        twinseq.PPOTrainer  # noqa: B018


def test_a_task_without_written_classes_gets_generated_ones_that_train(tmp_path):
    """The API a new method gets from its spec alone: ``<Name>Config`` / ``<Name>Trainer`` on the task's builder
    (here SFT's spec under another class name, trained for one step)."""
    spec = TaskSpec(name="sft", trainer="ShadowSFTTrainer", builder="trainer:build_sft")
    trainer_class = api._generated_trainer(spec)
    assert trainer_class.__name__ == "ShadowSFTTrainer" and trainer_class.config_class.__name__ == "ShadowSFTConfig"
    assert trainer_class.__mro__[1] is api._Trainer
    args = trainer_class.config_class(output_dir=str(tmp_path), max_steps=1, max_length=32, disable_tqdm=True)
    rows = [{"prompt": f"q{i}", "completion": f" a{i}"} for i in range(4)]
    out = trainer_class(model="tiny", args=args, train_dataset=rows, backend="torch").train()
    assert out.global_step == 1 and out.training_loss > 0
    online = api._generated_trainer(TaskSpec(name="grpo", trainer="ShadowGRPOTrainer", builder="grpo:build_grpo",
                                             online=True))
    assert issubclass(online, api.GRPOTrainer)
