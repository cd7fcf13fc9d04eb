"""Split a model's blocks into contiguous pipeline stages (pure; no torch).

The model is a list of blocks: ``n_special[0]`` leading blocks (the embedding), then the L
transformer layers, then ``n_special[1]`` trailing blocks (the head: final norm, output layer
and loss). With the default ``n_special=(1, 1)``: block 0 is the embedding, blocks 1..L the
layers, block L+1 the head. ``partition`` returns one ``range`` of block indices per virtual
stage ``s`` (model order), placed by the stage map (``stage_map.stage_rank`` / ``stage_chunk``).

Every stage gets at least one transformer layer; the leading blocks always go with stage 0 and
the trailing blocks with the last stage.
"""

from __future__ import annotations

from typing import Sequence

from hybrid.planning.schedules.stage_map import Placement
from hybrid.planning.schedules.actions import LOOP, stage_chunk, stage_rank
from hybrid.errors import UserError

PARTITION_MODES = ("uniform", "balanced", "measured")


class PartitionError(UserError):
    """The blocks cannot be split as asked; one line with the fix."""


def partition(costs: Sequence[float], pp: int, vpp: int = 1, mode: str = "uniform",
              n_special: tuple[int, int] = (1, 1)) -> list[range]:
    """Contiguous block ranges, one per virtual stage, covering ``range(len(costs))`` in order.

    ``costs``: one number per block (parameter counts or FLOPs; embedding and head included).
    ``mode="uniform"`` ignores the values and splits the layers as evenly as possible; when
    they do not divide evenly, the earlier stages get one layer more, because the last stage
    already carries the head (the vocabulary projection and the loss), usually the heaviest
    block. ``mode="balanced"`` picks the contiguous split that minimises the largest stage cost;
    ``mode="measured"`` is the same split, named for costs that are measured seconds.
    """
    n_leading, n_trailing = _check_arguments(costs, pp, vpp, mode, n_special)
    n_layers = len(costs) - n_leading - n_trailing
    n_stages = pp * vpp
    if mode == "uniform":
        layer_counts = _uniform_layer_counts(n_layers, n_stages)
    else:
        layer_costs = list(costs[n_leading:n_leading + n_layers])
        layer_counts = _balanced_layer_counts(
            layer_costs, n_stages, sum(costs[:n_leading]), sum(costs[n_leading + n_layers:]))
    return ranges_from_layer_counts(layer_counts, n_leading, len(costs))


def partition_per_stage(stage_costs: Sequence[Sequence[float]],
                        n_special: tuple[int, int] = (1, 1)) -> list[range]:
    """Contiguous block ranges for stages that run at different speeds: ``stage_costs[s]``
    holds every block's cost (seconds) on virtual stage ``s``'s device, so a block costs less
    on a faster stage. The split minimises the largest stage's cost, as ``mode="balanced"``
    does with one cost list (``cost.node_devices``: a stage on a slower node gets fewer
    layers)."""
    n_stages = len(stage_costs)
    lengths = {len(costs) for costs in stage_costs}
    if n_stages < 1 or len(lengths) != 1:
        raise PartitionError(f"{n_stages} stages with block counts {sorted(lengths)}: give "
                             f"every stage one cost per block of the same model")
    n_leading, n_trailing = _check_arguments(stage_costs[0], n_stages, 1, "measured",
                                             n_special)
    for costs in stage_costs[1:]:
        _check_arguments(costs, n_stages, 1, "measured", n_special)
    n_blocks = len(stage_costs[0])
    n_layers = n_blocks - n_leading - n_trailing
    prefixes = []
    for costs in stage_costs:
        prefix = [0.0]
        for cost in costs[n_leading:n_leading + n_layers]:
            prefix.append(prefix[-1] + cost)
        prefixes.append(prefix)

    def group_cost(stage: int, first: int, stop: int) -> float:
        costs = stage_costs[stage]
        extra = (sum(costs[:n_leading]) if stage == 0 else 0) + (
            sum(costs[n_leading + n_layers:]) if stage == n_stages - 1 else 0)
        return prefixes[stage][stop] - prefixes[stage][first] + extra

    smallest_max, _ = _split_layers(n_layers, n_stages, group_cost, max, lambda c: c)
    limit = smallest_max * (1 + 1e-9) + 1e-12
    _, counts = _split_layers(n_layers, n_stages, group_cost, lambda a, b: a + b,
                              lambda c: c * c, limit)
    return ranges_from_layer_counts(counts, n_leading, n_blocks)


def stage_costs(stages: list[range], costs: Sequence[float]) -> list[float]:
    """The total block cost of each stage."""
    return [sum(costs[block] for block in stage) for stage in stages]


def _check_arguments(costs: Sequence[float], pp: int, vpp: int, mode: str,
                     n_special: tuple[int, int]) -> tuple[int, int]:
    if mode not in PARTITION_MODES:
        raise PartitionError(f"unknown partition mode {mode!r}; use one of {PARTITION_MODES}")
    for name, value in (("pp", pp), ("vpp", vpp)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PartitionError(f"{name}={value!r} must be an integer >= 1")
    n_leading, n_trailing = n_special
    if min(n_leading, n_trailing) < 0:
        raise PartitionError(f"n_special={n_special} must count blocks, so be >= 0")
    if any(cost < 0 for cost in costs):
        raise PartitionError("block costs must be >= 0; pass parameter counts or FLOPs")
    n_layers = len(costs) - n_leading - n_trailing
    n_stages = pp * vpp
    if n_layers < n_stages:
        raise PartitionError(
            f"pp*vpp = {pp}*{vpp} = {n_stages} stages need at least {n_stages} transformer "
            f"layers, the model has {max(n_layers, 0)}; lower pp or vpp, or use more layers"
        )
    return n_leading, n_trailing


def _uniform_layer_counts(n_layers: int, n_stages: int) -> list[int]:
    base, extra = divmod(n_layers, n_stages)
    return [base + 1 if stage < extra else base for stage in range(n_stages)]


def _balanced_layer_counts(layer_costs: list[float], n_stages: int, leading_cost: float,
                           trailing_cost: float) -> list[int]:
    """Layers per stage minimising the largest stage cost (linear-partition DP).

    Many splits often share the smallest maximum; among them the one with the smallest sum of
    squared stage costs is taken, so the stages that do not set the maximum are even too.
    """
    prefix = [0.0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def group_cost(stage: int, first: int, stop: int) -> float:
        extra = (leading_cost if stage == 0 else 0) + (
            trailing_cost if stage == n_stages - 1 else 0)
        return prefix[stop] - prefix[first] + extra

    smallest_max, _ = _split_layers(len(layer_costs), n_stages, group_cost, max, lambda c: c)
    # a relative slack, so that float rounding of the prefix sums cannot exclude the optimum
    limit = smallest_max * (1 + 1e-9) + 1e-12
    _, counts = _split_layers(len(layer_costs), n_stages, group_cost,
                              lambda a, b: a + b, lambda c: c * c, limit)
    return counts


def _split_layers(n_layers: int, n_stages: int, group_cost, combine, weight,
                  limit: float = float("inf")) -> tuple[float, list[int]]:
    """Best split of ``n_layers`` into ``n_stages`` non-empty contiguous groups.

    ``best[k][j]``: the best score when the first ``j`` layers fill the first ``k`` stages;
    a split scores ``combine``-folded ``weight(group cost)``, groups above ``limit`` are not
    allowed. O(stages * layers^2), plenty for real depths. Ties keep the smallest cut.
    """
    inf = float("inf")
    best = [[inf] * (n_layers + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layers + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for k in range(1, n_stages + 1):
        # the remaining n_stages - k stages still need one layer each
        last_j = n_layers if k == n_stages else n_layers - (n_stages - k)
        for j in range(k, last_j + 1):
            for i in range(k - 1, j):
                cost = group_cost(k - 1, i, j)
                if cost > limit or best[k - 1][i] == inf:
                    continue
                candidate = combine(best[k - 1][i], weight(cost))
                if candidate < best[k][j]:
                    best[k][j], cut[k][j] = candidate, i
    counts, stop = [], n_layers
    for k in range(n_stages, 0, -1):
        counts.append(stop - cut[k][stop])
        stop = cut[k][stop]
    return best[n_stages][n_layers], counts[::-1]


def ranges_from_layer_counts(layer_counts: Sequence[int], n_leading: int,
                             n_blocks: int) -> list[range]:
    """The block ranges of ``layer_counts`` layers per stage: the ``n_leading`` blocks on the
    first stage, the blocks after the layers (up to ``n_blocks``) on the last."""
    stops, stop = [], n_leading  # stage 0 takes the leading blocks
    for count in layer_counts:
        stop += count
        stops.append(stop)
    stops[-1] = n_blocks  # the last stage takes the trailing blocks
    starts = [0] + stops[:-1]
    return [range(start, stop) for start, stop in zip(starts, stops)]


# ----- printing ------------------------------------------------------------------------------
def block_names(n_blocks: int, n_special: tuple[int, int] = (1, 1)) -> list[str]:
    """``["embedding", "layer 0", ..., "head"]`` (numbered when there are several specials)."""
    n_leading, n_trailing = n_special

    def specials(name: str, count: int) -> list[str]:
        return [name] if count == 1 else [f"{name}.{i}" for i in range(count)]

    n_layers = n_blocks - n_leading - n_trailing
    return (specials("embedding", n_leading) + [f"layer {i}" for i in range(n_layers)]
            + specials("head", n_trailing))


def format_partition(stages: list[range], pp: int, n_layers: int | None = None, *,
                     n_special: tuple[int, int] = (1, 1),
                     costs: Sequence[float] | None = None, placement: Placement = LOOP) -> str:
    """One line per stage, by rank then chunk, e.g.
    ``rank 0 chunk 0 (stage 0): blocks 0-4 [embedding, layer 0..3]`` (+ ``cost`` if given).

    ``n_layers``, if given, is checked against the blocks that ``stages`` cover.
    """
    n_blocks = stages[-1].stop
    if n_layers is not None and n_layers + sum(n_special) != n_blocks:
        raise PartitionError(
            f"the stages cover {n_blocks} blocks, not {n_layers} layers + {sum(n_special)} "
            f"special blocks; partition the same model that you print"
        )
    names = block_names(n_blocks, n_special)
    lines = []
    def place(s: int) -> tuple[int, int]:
        return stage_rank(s, pp, placement), stage_chunk(s, pp, placement)

    for stage in sorted(range(len(stages)), key=place):
        rank, chunk = place(stage)
        blocks = stages[stage]
        span = f"{blocks.start}-{blocks.stop - 1}" if len(blocks) > 1 else f"{blocks.start}"
        line = (f"rank {rank} chunk {chunk} (stage {stage}): blocks {span} "
                f"[{_describe_blocks([names[b] for b in blocks])}]")
        if costs is not None:
            line += f" cost {sum(costs[b] for b in blocks):g}"
        lines.append(line)
    return "\n".join(lines)


def _describe_blocks(names: list[str]) -> str:
    """Collapse a run of layers: ``embedding, layer 0..3`` rather than every layer."""
    layers = [name for name in names if name.startswith("layer ")]
    others_before = [name for name in names if name.startswith("embedding")]
    others_after = [name for name in names if name.startswith("head")]
    if len(layers) > 1:
        layers = [f"{layers[0]}..{layers[-1].removeprefix('layer ')}"]
    return ", ".join(others_before + layers + others_after)
