"""Hugging Face checkpoints mapped to ours and back: GPT-2 (``GPT2LMHeadModel``) and LLaMA
(``LlamaForCausalLM``), their config.json and tensor names and layouts. Names and layouts only: the
files are read and written by ``horse.hf.weights`` (``horse.hf.from_pretrained(folder)``,
``python -m horse.checkpoint export RUN --format hf --out DIR``).

The two architectures map onto GPTConfig as:

    GPT2LMHeadModel   learned positions, LayerNorm, GELU (tanh), biases, tied head. HF's Conv1D
                      stores weights (in, out): transposed to nn.Linear's (out, in).
    LlamaForCausalLM  rotary positions (rope_theta, HF's rotate-half pairs (i, i + hd/2), which
                      horse.layers.RotaryEmbedding uses too), RMSNorm (rms_norm_eps), SwiGLU, grouped-
                      query attention, attention biases as attention_bias, head tied or not.
                      q_proj, k_proj and v_proj are stacked into c_attn's [q | k | v] rows.

The vocabulary is rounded up to a multiple of 64 (for the tensor cores) with zero rows, and
``GPTConfig.vocab_used`` masks their logits to -inf, so they are never sampled and take no
probability in the loss; export drops them again.
"""

import json
from pathlib import Path

import torch

from horse.model import GPT, GPTConfig

CONFIG, SAFETENSORS, SAFETENSORS_INDEX = "config.json", "model.safetensors", "model.safetensors.index.json"
BIN, BIN_INDEX, TOKENIZER = "pytorch_model.bin", "pytorch_model.bin.index.json", "tokenizer.json"
ARCHITECTURES = ("GPT2LMHeadModel", "LlamaForCausalLM")
GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # tanh approximations of GELU


def pad_vocab(vocab: int) -> int:
    return -(-vocab // 64) * 64


def is_hf_folder(path: str | Path) -> bool:
    """Whether path is a folder in Hugging Face's layout (a config.json naming a model type); a
    training run's config.json (flags under "train" and "model") is not."""
    config = Path(path) / CONFIG
    if not config.is_file():
        return False
    try:
        values = json.loads(config.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return isinstance(values, dict) and ("model_type" in values or "architectures" in values)


# ----------------------------------------------------------------------------------------------
# Reading a folder
# ----------------------------------------------------------------------------------------------


def _architecture(path: Path, hf: dict) -> str:
    archs = hf.get("architectures") or []
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if not archs:  # go by model_type, as transformers' AutoModelForCausalLM does
        arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}.get(hf.get("model_type"))
    if not archs and "model_type" not in hf:
        raise ValueError(
            f"{path / CONFIG}: names no architectures or model_type: not a Hugging Face checkpoint "
            "(a horse run or checkpoint loads with horse.checkpoint, or as --ckpt / --init-from)"
        )
    if arch is None:
        raise ValueError(
            f"{path / CONFIG}: architecture {archs or hf.get('model_type')!r} is not supported "
            f"(expected one of {', '.join(ARCHITECTURES)})"
        )
    return arch


def _require(path: Path, what: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{path / CONFIG}: {what}; expected {expected}")


def _rope_theta(path: Path, hf: dict) -> float:
    # transformers 5 nests it in rope_parameters (with rope_type), older versions keep it at the top
    # level next to rope_scaling.
    params = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or {}
    for rope_type in (params.get("rope_type"), scaling.get("rope_type"), scaling.get("type")):
        ok = rope_type in (None, "default")
        _require(path, f"rope_type {rope_type!r}", ok, "the default rotary (no scaling)")
    return float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))


def config_from_hf(path: str | Path) -> tuple[GPTConfig, str]:
    """(GPTConfig, architecture) of the Hugging Face folder path, or an error naming its config.json
    and what is not supported."""
    path = Path(path)
    try:
        hf = json.loads((path / CONFIG).read_text())
    except FileNotFoundError as e:
        raise FileNotFoundError(f"{path}: no {CONFIG}: not a Hugging Face checkpoint folder") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / CONFIG}: not valid JSON ({e})") from e
    arch = _architecture(path, hf)
    try:
        return _config(path, hf, arch), arch
    except KeyError as e:
        raise ValueError(f"{path / CONFIG}: no {e.args[0]!r}, which a {arch} config needs") from e
    except ValueError as e:  # GPTConfig's own checks (a width that the heads do not divide, ...)
        raise ValueError(f"{path / CONFIG}: {e}") from e


def _config(path: Path, hf: dict, arch: str) -> GPTConfig:
    vocab = hf["vocab_size"]
    common = {
        "vocab_size": pad_vocab(vocab),
        "vocab_used": vocab if pad_vocab(vocab) != vocab else None,
        "tie_embeddings": hf.get("tie_word_embeddings", True),
    }
    if arch == "GPT2LMHeadModel":
        act = hf.get("activation_function", "gelu_new")
        _require(path, f"activation_function {act!r}", act in GELU_TANH, f"one of {GELU_TANH}")
        for key, want in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False)):
            _require(path, f"{key} {hf.get(key, want)}", hf.get(key, want) == want, f"{key} {want}")
        return GPTConfig(
            block_size=hf["n_positions"],
            n_layer=hf["n_layer"],
            n_head=hf["n_head"],
            d_model=hf["n_embd"],
            mlp_hidden=hf.get("n_inner"),
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
            **common,
        )
    act = hf.get("hidden_act", "silu")
    _require(path, f"hidden_act {act!r}", act == "silu", "silu (SwiGLU)")
    _require(path, "mlp_bias true", not hf.get("mlp_bias", False), "no MLP biases")
    d_model, n_head = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or d_model // n_head
    _require(path, f"head_dim {head_dim}", head_dim * n_head == d_model, "hidden_size / num_attention_heads")
    return GPTConfig(
        block_size=hf["max_position_embeddings"],
        n_layer=hf["num_hidden_layers"],
        n_head=n_head,
        n_kv_heads=hf.get("num_key_value_heads") or n_head,
        d_model=d_model,
        mlp_hidden=hf["intermediate_size"],
        positions="rotary",
        norm="rmsnorm",
        mlp="swiglu",
        bias=hf.get("attention_bias", False),
        rope_base=_rope_theta(path, hf),
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        **common,
    )


# ----------------------------------------------------------------------------------------------
# Names: horse's parameter -> HF's tensor
# ----------------------------------------------------------------------------------------------


def _gpt2_names(config: GPTConfig) -> dict[str, str]:
    names = {"wte.weight": "transformer.wte.weight", "wpe.weight": "transformer.wpe.weight"}
    ours = {"norm_1": "ln_1", "attn.c_attn": "attn.c_attn", "attn.c_proj": "attn.c_proj", "norm_2": "ln_2"}
    ours |= {"mlp.c_fc": "mlp.c_fc", "mlp.c_proj": "mlp.c_proj"}
    for i in range(config.n_layer):
        for mine, theirs in ours.items():
            for p in ("weight", "bias"):
                names[f"blocks.{i}.{mine}.{p}"] = f"transformer.h.{i}.{theirs}.{p}"
    names |= {"norm_f.weight": "transformer.ln_f.weight", "norm_f.bias": "transformer.ln_f.bias"}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _llama_names(config: GPTConfig) -> dict[str, str]:
    """Every name but c_attn's, which stacks q_proj, k_proj and v_proj."""
    names = {"wte.weight": "model.embed_tokens.weight", "norm_f.weight": "model.norm.weight"}
    ours = {
        "norm_1.weight": "input_layernorm.weight",
        "attn.c_proj.weight": "self_attn.o_proj.weight",
        "norm_2.weight": "post_attention_layernorm.weight",
        "mlp.gate_proj.weight": "mlp.gate_proj.weight",
        "mlp.up_proj.weight": "mlp.up_proj.weight",
        "mlp.down_proj.weight": "mlp.down_proj.weight",
    }
    if config.bias:
        ours["attn.c_proj.bias"] = "self_attn.o_proj.bias"
    for i in range(config.n_layer):
        names |= {f"blocks.{i}.{mine}": f"model.layers.{i}.{theirs}" for mine, theirs in ours.items()}
    if not config.tie_embeddings:
        names["lm_head.weight"] = "lm_head.weight"
    return names


def _qkv_names(config: GPTConfig, i: int) -> dict[str, list[str]]:
    """c_attn's tensors of block i -> the HF tensors stacked in them (q, k, v)."""
    stacked = {f"blocks.{i}.attn.c_attn.weight": "weight"} | (
        {f"blocks.{i}.attn.c_attn.bias": "bias"} if config.bias else {}
    )
    return {
        mine: [f"model.layers.{i}.self_attn.{p}_proj.{kind}" for p in "qkv"] for mine, kind in stacked.items()
    }


CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])]) if t.shape[0] < rows else t


def hf_parts(config: GPTConfig, arch: str) -> dict[str, list[str]]:
    """Each horse parameter -> the HF tensors it holds, stacked along dim 0 in order (q, k and v for
    LLaMA's c_attn; one tensor for the rest). GPT-2's CONV1D tensors are stored transposed."""
    if arch == "GPT2LMHeadModel":
        return {mine: [theirs] for mine, theirs in _gpt2_names(config).items()}
    parts = {mine: [theirs] for mine, theirs in _llama_names(config).items()}
    return parts | {k: v for i in range(config.n_layer) for k, v in _qkv_names(config, i).items()}


def is_transposed(arch: str, name: str) -> bool:
    """Whether HF stores horse parameter name transposed (GPT-2's Conv1D: (in, out))."""
    return arch == "GPT2LMHeadModel" and name.endswith(CONV1D)


def from_hf_tensors(tensors: dict, config: GPTConfig, arch: str, source: Path) -> dict[str, torch.Tensor]:
    """Horse's state dict (float32) from HF's tensors, or an error naming source and every missing one."""
    base = "transformer." if arch == "GPT2LMHeadModel" else "model."
    if not any(k.startswith(base) for k in tensors):  # saved from the bare GPT2Model / LlamaModel
        tensors = {base + k: v for k, v in tensors.items()}  # (as OpenAI's GPT-2 on the Hub is)
    if arch == "GPT2LMHeadModel":
        names, stacked = _gpt2_names(config), {}
    else:
        names = _llama_names(config)
        stacked = {k: v for i in range(config.n_layer) for k, v in _qkv_names(config, i).items()}
    needed = list(names.values()) + [n for parts in stacked.values() for n in parts]
    missing = [n for n in needed if n not in tensors]
    if missing:
        raise ValueError(
            f"{source}: {len(missing)} tensor(s) missing for {arch} with {config.n_layer} layers: "
            + ", ".join(missing)
        )
    state = {}
    for mine, theirs in names.items():
        t = tensors[theirs]
        state[mine] = t.t() if arch == "GPT2LMHeadModel" and mine.endswith(CONV1D) else t
    for mine, parts in stacked.items():
        state[mine] = torch.cat([tensors[p] for p in parts])
    for name in ("wte.weight", "lm_head.weight"):
        if name in state:
            state[name] = _pad_rows(state[name], config.vocab_size)
    with torch.device("meta"):
        expected = GPT(config).state_dict()
    wrong = [
        f"{', '.join(stacked.get(k, [names.get(k)]))} (as {k}): {list(t.shape)}, "
        f"expected {list(expected[k].shape)}"
        for k, t in state.items()
        if t.shape != expected[k].shape
    ]
    if wrong:
        raise ValueError(f"{source}: tensors of the wrong shape for its {CONFIG}: " + "; ".join(wrong))
    return {k: v.float().contiguous() for k, v in state.items()}


def hf_architecture(config: GPTConfig) -> str:
    """The HF architecture a horse config exports as, or an error naming the fields neither takes."""
    if config.moe_experts:
        raise ValueError(
            f"a mixture of experts (moe_experts {config.moe_experts}) has no Hugging Face export here: "
            "GPT2LMHeadModel and LlamaForCausalLM are dense; its checkpoints load and generate with "
            "horse itself (python -m horse.generate --ckpt ...)"
        )
    gpt2 = {"positions": "learned", "norm": "layernorm", "mlp": "gelu", "attn_window": None}
    llama = {"positions": "rotary", "norm": "rmsnorm", "mlp": "swiglu", "attn_window": None}
    ours = {k: getattr(config, k) for k in gpt2}
    if ours == gpt2 and config.kv_heads == config.n_head:
        return "GPT2LMHeadModel"
    if ours == llama:
        return "LlamaForCausalLM"
    raise ValueError(
        f"a model of {ours} with {config.kv_heads} of {config.n_head} heads for keys and values has no "
        f"Hugging Face twin here: GPT2LMHeadModel takes {gpt2} and kv heads = heads, LlamaForCausalLM "
        f"takes {llama}"
    )


def to_hf(config: GPTConfig, state: dict[str, torch.Tensor]) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json's dict, tensors by HF name) of a whole horse model's state dict."""
    arch = hf_architecture(config)
    vocab = config.vocab_used or config.vocab_size
    state = {k: v[:vocab] if k in ("wte.weight", "lm_head.weight") else v for k, v in state.items()}
    common = {"architectures": [arch], "vocab_size": vocab, "tie_word_embeddings": config.tie_embeddings}
    common |= {"bos_token_id": None, "eos_token_id": None, "dtype": "float32", "torch_dtype": "float32"}
    if arch == "GPT2LMHeadModel":
        names, stacked = _gpt2_names(config), {}
        if not config.bias:  # HF's GPT-2 always has biases: zeros are the same model
            state = state | {
                k.replace("weight", "bias"): v.new_zeros(v.shape[0])
                for k, v in state.items()
                if k.startswith(("blocks.", "norm_f")) and k.endswith("weight")
            }
        hf = common | {
            "model_type": "gpt2",
            "n_positions": config.block_size,
            "n_embd": config.d_model,
            "n_layer": config.n_layer,
            "n_head": config.n_head,
            "n_inner": config.mlp_hidden,  # None: 4 · n_embd, in both
            "activation_function": "gelu_new",
            "layer_norm_epsilon": config.norm_eps,
        }
    else:
        names = _llama_names(config)
        stacked = {k: v for i in range(config.n_layer) for k, v in _qkv_names(config, i).items()}
        hf = common | {
            "model_type": "llama",
            "max_position_embeddings": config.block_size,
            "hidden_size": config.d_model,
            "intermediate_size": config.hidden,
            "num_hidden_layers": config.n_layer,
            "num_attention_heads": config.n_head,
            "num_key_value_heads": config.kv_heads,
            "head_dim": config.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": config.norm_eps,
            "rope_theta": config.rope_base,
            "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_base},
            "attention_bias": config.bias,
            "mlp_bias": False,
        }
    tensors = {}
    for mine, theirs in names.items():
        t = state[mine]
        tensors[theirs] = t.t() if arch == "GPT2LMHeadModel" and mine.endswith(CONV1D) else t
    q, kv = config.n_head * config.head_dim, config.kv_heads * config.head_dim
    for mine, parts in stacked.items():
        tensors |= dict(zip(parts, state[mine].split([q, kv, kv]), strict=True))
    return hf, {k: v.detach().float().contiguous() for k, v in tensors.items()}
