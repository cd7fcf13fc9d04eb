"""``hybrid-generate``: text from a hybrid checkpoint or an HF GPT-2 or Llama directory.

::

    hybrid-generate SOURCE prompt="..." [max_new_tokens=32] [temperature=0.8] [top_k=50]
                    [seed=1234] [stop_at_eod=true] [show_ids=false]

``SOURCE``: a checkpoint directory (``step_*``), a run directory (its newest checkpoint) or a
local HF GPT-2 or Llama directory. Overrides are ``key=value`` as in the other commands; an unknown key,
a value of the wrong type or out of range is one line and exit status 2. ``temperature=0`` is
greedy. The text is printed as it comes (the prompt once the model is ready, then each new
piece, flushed); Ctrl-C stops it in one line with exit status 130, the text so far kept on
stdout. The generation itself is ``hybrid.generate``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass, field
from typing import Optional, Sequence

from hybrid.errors import USER_ERROR_EXIT, UserError
from hybrid.generate import GenerateError
from launch.commands.console import INTERRUPTED_EXIT

USAGE = ('usage: hybrid-generate SOURCE prompt="..." [max_new_tokens=N] [temperature=T] '
         '[top_k=K] [seed=S] [stop_at_eod=true|false] [show_ids=true|false]')
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


SETTINGS_HELP = {
    "prompt": "the text to continue (required)",
    "max_new_tokens": f"how many tokens to add, 1..{MAX_NEW_TOKENS:,}",
    "temperature": "0: greedy; otherwise any finite number > 0",
    "top_k": "sample among the k likeliest tokens, 0: all",
    "seed": "the sampling seed, 0..2**64-1",
    "stop_at_eod": "stop at the end-of-document token",
    "show_ids": "also print the prompt's and the new tokens' ids",
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
        default = "" if name == "prompt" else f" (default {value})"
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
        setattr(cfg, key, _typed(key, value, fields[key].type))
    return _checked(cfg)


def _typed(key: str, value: str, kind: str):
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


def _checked(cfg: GenerateConfig) -> GenerateConfig:
    if not cfg.source:
        raise GenerateError(f"no SOURCE given; {USAGE}")
    if not cfg.prompt:
        raise GenerateError('the prompt is empty; pass prompt="some text" to continue')
    if not 1 <= cfg.max_new_tokens <= MAX_NEW_TOKENS:
        raise GenerateError(f"max_new_tokens={cfg.max_new_tokens} must be in "
                            f"1..{MAX_NEW_TOKENS:,} (each token recomputes the whole context); "
                            f"choose one in that range")
    if not cfg.temperature >= 0 or cfg.temperature == float("inf"):
        raise GenerateError(f"temperature={cfg.temperature} must be a finite number >= 0 "
                            f"(0: greedy)")
    if cfg.top_k < 0:
        raise GenerateError(f"top_k={cfg.top_k} must be >= 0 (0: every token)")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise GenerateError(f"seed={cfg.seed} must be an integer in 0..{MAX_SEED:,} (torch's "
                            f"64-bit generator seed); choose one in that range")
    return cfg


@dataclass
class Shown:
    """What is on stdout so far: the prompt (once the model is ready), then the new ids."""

    prompt: bool = False
    new: list[int] = field(default_factory=list)


def run(cfg: GenerateConfig, shown: Shown) -> list[int]:
    """Generate, printing the text as it comes; the prompt's ids (the new ones: ``shown``)."""
    from hybrid.generate import (TextPieces, load_source, new_tokens, one_process_model,
                                 text_tokenizer)

    source = load_source(cfg.source)
    tokenizer = text_tokenizer(source)
    prompt = _encoded(cfg.prompt, tokenizer, source)
    with one_process_model(source) as model:
        _say(cfg.prompt)
        shown.prompt = True
        pieces = TextPieces(tokenizer.decode)
        for token in new_tokens(model, prompt, max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed,
                                eod=tokenizer.info.eod, stop_at_eod=cfg.stop_at_eod):
            shown.new.append(token)
            _say(pieces.add(token))
        _say(pieces.rest() + "\n")
    return prompt


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
    except KeyboardInterrupt:
        if shown.prompt:
            print(flush=True)  # end the text's line; what was printed stays
        print("interrupted: " + (f"generation stopped after {len(shown.new)} new tokens"
                                 if shown.prompt else "stopped before generation began") +
              " (Ctrl-C)", file=sys.stderr)
        sys.exit(INTERRUPTED_EXIT)
    if cfg.show_ids:
        print(f"prompt ids: {prompt}")
        print(f"new ids: {shown.new}")


if __name__ == "__main__":
    main()
