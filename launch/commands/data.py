"""``hybrid-data``: text, JSONL or Parquet in, tokens out for ``data.source=tokens`` or ``indexed``.

::

    hybrid-data INPUT... OUTPUT [--tokenizer bytes|gpt2|PATH] [--format tokens|indexed]
                [--documents file|blank-lines] [--json-key text] [--workers N] [--force]
    hybrid-data train-tokenizer INPUT... OUT --vocab-size N

Inputs may be gzip- or zstd-compressed (``corpus.jsonl.zst``; ``hybrid.data.readers``).
The first tokenizes (``hybrid.data.prepare``); the second learns a byte-level BPE from the
inputs with HF ``tokenizers`` and writes ``OUT/tokenizer.json`` for ``--tokenizer OUT``.
Needs numpy and ``tokenizers``, not torch. Bad input is one line on stderr and exit status 2,
with nothing written.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Optional, Sequence

from hybrid.data.documents import (DOCUMENT_MODES, ENCODING_ERRORS, INPUT_FORMATS, InputError,
                                   ReadOptions, chunk_documents, expand_inputs)
from hybrid.data.prepare import FORMATS, Report, Request, prepare_data, usable_cores, writing
from hybrid.data.readers import read_chunks
from hybrid.errors import USER_ERROR_EXIT, UserError

TRAIN_TOKENIZER = "train-tokenizer"
MIN_BPE_VOCAB = 257  # every byte, and <|endoftext|>


def _reading_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--documents", default="file", choices=DOCUMENT_MODES,
                        help="text inputs: one document per file (default), or documents "
                             "separated by blank lines")
    parser.add_argument("--input-format", default="auto", choices=INPUT_FORMATS,
                        help="auto (default): *.parquet is Parquet, *.jsonl and *.json are "
                             "JSON Lines, anything else text; each may end in .gz or .zst "
                             "(compressed)")
    parser.add_argument("--json-key", default="text",
                        help="JSONL inputs: the key holding each document; Parquet inputs: "
                             "the column (default: text)")
    parser.add_argument("--encoding-errors", default="strict", choices=ENCODING_ERRORS,
                        help="text that is not UTF-8: refuse (default), or replace each bad "
                             "byte with U+FFFD and count them")
    parser.add_argument("--force", action="store_true", help="replace existing outputs")


def _tokenize_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybrid-data",
        description="Tokenize text, JSONL or Parquet files (JSONL and text may be gzip- "
                    "or zstd-compressed) into a token file (data.source=tokens) or "
                    "Megatron's indexed PREFIX.bin/.idx (data.source=indexed). "
                    f"See also: hybrid-data {TRAIN_TOKENIZER} --help.")
    parser.add_argument("paths", nargs="+", metavar="INPUT... OUTPUT",
                        help="input files or quoted globs, then the output (a file for "
                             "--format tokens, a PREFIX for --format indexed)")
    parser.add_argument("--tokenizer", default="bytes",
                        help="bytes (default, vocab 256) | gpt2 | a tokenizer.json or a folder "
                             "holding one (or vocab.json + merges.txt)")
    parser.add_argument("--eod", default=None,
                        help="the end-of-document token (default: the tokenizer's own)")
    parser.add_argument("--format", default="tokens", choices=FORMATS,
                        help="tokens (default): a flat token file; indexed: PREFIX.bin + "
                             "PREFIX.idx (MMIDIDX v1)")
    parser.add_argument("--dtype", default=None,
                        help="token type (default: the smallest that holds the vocabulary)")
    parser.add_argument("--workers", type=int, default=1,
                        help="processes tokenizing in parallel, one core each (default 1; at "
                             "most the cores this process may use)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    _reading_options(parser)
    return parser


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"hybrid-data {TRAIN_TOKENIZER}",
        description="Learn a byte-level BPE (HF tokenizers) from text or JSONL files and "
                    "write OUT/tokenizer.json, for hybrid-data --tokenizer OUT.")
    parser.add_argument("paths", nargs="+", metavar="INPUT... OUT",
                        help="input files or quoted globs, then the output folder")
    parser.add_argument("--vocab-size", type=int, required=True,
                        help=f"ids in the vocabulary, >= {MIN_BPE_VOCAB} (every byte and "
                             f"<|endoftext|>, which is id 0)")
    parser.add_argument("--min-frequency", type=int, default=2,
                        help="pairs seen fewer times are never merged (default 2)")
    _reading_options(parser)
    return parser


def _read_options(args: argparse.Namespace) -> ReadOptions:
    return ReadOptions(documents=args.documents, input_format=args.input_format,
                       json_key=args.json_key, encoding_errors=args.encoding_errors)


def _split_paths(parser: argparse.ArgumentParser, paths: list[str]) -> tuple[list[str], str]:
    if len(paths) < 2:
        parser.error("give at least one input and the output")
    return paths[:-1], paths[-1]


def tokenize(argv: Sequence[str]) -> None:
    parser = _tokenize_parser()
    args = parser.parse_args(argv)
    inputs, output = _split_paths(parser, args.paths)
    report = prepare_data(Request(
        inputs=inputs, output=output, tokenizer=args.tokenizer, eod=args.eod,
        format=args.format, dtype=args.dtype, workers=_workers(args.workers),
        read=_read_options(args), force=args.force, progress=not args.quiet))
    _print_report(report, args.format, output)


def _workers(asked: int) -> int:
    """``--workers``, capped at the cores there are (more only share them, and each costs a
    process and its memory), with a warning when capped."""
    cores = usable_cores()
    if asked > cores:
        print(f"warning: --workers {asked} is more than the {cores} cores this process may "
              f"use; tokenizing with {cores} workers", file=sys.stderr)
        return cores
    return asked


def _print_report(report: Report, fmt: str, output: str) -> None:
    info = report.info
    rate = report.tokens / report.seconds if report.seconds else 0.0
    documents = f"{report.documents} document{'s' * (report.documents != 1)}"
    print(f"wrote {report.tokens} tokens of {documents} ({report.dtype}, "
          f"{info.source}, vocab {info.vocab_size}) in {report.seconds:.1f} s "
          f"({rate:,.0f} tokens/s) to {_written(fmt, os.path.abspath(output))}")
    if report.empty:
        print(f"skipped {report.empty} empty document{'s' * (report.empty != 1)}")
    if report.replaced:
        many = report.replaced != 1
        print(f"replaced {report.replaced} byte{'s' * many} that {'were' if many else 'was'} "
              f"not UTF-8 with U+FFFD")
    path = os.path.abspath(output)
    line = use_line(fmt, path, report.dtype, info.vocab_size)
    if line is None:
        print(f"warning: {path} holds {report.tokens} tokens, too few for one batch of "
              f"hybrid-train's default (train.global_batch samples of model.seq_len+1 "
              f"tokens) even at model.seq_len={MIN_USE_SEQ_LEN}; tokenize more text",
              file=sys.stderr)
        return
    if "model.seq_len=" in line:
        print(f"warning: {path} holds {report.tokens} tokens, too few for one batch at the "
              f"default model.seq_len; the use line sets a shorter one", file=sys.stderr)
    print(f"use: {line}")


MIN_USE_SEQ_LEN = 8
"""The shortest ``model.seq_len`` a ``use:`` line offers for a short token file."""


def _written(fmt: str, path: str) -> str:
    """The data files written: a token file, or an indexed prefix's two files by name."""
    return f"{path}.bin and {path}.idx" if fmt == "indexed" else path


def use_line(fmt: str, path: str, dtype: str, vocab: int) -> Optional[str]:
    """The settings that train on what was written: the data group's choice (``data=tokens``
    / ``data=indexed``), never ``data.source=`` alone, which keeps the default data's other
    keys (``data.example``) and clashes with them. An indexed data set whose validation part
    (``data.split``) is too small for the default evaluation gets evaluation turned off; a
    token file too short for one default batch gets a shorter ``model.seq_len`` (None: none
    fits)."""
    if fmt != "indexed":
        return _fitting(f"data=tokens data.path={path} data.dtype={dtype} model.vocab={vocab}")
    line = f"data=indexed data.path={path} model.vocab={vocab}"
    return line if _evaluates(line.split()) else f"{line} eval.every=0 eval.at_end=false"


def _fitting(line: str) -> Optional[str]:
    """``line``, or with the longest halved ``model.seq_len`` whose samples fill one default
    global batch of the token file; None when not even ``MIN_USE_SEQ_LEN`` does."""
    from hybrid.data import validate_data
    from launch.commands.app import compose_train_config

    seq_len, suffix = compose_train_config([]).model.seq_len, ""
    while True:
        cfg = compose_train_config((line + suffix).split())
        try:
            validate_data(cfg.data, cfg.model, cfg.train, cfg.eval)
            return line + suffix
        except UserError:
            seq_len //= 2
            if seq_len < MIN_USE_SEQ_LEN:
                return None
            suffix = f" model.seq_len={seq_len}"


def _evaluates(overrides: list[str]) -> bool:
    """Whether ``hybrid-train`` with ``overrides`` passes the data checks, its evaluation
    included (a validation part with no document or fewer samples than it reads)."""
    from hybrid.data import validate_data
    from hybrid.data.dataset import DataError
    from hybrid.data.eval_split import check_eval_split
    from launch.commands.app import compose_train_config

    cfg = compose_train_config(overrides)
    try:
        validate_data(cfg.data, cfg.model, cfg.train, cfg.eval)
        check_eval_split(cfg, [cfg.data.path])
    except DataError:
        return False
    return True


def train_tokenizer(argv: Sequence[str]) -> None:
    from hybrid.data.tokenizer import train_byte_level_bpe
    from hybrid.files import AtomicFiles

    parser = _train_parser()
    args = parser.parse_args(argv)
    inputs, out = _split_paths(parser, args.paths)
    if args.vocab_size < MIN_BPE_VOCAB:
        raise InputError(f"--vocab-size {args.vocab_size} is below {MIN_BPE_VOCAB} (every byte "
                         f"and <|endoftext|>); pass a larger size, e.g. 8000")
    target = os.path.join(out, "tokenizer.json")
    if os.path.exists(target) and not args.force:
        raise InputError(f"output {target} exists; choose another folder or pass --force")
    paths = expand_inputs(inputs)
    options = _read_options(args)
    texts = (text for chunk in read_chunks(paths, options)
             for text in chunk_documents(chunk, options).texts)
    tokenizer = train_byte_level_bpe(texts, args.vocab_size, args.min_frequency)
    with writing(target), AtomicFiles([target]) as files:
        os.makedirs(out, exist_ok=True)
        files.handle(target).write(tokenizer.to_str().encode("utf-8"))
        files.commit()
    print(f"wrote a byte-level BPE of {tokenizer.get_vocab_size()} ids "
          f"(<|endoftext|> = {tokenizer.token_to_id('<|endoftext|>')}) to {target}")
    print(f"use: hybrid-data --tokenizer {out} INPUT... OUTPUT")


def _stop(signum: int, frame) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)  # unwinds: temporary files go


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _stop)
    try:
        if argv[:1] == [TRAIN_TOKENIZER]:
            train_tokenizer(argv[1:])
        else:
            tokenize(argv)
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except KeyboardInterrupt as err:
        name = str(err) or "SIGINT"
        print(f"interrupted ({name}): nothing was written", file=sys.stderr)
        sys.exit(128 + signal.Signals[name].value)


if __name__ == "__main__":
    main()
