"""Peak resident memory of training steps, LoRA vs QLoRA, in a fresh process (run by test_peft.py).

``python _peft_memory.py {lora,qlora}`` pins glibc's mmap threshold (``memory.return_large_frees_to_the_os``),
builds an 8-layer, H=512 Llama (34M decoder-linear parameters), adds
r=8 adapters on every linear layer (QLoRA: the decoder's linear layers in NF4 first), frees what building left
behind, runs one warm-up step, resets the kernel's peak-RSS mark (``/proc/self/clear_refs`` 5), runs 3 optimizer steps and prints one
JSON line: ``VmHWM`` (peak RSS since the reset: the resident weights, the adapters, AdamW's state and the
activations of the steps) and ``VmRSS`` before the steps.
"""

import ctypes
import gc
import json
import sys

import numpy as np
import torch


def _status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def main(kind: str) -> None:
    from twinseq.common.data.batching import collate
    from twinseq.common.models.configs import ModelConfig
    from twinseq.common.models.peft import PeftConfig
    from twinseq.torch_backend.model import build_model, compute_loss
    from twinseq.torch_backend.peft import add_adapters

    torch.set_num_threads(1)
    # both runs under one allocator rule (memory.return_large_frees_to_the_os: freed buffers leave the process)
    # (with glibc's dynamic threshold the same runs gave LoRA 729-732 MiB, QLoRA 653-678 MiB)
    from twinseq.torch_backend.memory import return_large_frees_to_the_os

    assert return_large_frees_to_the_os(), "this measurement needs glibc"
    cfg = ModelConfig.preset("tiny", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                             num_attention_heads=8, num_key_value_heads=8, head_dim=64)
    peft = PeftConfig(use_peft=True, lora_r=8, lora_alpha=16, lora_dropout=0.0, load_in_4bit=kind == "qlora")
    model = add_adapters(build_model(cfg), cfg, peft)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    rng = np.random.default_rng(0)
    batch = collate([{"input_ids": rng.integers(3, cfg.vocab_size, 64).tolist()} for _ in range(2)])

    def step() -> None:
        compute_loss(model, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up: pages in the kernels' code and AdamW's state, which both runs hold alike
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    rss_before = _status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    for _ in range(3):
        step()
    print(json.dumps({"kind": kind, "peak_rss_bytes": _status("VmHWM"), "rss_before_steps_bytes": rss_before,
                      "param_bytes": sum(p.untyped_storage().nbytes() for p in model.parameters())}))


if __name__ == "__main__":
    main(sys.argv[1])
