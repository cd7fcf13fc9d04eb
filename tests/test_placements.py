"""Per-parameter placements: a parameter's spec names the role groups that reduce, shard and
count it; buckets never mix placements (here and in the cost model), and a model whose
parameters carry the expert placement trains exactly as the dense one while the expert roles
span the dense axes."""

from dataclasses import replace

import pytest
import torch

from hybrid.dp import GradSync
from hybrid.groups import ParallelGroups
from hybrid.optim import lr_at
from hybrid.planning.cost.state_bytes import bucket_members, bucket_tag, late_axis
from hybrid.planning.layout import Layout, role_key
from hybrid.planning.param_spec import DENSE, EXPERT, replicated_spec
from hybrid.testing import spawn
from test_dp import CLIP, MICRO, OPTIM, TINY_BUCKETS_MB, Toy, global_batch, reference_step

pytestmark = pytest.mark.timeout(180)


def test_expert_roles_are_the_dense_groups_at_ep_1_and_their_own_above():
    pairs = (("gradient", EXPERT.reduce_role), ("sharding", EXPERT.shard_role),
             ("model", EXPERT.norm_role))
    for layout in (Layout(dp=4, tp=2, pp=2), Layout(dp=2, cp=2, tp=2)):
        for dense, expert in pairs:
            assert role_key(dense) != role_key(expert)
            assert layout.role_groups(dense) == layout.role_groups(expert)
    layout = Layout(dp=4, tp=2, ep=2)  # 8 ranks, tp fastest: ep pairs dp neighbours
    assert layout.role_groups("expert") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert layout.role_groups("expert_gradient") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert layout.role_groups("expert_model") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.role_size("expert_sharding") == 2 and layout.role_size("sharding") == 4
    assert replicated_spec("w", (2, 2)).placement == DENSE


def test_bucket_tags_keep_placements_apart_and_dense_tags_unchanged():
    assert [bucket_tag(late, DENSE) for late in ("", "tp", "embedding")] == \
        ["", "tp", "embedding"]
    expert, late_expert = bucket_tag("", EXPERT), bucket_tag("tp", EXPERT)
    assert (late_axis(expert), late_axis(late_expert)) == ("", "tp")
    # registration order: dense, expert, dense, expert (tp-late), dense (tp-late)
    tensors = [(10, ""), (20, expert), (30, ""), (5, late_expert), (6, "tp")]
    members = bucket_members(tensors, bucket_mb=1.0)
    assert members == [[2, 0], [1], [4], [3]]  # backward order, one tag per bucket
    dense_only = [(10, ""), (30, ""), (6, "tp")]
    assert bucket_members(dense_only, bucket_mb=1.0) == [[1, 0], [2]]


def _expert_toy() -> Toy:
    """``Toy`` with its input linear declared an expert's."""
    model = Toy()
    for name, param in model.named_parameters():
        spec = replicated_spec(name, tuple(param.shape))
        param.spec = replace(spec, placement=EXPERT) if name.startswith("inp.") else spec
    return model


def _train(rank, world, zero, steps=4, microbatches=2):
    groups = ParallelGroups.create(Layout(dp=world))
    model, ref = _expert_toy(), Toy()
    from hybrid.optim import build_adamw, spec_of

    ref_opt = build_adamw([(p, spec_of(p, n).weight_decay) for n, p in ref.named_parameters()],
                          OPTIM)
    sync = GradSync(model, groups, OPTIM, bucket_mb=TINY_BUCKETS_MB, zero=zero)
    placements = [{spec_of(p).placement for p in b.params} for b in sync.buckets]
    out = {"placements": placements, "norm": [], "ref_norm": [],
           "groups": [b.group.ranks for b in sync.buckets]}
    for step in range(1, steps + 1):
        x, y = global_batch(step, world * microbatches * MICRO)
        lr = lr_at(step, OPTIM, steps)
        sync.start_step(microbatches)
        for chunk in range(microbatches):
            rows = slice((rank * microbatches + chunk) * MICRO,
                         (rank * microbatches + chunk + 1) * MICRO)
            (model(x[rows], y[rows]) / microbatches).backward()
        out["norm"].append(sync.finish_step(lr=lr, max_norm=CLIP))
        out["ref_norm"].append(reference_step(ref, ref_opt, x, y, world * microbatches, lr)[1])
    out["same"] = all(torch.allclose(p, r, rtol=1e-5, atol=1e-7)
                      for p, r in zip(model.parameters(), ref.parameters()))
    out["gradient"] = groups.gradient.ranks
    return out


@pytest.mark.parametrize("zero", [0, 1])
def test_expert_placed_parameters_train_as_the_1_process_model(zero):
    for result in spawn(_train, 2, zero):
        assert all(len(p) == 1 for p in result["placements"])
        assert {EXPERT} in result["placements"] and {DENSE} in result["placements"]
        assert all(g == result["gradient"] for g in result["groups"])
        torch.testing.assert_close(result["norm"], result["ref_norm"], rtol=1e-5, atol=0)
        assert result["same"]
