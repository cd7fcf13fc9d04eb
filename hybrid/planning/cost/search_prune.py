"""What the layout search rejects without planning a layout (pure: no torch;
``hybrid.planning.cost.search``): the layouts whose memory floor, a byte count no plan of
theirs goes below by the plan's own terms, is over the device's memory, and the ZeRO stages
tried only where the one below fails. Neither can drop a layout that fits:
``tests/test_search.py`` checks the floor against the plans and the search with it against
the search without.
"""

from __future__ import annotations

from hybrid.planning.config import Config
from hybrid.planning.cost.devices import Device
from hybrid.planning.cost.memory_bound import layer_params
from hybrid.planning.cost.sizes import (
    activation_bytes_per_layer, block_params, head_activation_bytes,
)
from hybrid.planning.schedules import schedule_spec
from hybrid.planning.schedules.shapes import closed_form_schedule
from hybrid.planning.strategies import SHARDINGS

FP32_BYTES = 4
OUT_OF_MEMORY = "does not fit in device memory"
LOWER_STAGE_FITS = "fit at a lower ZeRO stage"
"""Why a stage that is never faster than the one below (``searched_if_less_fails``: ZeRO-3,
whose gathers come on top of ZeRO-2's traffic) is not tried on a layout."""


def memory_floor(candidate: Config, memo: dict | None = None) -> int:
    """Bytes some rank of a valid ``candidate`` holds at least, by ``estimate_memory``'s own
    terms: the pipeline rank with the most layers holds ``ceil(layers / pp)`` or more (whole
    layers), and with the uniform partition every virtual stage holds ``layers // (pp * vpp)``
    or more, so the first rank holds that many in each chunk with its schedule's peak of
    micro-batches in flight, and the embedding, and the rank with the head as many and the
    head's activations for the micro-batches its schedule holds; ZeRO-3 gathers at least one layer's weights whole (norms, biases,
    embeddings, padding and more micro-batches in flight only add). A layout over it is
    rejected for memory without being planned: most of a large model's layouts. ``memo``:
    what candidates of one search share, computed once (layers' and head's activations,
    schedules' peaks)."""
    m, par, mb = candidate.model, candidate.parallel, candidate.train.micro_batch
    precision, sp = candidate.train.precision, par.sequence_parallel
    memo = {} if memo is None else memo
    key = ("layer", mb, par.tp, sp, precision, m.recompute, par.cp)
    if key not in memo:
        memo[key] = (
            activation_bytes_per_layer(m, mb, par.tp, sp, precision, m.recompute, par.cp),
            (activation_bytes_per_layer(m, mb, par.tp, sp, precision, cp=par.cp)
             if m.recompute == "full" else 0), layer_params(m))
    per_layer, working, weights = memo[key]
    if SHARDINGS[par.zero].gathers_params:  # a layer's weights gathered whole, at least
        working += int(FP32_BYTES * weights / par.tp)

    def held(layers: float, chunk_layers: float, inflight: int, more_params: int = 0) -> int:
        state = SHARDINGS[par.zero].closed_form_state(
            int(layers * weights / par.tp) + more_params, par.dp * par.cp)
        return (state.param_bytes + state.grad_bytes + state.optimizer_bytes
                + int(chunk_layers * per_layer * inflight) + working)

    most_layers = -(-m.layers // par.pp)  # whole layers: some rank holds this many
    most = held(most_layers, most_layers / par.vpp, 1)
    if par.partition != "uniform":
        return most
    each = m.layers // (par.pp * par.vpp)
    microbatches = candidate.train.global_batch // (par.dp * mb)
    key = ("schedule", par.schedule, par.pp, microbatches, par.vpp, mb, par.tp, sp, par.cp)
    if key not in memo:
        # the rank with the head keeps its activations for the micro-batches it holds
        memo[key] = (closed_form_schedule(par.schedule, par.pp, microbatches, par.vpp)[1][0],
                     schedule_spec(par.schedule).last_stage_holds(microbatches)
                     * head_activation_bytes(m, mb, par.tp, sp, precision, par.cp))
    first, head = memo[key]
    # the first rank holds the embedding too
    embedding = block_params(m)[0].per_rank(par.tp)
    return max(most, held(each * par.vpp, each, first, embedding),
               held(each * par.vpp, each, 1) + head)


def zero_stage_skip(spec, lower, device: Device) -> str | None:
    """Why a stage tried only where lower ones fail is not tried on a layout: a lower stage
    fits (it is never faster), or even its memory floor, from the lower stage's plan, does
    not (then planning it is wasted: most of a large model's layouts)."""
    if lower is None:
        return None
    totals = [est.total_bytes for est in lower.memory]
    if max(totals) <= device.memory_bytes:
        return LOWER_STAGE_FITS
    d = lower.layout.role_size("sharding")
    if min(spec.memory_floor(est, d) for est in lower.memory) > device.memory_bytes:
        return OUT_OF_MEMORY
    return None
