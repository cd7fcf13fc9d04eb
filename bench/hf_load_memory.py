"""Peak host memory of ``model.from_hf``'s loading, per rank, beside a plain load of the files;
and of ``hybrid-ckpt import`` and ``export --format hf``, beside ``transformers``.

A random Llama of about ``--gb`` GB (fp32) is saved as the hub ships it (shards of
``--shard-mb`` MB and an index). Then, each in a fresh process: every rank of tp2 x pp2 loads
its parameters through ``load_hf_weights`` (each reads its own slices), and the peer loads every
shard with ``safetensors.torch.load_file`` (what a whole-model conversion holds). Printed per
process: the peak RSS growth over the process's state before loading (its own parameters
allocated and resident; the pages of the files it reads count, as the kernel maps them), against the largest shard and the rank's share; ``ratio=`` last is that peak over
the peer's.

    .venv/bin/python bench/hf_load_memory.py --gb 1 --shard-mb 200
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

MB = 2**20


def make_model(folder: Path, gb: float, shard_mb: float, hidden: int = 1024,
               vocab: int = 32000) -> None:
    """A random Llama of about ``gb`` GB: its names and shapes from hybrid's own export map."""
    import torch

    from hybrid.interop import llama
    from hybrid.interop.hf_slices import _meta_weights
    from hybrid.interop.shards import save_sharded
    from hybrid.planning.config import ModelConfig

    layers = max(2, round(gb * 1e9 / 4 / (12 * hidden * hidden)))
    model = ModelConfig(family="llama", layers=layers, hidden=hidden, heads=16, kv_heads=8,
                        ffn_hidden=4 * hidden, vocab=vocab, seq_len=256, vocab_pad_multiple=1,
                        tie_embeddings=False)
    torch.manual_seed(0)
    tensors = {name: torch.randn(t.shape) * 0.02
               for name, t in llama.to_hf(_meta_weights(model), model).items()}
    folder.mkdir(parents=True)
    save_sharded(tensors, folder, int(shard_mb * MB))
    (folder / "config.json").write_text(json.dumps(llama.hf_config(model)))


def rss_mb() -> float:
    """This process's resident set now (Linux)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize() / MB


def reset_peak() -> None:
    """Start the peak (VmHWM) afresh at the resident set now (Linux: clear_refs 5), so what
    imports and set-up peaked at is no part of the load's peak."""
    Path("/proc/self/clear_refs").write_text("5")


def peak_mb() -> float:
    """The peak resident set since ``reset_peak`` (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def load_rank(folder: str, tp_rank: int, stage: int) -> dict:
    """One rank of tp2 x pp2: its parameters allocated, then loaded from ``folder``."""
    import torch

    import hybrid.checkpoint.weights  # noqa: F401  every module the load imports, before the
    import hybrid.interop.convert  # noqa: F401  measure: imports are no loading's memory
    import hybrid.interop.hf_dir  # noqa: F401
    import hybrid.interop.hf_slices  # noqa: F401
    import hybrid.model.shards  # noqa: F401
    import safetensors.torch  # noqa: F401
    from hybrid.interop.hf_source import load_hf_weights, source_model
    from hybrid.planning.params import model_param_specs

    model = source_model(folder)
    groups = SimpleNamespace(layout=SimpleNamespace(tp=2, ep=1), tp_rank=tp_rank,
                             expert=SimpleNamespace(rank=lambda: 0))
    specs = list(model_param_specs(model).values())
    cut = len(specs) // 2
    params = {}
    for spec in (specs[:cut] if stage == 0 else specs[cut:]):
        # filled, not zeros (calloc'd pages would not be resident yet): the growth is the load's
        params[spec.name] = torch.nn.Parameter(torch.full(spec.local_shape(2), 1.0))
        params[spec.name].spec = spec
    share = sum(p.numel() * 4 for p in params.values()) / MB
    reset_peak()
    before = rss_mb()
    load_hf_weights(folder, model, params, groups)
    return {"share_mb": share, "peak_growth_mb": peak_mb() - before}


def load_whole(folder: str) -> dict:
    """The peer: every shard loaded whole (``safetensors.torch.load_file``), kept."""
    import torch  # noqa: F401  imported before the measure, as the ranks import theirs
    from safetensors.torch import load_file

    reset_peak()
    before = rss_mb()
    kept = [load_file(str(f)) for f in sorted(Path(folder).glob("*.safetensors"))]
    for part in kept:  # safetensors maps the files: read every page, as a conversion does
        for tensor in part.values():
            tensor.sum()
    size = sum(t.numel() * 4 for part in kept for t in part.values()) / MB
    return {"share_mb": size, "peak_growth_mb": peak_mb() - before}


def _import_conversion_modules() -> None:
    """What a conversion imports, imported before the measure (no conversion's memory)."""
    import tokenizers  # noqa: F401
    import torch.distributed.checkpoint  # noqa: F401

    import hybrid.checkpoint.weights  # noqa: F401
    import hybrid.interop.convert  # noqa: F401
    import hybrid.interop.hf_stream  # noqa: F401
    import hybrid.interop.llama_family  # noqa: F401
    import hybrid.planning.models.moe  # noqa: F401
    import safetensors.torch  # noqa: F401


def import_streamed(folder: str, out: str) -> dict:
    """``hybrid-ckpt import``'s conversion (streamed), into ``out``."""
    from hybrid.interop.convert import import_hf

    _import_conversion_modules()
    reset_peak()
    before = rss_mb()
    import_hf(folder, out)
    return {"peak_growth_mb": peak_mb() - before}


def export_streamed(checkpoint: str, out: str, shard_mb: str) -> dict:
    """``hybrid-ckpt export --format hf --max-shard-size``'s conversion (streamed)."""
    from hybrid.checkpoint.store import read_manifest
    from hybrid.interop.convert import export_hf

    _import_conversion_modules()
    manifest = read_manifest(Path(checkpoint))
    reset_peak()
    before = rss_mb()
    export_hf(Path(checkpoint), manifest, out, int(float(shard_mb) * MB))
    return {"peak_growth_mb": peak_mb() - before}


def transformers_peer(folder: str, out: str, shard_mb: str) -> dict:
    """The peer: ``from_pretrained`` (import's), then ``save_pretrained`` (export's: both, as
    a user converting with transformers runs them)."""
    from transformers import AutoModelForCausalLM

    reset_peak()
    before = rss_mb()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    for param in model.parameters():  # mapped from the files: read every page, as a
        param.sum()                  # conversion (or the first forward) does
    loaded = peak_mb() - before
    model.save_pretrained(out, max_shard_size=int(float(shard_mb) * MB))
    return {"load_mb": loaded, "load_save_mb": peak_mb() - before}


def largest_tensor_mb(folder: Path) -> float:
    from hybrid.interop.hf_stream import hf_headers

    return max(t.numel() * t.element_size() for _, t in hf_headers(folder).values()) / MB


def conversions(folder: Path, shard: float, shard_mb: float) -> None:
    """The import and export rows: each against (largest shard + largest tensor), and
    ``ratio=`` over transformers'."""
    bound = shard + largest_tensor_mb(folder)
    work = folder.parent
    peer = in_child("transformers", str(folder), str(work / "peer"), str(shard_mb))
    got = in_child("import", str(folder), str(work / "imported"))
    checkpoint = str(work / "imported" / "step_00000000")
    put = in_child("export", checkpoint, str(work / "exported"), str(shard_mb))
    print(f"one shard + one tensor: {bound:.0f} MB")
    for what, mine, theirs, name in (
            ("import", got, peer["load_mb"], "from_pretrained"),
            ("export", put, peer["load_save_mb"], "from_pretrained + save_pretrained")):
        print(f"{what} (streamed): peak growth {mine['peak_growth_mb']:.0f} MB = "
              f"{mine['peak_growth_mb'] / bound:.2f} x (shard + tensor); peer {name} "
              f"{theirs:.0f} MB; ratio={mine['peak_growth_mb'] / max(theirs, 1e-3):.3f}")


CHILDREN = {"whole": load_whole, "import": import_streamed, "export": export_streamed,
            "transformers": transformers_peer}


def in_child(*args: str) -> dict:
    done = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                          text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--shard-mb", type=float, default=200)
    parser.add_argument("--smoke", action="store_true",
                        help="a model of a few MB (hidden 64, vocabulary 512), two of the "
                        "four ranks: the script runs")
    parser.add_argument("--child", nargs="+")
    args = parser.parse_args()
    if args.child:
        kind, folder, *rest = args.child
        result = CHILDREN[kind](folder, *rest) if kind in CHILDREN else \
            load_rank(folder, *map(int, rest))
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "llama"
        if args.smoke:
            make_model(folder, 0.0, 0.05, hidden=64, vocab=512)
        else:
            make_model(folder, args.gb, args.shard_mb)
        files = sorted(folder.glob("*.safetensors"))
        shard = max(f.stat().st_size for f in files) / MB
        print(f"model {sum(f.stat().st_size for f in files) / MB:.0f} MB in {len(files)} "
              f"shards, largest {shard:.0f} MB")
        peer = in_child("whole", str(folder))
        print(f"peer load_file of every shard: peak growth {peer['peak_growth_mb']:.0f} MB")
        ranks = [(0, 0), (1, 1)] if args.smoke else [(s, t) for s in range(2) for t in range(2)]
        for stage, tp_rank in ranks:  # the smoke run: the first rank and the last
            got = in_child("rank", str(folder), str(tp_rank), str(stage))
            print(f"rank tp{tp_rank} pp{stage}: share {got['share_mb']:.0f} MB, peak growth "
                  f"{got['peak_growth_mb']:.0f} MB = "
                  f"{got['peak_growth_mb'] / got['share_mb']:.2f} x share, "
                  f"{got['peak_growth_mb'] / shard:.2f} x largest shard, "
                  f"ratio={got['peak_growth_mb'] / max(peer['peak_growth_mb'], 1e-3):.3f}")
        conversions(folder, shard, 0.05 if args.smoke else args.shard_mb)


if __name__ == "__main__":
    main()
