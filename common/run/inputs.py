"""What a Python caller hands a run beside its ``TrainConfig``: the objects a YAML file cannot hold.

``twinseq train`` reads everything from the config: the dataset by name, the tokenizer from the model folder, the
reward functions by name. The trainer classes (``twinseq.SFTTrainer``, ...) also take objects: a
``datasets.Dataset`` or a list of rows, a tokenizer, a built model, reward callables, callbacks. They travel in one
``RunInputs`` from the trainer class through ``backend.train(cfg, inputs)`` to the task's builder, and each field
left empty means "as the config says". The config keeps describing the run (``dataset_name`` names what was given,
for the log and for a resume's check).

>>> inputs = RunInputs(train_dataset=[{"text": "hello"}])
>>> inputs.train_dataset is not None, inputs.eval_dataset is None, NO_INPUTS.callbacks
(True, True, ())
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence


@dataclass
class RunInputs:
    """Objects for one run; each None (or empty) field is read from the config instead."""

    train_dataset: Any = None
    """A ``datasets.Dataset`` / ``IterableDataset`` / ``DatasetDict`` split, a list of row dicts, or a dict of
    columns (None: ``dataset_name``)."""
    eval_dataset: Any = None
    """The same kinds, held out for evaluation (None: ``eval_dataset_name`` / ``eval_split`` / ``eval_fraction``)."""
    tokenizer: Any = None
    """A ``transformers`` tokenizer or a ``TwinseqTokenizer`` (None: the model folder's, or the embedded one)."""
    model: Any = None
    """A built model of the run's backend (torch: a ``transformers`` ``PreTrainedModel``), trained in place
    (None: ``model_config``)."""
    reward_funcs: Optional[Sequence[Any]] = None
    """GRPO: callables with TRL's signature, or names (None: ``reward_funcs`` of the config)."""
    callbacks: Sequence[Any] = ()
    """``common.run.callbacks.TrainerCallback``-like objects: ``on_log``, ``on_evaluate``, ``on_save``,
    ``on_step_end``."""
    on_built: Optional[Callable[..., None]] = field(default=None, repr=False)
    """Called with keywords ``trainer``, ``source`` (the step source), ``tokenizer`` and ``evaluator`` once the run
    is built: how a trainer class keeps the trained model for ``.model``, ``.evaluate()`` and ``.save_model()``."""


NO_INPUTS = RunInputs()
"""The inputs of a run that reads everything from its config (the CLI's)."""
