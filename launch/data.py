"""``hybrid-data``: turn a text file into a token file for ``data.source=tokens``.

The tokenizer is byte-level: each byte of the file is one token (ids 0..255, so
``model.vocab=256`` fits), written as a flat ``uint16`` (default) or ``uint32`` array::

    hybrid-data input.txt tokens.bin [--dtype uint32]

The output appears atomically (written to a temporary file beside it, then renamed), so an
interrupted or failed run never leaves a half-written token file. Needs numpy, not torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Optional, Sequence

import numpy as np

from hybrid.data import TOKEN_DTYPES
from hybrid.errors import USER_ERROR_EXIT, UserError

READ_CHUNK_BYTES = 1 << 24


class InputError(UserError):
    """A bad command line argument; the message says what to pass instead."""


def _parse(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="hybrid-data",
        description="Tokenize a text file byte by byte (vocab 256) into a flat token file.")
    parser.add_argument("input", help="text file to tokenize")
    parser.add_argument("output", help="token file to write (e.g. tokens.bin)")
    parser.add_argument("--dtype", default="uint16", choices=sorted(TOKEN_DTYPES),
                        help="element type of the token file (default: uint16)")
    parser.add_argument("--force", action="store_true",
                        help="replace an existing output file")
    return parser.parse_args(argv)


def _check_paths(input_path: str, output_path: str, force: bool = False) -> None:
    if os.path.exists(output_path) and os.path.exists(input_path) \
            and os.path.samefile(input_path, output_path):
        raise InputError(f"output {output_path} is the input file; write the tokens to "
                         f"another path (e.g. {input_path}.bin)")
    if os.path.exists(output_path) and not force:
        raise InputError(f"output {output_path} exists; choose another path or pass --force "
                         f"to replace it")
    if not os.path.isfile(input_path):
        raise InputError(f"input file {input_path} does not exist; pass the path of a text file")
    if os.path.getsize(input_path) == 0:
        raise InputError(f"input file {input_path} is empty; pass a file with some text")
    out_dir = os.path.dirname(os.path.abspath(output_path))
    if not os.path.isdir(out_dir):
        raise InputError(f"output folder {out_dir} does not exist; create it or choose "
                         f"another output path")


def tokenize_file(input_path: str, output_path: str, dtype: str = "uint16",
                  force: bool = False) -> int:
    """Write the bytes of ``input_path`` as ``dtype`` token ids to ``output_path``; count them.

    Streams in chunks (bounded memory) into a temporary file in the output's folder and
    renames it over ``output_path`` only once complete.
    """
    _check_paths(input_path, output_path, force)
    out_dir = os.path.dirname(os.path.abspath(output_path))
    fd, tmp_path = tempfile.mkstemp(dir=out_dir, prefix=f".{os.path.basename(output_path)}.",
                                    suffix=".tmp")
    written = 0
    try:
        with open(input_path, "rb") as src, os.fdopen(fd, "wb") as dst:
            while chunk := src.read(READ_CHUNK_BYTES):
                np.frombuffer(chunk, dtype=np.uint8).astype(TOKEN_DTYPES[dtype]).tofile(dst)
                written += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; a plain file honours umask
        os.replace(tmp_path, output_path)
    except BaseException:  # including Ctrl-C: never leave the temporary file behind
        if os.path.exists(tmp_path):
            os.unlink(tmp_path)
        raise
    return written


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = _parse(argv)
    try:
        count = tokenize_file(args.input, args.output, args.dtype, args.force)
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    path = os.path.abspath(args.output)
    print(f"wrote {count} tokens ({args.dtype}, byte-level, vocab 256) to {path}")
    print(f"use: data.source=tokens data.path={path} data.dtype={args.dtype}")


if __name__ == "__main__":
    main()
