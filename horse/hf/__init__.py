"""Hugging Face models: their checkpoints in and out of our GPT.

Checkpoints (``horse.hf.convert``, no transformers needed): ``GPT.from_pretrained(folder)`` reads a GPT-2 or
LLaMA folder, ``python -m horse.checkpoint export RUN --format hf`` writes one.
"""

from horse.hf.convert import (
    ARCHITECTURES,
    BIN,
    BIN_INDEX,
    CONFIG,
    GELU_TANH,
    SAFETENSORS,
    SAFETENSORS_INDEX,
    TOKENIZER,
    config_from_hf,
    export,
    from_hf_tensors,
    from_pretrained,
    hf_architecture,
    is_hf_folder,
    load_model,
    load_pretrained,
    pad_vocab,
    pretrained_config,
    pretrained_config_for,
    read_tensors,
    to_hf,
    tokenizer_of,
)

__all__ = [
    "ARCHITECTURES",
    "BIN",
    "BIN_INDEX",
    "CONFIG",
    "GELU_TANH",
    "SAFETENSORS",
    "SAFETENSORS_INDEX",
    "TOKENIZER",
    "config_from_hf",
    "export",
    "from_hf_tensors",
    "from_pretrained",
    "hf_architecture",
    "is_hf_folder",
    "load_model",
    "load_pretrained",
    "pad_vocab",
    "pretrained_config",
    "pretrained_config_for",
    "read_tensors",
    "to_hf",
    "tokenizer_of",
]
