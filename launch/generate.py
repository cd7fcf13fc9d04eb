"""``hybrid-generate``: text from a hybrid checkpoint or an HF GPT-2 or Llama directory.

::

    hybrid-generate SOURCE prompt="..." [max_new_tokens=32] [temperature=0.8] [top_k=50]
                    [seed=1234] [stop_at_eod=true] [show_ids=false]

``SOURCE``: a checkpoint directory (``step_*``), a run directory (its newest checkpoint) or a
local HF GPT-2 or Llama directory. Overrides are ``key=value`` as in the other commands; an
unknown key or a value of the wrong type is one line and exit status 2. ``temperature=0`` is
greedy. The generation itself is ``hybrid.generate``.
"""

from __future__ import annotations

import dataclasses
import sys
import warnings
from dataclasses import dataclass
from typing import Optional, Sequence

from hybrid.errors import USER_ERROR_EXIT, UserError
from hybrid.generate import GenerateError

USAGE = ('usage: hybrid-generate SOURCE prompt="..." [max_new_tokens=N] [temperature=T] '
         '[top_k=K] [seed=S] [stop_at_eod=true|false] [show_ids=true|false]')


@dataclass
class GenerateConfig:
    source: str = ""
    """A checkpoint or run directory, or a local HF GPT-2 or Llama directory."""
    prompt: str = ""
    """The text to continue (encoded with the source's tokenizer)."""
    max_new_tokens: int = 32
    temperature: float = 0.8
    """0: greedy (the most likely token every time)."""
    top_k: int = 50
    """Sample among the k most likely tokens (0: all)."""
    seed: int = 1234
    stop_at_eod: bool = True
    """Stop at the end-of-document token."""
    show_ids: bool = False
    """Also print the prompt's and the new tokens' ids."""


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
    if cfg.max_new_tokens < 1:
        raise GenerateError(f"max_new_tokens={cfg.max_new_tokens} must be >= 1")
    if not cfg.temperature >= 0 or cfg.temperature == float("inf"):
        raise GenerateError(f"temperature={cfg.temperature} must be a finite number >= 0 "
                            f"(0: greedy)")
    if cfg.top_k < 0:
        raise GenerateError(f"top_k={cfg.top_k} must be >= 0 (0: every token)")
    return cfg


def run(cfg: GenerateConfig) -> tuple[list[int], list[int], str]:
    """(prompt ids, new ids, new text)."""
    from hybrid.generate import generate, load_source, one_process_model, text_tokenizer

    source = load_source(cfg.source)
    tokenizer = text_tokenizer(source)
    prompt = tokenizer.encode_text(cfg.prompt)
    if len(prompt) > source.model.seq_len:
        raise GenerateError(f"the prompt is {len(prompt)} tokens, longer than the model's "
                            f"seq_len={source.model.seq_len}; shorten it")
    with one_process_model(source) as model:
        new = generate(model, prompt, max_new_tokens=cfg.max_new_tokens,
                       temperature=cfg.temperature, top_k=cfg.top_k, seed=cfg.seed,
                       eod=tokenizer.info.eod, stop_at_eod=cfg.stop_at_eod)
    return prompt, new, tokenizer.decode(new)


def main(argv: Optional[Sequence[str]] = None) -> None:
    # megatron-core warns on import that Transformer Engine and Apex are absent: expected here
    warnings.filterwarnings("ignore", message="Transformer Engine and Apex")
    try:
        cfg = parse(sys.argv[1:] if argv is None else argv)
        prompt, new, text = run(cfg)
    except (UserError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(USER_ERROR_EXIT)
    print(cfg.prompt + text)
    if cfg.show_ids:
        print(f"prompt ids: {prompt}")
        print(f"new ids: {new}")


if __name__ == "__main__":
    main()
