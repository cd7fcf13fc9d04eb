"""``hybrid-ckpt``: look into a checkpoint, or export its model for one process.

    hybrid-ckpt show PATH         # step, the layout it was saved from, model shape, tensors
    hybrid-ckpt export PATH OUT   # the full model, global names, one torch.save file

``PATH`` is a checkpoint directory (``.../checkpoints/step_00000005``) or a run directory (its
newest complete checkpoint). ``export`` needs no process group: it reads the model tensors of
any layout's checkpoint whole, and ``hybrid.model.load_global_weights`` puts them into the
1-process model (or any layout's shards). The file is written to a temporary name and renamed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from hybrid.errors import USER_ERROR_EXIT, UserError
from hybrid.checkpoint.store import CheckpointError, check_files, read_manifest, resolve_resume



def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybrid-ckpt",
                                     description="Inspect or export a hybrid checkpoint.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="step, layout, model shape and tensors")
    show.add_argument("path", help="checkpoint directory (step_*) or run directory")
    export = commands.add_parser("export", help="the full model as one torch.save file")
    export.add_argument("path", help="checkpoint directory (step_*) or run directory")
    export.add_argument("output", help="file to write, e.g. model.pt")
    return parser.parse_args(argv)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def describe(path: Path, manifest: dict) -> str:
    """What ``show`` prints: a header, then one line per tensor."""
    layout, model = manifest["layout"], manifest["model"]
    lines = [f"checkpoint {path}",
             f"step {manifest['step']} (consumed samples {manifest['consumed_samples']})",
             f"saved from dp {layout['dp']} x tp {layout['tp']} x pp {layout['pp']} "
             f"(vpp {layout['vpp']}, zero {layout['zero']}, schedule {layout['schedule']}, "
             f"{layout['world']} ranks)",
             "model: " + ", ".join(f"{key} {value}" for key, value in model.items()),
             f"files: {len(manifest['files'])} data files, "
             f"{_human(sum(f['bytes'] for f in manifest['files'].values()))}", ""]
    tensors = manifest["tensors"]
    width = max(len(name) for name in tensors)
    lines.append(f"{'tensor':<{width}}  {'shape':<14} {'dtype':<8} bytes")
    for name, info in tensors.items():
        shape = "x".join(map(str, info["shape"])) or "scalar"
        lines.append(f"{name:<{width}}  {shape:<14} {info['dtype']:<8} {info['bytes']}")
    total = sum(info["bytes"] for info in tensors.values())
    lines.append(f"{len(tensors)} tensors, {_human(total)}")
    return "\n".join(lines)


def export_model(path: Path, output: str) -> int:
    """Write the checkpoint's model tensors (global names, full shapes) to ``output``."""
    import torch
    import torch.distributed.checkpoint as dcp

    from hybrid.checkpoint.dcp_io import SafeReader, read_metadata

    metadata = read_metadata(path)
    state = {key: torch.empty(tuple(item.size), dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items() if key.startswith("model.")}
    dcp.load(state, storage_reader=SafeReader(path), no_dist=True)
    weights = {key.removeprefix("model."): tensor for key, tensor in state.items()}
    out_dir = os.path.dirname(os.path.abspath(output))
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{os.path.basename(output)}.",
                               suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(weights, handle)
        os.replace(tmp, output)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return sum(t.numel() for t in weights.values())


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    try:
        path = resolve_resume(args.path, Path(args.path), field="PATH")
        manifest = read_manifest(path)
        check_files(path, manifest)
        if args.command == "show":
            print(describe(path, manifest))
            return
        if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
            raise CheckpointError(f"the folder of {args.output} does not exist; create it or "
                                  f"choose another output path")
        count = export_model(path, args.output)
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    print(f"wrote {count:,} parameters of {path} (step {manifest['step']}) to "
          f"{os.path.abspath(args.output)}")


if __name__ == "__main__":
    main()
