"""Interoperation with HF transformers: GPT-2 weights and configs both ways (``gpt2``), HF
directories on disk (``hf_dir``), and the checkpoint conversions (``convert``)."""
