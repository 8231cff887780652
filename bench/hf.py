"""Hugging Face models in the bench suite: one training step of a transformers model, as users run it.

    python -m bench --only hf          (or python -m bench.hf, the same)

A step is forward with labels, backward and ``torch.optim.AdamW`` (foreach), through transformers' own
model classes, in bfloat16 weights (``from_pretrained(..., torch_dtype=torch.bfloat16)`` as the users of
``horse.hf`` load them), on one fixed random batch made on the GPU beforehand. Implementations:

* ``eager`` and ``sdpa``: transformers' own attention implementations;
* ``ours``: the sdpa model after ``horse.hf.apply`` (our attention, norms, MLP and the loss without logits);
* ``liger``: Liger-Kernel's instance patch (``apply_liger_kernel_to_llama(model=...)``) where it is
  installed, an optional baseline; it has no GPT-2.

Models (random weights, no download): a LLaMA of 1.2 B parameters (Llama 3.2 1B's shape: d_model 2,048,
16 layers, 32 query and 8 key-value heads, MLP 8,192, vocabulary 128,256, tied embeddings) at 4,096 tokens a
sequence, and GPT-2 124M at 16 × 1,024 tokens. Work: 6·N + 12·L·d·T FLOPs a token (bench.train's count;
N the parameters once, T the sequence length). Peak memory (the suite's ``peak_memory_bytes``: what the
case allocated at most, model and optimizer included) is gated with tokens/s: gates.toml holds ours to at
least sdpa's tokens/s and at most its peak memory, and to Liger's tokens/s where Liger is installed.

Before ours is timed, its loss on the batch is compared with sdpa's on the same weights (bfloat16:
within 2 %). Without a GPU, :func:`interpreter_checks` runs tiny models of both families in float16 in
Triton's interpreter against eager in float32.
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

    def make_config(self):
        import transformers

        config_class = {"llama": transformers.LlamaConfig, "gpt2": transformers.GPT2Config}[self.family]
        return config_class(**self.config)

    @property
    def params(self) -> dict:
        config = self.make_config()  # GPT-2's config maps these names onto n_layer and n_embd
        return {
            "model": self.name,
            "layers": config.num_hidden_layers,
            "d_model": config.hidden_size,
            "batch": self.batch,
            "seq_len": self.seq_len,
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
MODELS = (LLAMA_1B, GPT2_124M)


def flops_per_step(model, spec: Model) -> int:
    """Training FLOPs of a step: (6·N + 12·L·d·T) a token, N the parameters (tied ones once)."""
    params = sum(p.numel() for p in model.parameters())
    per_token = 6 * params + 12 * spec.params["layers"] * spec.params["d_model"] * spec.seq_len
    return per_token * spec.batch * spec.seq_len


def build(spec: Model, implementation: str, device: str, dtype: torch.dtype = DTYPE):
    """The model of spec for implementation, from one seed, in training mode."""
    import transformers

    import horse.hf

    torch.manual_seed(0)
    attention = "eager" if implementation == "eager" else "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(spec.make_config(), attn_implementation=attention)
    model = model.to(device=device, dtype=dtype).train()
    if implementation == "ours":
        horse.hf.apply(model)
    elif implementation == "liger":
        _apply_liger(model, spec)
    return model


def _apply_liger(model, spec: Model) -> None:
    if spec.family != "llama":
        raise suite.UnavailableError(f"Liger-Kernel has no {spec.family}")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(model=model)
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
    """Ours' loss on a batch against sdpa's on the same weights (forward, bfloat16)."""
    import horse.hf

    model = build(spec, "sdpa", device)
    ids = torch.randint(model.config.vocab_size, (spec.batch, spec.seq_len), device=device)
    with torch.no_grad():
        expected = model(input_ids=ids, labels=ids).loss.item()
        horse.hf.apply(model)
        loss = model(input_ids=ids, labels=ids).loss.item()
    error = abs(loss - expected) / abs(expected)
    return {"loss": error}, error <= LOSS_TOLERANCE


def cases(quick: bool) -> list[suite.Case]:
    """Every model on every implementation (the quick run keeps those the gates name)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench.hf: transformers is not installed; no hf cases")
        return []
    result = []
    for spec in MODELS:
        with torch.device("meta"):
            work = flops_per_step(build(spec, "sdpa", "meta"), spec)
        result += suite.family_cases(
            KERNEL,
            spec.params,
            {name: name for name in IMPLEMENTATIONS},
            ["forward+backward"],
            lambda direction, work=work: work,
            "flop",
            lambda name, implementation, direction, spec=spec: functools.partial(make_step, spec, name),
            functools.partial(check, spec),
        )
    return result


# Tiny models for the interpreter: two layers, GQA in the LLaMA, 16 tokens a sequence.
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
