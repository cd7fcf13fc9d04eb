"""The analytical estimates behind hybrid-plan (pure arithmetic)."""

from dataclasses import replace

import pytest

from hybrid.planning.config import ModelConfig
from hybrid.planning.cost.sizes import block_params, estimate_memory, param_count

MODEL = ModelConfig(layers=8, hidden=64, heads=4, vocab=256, seq_len=32)
ALL = list(range(MODEL.layers + 2))


def estimate(chunks, **kwargs):
    args = {"tp": 1, "dp": 1, "zero": 0, "micro_batch": 2, "inflight": 1, "sp": False,
            "precision": "fp32", **kwargs}
    return estimate_memory(args.pop("model", MODEL), chunks, **args)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_shards_sum_to_the_model_and_replicated_parts_repeat(tp):
    blocks = block_params(MODEL)
    sharded = sum(b.sharded for b in blocks)
    replicated = sum(b.replicated for b in blocks)
    assert sharded + replicated == param_count(MODEL)
    assert estimate([ALL], tp=tp).params * tp == sharded + tp * replicated


def test_zero1_divides_only_the_optimizer_state_by_dp():
    plain, zero = estimate([ALL], dp=4), estimate([ALL], dp=4, zero=1)
    assert zero.optimizer_bytes * 4 == plain.optimizer_bytes == 8 * plain.params
    assert (zero.param_bytes, zero.grad_bytes) == (plain.param_bytes, plain.grad_bytes)


def test_activations_scale_with_inflight_and_with_layers_per_chunk_not_per_rank():
    one = estimate([[1, 2]], inflight=1).activation_bytes
    assert estimate([[1, 2]], inflight=3).activation_bytes == pytest.approx(3 * one, abs=3)
    # two chunks of two layers each hold one chunk's layers per (chunk, micro-batch) pair
    assert estimate([[1, 2], [5, 6]], inflight=3).activation_bytes == pytest.approx(3 * one,
                                                                                   abs=3)


def test_recompute_and_sequence_parallel_shrink_activations():
    full = estimate([ALL], inflight=4, tp=2).activation_bytes
    assert estimate([ALL], inflight=4, tp=2, sp=True).activation_bytes < full
    recomputed = estimate([ALL], inflight=4, tp=2, model=replace(MODEL, recompute="full"))
    assert recomputed.activation_bytes < full / 4
    selective = estimate([ALL], inflight=4, tp=2, model=replace(MODEL, recompute="selective"))
    assert recomputed.activation_bytes < selective.activation_bytes < full
    # bf16 halves the matmuls' tensors; the residual stream and norms stay fp32
    assert estimate([ALL]).activation_bytes / 2 < estimate([ALL], precision="bf16") \
        .activation_bytes < estimate([ALL]).activation_bytes
