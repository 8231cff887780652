"""What a preset trains with, and how the trainer runs its model.

Recipes. Each preset carries the optimiser settings it is trained with; ``horse.train`` takes them
under its flags (a flag, or a --config key, overrides one):

    preset      lr       warm-up   tokens a step            weight decay  betas        eval tokens
    tiny        2e-3     30 steps  --batch-size x T         0.1           0.9, 0.95    20,480
    tiny-moe    2e-3     30        --batch-size x T         0.1           0.9, 0.95    20,480
    gpt2-124m   6e-4     715       524,288 (0.5M)           0.1           0.9, 0.95    1,048,576
    moe-124m    6e-4     715       524,288 (0.5M)           0.1           0.9, 0.95    1,048,576
    gpt2-350m   3e-4     715       524,288                  0.1           0.9, 0.95    1,048,576
    gpt2-774m   2.5e-4   715       524,288                  0.1           0.9, 0.95    1,048,576
    gpt2-1.5b   2e-4     358       1,048,576 (1M)           0.1           0.9, 0.95    1,048,576
    moe-1b-7b   2e-4     358       1,048,576 (1M)           0.1           0.9, 0.95    1,048,576

GPT-2's are the GPT-3 paper's (Brown et al. 2020, table 2.1 and appendix B) for the model of the
nearest size (Small 125M, Medium 350M, Large 760M, XL 1.3B): Adam with betas 0.9 and 0.95, weight
decay 0.1, gradients clipped at 1.0, a linear warm-up over the first 375M tokens (715 steps of
2^19 tokens), cosine decay to 10 % of the peak. The mixtures of experts take the recipe of the GPT-3
model nearest their active parameters (moe-124m: 124M, Small's; moe-1b-7b: 1.18B, XL's), tiny-moe
tiny's. A step's tokens (--batch-tokens) are reached by gradient accumulation: --grad-accum =
batch_tokens / (--batch-size x seq_len x data-parallel replicas). The GPT-2 and moe presets need
data prepared with a BPE tokenizer: without --data they stop and say how to make it (the built-in
corpus is bytes, for the tiny models).

Running the model (``horse.parallel.parallelize_gpt`` applies both). ``--compile`` runs the training
loss under torch.compile: the Triton kernels are registered custom ops with fake implementations, so
the whole forward and backward is one graph (fullgraph at tp=1, where a graph break is an error; at
tp > 1 the collectives of ``horse.parallel`` are left to Dynamo); under FSDP2 (--dp-shard) each
block is compiled on its own, inside FSDP's hooks, as torchtitan does. ``--activation-checkpointing``
keeps only each block's inputs in the forward and recomputes the block in the backward: the
activations of one block at a time instead of all of them, for one more forward of the blocks.
"""

import dataclasses
from dataclasses import dataclass

GPT3_BATCH = 2**19  # "0.5M" tokens
GPT3_WARMUP_TOKENS = 375_000_000


@dataclass(frozen=True)
class Recipe:
    """Values of TrainConfig fields (batch_tokens None: --grad-accum micro-batches a step)."""

    lr: float
    warmup_steps: int
    batch_tokens: int | None
    weight_decay: float
    beta1: float
    beta2: float
    eval_tokens: int
    source: str  # where the numbers come from
    needs_data: bool = False  # its vocabulary is a BPE tokenizer's: refuse the built-in bytes


def _gpt3(lr: float, batch_tokens: int, size: str) -> Recipe:
    return Recipe(
        lr=lr,
        warmup_steps=round(GPT3_WARMUP_TOKENS / batch_tokens),
        batch_tokens=batch_tokens,
        weight_decay=0.1,
        beta1=0.9,
        beta2=0.95,
        eval_tokens=2**20,
        source=f"GPT-3 paper, table 2.1: {size}",
        needs_data=True,
    )


RECIPES = {
    # 32 windows of 64 bytes a step, 250 steps: see horse.model.tiny.
    "tiny": Recipe(2e-3, 30, None, 0.1, 0.9, 0.95, 20_480, "tuned on the built-in corpus"),
    "tiny-moe": Recipe(2e-3, 30, None, 0.1, 0.9, 0.95, 20_480, "tiny's"),
    "gpt2-124m": _gpt3(6e-4, GPT3_BATCH, "Small, 125M"),
    "moe-124m": _gpt3(6e-4, GPT3_BATCH, "Small, 125M, its active parameters' size"),
    "gpt2-350m": _gpt3(3e-4, GPT3_BATCH, "Medium, 350M"),
    "gpt2-774m": _gpt3(2.5e-4, GPT3_BATCH, "Large, 760M"),
    "gpt2-1.5b": _gpt3(2e-4, 2 * GPT3_BATCH, "XL, 1.3B"),
    "moe-1b-7b": _gpt3(2e-4, 2 * GPT3_BATCH, "XL, 1.3B, its active parameters' size"),
}
FIELDS = [f.name for f in dataclasses.fields(Recipe) if f.name not in ("source", "needs_data")]


def recipe_values(preset: str, given: dict) -> dict:
    """The preset's recipe as TrainConfig values, under given (the flags, config file and resumed
    run's values): given wins; a --grad-accum given without --batch-tokens drops the recipe's
    batch_tokens. An unknown preset has none (TrainConfig names it)."""
    if preset not in RECIPES:
        return given
    values = {name: getattr(RECIPES[preset], name) for name in FIELDS}
    if "grad_accum" in given and "batch_tokens" not in given:
        del values["batch_tokens"]
    return values | given


def describe(cfg) -> str:
    """The recipe line printed at the start of a run: each value, and where a flag changed it."""
    recipe = RECIPES[cfg.preset]
    parts = []
    for name in FIELDS:
        value, default = getattr(cfg, name), getattr(recipe, name)
        flag = "--" + name.replace("_", "-")
        parts.append(
            f"{flag} {_show(value)}" + (f" (the recipe's {_show(default)})" if value != default else "")
        )
    return f"recipe {cfg.preset} ({recipe.source}): " + ", ".join(parts)


def _show(value: float | int | None) -> str:
    return "none" if value is None else f"{value:,}" if isinstance(value, int) else f"{value:g}"


def check_data(cfg) -> None:
    """A preset that needs prepared data stops without --data, saying how to make it."""
    recipe = RECIPES.get(cfg.preset)
    if recipe is not None and recipe.needs_data and not cfg.data and not cfg.init_from:
        raise ValueError(
            f"--preset {cfg.preset} trains on text tokenised with a BPE tokenizer, not on the built-in "
            "corpus's bytes: prepare it with\n"
            "    python -m horse.data prepare CORPUS... --tokenizer tokenizer.json --out data/NAME\n"
            "(files, directories, globs; .jsonl too) and pass --data data/NAME"
        )


def grad_accum(cfg, seq_len: int, dp_size: int) -> int:
    """Micro-batches a step: --grad-accum, or --batch-tokens / (batch_size · seq_len · dp_size),
    which must divide exactly."""
    if cfg.batch_tokens is None:
        return cfg.grad_accum
    micro = cfg.batch_size * seq_len * dp_size
    if cfg.batch_tokens % micro:
        raise ValueError(
            f"--batch-tokens {cfg.batch_tokens:,} is not a multiple of --batch-size {cfg.batch_size} x "
            f"seq_len {seq_len} x {dp_size} data-parallel replica(s) = {micro:,} tokens a micro-batch"
        )
    accum = cfg.batch_tokens // micro
    if cfg.grad_accum not in (1, accum):
        raise ValueError(
            f"--grad-accum {cfg.grad_accum} and --batch-tokens {cfg.batch_tokens:,} disagree (the latter "
            f"makes {accum} micro-batches of {micro:,} tokens): give one of them"
        )
    return accum
