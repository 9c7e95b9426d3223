"""vLLM in colocate mode: a ``vllm.LLM`` owned by the training process, sharing its GPU.

Online RL generates with the policy being trained. In colocate mode each training rank owns a vLLM
engine on its own GPU (no separate server): vLLM takes ``gpu_memory_utilization`` of the GPU for its
weights and KV cache, and, with ``enable_sleep_mode``, hands that memory back between generation
phases. The cycle per optimizer step:

1. the trainer steps the optimizer;
2. ``sync_weights(model)``: wake vLLM's weights, copy the policy's HF-named tensors in with vLLM's own
   ``load_weights`` (under ZeRO-3 the partitioned parameters are gathered first, one at a time);
3. ``generate(prompts)``: wake the KV cache, generate token ids;
4. ``sleep()``: level 1 offloads the weights to CPU memory and drops the KV cache; level 2 drops both
   (the next ``sync_weights`` writes every weight anyway, so level 2 costs nothing more per step).

vLLM starts from ``load_format="dummy"`` on a folder holding only ``config.json``: the real weights
arrive through the first ``sync_weights``, so no checkpoint is written and no tokenizer is loaded
(prompts and completions are token ids).

vLLM is CUDA-only here (the ``gpu`` extra), and sleep mode needs CUDA's memory pool: ``check_vllm``
refuses both on a CPU machine with the fix.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch

from twinseq.common.errors import ConfigError, MissingDependencyError

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'twinseq[gpu]' (vllm==0.32.0, which pins torch 2.13.0)"
SLEEP_LEVELS = (1, 2)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def check_vllm(*, enable_sleep_mode: bool = False, sleep_level: int = 1, gpu_memory_utilization: float = 0.3,
               cuda_available: Optional[bool] = None) -> None:
    """Raise what keeps a colocated vLLM engine from running here, with the fix (before anything loads).

    ``MissingDependencyError`` without vllm; ``ConfigError`` for a knob out of range, for sleep mode
    without CUDA (it pauses CUDA's memory pool), and for vLLM itself without CUDA.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"vllm_gpu_memory_utilization={gpu_memory_utilization!r} is not valid: it must be in "
                          f"(0, 1], the share of the GPU vLLM may take (0.3 leaves the rest to training).")
    if sleep_level not in SLEEP_LEVELS:
        raise ConfigError(f"sleep_level={sleep_level!r} is not valid; choose 1 (offload the weights to CPU, drop "
                          f"the KV cache) or 2 (drop both; the next weight sync rewrites them).")
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if enable_sleep_mode and not cuda:
        raise ConfigError("vllm_enable_sleep_mode=True needs CUDA: sleep mode pauses vLLM's CUDA memory pool, and "
                          "this machine has no GPU; drop --vllm-enable-sleep-mode (or run on a GPU).")
    if not vllm_available():
        raise MissingDependencyError(f"use_vllm=True needs vLLM, which is not installed; {INSTALL_HINT}, or drop "
                                     f"--use-vllm to generate with Hugging Face generate.")
    if not cuda:
        raise ConfigError("use_vllm=True needs a CUDA GPU (vLLM's colocate engine shares it with training); drop "
                          "--use-vllm to generate with Hugging Face generate on this machine.")


def write_config_folder(hf_config: Any, folder: Optional[str] = None) -> Path:
    """A folder holding only ``config.json`` (from a transformers config), for ``load_format='dummy'``."""
    path = Path(folder or tempfile.mkdtemp(prefix="twinseq-vllm-"))
    path.mkdir(parents=True, exist_ok=True)
    values = hf_config.to_dict()
    values["architectures"] = values.get("architectures") or [type(hf_config).__name__.replace("Config",
                                                                                             "ForCausalLM")]
    (path / "config.json").write_text(json.dumps(values, indent=2, default=str))
    return path


@contextlib.contextmanager
def _gathered(param: torch.nn.Parameter) -> Iterator[torch.Tensor]:
    """The full tensor of ``param``: as it is, or gathered for the block under ZeRO-3 (a collective)."""
    if hasattr(param, "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield param.data
    else:
        yield param.data


class ColocatedVLLM:
    """A ``vllm.LLM`` in this process, on this rank's GPU, fed the policy's weights after each step.

    >>> engine = ColocatedVLLM(model.config, gpu_memory_utilization=0.3, enable_sleep_mode=True)  # doctest: +SKIP
    >>> engine.sync_weights(model); engine.generate([[1, 2, 3]], max_new_tokens=8); engine.sleep()  # doctest: +SKIP
    """

    def __init__(self, hf_config: Any, *, gpu_memory_utilization: float = 0.3, enable_sleep_mode: bool = False,
                 sleep_level: int = 1, max_model_len: Optional[int] = None, dtype: str = "auto", seed: int = 0,
                 folder: Optional[str] = None) -> None:
        check_vllm(enable_sleep_mode=enable_sleep_mode, sleep_level=sleep_level,
                   gpu_memory_utilization=gpu_memory_utilization)
        import torch.distributed as dist
        from vllm import LLM

        self.sleep_level, self.enable_sleep_mode = sleep_level, enable_sleep_mode
        self.sleeping: set[str] = set()  # what vLLM has released: "weights", "kv_cache"
        # each training rank owns one engine on its own GPU ("external_launcher": no vLLM worker processes)
        launched = dist.is_initialized() and dist.get_world_size() > 1
        self.llm = LLM(model=str(write_config_folder(hf_config, folder)), load_format="dummy",
                       skip_tokenizer_init=True, gpu_memory_utilization=gpu_memory_utilization,
                       enable_sleep_mode=enable_sleep_mode, max_model_len=max_model_len, dtype=dtype,
                       seed=seed + (dist.get_rank() if launched else 0),
                       **({"distributed_executor_backend": "external_launcher"} if launched else {}))

    def _runner_model(self) -> Any:
        """vLLM's model object (its ``load_weights`` takes HF names), found where 0.10-0.32 keep it."""
        executor = self.llm.llm_engine.model_executor
        worker = getattr(executor, "driver_worker", None)
        for path in (("worker", "model_runner", "model"), ("model_runner", "model")):
            obj = worker
            for attr in path:
                obj = getattr(obj, attr, None)
            if obj is not None and hasattr(obj, "load_weights"):
                return obj
        raise RuntimeError(f"cannot find the model inside vLLM {__import__('vllm').__version__}'s executor to load "
                           f"weights into; pin vllm==0.32.0 ({INSTALL_HINT}).")

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take back what ``sleep`` released (``tags``: "weights", "kv_cache"; None: both)."""
        waking = [t for t in (tags or ["weights", "kv_cache"]) if t in self.sleeping]
        if waking:
            self.llm.wake_up(tags=waking)
            self.sleeping -= set(waking)

    def sleep(self) -> None:
        """Give the GPU memory back to training until the next ``sync_weights``/``generate``."""
        if self.enable_sleep_mode and not self.sleeping:
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = {"weights", "kv_cache"}

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> int:
        """Copy every parameter of ``model`` (HF names; a tied weight once) into vLLM; returns the count.

        Under ZeRO-3 each parameter is gathered in turn (every rank must call this), so no rank holds more
        than one full tensor beyond vLLM's copy.
        """
        self.wake_up(tags=["weights"])
        target = self._runner_model()
        count = 0
        for name, param in model.named_parameters():
            with _gathered(param) as full:
                target.load_weights(weights=[(name, full)])
            count += 1
        self.llm.reset_prefix_cache()
        return count

    def generate(self, prompts: Sequence[Sequence[int]], *, max_new_tokens: int = 16, temperature: float = 1.0,
                 top_p: float = 1.0, top_k: int = -1, do_sample: bool = True, seed: Optional[int] = None,
                 ) -> list[list[int]]:
        """Completion token ids of each prompt (token ids); greedy with ``do_sample=False``."""
        from vllm import SamplingParams

        self.wake_up(tags=["kv_cache"])
        params = SamplingParams(max_tokens=max_new_tokens, temperature=temperature if do_sample else 0.0,
                                top_p=top_p, top_k=top_k, seed=seed)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params,
                                    use_tqdm=False)
        return [list(out.outputs[0].token_ids) for out in outputs]
