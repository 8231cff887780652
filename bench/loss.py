"""The fused loss in the bench suite: ours against torch eager, torch.compile and Liger-Kernel.

    python -m bench --only loss        (or python -m bench.loss, the same)

Two kernels, float16:

* ``linear_cross_entropy``: the LM head and its mean loss, x (tokens, d_model) @ Wᵀ (vocab, d_model)
  then cross-entropy against int64 targets; forward (one call under no_grad) and forward+backward
  (the loss, then ``torch.autograd.grad`` of it w.r.t. x and W). ours: ``horse.kernels.linear_cross_entropy``;
  eager: ``F.linear`` then ``F.cross_entropy`` of the float32 logits (what autocast runs); compile:
  ``torch.compile`` of eager; liger: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` where it
  imports. FLOPs count the GEMMs (:func:`linear_loss_flops`): 2·T·D·V forward, three times that
  forward+backward. Shapes: GPT-2's head (d_model 768, 1600; vocabulary 50,304) and LLaMA 3 8B's
  (4096, 128,256), at 8K and 16K tokens.
* ``cross_entropy``: the loss of given logits (tokens, vocab), forward and forward+backward;
  ``horse.kernels.cross_entropy`` against ``F.cross_entropy`` of the float32 logits, eager and compiled.
  Bytes are what must move (:func:`cross_entropy_bytes`): the logits read once, and in
  forward+backward their gradient written once.

gates.toml holds ``linear_cross_entropy`` forward+backward to at least eager and torch.compile.
"""

import functools
import itertools
import sys

import torch
import torch.nn.functional as F  # noqa: N812

from bench import correctness, suite, timing

DTYPE = torch.float16
TOKENS = (8192, 16384)
HEADS = ((768, 50304), (1600, 50304), (4096, 128256))  # (d_model, vocab)
QUICK_SHAPES = ((16384, 768, 50304),)  # (tokens, d_model, vocab), where the gates apply
CROSS_ENTROPY_SHAPES = ((16384, 50304), (8192, 128256))  # (tokens, vocab)
# Small and ragged shapes for the interpreter: (tokens, d_model, vocab).
INTERPRETER_SHAPES = ((67, 48, 1000), (5, 16, 7))
DIRECTIONS = ("forward", "forward+backward")  # ours does the backward's work in the forward
IGNORED = -100
# Largest normalized error (bench.correctness.normalized_error) allowed against the float32 reference.
TOLERANCE = 2e-2


def linear_loss_flops(tokens: int, d_model: int, vocab: int, direction: str) -> int:
    """GEMM FLOPs: the logits 2·T·D·V; forward+backward adds dx and dW, 2·T·D·V each."""
    forward = 2 * tokens * d_model * vocab
    return forward * {"forward": 1, "forward+backward": 3}[direction]


def cross_entropy_bytes(tokens: int, vocab: int, element_bytes: int, direction: str) -> int:
    """Bytes that must move: read the logits; forward+backward also writes their gradient (targets
    and per-row results, 8-12 bytes a row, are not counted)."""
    return tokens * vocab * element_bytes * {"forward": 1, "forward+backward": 2}[direction]


def make_inputs(tokens: int, d_model: int, vocab: int, device, requires_grad: bool = False) -> dict:
    """x ~ N(0, 1), W ~ N(0, 1/d_model) (logits of O(1)), targets uniform with every 10th ignored."""
    x = torch.randn(tokens, d_model, device=device).to(DTYPE)
    w = (torch.randn(vocab, d_model, device=device) / d_model**0.5).to(DTYPE)
    target = torch.randint(0, vocab, (tokens,), device=device)
    target[::10] = IGNORED
    return {"x": x.requires_grad_(requires_grad), "w": w.requires_grad_(requires_grad), "target": target}


def eager_linear_loss(t: dict) -> torch.Tensor:
    return F.cross_entropy(F.linear(t["x"], t["w"]).float(), t["target"], ignore_index=IGNORED)


def ours_linear_loss(t: dict) -> torch.Tensor:
    from horse import kernels  # here, not at import: the CPU path sets TRITON_INTERPRET first

    return kernels.linear_cross_entropy(t["x"], t["w"], t["target"], ignore_index=IGNORED)


def liger_linear_loss():
    """Liger-Kernel's fused linear cross-entropy as a call on the inputs; UnavailableError without it."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except ImportError as error:
        raise suite.UnavailableError(f"liger_kernel does not import: {error}") from error
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORED)
    return lambda t: loss(t["w"], t["x"], t["target"])


def eager_cross_entropy(t: dict) -> torch.Tensor:
    return F.cross_entropy(t["logits"].float(), t["target"], ignore_index=IGNORED)


def ours_cross_entropy(t: dict) -> torch.Tensor:
    from horse import kernels

    return kernels.cross_entropy(t["logits"], t["target"], ignore_index=IGNORED)


def check(tokens: int, d_model: int, vocab: int, device) -> tuple[dict, bool]:
    """Ours's loss, dx and dW against the float32 reference (:func:`bench.correctness.check`). The
    loss is summed here, not averaged, so that each token's dx is O(1), as normalized_error expects."""
    from horse import kernels
    from horse.kernels import reference

    torch.manual_seed(0)
    t = make_inputs(tokens, d_model, vocab, device, requires_grad=True)
    options = {"ignore_index": IGNORED, "reduction": "sum"}
    return correctness.check(
        lambda x, w: kernels.linear_cross_entropy(x, w, t["target"], **options),
        lambda x, w: reference.linear_cross_entropy(x, w, t["target"], **options),
        [t["x"], t["w"]],
        ("loss", "dx", "dw"),
        TOLERANCE,
    )


def linear_cases(tokens: int, d_model: int, vocab: int, quick=False, device="cuda") -> list[suite.Case]:
    """ours, eager, compile and liger on one head, forward and forward+backward; quick: compile
    only where a gate holds ours to it (forward+backward), since each of its cases compiles afresh."""
    params = {"tokens": tokens, "d_model": d_model, "vocab": vocab}
    implementations = {
        "ours": lambda: ours_linear_loss,
        "eager": lambda: eager_linear_loss,
        "compile": suite.compiled(eager_linear_loss),
        "liger": liger_linear_loss,
    }
    make_copy = functools.partial(make_inputs, tokens, d_model, vocab, device)
    read = (tokens + vocab) * d_model * DTYPE.itemsize  # x and W
    cases = suite.family_cases(
        "linear_cross_entropy",
        params,
        implementations,
        DIRECTIONS,
        work=functools.partial(linear_loss_flops, tokens, d_model, vocab),
        unit="flop",
        setup=lambda name, make_fn, d: timing.setup(make_fn, make_copy, d, read, device),
        check=functools.partial(check, tokens, d_model, vocab, device),
    )
    return [c for c in cases if not (quick and c.implementation == "compile" and c.direction == "forward")]


def cross_entropy_cases(tokens: int, vocab: int, device="cuda") -> list[suite.Case]:
    params = {"tokens": tokens, "vocab": vocab}
    implementations = {
        "ours": lambda: ours_cross_entropy,
        "eager": lambda: eager_cross_entropy,
        "compile": suite.compiled(eager_cross_entropy),
    }

    def make_copy(requires_grad: bool):
        logits = torch.randn(tokens, vocab, device=device).to(DTYPE).requires_grad_(requires_grad)
        target = torch.randint(0, vocab, (tokens,), device=device)
        return {"logits": logits, "target": target}

    return suite.family_cases(
        "cross_entropy",
        params,
        implementations,
        DIRECTIONS,
        work=functools.partial(cross_entropy_bytes, tokens, vocab, DTYPE.itemsize),
        unit="byte",
        setup=lambda name, make_fn, d: timing.setup(
            make_fn, make_copy, d, tokens * vocab * DTYPE.itemsize, device
        ),
    )


def cases(quick: bool) -> list[suite.Case]:
    heads = QUICK_SHAPES if quick else [(t, d, v) for t, (d, v) in itertools.product(TOKENS, HEADS)]
    out = [case for shape in heads for case in linear_cases(*shape, quick=quick)]
    if not quick:
        out += [case for shape in CROSS_ENTROPY_SHAPES for case in cross_entropy_cases(*shape)]
    return out


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """The correctness check on small, ragged shapes, on the CPU (in Triton's interpreter when it is on)."""
    return [
        (f"linear_cross_entropy tokens={t} d_model={d} vocab={v}", *check(t, d, v, "cpu"))
        for t, d, v in INTERPRETER_SHAPES
    ]


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["--only", "loss", *sys.argv[1:]]))
