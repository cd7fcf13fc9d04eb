"""``hybrid-generate``: text from a hybrid checkpoint or an HF GPT-2 or Llama directory.

::

    hybrid-generate SOURCE prompt="..." [max_new_tokens=32] [temperature=0.8] [top_k=50]
                    [seed=1234] [stop_at_eod=true] [show_ids=false] [context=N]
    hybrid-generate SOURCE prompt_ids=1,2,3 ...

``SOURCE``: a checkpoint directory (``step_*``), a run directory (its newest checkpoint) or a
local HF GPT-2, Llama or Mixtral directory. ``prompt_ids=`` gives the prompt as token ids
instead of text, for a model without a tokenizer (an HF directory without ``tokenizer.json``,
a run on data with none recorded): the prompt and new ids are printed, and the text too where a
tokenizer exists. Overrides are ``key=value`` as in the other commands; an unknown key,
a value of the wrong type or out of range is one line and exit status 2. ``temperature=0`` is
greedy. The text is printed as it comes (the prompt once the model is ready, then each new
piece, flushed); Ctrl-C stops it in one line with exit status 130, the text so far kept on
stdout. ``context=N``: the positions the model sees (the key/value cache's length, the window
that slides beyond it); by default those the source model was made for (an HF folder's
``max_position_embeddings``, or that of the folder or checkpoint a run started from, not the
``seq_len`` it was fine-tuned at). A rotary model takes any; GPT-2's learned positions are
refused beyond their table in one line. The generation itself is ``hybrid.generate``.
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

from hybrid.errors import USER_ERROR_EXIT, UserError
from hybrid.generate import GenerateError
from launch.commands.console import INTERRUPTED_EXIT

USAGE = ('usage: hybrid-generate SOURCE prompt="..."|prompt_ids=1,2,3 [max_new_tokens=N] '
         '[temperature=T] [top_k=K] [seed=S] [stop_at_eod=true|false] [show_ids=true|false] '
         '[context=N]')
MAX_NEW_TOKENS = 10_000
"""Past ``model.seq_len`` every new token recomputes the window (the key/value cache holds
only what fits): a typo such as ``max_new_tokens=1000000000`` would run for days, so it is
refused before the model loads."""
MAX_SEED = 2**64 - 1
"""torch's generator seed is 64-bit unsigned (it remaps a negative one, refuses a larger)."""


@dataclass
class GenerateConfig:
    source: str = ""
    """A checkpoint or run directory, or a local HF GPT-2 or Llama directory."""
    prompt: str = ""
    """The text to continue (encoded with the source's tokenizer)."""
    prompt_ids: Optional[list[int]] = None
    """Or the ids to continue (``1,2,3``), for a model without a tokenizer."""
    max_new_tokens: int = 32
    """At most ``MAX_NEW_TOKENS``."""
    temperature: float = 0.8
    """0: greedy (the most likely token every time)."""
    top_k: int = 50
    """Sample among the k most likely tokens (0: all)."""
    seed: int = 1234
    """0 .. 2**64 - 1."""
    stop_at_eod: bool = True
    """Stop at the end-of-document token."""
    show_ids: bool = False
    """Also print the prompt's and the new tokens' ids."""
    context: Optional[int] = None
    """Positions the model sees; None: those the source model was made for."""


SETTINGS_HELP = {
    "prompt": "the text to continue (this or prompt_ids)",
    "prompt_ids": "or the token ids to continue, comma-separated: 1,2,3 (no tokenizer needed)",
    "max_new_tokens": f"how many tokens to add, 1..{MAX_NEW_TOKENS:,}",
    "temperature": "0: greedy; otherwise any finite number > 0",
    "top_k": "sample among the k likeliest tokens, 0: all",
    "seed": "the sampling seed, 0..2**64-1",
    "stop_at_eod": "stop at the end-of-document token",
    "show_ids": "also print the prompt's and the new tokens' ids",
    "context": "positions the model sees (default: the source model's own; any for a rotary "
               "model, at most its table for GPT-2)",
}


def help_text() -> str:
    """``--help``: the usage, what SOURCE may be, each setting with its default."""
    defaults = GenerateConfig()
    lines = [USAGE, "", "Continues the prompt with a model from SOURCE: a checkpoint directory "
             "(step_*),", "a run directory (its newest checkpoint) or a local HF GPT-2, Llama or "
             "Mixtral directory.", ""]
    for name, text in SETTINGS_HELP.items():
        value = getattr(defaults, name)
        value = str(value).lower() if isinstance(value, bool) else value  # as typed: true
        default = "" if name in ("prompt", "prompt_ids", "context") else f" (default {value})"
        lines.append(f"  {name:<15} {text}{default}")
    lines += ["", "A setting out of range is one line and exit status 2; Ctrl-C stops in one "
              f"line (status {INTERRUPTED_EXIT}),", "keeping the text so far."]
    return "\n".join(lines)


def parse(argv: Sequence[str]) -> GenerateConfig:
    """``SOURCE key=value ...`` into a ``GenerateConfig`` (``GenerateError``: one line)."""
    cfg, fields = GenerateConfig(), {f.name: f for f in dataclasses.fields(GenerateConfig)}
    for arg in argv:
        key, equals, value = arg.partition("=")
        if not equals:
            if cfg.source:
                raise GenerateError(f"{arg!r}: give one SOURCE; other arguments are key=value")
            cfg.source = arg
            continue
        if key not in fields:
            raise GenerateError(f"unknown key {key!r}; choose one of {', '.join(fields)}")
        setattr(cfg, key, _ids(value) if key == "prompt_ids" else
                _typed(key, value, fields[key].type))
    return _checked(cfg)


def _typed(key: str, value: str, kind: str):
    kind = kind.removeprefix("Optional[").removesuffix("]")  # context: None is the default
    if kind == "str":
        return value
    if kind == "bool":
        if value.lower() not in ("true", "false"):
            raise GenerateError(f"{key}={value!r} must be true or false")
        return value.lower() == "true"
    try:
        return int(value) if kind == "int" else float(value)
    except ValueError:
        raise GenerateError(f"{key}={value!r} must be a{'n integer' if kind == 'int' else ' number'}"
                            ) from None


def _ids(value: str) -> list[int]:
    """``prompt_ids=1,2,3`` (or ``[1, 2, 3]``, as ``show_ids`` prints them) as a list."""
    parts = [part.strip() for part in value.strip().strip("[]").split(",")]
    if parts == [""]:
        raise GenerateError("prompt_ids is empty; give the token ids to continue, "
                            "comma-separated: prompt_ids=1,2,3")
    for part in parts:
        if not (part.isascii() and part.isdigit()):  # also refuses "-1" and "" (as in "1,,2")
            raise GenerateError(f"prompt_ids={value!r}: {part!r} is not a token id (an integer "
                                f">= 0); give comma-separated ids: prompt_ids=1,2,3")
    return [int(part) for part in parts]


def _checked(cfg: GenerateConfig) -> GenerateConfig:
    if not cfg.source:
        raise GenerateError(f"no SOURCE given; {USAGE}")
    if cfg.prompt and cfg.prompt_ids is not None:
        raise GenerateError("both prompt and prompt_ids are given; pass one: the text "
                            "(prompt=...) or its token ids (prompt_ids=1,2,3)")
    if not cfg.prompt and cfg.prompt_ids is None:
        raise GenerateError('the prompt is empty; pass prompt="some text" to continue, or '
                            'prompt_ids=1,2,3 for a model without a tokenizer')
    if not 1 <= cfg.max_new_tokens <= MAX_NEW_TOKENS:
        raise GenerateError(f"max_new_tokens={cfg.max_new_tokens} must be in "
                            f"1..{MAX_NEW_TOKENS:,} (past the model's seq_len each new token "
                            f"recomputes a seq_len window); choose one in that range")
    if not cfg.temperature >= 0 or cfg.temperature == float("inf"):
        raise GenerateError(f"temperature={cfg.temperature} must be a finite number >= 0 "
                            f"(0: greedy)")
    if cfg.top_k < 0:
        raise GenerateError(f"top_k={cfg.top_k} must be >= 0 (0: every token)")
    if cfg.context is not None and cfg.context < 1:
        raise GenerateError(f"context={cfg.context} must be >= 1 (positions the model sees)")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise GenerateError(f"seed={cfg.seed} must be an integer in 0..{MAX_SEED:,} (torch's "
                            f"64-bit generator seed); choose one in that range")
    return cfg


@dataclass
class Shown:
    """How far generation got: the model ready, its text being printed (the prompt first;
    not without a tokenizer), the new ids so far."""

    started: bool = False
    text: bool = False
    prompt_ids: bool = False
    new: list[int] = field(default_factory=list)


def run(cfg: GenerateConfig, shown: Shown) -> list[int]:
    """Generate, printing the text as it comes where there is a tokenizer; the prompt's ids
    (the new ones: ``shown``)."""
    from hybrid.generate import (TextPieces, load_source, new_tokens, one_process_model,
                                 text_tokenizer)

    source = load_source(cfg.source, cfg.context)
    if cfg.prompt_ids is None:
        tokenizer = text_tokenizer(source)
        prompt = _encoded(cfg.prompt, tokenizer, source)
    else:  # ids need no tokenizer; one that exists still shows the text
        tokenizer = None if source.tokenizer is None else text_tokenizer(source)
        prompt = _in_vocabulary(cfg.prompt_ids, source)
    eod = source.eod if tokenizer is None else tokenizer.info.eod
    with one_process_model(source) as model:
        shown.started = True
        pieces = None if tokenizer is None else TextPieces(tokenizer.decode)
        if pieces is not None:
            _say(cfg.prompt or tokenizer.decode(prompt))
            shown.text = True
        else:  # no text to stream: the prompt's ids say the model is ready
            _say(f"prompt ids: {prompt}\n")
            shown.prompt_ids = True
        for token in new_tokens(model, prompt, max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed,
                                eod=eod, stop_at_eod=cfg.stop_at_eod):
            shown.new.append(token)
            _say("" if pieces is None else pieces.add(token))
        _say("" if pieces is None else pieces.rest() + "\n")
    return prompt


def _in_vocabulary(ids: list[int], source) -> list[int]:
    """``prompt_ids``, each an id of the model's vocabulary, at most ``seq_len`` of them."""
    vocab = source.model.vocab
    outside = [(i, token) for i, token in enumerate(ids) if token >= vocab]
    if outside:
        position, token = outside[0]
        raise GenerateError(f"prompt_ids has {token} (position {position}, {len(outside)} "
                            f"outside in all), past the vocabulary of {source.where} "
                            f"(model.vocab={vocab}: ids 0..{vocab - 1}); give ids below {vocab}")
    if len(ids) > source.model.seq_len:
        raise GenerateError(f"prompt_ids has {len(ids)} ids, more than the model's "
                            f"seq_len={source.model.seq_len}; shorten it")
    return ids


def _encoded(text: str, tokenizer, source) -> list[int]:
    """The prompt's ids: at least one, at most the model's ``seq_len``."""
    prompt = tokenizer.encode_text(text)
    if not prompt:
        raise GenerateError(f"the prompt {text[:40]!r} encodes to no tokens with the tokenizer "
                            f"of {source.where} (vocabulary {tokenizer.info.vocab_size}); give "
                            f"a prompt it can spell, or a model whose tokenizer covers it")
    if len(prompt) > source.model.seq_len:
        raise GenerateError(f"the prompt is {len(prompt)} tokens, longer than the model's "
                            f"seq_len={source.model.seq_len}; shorten it")
    return prompt


def _say(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def main(argv: Optional[Sequence[str]] = None) -> None:
    # megatron-core warns on import that Transformer Engine and Apex are absent: expected here
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    argv = sys.argv[1:] if argv is None else argv
    if any(arg in ("-h", "--help") for arg in argv):
        print(help_text())
        return
    shown = Shown()
    try:
        cfg = parse(argv)
        prompt = run(cfg, shown)
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM/SIGHUP as console.Stopped
        number = getattr(err, "signal_number", signal.SIGINT)
        if shown.text:
            print(flush=True)  # end the text's line; what was printed stays
        elif shown.started:
            print(f"new ids: {shown.new}", flush=True)  # no text: the ids so far are the output
        print("interrupted: " + (f"generation stopped after {len(shown.new)} new tokens"
                                 if shown.started else "stopped before generation began") +
              f" ({'Ctrl-C' if number == signal.SIGINT else signal.Signals(number).name})",
              file=sys.stderr)
        sys.exit(128 + number)
    if cfg.show_ids or cfg.prompt_ids is not None:  # ids in, ids out
        if not shown.prompt_ids:
            print(f"prompt ids: {prompt}")
        print(f"new ids: {shown.new}")


if __name__ == "__main__":
    main()
