"""Hugging Face models in the bench suite: one training step of a transformers model, as users run it.

    python -m bench --only hf          (or python -m bench.hf, the same)

A step is forward with labels, backward and ``torch.optim.AdamW`` (foreach), through transformers' own
model classes, in bfloat16 weights (``from_pretrained(..., torch_dtype=torch.bfloat16)`` as the users of
``horse.hf`` load them), on one fixed random batch made on the GPU beforehand. Implementations:

* ``eager`` and ``sdpa``: transformers' own attention implementations (Gemma 2 has no sdpa: "sdpa does not
  support softcapping"; nor has gpt-oss, for its sinks);
* ``ours``: the sdpa model (Gemma 2's and gpt-oss's eager one) after ``horse.hf.apply`` (our attention,
  norms, MLP or experts and the loss without logits);
* ``liger``: Liger-Kernel's instance patch (``apply_liger_kernel_to_llama(model=...)``, ``..._phi3``,
  ``..._gemma2``, ``..._gemma3_text``, ``..._qwen3_moe``, ``..._gpt_oss``) where it is installed, an optional
  baseline; it has no GPT-2.

Models (random weights, no download): a LLaMA of 1.2 B parameters (Llama 3.2 1B's shape: d_model 2,048, 16
layers, 32 query and 8 key-value heads, MLP 8,192, vocabulary 128,256, tied embeddings) at 4,096 tokens a
sequence; GPT-2 124M at 16 × 1,024 tokens; a Phi-3 of 3.8 B (Phi-3-mini's shape: d_model 3,072, 32 layers of
32 heads, the fused gate_up_proj of 2 × 8,192, vocabulary 32,064, sliding window 2,047) at 2 × 2,048 tokens
(at 4,096, eager's saved attention weights, 32 layers × 32 heads × 4,096² in bfloat16, would be 34 GB beside
the 31 GB of weights, gradients and AdamW state: estimated, too near an H100's 80); a Gemma 3 of 1.0 B (Gemma
3 1B's shape: d_model 1,152, 26 layers of 4 query heads over 1 key-value head of dim 256, GeGLU MLP 6,912,
vocabulary 262,144, windows of 512 on five layers in six, tied embeddings) with Gemma 2's final-logit
softcapping of 30 at 4,096 tokens; a Gemma 2 of 2.6 B (Gemma 2 2B's shape and caps: d_model 2,304, 26 layers,
GeGLU MLP 9,216, vocabulary 256,000, attention softcap 50, final-logit softcap 30, windows of 4,096 on
alternate layers, 8 query heads over 4 of dim 256, tied embeddings) at 2,048 tokens (eager's saved scores, 26
layers × 8 heads × 2,048² in bfloat16 and the softmax's in float32, about 7 GB beside 21 GB of weights,
gradients and AdamW state: estimated); a Qwen3-MoE of 3.1 B, 0.85 B of
them active (Qwen3-30B-A3B's shape with 4 of its 48 layers: d_model 2,048, 32 query heads over 4 key-value
heads of dim 128, 128 experts of inter 768, top 8, vocabulary 151,936, the router's aux loss on) at 4,096
tokens; a gpt-oss of 4.45 B, 1.66 B of them active (gpt-oss-20b's shape with 4 of its 24 layers: d_model
2,880, 64 query heads over 8 key-value heads of dim 64 with sinks, windows of 128 on alternate layers, 32
experts of inter 2,880 with biases and the clamped SwiGLU, top 4, vocabulary 201,088, the aux loss on) at
2 × 2,048 tokens against its eager attention. Work: 6·N + 12·L·d·T FLOPs a token (bench.train's count; N the
parameters once, only the routed experts' share of an MoE's experts, T the sequence length; for the Gemmas
and gpt-oss it counts full attention on every layer, as for the others). Peak memory (the suite's
``peak_memory_bytes``: what the case allocated at most, model and optimizer included) is gated with tokens/s:
gates.toml holds ours to at least sdpa's tokens/s and at most its peak memory (eager's where the family has no
sdpa: the param ``sdpa`` false), and to Liger's tokens/s where Liger is installed.

Before ours is timed, its loss on the batch is compared with sdpa's (Gemma 2, gpt-oss: eager's) on the same
weights (bfloat16: within 2%). Without a GPU, :func:`interpreter_checks` runs a tiny model of each family (the
Gemmas with their softcaps, a Qwen3-MoE and a gpt-oss with their aux losses) in float16 in Triton's
interpreter against eager in float32.
"""

import dataclasses
import functools
import sys

import torch

from bench import suite

KERNEL = "hf_train_step"
DTYPE = torch.bfloat16
IMPLEMENTATIONS = ("ours", "sdpa", "eager", "liger")
LOSS_TOLERANCE = 0.02  # relative, ours against sdpa in bfloat16 on the same weights


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    family: str
    config: dict  # the transformers config's arguments
    batch: int
    seq_len: int
    attention: str = "sdpa"  # transformers' attention the family runs: ours is checked and gated against it

    def make_config(self):
        import transformers

        return transformers.AutoConfig.for_model(self.family, **self.config)

    @property
    def params(self) -> dict:
        config = self.make_config()  # GPT-2's config maps these names onto n_layer and n_embd
        return {
            "model": self.name,
            "layers": config.num_hidden_layers,
            "d_model": config.hidden_size,
            "batch": self.batch,
            "seq_len": self.seq_len,
            "sdpa": self.attention == "sdpa",  # the gates' choice of baseline: sdpa, else eager
        }


LLAMA_1B = Model(
    "llama-1b",
    "llama",
    {
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": True,
        "rope_theta": 500000.0,
    },
    batch=1,
    seq_len=4096,
)
# Dropout off everywhere (our attention refuses attention dropout, and the others should do the same work).
GPT2_124M = Model(
    "gpt2-124m", "gpt2", {"attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}, batch=16, seq_len=1024
)
PHI3_MINI = Model(
    "phi3-mini",
    "phi3",
    {
        "vocab_size": 32064,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "max_position_embeddings": 4096,
        "sliding_window": 2047,
    },
    batch=2,
    seq_len=2048,
)
GEMMA3_1B = Model(
    "gemma3-1b-softcap",
    "gemma3_text",
    {
        "vocab_size": 262144,
        "hidden_size": 1152,
        "intermediate_size": 6912,
        "num_hidden_layers": 26,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 512,
        "max_position_embeddings": 32768,
        "final_logit_softcapping": 30.0,
    },
    batch=1,
    seq_len=4096,
)
GEMMA2_2B = Model(
    "gemma2-2b",
    "gemma2",
    {
        "vocab_size": 256000,
        "hidden_size": 2304,
        "intermediate_size": 9216,
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "query_pre_attn_scalar": 256,
        "sliding_window": 4096,
        "max_position_embeddings": 8192,
        "attn_logit_softcapping": 50.0,
        "final_logit_softcapping": 30.0,
    },
    batch=1,
    seq_len=2048,
    attention="eager",
)
# Qwen3-30B-A3B's shape with 4 of its 48 layers: 128 experts of inter 768, top 8, the aux loss on.
QWEN3_MOE = Model(
    "qwen3-moe-4l",
    "qwen3_moe",
    {
        "vocab_size": 151936,
        "hidden_size": 2048,
        "moe_intermediate_size": 768,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "output_router_logits": True,
        "num_hidden_layers": 4,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "max_position_embeddings": 4096,
    },
    batch=1,
    seq_len=4096,
)
# gpt-oss-20b's shape with 4 of its 24 layers: 32 experts of inter 2,880, top 4, with biases and the clamped
# SwiGLU, attention sinks, windows of 128 on alternate layers; the aux loss on. Eager attention (transformers
# refuses gpt-oss sdpa) saves about 5 copies of 64 heads x 2,048² scores in bfloat16 a layer: 2 x 2,048 tokens
# keep that near 20 GB beside the 36 GB of weights, gradients and AdamW state (estimated).
GPT_OSS = Model(
    "gpt-oss-4l",
    "gpt_oss",
    {
        "vocab_size": 201088,
        "hidden_size": 2880,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "output_router_logits": True,
        "num_hidden_layers": 4,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "sliding_window": 128,
    },
    batch=2,
    seq_len=2048,
    attention="eager",
)
MODELS = (LLAMA_1B, GPT2_124M, PHI3_MINI, GEMMA3_1B, GEMMA2_2B, QWEN3_MOE, GPT_OSS)
# Liger-Kernel's instance patch for each family it has
LIGER_PATCHES = {
    "llama": "apply_liger_kernel_to_llama",
    "phi3": "apply_liger_kernel_to_phi3",
    "gemma2": "apply_liger_kernel_to_gemma2",
    "gemma3_text": "apply_liger_kernel_to_gemma3_text",
    "qwen3_moe": "apply_liger_kernel_to_qwen3_moe",
    "gpt_oss": "apply_liger_kernel_to_gpt_oss",
}


def active_params(model) -> int:
    """The parameters a token uses (tied ones once): all of them, less, in a mixture of experts, the share of
    the experts' weights it is not routed to (num_experts - num_experts_per_tok of num_experts)."""
    params = sum(p.numel() for p in model.parameters())
    experts = getattr(model.config, "num_experts", None)
    if experts is None:
        return params
    expert_params = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return params - expert_params * (experts - model.config.num_experts_per_tok) // experts


def flops_per_step(model, spec: Model) -> int:
    """Training FLOPs of a step: (6·N + 12·L·d·T) a token, N the parameters a token uses (active_params)."""
    per_token = 6 * active_params(model) + 12 * spec.params["layers"] * spec.params["d_model"] * spec.seq_len
    return per_token * spec.batch * spec.seq_len


def build(spec: Model, implementation: str, device: str, dtype: torch.dtype = DTYPE):
    """The model of spec for implementation, from one seed, in training mode."""
    import transformers

    import horse.hf

    torch.manual_seed(0)
    attention = "eager" if implementation == "eager" else spec.attention
    model = transformers.AutoModelForCausalLM.from_config(spec.make_config(), attn_implementation=attention)
    model = model.to(device=device, dtype=dtype).train()
    if implementation == "ours":
        horse.hf.apply(model)
    elif implementation == "liger":
        _apply_liger(model, spec)
    return model


def _apply_liger(model, spec: Model) -> None:
    if spec.family not in LIGER_PATCHES:
        raise suite.UnavailableError(f"Liger-Kernel has no {spec.family}")
    try:
        import liger_kernel.transformers

        getattr(liger_kernel.transformers, LIGER_PATCHES[spec.family])(model=model)
    except Exception as error:  # not installed, or not for this transformers
        raise suite.UnavailableError(f"Liger-Kernel: {error}") from error


def make_step(spec: Model, implementation: str, device: str = "cuda"):
    """A call that takes one training step (forward with labels, backward, AdamW) and returns the loss."""
    model = build(spec, implementation, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    vocab = model.config.vocab_size
    ids = torch.randint(vocab, (spec.batch, spec.seq_len), device=device)

    def step():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss

    return step


def check(spec: Model, device: str = "cuda") -> tuple[dict, bool]:
    """Ours' loss on a batch against transformers' own attention's (spec.attention) on the same weights
    (forward, bfloat16)."""
    import horse.hf

    model = build(spec, spec.attention, device)
    ids = torch.randint(model.config.vocab_size, (spec.batch, spec.seq_len), device=device)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
        horse.hf.apply(model)
        loss = model(input_ids=ids, labels=ids).loss.item()
    error = abs(loss - expected) / abs(expected)
    return {"loss": error}, error <= LOSS_TOLERANCE


def implementations(spec: Model) -> tuple[str, ...]:
    """IMPLEMENTATIONS, without sdpa where the family has none (Gemma 2)."""
    return tuple(name for name in IMPLEMENTATIONS if name != "sdpa" or spec.attention == "sdpa")


def cases(quick: bool) -> list[suite.Case]:
    """Every model on every implementation it has (the quick run keeps those the gates name)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.hf: transformers is not installed; no hf cases")
        return []
    result = []
    for spec in MODELS:
        with torch.device("meta"):
            work = flops_per_step(build(spec, spec.attention, "meta"), spec)
        result += suite.family_cases(
            KERNEL,
            spec.params,
            {name: name for name in implementations(spec)},
            ["forward+backward"],
            lambda direction, work=work: work,
            "flop",
            lambda name, implementation, direction, spec=spec: functools.partial(make_step, spec, name),
            functools.partial(check, spec),
        )
    return result


# Tiny models for the interpreter: two layers, GQA in the LLaMA and the Gemmas, 16 tokens a sequence.
INTERPRETER_MODELS = (
    Model(
        "llama-tiny",
        "llama",
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
        },
        batch=2,
        seq_len=16,
    ),
    Model(
        "gpt2-tiny",
        "gpt2",
        {
            "vocab_size": 96,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 64,
            "attn_pdrop": 0.0,
            "resid_pdrop": 0.0,
            "embd_pdrop": 0.0,
        },
        batch=2,
        seq_len=16,
    ),
    Model(
        "phi3-tiny",
        "phi3",
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 4,
            "sliding_window": 7,
            "pad_token_id": 0,  # Phi-3's 32,000 lies outside this vocabulary
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        batch=2,
        seq_len=16,
    ),
    # Weights 10x the default spread: the router's top 2 of 8 well apart, so that float16 routes as float32.
    Model(
        "qwen3-moe-tiny",
        "qwen3_moe",
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "initializer_range": 0.2,
        },
        batch=2,
        seq_len=16,
    ),
    # Weights 10x the default spread, as the Qwen3-MoE's; a swiglu_limit of 2 that the experts' gate and up
    # cross (they reach about ±6), a window of 5 on the first layer; eager attention (no sdpa for gpt-oss).
    Model(
        "gpt-oss-tiny",
        "gpt_oss",
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "swiglu_limit": 2.0,
            "output_router_logits": True,
            "router_aux_loss_coef": 0.1,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "initializer_range": 0.2,
        },
        batch=2,
        seq_len=16,
        attention="eager",
    ),
    # Weights 10x the default spread: logits reach about ±10, where a softcap of 5 bends the large ones.
    Model(
        "gemma3-tiny-softcap",
        "gemma3_text",
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "layer_types": ["sliding_attention", "full_attention"],
            "initializer_range": 0.2,
            "final_logit_softcapping": 5.0,
        },
        batch=2,
        seq_len=16,
    ),
    # Both caps biting: scaled attention scores reach about ±9 with query_pre_attn_scalar 16 (capped at 2).
    Model(
        "gemma2-tiny-softcap",
        "gemma2",
        {
            "vocab_size": 96,
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "sliding_window": 5,
            "query_pre_attn_scalar": 16,
            "initializer_range": 0.2,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 5.0,
        },
        batch=2,
        seq_len=16,
        attention="eager",
    ),
)
FLOOR = 1e-3  # float16's, as the tests' accuracy rule (times the largest magnitude)


def loss_and_grads(model, ids) -> tuple[torch.Tensor, list[torch.Tensor]]:
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach().double(), [p.grad.double() for p in model.parameters()]


def interpreter_check(spec: Model) -> tuple[dict, bool]:
    """Ours in float16 against eager in float32 (the truth) on the loss and every gradient: its error at
    most twice eager float16's, plus a floor."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, spec.config["vocab_size"], (spec.batch, spec.seq_len), generator=generator)
    truth = loss_and_grads(build(spec, "eager", "cpu", torch.float32), ids)
    baseline = loss_and_grads(build(spec, "eager", "cpu", torch.float16), ids)
    ours = loss_and_grads(build(spec, "ours", "cpu", torch.float16), ids)
    errors, passed = {}, True
    for name, got, base, true in (
        ("loss", [ours[0]], [baseline[0]], [truth[0]]),
        ("grads", ours[1], baseline[1], truth[1]),
    ):
        error = max((g - t).abs().max().item() for g, t in zip(got, true, strict=True))
        allowed = max(
            2 * (b - t).abs().max().item() + FLOOR * max(1.0, t.abs().max().item())
            for b, t in zip(base, true, strict=True)
        )
        errors[name] = error
        passed &= error <= allowed
    return errors, passed


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """Each tiny model's float16 training loss and gradients, ours against eager (CPU)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return [("hf: transformers is not installed", {}, True)]
    label = "{} {} float16 against eager float32"
    return [(label.format(KERNEL, spec.name), *interpreter_check(spec)) for spec in INTERPRETER_MODELS]


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["--only", "hf", *sys.argv[1:]]))
