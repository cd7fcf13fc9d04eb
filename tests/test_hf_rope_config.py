"""The rope of an HF ``config.json`` is read in transformers' order (its
``RotaryEmbeddingConfigMixin``): a legacy ``rope_scaling``, when set, replaces
``rope_parameters``; the dict's ``rope_theta`` outranks the top-level one, which outranks the
class's default (Mixtral's 1e6); ``type`` stands for ``rope_type``; a llama3 rope without
``original_max_position_embeddings`` takes ``max_position_embeddings``. Each case is checked
against the rope parameters transformers itself makes of the same config. A rope type hybrid
does not build is one line naming it and the built ones. Pure: configs, no weights."""

import pytest

from hybrid.interop.hf_dir import ConversionError
from hybrid.interop.llama_variants import rope_fields

transformers = pytest.importorskip("transformers")

SHAPE = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=300, max_position_embeddings=64)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    "nothing": {},
    "top-level theta": {"rope_theta": 5e5},
    "the dict's theta outranks the top level": {
        "rope_theta": 2e5, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    "the top level fills a dict without theta": {
        "rope_theta": 2e5, "rope_parameters": {"rope_type": "default"}},
    "rope_scaling outranks rope_parameters": {
        "rope_theta": 2e5, "rope_scaling": dict(LLAMA3),
        "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
    "an empty rope_scaling leaves rope_parameters": {
        "rope_scaling": {}, "rope_parameters": {**LLAMA3, "rope_theta": 3e5}},
    "legacy type key": {"rope_theta": 5e5, "rope_scaling": {
        **{k: v for k, v in LLAMA3.items() if k != "rope_type"}, "type": "llama3"}},
    "original positions default to max_position_embeddings": {"rope_parameters": {
        k: v for k, v in LLAMA3.items() if k != "original_max_position_embeddings"}},
}


def transformers_rope(model_type: str, config: dict) -> dict:
    """The ``rope_parameters`` transformers makes of ``config`` (a deep copy: it edits the
    dicts it is given)."""
    import copy

    from transformers import AutoConfig

    settings = {k: v for k, v in copy.deepcopy(config).items() if k != "model_type"}
    return AutoConfig.for_model(model_type, **settings).rope_parameters


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3", "mistral", "mixtral"])
@pytest.mark.parametrize("case", CASES)
def test_the_rope_is_read_as_transformers_reads_it(model_type, case):
    config = {"model_type": model_type, **SHAPE, **CASES[case]}
    theirs = transformers_rope(model_type, config)
    ours = rope_fields(config, "src")
    assert ours["rope_base"] == pytest.approx(theirs["rope_theta"])
    assert ours.get("rope_scaling", "none") == (
        "none" if theirs["rope_type"] == "default" else theirs["rope_type"])
    if theirs["rope_type"] == "llama3":
        assert (ours["rope_factor"], ours["rope_low_freq_factor"],
                ours["rope_high_freq_factor"], ours["rope_original_positions"]) == (
            theirs["factor"], theirs["low_freq_factor"], theirs["high_freq_factor"],
            theirs["original_max_position_embeddings"])


@pytest.mark.parametrize("where", ["rope_scaling", "rope_parameters"])
@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0},
                                  {"rope_type": "dynamic", "factor": 2.0},
                                  {"rope_type": "linear", "factor": 2.0},
                                  {"type": "longrope"}])
def test_a_rope_type_hybrid_does_not_build_is_one_line(where, rope):
    kind = rope.get("rope_type", rope.get("type"))
    with pytest.raises(ConversionError) as err:
        rope_fields({"model_type": "llama", **SHAPE, where: rope}, "src")
    assert str(err.value) == (f"src: rope type {kind!r} ({where}) is not supported; hybrid "
                              f"builds default, llama3")


def test_a_rope_per_layer_type_is_one_line():
    nested = {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}
    with pytest.raises(ConversionError, match="is not one rope for every layer"):
        rope_fields({"model_type": "qwen3", **SHAPE, "rope_parameters": nested}, "src")
