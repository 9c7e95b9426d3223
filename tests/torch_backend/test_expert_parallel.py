"""Expert parallelism (``torch_backend.expert_parallel``) on 2 gloo processes, the tiny MoE presets.

Invariants (float32):
- with the experts sharded over 2 ranks (each rank its own documents, tokens exchanged by ``all_to_all_single``),
  the loss summed over ranks equals the unsharded model's loss on all documents within 1e-5 relative, and every
  gradient within 1e-5 relative (expert tensors slice by slice, replicated tensors summed over ranks);
- every token copy reaches its expert: per layer and expert, the copies the routers sent equal the copies the
  owning rank computed, ``tokens * top_k`` per layer in all (no capacity drop);
- negative controls: the exchange without its backward leaves the loss equal and the gradients wrong; a rank's
  experts in the wrong order change the loss; the checks see both.
- what expert parallelism cannot shard is refused, naming the field, the value and the fix.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).parent))
import _dist_workers as W  # noqa: E402
import _ep_workers as E  # noqa: E402

from twinseq.common.config import ModelConfig  # noqa: E402
from twinseq.common.errors import ConfigError  # noqa: E402
from twinseq.torch_backend.expert_parallel import check_expert_parallel  # noqa: E402

REL = 1e-5
WORLD = 2
PRESETS = ("tiny-qwen3-moe", "tiny-mixtral")


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict]:
    jobs = [{"name": p, "preset": p} for p in PRESETS]
    jobs += [
        {"name": c, "preset": "tiny-qwen3-moe", "control": c} for c in ("misplaced_experts", "no_backward_exchange")
    ]
    return W.launch_script(E.__file__, {"jobs": jobs}, tmp_path_factory.mktemp("ep"), WORLD)  # control last


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_expert_parallel_equals_the_unsharded_model(results, preset):
    for rank in results:
        r = rank[preset]
        assert abs(r["loss"] - r["ref_loss"]) <= REL * abs(r["ref_loss"]), r
        worst = max(r["grad_rel"].values())
        print(
            f"{preset} ep={WORLD}: loss rel {abs(r['loss'] - r['ref_loss']) / r['ref_loss']:.2e}, "
            f"worst grad rel {worst:.2e} over {len(r['grad_rel'])} tensors"
        )
        assert worst <= REL, sorted(r["grad_rel"].items(), key=lambda kv: -kv[1])[:3]


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_every_token_copy_reaches_its_expert(results, preset):
    cfg = ModelConfig.preset(preset, vocab_size=E.VOCAB)
    moe_layers = sum(cfg.layer_is_moe(i) for i in range(cfg.num_hidden_layers))
    for rank in results:
        r = rank[preset]
        assert r["missing_copies"] == 0
        assert r["received_copies"] == r["tokens"] * cfg.num_experts_per_tok * moe_layers


@pytest.mark.slow
def test_negative_controls_are_seen(results):
    misplaced, detached = results[0]["misplaced_experts"], results[0]["no_backward_exchange"]
    print(
        f"controls: misplaced experts loss rel {abs(misplaced['loss'] / misplaced['ref_loss'] - 1):.2e}, "
        f"no backward exchange worst grad rel {max(detached['grad_rel'].values()):.2e}"
    )
    assert abs(misplaced["loss"] - misplaced["ref_loss"]) > 100 * REL * misplaced["ref_loss"]
    assert abs(detached["loss"] - detached["ref_loss"]) <= REL * detached["ref_loss"]  # the forward is right
    assert max(detached["grad_rel"].values()) > 100 * REL


def test_what_cannot_be_sharded_is_refused():
    from twinseq.torch_backend.expert_parallel import shard_experts
    from twinseq.torch_backend.model import build_model

    assert not torch.distributed.is_initialized()
    with pytest.raises(ConfigError, match="torch.distributed is not initialised"):
        shard_experts(build_model(ModelConfig.preset("tiny-qwen3-moe", vocab_size=E.VOCAB)))
    with pytest.raises(ConfigError, match="num_experts=6 .*expert_parallel_size=4"):
        check_expert_parallel(6, 4, [object()])
    with pytest.raises(ConfigError, match="no MoE layer"):
        check_expert_parallel(0, 2, [])
