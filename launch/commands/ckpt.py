"""``hybrid-ckpt``: look into a checkpoint, export its model, import an HF GPT-2 or Llama.

    hybrid-ckpt show PATH                  # step, the layout it was saved from, model, tensors
    hybrid-ckpt export PATH OUT            # the full model, global names, one torch.save file
    hybrid-ckpt export PATH OUT --format hf  # an HF directory (transformers loads it)
    hybrid-ckpt export PATH OUT --format hf --max-shard-size 5GB  # as HF's shards + index
    hybrid-ckpt import HF_DIR OUT          # an HF GPT-2 or Llama as OUT/step_00000000, for
                                           # checkpoint.init_from=OUT (hybrid.interop)

``PATH`` is a checkpoint directory (``.../checkpoints/step_00000005``) or a run directory (its
newest complete checkpoint). ``export`` needs no process group: it reads the model tensors of
any layout's checkpoint whole, and ``hybrid.model.load_global_weights`` puts them into the
1-process model (or any layout's shards). The file (or the HF folder) is written to a temporary
name and renamed, with a new file's (folder's) mode; an output that cannot be written is one
line naming it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional, Sequence

from hybrid.errors import USER_ERROR_EXIT, UserError
from hybrid.files import AtomicFiles
from hybrid.checkpoint.store import (WEIGHTS_KIND, CheckpointError, check_files, read_manifest,
                                     resolve_resume)


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="hybrid-ckpt",
                                     description="Inspect or export a hybrid checkpoint.")
    commands = parser.add_subparsers(dest="command", required=True)
    show = commands.add_parser("show", help="step, layout, model shape and tensors")
    show.add_argument("path", help="checkpoint directory (step_*) or run directory")
    export = commands.add_parser("export", help="the full model as one torch.save file, or "
                                                 "an HF GPT-2 or Llama directory (--format hf)")
    export.add_argument("path", help="checkpoint directory (step_*) or run directory")
    export.add_argument("output", help="file to write (model.pt), or folder for --format hf")
    export.add_argument("--format", default="torch", choices=("torch", "hf"),
                        help="torch (default): hybrid's global names in one file; hf: "
                             "model.safetensors + config.json (+ the data's tokenizer)")
    export.add_argument("--max-shard-size", default=None, metavar="SIZE",
                        help="--format hf: shards of at most SIZE (5GB, 500MB, 2GiB) with "
                             "HF's model.safetensors.index.json; default one file")
    imports = commands.add_parser("import", help="a local HF GPT-2 or Llama directory as a "
                                                 "checkpoint, for checkpoint.init_from")
    imports.add_argument("path", help="HF model directory (config.json, model.safetensors or "
                                      "its shards and model.safetensors.index.json)")
    imports.add_argument("output", help="folder to write; it gets OUT/step_00000000")
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
    origin = f"imported from {manifest['source']} (weights only: checkpoint.init_from)" \
        if manifest.get("kind") == WEIGHTS_KIND else (
            f"saved from dp {layout['dp']} x "
            f"{'cp %d x ' % layout['cp'] if layout.get('cp', 1) > 1 else ''}"
            f"tp {layout['tp']} x pp {layout['pp']} "
            f"(vpp {layout['vpp']}, zero {layout['zero']}, schedule {layout['schedule']}, "
            f"{layout['world']} ranks)")
    tokenizer = manifest.get("tokenizer")
    lines = [f"checkpoint {path}",
             f"step {manifest['step']} (consumed samples {manifest['consumed_samples']})",
             origin,
             "tokenizer: " + ("none recorded" if tokenizer is None else
                              f"{tokenizer['source']} (vocabulary {tokenizer['vocab_size']}, "
                              f"end of document {tokenizer['eod']})"),
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

    from hybrid.checkpoint.weights import read_model_weights

    weights = read_model_weights(path)
    with AtomicFiles([output]) as files:  # whole or not at all, with a plain file's mode
        torch.save(weights, files.handle(output))  # a file object: an OSError, not torch's
        files.commit()
    return sum(t.numel() for t in weights.values())


def _checkpoint(path_arg: str) -> tuple[Path, dict]:
    path = resolve_resume(path_arg, Path(path_arg), field="PATH")
    manifest = read_manifest(path)
    check_files(path, manifest)
    return path, manifest


def _export(args: argparse.Namespace) -> None:
    from hybrid.checkpoint.dcp_io import verify_files_here

    if args.max_shard_size is not None and args.format != "hf":
        raise CheckpointError(f"--max-shard-size={args.max_shard_size} shards an HF folder; "
                              f"add --format hf, or drop it")

    path, manifest = _checkpoint(args.path)
    verify_files_here(path, manifest)  # what a resume checks: never export damaged weights
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.output))):
        raise CheckpointError(f"the folder of {args.output} does not exist; create it or "
                              f"choose another output path")
    out = os.path.abspath(args.output)
    try:
        written, tail, architecture = _write_export(path, manifest, args.output, args.format,
                                                    args.max_shard_size)
    except OSError as err:  # a read-only file system, no permission, a full disk
        raise CheckpointError(f"cannot write {out}: {err.strerror or err}; choose an output "
                              f"path on a writable file system") from None
    print(f"wrote {written} of {path} (step {manifest['step']}) to {out}{tail}")
    if architecture is not None:
        print(f"use: transformers.{architecture}.from_pretrained({out!r})")


def _write_export(path: Path, manifest: dict, output: str,
                  format: str, max_shard_size: Optional[str] = None
                  ) -> tuple[str, str, Optional[str]]:
    """Write the export; (what was written, what goes with it), in words, and the HF
    architecture written (None: a torch file)."""
    if format == "torch":
        return f"{export_model(path, output):,} parameters", "", None
    from hybrid.interop.convert import export_hf
    from hybrid.interop.shards import parse_size

    done = export_hf(path, manifest, output,
                     None if max_shard_size is None else parse_size(max_shard_size))
    tokenizer = f", with its tokenizer ({done['tokenizer']})" if done["tokenizer"] else (
        " (the byte-level tokenizer has no HF form: decode the ids as bytes)"
        if done["bytes_tokenizer"] else " (the run recorded no tokenizer)")
    return f"an HF {done['architecture']} of {done['parameters']:,} parameters", tokenizer, \
        done["architecture"]


def _import(args: argparse.Namespace) -> None:
    from hybrid.checkpoint.store import read_manifest
    from hybrid.interop.convert import import_hf, model_config_of, shape_overrides

    path = import_hf(args.path, args.output)
    print(f"wrote {path} from {args.path}")
    overrides = " ".join(shape_overrides(model_config_of(read_manifest(path))))
    print(f"use: hybrid-train {overrides} checkpoint.init_from={os.path.abspath(args.output)}")


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    try:
        if args.command == "show":
            print(describe(*_checkpoint(args.path)))
        elif args.command == "export":
            _export(args)
        else:
            _import(args)
    except BrokenPipeError:
        raise  # the reader went away (``| head``): the console script ends quietly
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)


if __name__ == "__main__":
    main()
