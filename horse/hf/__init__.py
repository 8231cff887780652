"""Hugging Face models: their checkpoints in and out of our GPT, and our kernels inside them.

Checkpoints (no transformers needed): ``horse.hf.from_pretrained(folder)`` reads a GPT-2 or LLaMA
folder, ``python -m horse.checkpoint export RUN --format hf`` writes one. ``horse.hf.convert`` maps
the names and layouts, ``horse.hf.weights`` holds the loaders of every source of weights (Hugging Face
folders, horse checkpoints and runs).

Fused kernels in a transformers model, in place (``horse.hf.patch``, needs transformers 5.25 or newer)::

    import horse.hf
    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
    report = horse.hf.apply(model)      # {kind: [module names]} of what now runs our kernels
    horse.hf.unapply(model)             # the model's own forwards back
    model = horse.hf.AutoHorseForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)

``horse.hf.register()`` makes ``attn_implementation="horse"`` known to transformers (``apply`` calls it).
The patching names are imported on first use, so ``import horse.hf`` does not import transformers.
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
    from_hf_tensors,
    hf_architecture,
    is_hf_folder,
    pad_vocab,
    to_hf,
)
from horse.hf.weights import (
    export,
    from_pretrained,
    load_model,
    load_pretrained,
    pretrained_config,
    read_tensors,
    tokenizer_of,
)

_PATCHING = ("apply", "unapply", "register", "AutoHorseForCausalLM", "SUPPORTED_MODEL_TYPES")


def __getattr__(name: str):
    if name in _PATCHING:
        from horse.hf import patch

        return getattr(patch, name)
    raise AttributeError(f"module 'horse.hf' has no attribute {name!r}")


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
    "read_tensors",
    "to_hf",
    "tokenizer_of",
    *_PATCHING,
]
