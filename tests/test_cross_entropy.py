"""horse.kernels.cross_entropy and horse.kernels.linear_cross_entropy against F.cross_entropy in float64
(forward, dlogits, dx, dW, db) on awkward sizes, with ignore_index, label smoothing, z-loss and final-logit
softcapping; the largest vocabulary on every path; the chunk loop's plain-PyTorch form; bad input;
torch.compile; and the memory the fused loss saves."""

import dataclasses
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F  # noqa: N812
from helpers import assert_close
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import horse.kernels.cross_entropy  # noqa: F401 (the module, which horse.kernels.cross_entropy the function hides)
from horse import kernels
from horse.kernels import reference
from horse.model import GPT, GPTConfig

ce = sys.modules["horse.kernels.cross_entropy"]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
OPTIONS = [
    {},
    {"label_smoothing": 0.1},
    {"z_loss": 1e-2},
    {"label_smoothing": 0.2, "z_loss": 1e-3, "reduction": "sum"},
    {"reduction": "none", "label_smoothing": 0.05},
    {"softcap": 5.0},  # the logits (up to about 15) well into tanh's bend
    {"softcap": 30.0, "label_smoothing": 0.1, "z_loss": 1e-2, "reduction": "none"},
]


def _targets(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Targets with the first and last class and two ignored rows (rows >= 4)."""
    t = torch.randint(0, vocab, (rows,), generator=torch.Generator().manual_seed(seed))
    t[0], t[-1] = 0, vocab - 1
    if rows >= 4:
        t[1], t[rows // 2] = -100, -100
    return t


def _grads(loss: torch.Tensor, inputs: list, seed: int = 1) -> tuple:
    """The inputs' gradients for a random upstream gradient (every row its own weight for "none")."""
    upstream = (
        torch.rand(loss.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) + 0.5
    )
    return torch.autograd.grad(loss, inputs, upstream.to(loss.dtype))


def _cases(sizes: list[tuple]) -> list[tuple]:
    """Every option set on the first size; the other sizes with one each, in turn."""
    rest = [(*size, OPTIONS[i % len(OPTIONS)]) for i, size in enumerate(sizes[1:], 1)]
    return [(*sizes[0], options) for options in OPTIONS] + rest


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    ("rows", "vocab", "options"), _cases([(13, 1000), (5, 1), (9, 7), (3, 5003)]), ids=str
)
def test_cross_entropy_matches_float64(rows, vocab, dtype, options):
    logits = (torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 4).to(dtype)
    target = _targets(rows, vocab)
    exact = logits.double().requires_grad_()
    truth = reference.cross_entropy(exact, target, **options)
    (truth_grad,) = _grads(truth, [exact])
    baseline_in = logits.float().requires_grad_()  # PyTorch's own: F.cross_entropy upcasts 16-bit logits
    baseline = reference.cross_entropy(baseline_in, target, **options)
    (baseline_grad,) = _grads(baseline, [baseline_in])
    ours_in = logits.clone().requires_grad_()
    loss = kernels.cross_entropy(ours_in, target, **options)
    (grad,) = _grads(loss, [ours_in])
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    assert_close("loss", loss, truth, baseline)
    assert_close("dlogits", grad, truth_grad, baseline_grad.to(dtype))
    assert torch.equal(ours_in.detach(), logits)  # the caller's logits are not overwritten


@pytest.mark.interpreter
@pytest.mark.parametrize("softcap", [None, 30.0])
def test_cross_entropy_takes_the_largest_vocabulary(softcap):
    vocab = 2**20  # MAX_VOCAB, four times the 2**18 it was
    logits = (torch.randn(2, vocab) * 4).half().requires_grad_()
    target = torch.tensor([5, vocab - 1])
    loss = kernels.cross_entropy(logits, target, reduction="none", softcap=softcap)
    assert loss.shape == (2,)
    exact = logits.detach().double().requires_grad_()
    truth = reference.cross_entropy(exact, target, reduction="none", softcap=softcap)
    torch.testing.assert_close(loss.double(), truth, rtol=1e-5, atol=1e-5)
    loss.sum().backward()
    truth.sum().backward()
    torch.testing.assert_close(logits.grad.double(), exact.grad, rtol=0, atol=1e-3)


@pytest.mark.interpreter
@pytest.mark.parametrize("path", ["fused", "shard-kernels", "plain-pytorch"])
def test_the_head_loss_takes_gemma3s_vocabulary_on_every_path(path):
    """262,208 classes (above the old limit of 2**18) with Gemma 2's softcap: linear_cross_entropy (the
    one-launch kernel), and the model's head_loss on a (one-rank) shard: the statistics and gradient
    kernels, and their plain-PyTorch twins."""
    vocab = 262208
    tensors, target = _linear_case(3, 8, vocab, torch.float32, bias=False)
    ours_in, baseline_in = ([t.clone().requires_grad_() for t in tensors] for _ in range(2))
    if path == "fused":
        loss = kernels.linear_cross_entropy(*ours_in, target, softcap=30.0)
    else:
        use_triton = path == "shard-kernels"
        loss = ce.head_loss(*ours_in, target, use_triton=use_triton, shard=_one_rank(vocab), softcap=30.0)
    exact = [t.double().requires_grad_() for t in tensors]
    truth = reference.linear_cross_entropy(*exact, target, softcap=30.0)
    baseline = reference.linear_cross_entropy(*baseline_in, target, softcap=30.0)  # PyTorch's, float32
    assert_close("loss", loss, truth, baseline)
    grads = torch.autograd.grad(loss, ours_in)
    truth_grads = torch.autograd.grad(truth, exact)
    baseline_grads = torch.autograd.grad(baseline, baseline_in)
    for name, grad, want, base in zip(("dx", "dW"), grads, truth_grads, baseline_grads, strict=True):
        assert_close(name, grad, want, base)


def _linear_case(rows, hidden, vocab, dtype, bias: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5 * 3).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.5).to(dtype) if bias else None
    return [t for t in (x, w, b) if t is not None], _targets(rows, vocab, seed)


def _linear(fn, tensors, target, **options):
    x, w, *b = tensors
    return fn(x, w, target, b[0] if b else None, **options)


@pytest.mark.interpreter
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=str)  # bf16's tl.dot: no matmul here
@pytest.mark.parametrize(
    ("rows", "hidden", "vocab", "bias", "options"),
    _cases([(37, 24, 1001, True), (5, 8, 1, True), (23, 16, 300, False)]),
    ids=str,
)
def test_linear_cross_entropy_matches_float64(monkeypatch, rows, hidden, vocab, bias, dtype, options):
    monkeypatch.setattr(ce, "CHUNK_BYTES", 7 * vocab * dtype.itemsize)  # chunks of 7 rows: a ragged last one
    monkeypatch.setattr(ce, "DW_SLICE_BYTES", 5 * hidden * dtype.itemsize)  # and dW's slices
    tensors, target = _linear_case(rows, hidden, vocab, dtype, bias)
    exact = [t.double().requires_grad_() for t in tensors]
    truth = _linear(reference.linear_cross_entropy, exact, target, **options)
    truth_grads = _grads(truth, exact)
    # PyTorch's own at this precision: the logits by a matmul in dtype, the loss in float32.
    baseline_in = [t.clone().requires_grad_() for t in tensors]
    x, w, *b = baseline_in
    logits = F.linear(x, w, b[0] if b else None)
    baseline = reference.cross_entropy(logits, target, **options)
    baseline_grads = _grads(baseline, baseline_in)
    ours_in = [t.clone().requires_grad_() for t in tensors]
    loss = _linear(kernels.linear_cross_entropy, ours_in, target, **options)
    grads = _grads(loss, ours_in)
    assert loss.dtype == torch.float32
    assert_close("loss", loss, truth, baseline.float())
    for name, grad, want, base in zip(("dx", "dW", "db"), grads, truth_grads, baseline_grads, strict=False):
        assert_close(name, grad, want, base)


@pytest.mark.parametrize("softcap", [None, 4.0])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "plain-pytorch"])
def test_the_chunk_loop_matches_the_truth_on_either_path(monkeypatch, use_triton, softcap):
    if use_triton and not ce.runtime.INTERPRET:
        pytest.skip("the Triton path runs on a GPU or in the interpreter")
    monkeypatch.setattr(ce, "CHUNK_BYTES", 6 * 97 * 4)
    tensors, target = _linear_case(29, 12, 97, torch.float32, bias=True)
    options = {"ignore_index": -100, "label_smoothing": 0.1, "z_loss": 1e-2, "softcap": softcap}
    dloss = ce.row_weight(target, -100, "mean")
    rows, dx, dw, db = ce.linear_cross_entropy_chunks(*tensors[:2], tensors[2], target, dloss, **options,
                                                      use_triton=use_triton)  # fmt: skip
    exact = [t.double().requires_grad_() for t in tensors]
    truth = _linear(reference.linear_cross_entropy, exact, target, **options, reduction="none")
    torch.testing.assert_close(rows.double(), truth.detach(), rtol=1e-5, atol=1e-5)
    (truth / (target != -100).sum()).sum().backward()
    for got, t in zip((dx, dw, db), exact, strict=True):
        torch.testing.assert_close(got.double(), t.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("fused", ["cross_entropy", "linear_cross_entropy"])
def test_an_all_ignored_batch_gives_zero_gradients_and_a_mean_of_nan_or_zero(fused):
    """cross_entropy's mean over no rows is F.cross_entropy's, NaN; linear_cross_entropy's is 0 (the
    trainer's loss stops on a NaN)."""
    tensors, _ = _linear_case(6, 8, 33, torch.float16, bias=True)
    target = torch.full((6,), -1)
    tensors = [t.requires_grad_() for t in tensors]
    for reduction in ("mean", "sum", "none"):
        if fused == "cross_entropy":
            logits = F.linear(*tensors)
            loss = kernels.cross_entropy(logits, target, ignore_index=-1, reduction=reduction)
            expected = F.cross_entropy(logits.float(), target, ignore_index=-1, reduction=reduction)
        else:
            loss = _linear(
                kernels.linear_cross_entropy, tensors, target, ignore_index=-1, reduction=reduction
            )
            expected = torch.zeros_like(loss)
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0, equal_nan=True)
        assert loss.isnan().any() == (fused == "cross_entropy" and reduction == "mean")
        for grad in torch.autograd.grad(loss.sum(), tensors):
            assert torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.interpreter
@pytest.mark.parametrize("one_rank", [False, True], ids=["whole", "one-rank-shard"])
def test_no_gradient_is_computed_where_autograd_records_none(monkeypatch, one_rank):
    """Under torch.no_grad (the trainer's evaluation), and for inputs that need no gradient, the steps
    get no dloss: the forward computes no gradient."""
    dlosses = []

    def spy(real, dloss_at: int):
        def call(*args, **kwargs):
            dlosses.append(args[dloss_at])
            return real(*args, **kwargs)

        return call

    monkeypatch.setattr(ce, "cross_entropy_rows", spy(ce.cross_entropy_rows, 2))
    monkeypatch.setattr(ce, "linear_cross_entropy_chunks", spy(ce.linear_cross_entropy_chunks, 4))
    (x, w), target = _linear_case(9, 16, 40, torch.float32, bias=False)
    logits = x @ w.T
    shard = _one_rank(40) if one_rank else None
    x.requires_grad_(), logits.requires_grad_()
    with torch.no_grad():
        ce.head_loss(x, w, target, use_triton=True, shard=shard)
        ce.head_loss(logits, None, target, use_triton=True, shard=shard)
    ce.head_loss(x.detach(), w, target, use_triton=True, shard=shard)
    assert dlosses == [None] * 3
    ce.head_loss(x, w, target, use_triton=True, shard=shard)
    ce.head_loss(logits, None, target, use_triton=True, shard=shard)
    assert len(dlosses) == 5 and all(dloss is not None for dloss in dlosses[3:])


@pytest.mark.interpreter
def test_linear_cross_entropy_gradients_repeat_bit_for_bit(monkeypatch):
    monkeypatch.setattr(ce, "CHUNK_BYTES", 5 * 211 * 2)
    tensors, target = _linear_case(31, 16, 211, torch.float16, bias=True)
    runs = []
    for _ in range(3):
        inputs = [t.clone().requires_grad_() for t in tensors]
        loss = _linear(kernels.linear_cross_entropy, inputs, target, label_smoothing=0.1)
        runs.append((loss, *torch.autograd.grad(loss * 3.0, inputs)))
    for run in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(run, runs[0], strict=True))


def test_a_float32_master_weight_under_autocast_gets_a_float32_gradient():
    tensors, target = _linear_case(9, 16, 40, torch.float32, bias=True)
    x, w, b = [t.requires_grad_() for t in tensors]
    with torch.autocast("cpu", torch.bfloat16):
        loss = kernels.linear_cross_entropy(x, w, target, b)
    loss.backward()
    assert (x.grad.dtype, w.grad.dtype, b.grad.dtype) == (torch.float32,) * 3
    truth = reference.linear_cross_entropy(x.detach().bfloat16(), w.detach().bfloat16(), target, b.detach())
    assert loss.item() == pytest.approx(truth.item(), rel=2e-2)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t.clamp(max=0) + 40), ValueError,
         r"cross_entropy: target values must be in \[0, 40\) or ignore_index \(-100\); got 40"),
        (lambda x, w, t: kernels.linear_cross_entropy(x, w, torch.where(t > 3, -5, t)), ValueError,
         "linear_cross_entropy: target values .* got -5"),
        (lambda x, w, t: kernels.cross_entropy((x @ w.T).long(), t), TypeError, "logits must be float16"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t.int()), TypeError, "target must be int64"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t[:-1]), ValueError, r"target must have shape \[9\]"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t.to("meta")), ValueError, "target is on meta"),
        (lambda x, w, t: kernels.linear_cross_entropy(x, w.to("meta"), t), ValueError, "weight is on meta"),
        (lambda x, w, t: kernels.linear_cross_entropy(x, w[:, :-1], t), ValueError, r"weight must be \(V,"),
        (lambda x, w, t: kernels.linear_cross_entropy(x.int(), w, t), TypeError, "x must be float16"),
        (lambda x, w, t: kernels.linear_cross_entropy(x, w, t, bias=w[0]), ValueError,
         r"bias must have shape \[40\]"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t, reduction="avg"), ValueError, "reduction must be"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t, label_smoothing=1.5), ValueError,
         "label_smoothing must be in"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t, z_loss=-1.0), ValueError, "z_loss must be"),
        (lambda x, w, t: kernels.cross_entropy(torch.empty(1, 2**20 + 1, device="meta"), t[:1].to("meta")),
         ValueError, "logits must have between 1 and 1048576 classes"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t, softcap=0.0), ValueError,
         "cross_entropy: softcap must be a positive float or None, got 0.0"),
        (lambda x, w, t: kernels.linear_cross_entropy(x, w, t, softcap=-30.0), ValueError,
         "linear_cross_entropy: softcap must be a positive float or None, got -30.0"),
        (lambda x, w, t: kernels.linear_cross_entropy(x, w, t, softcap=float("inf")), ValueError,
         "softcap must be a positive float or None, got inf"),
        (lambda x, w, t: kernels.cross_entropy(x @ w.T, t, softcap="30"), TypeError,
         "softcap must be a positive float or None, got str"),
        (lambda x, w, t: ce.head_loss(x, w, t, use_triton=False, softcap=True), TypeError,
         "head_loss: softcap must be a positive float or None, got bool"),
    ],
)  # fmt: skip
def test_bad_input_raises_naming_the_argument(call, error, message):
    tensors, target = _linear_case(9, 16, 40, torch.float32, bias=False)
    with pytest.raises(error, match=message):
        call(*tensors, target)


@pytest.mark.interpreter
def test_custom_ops_pass_opcheck_and_compile_fullgraph():
    tensors, target = _linear_case(11, 16, 70, torch.float32, bias=True)
    x, w, b = [t.requires_grad_() for t in tensors]
    ops, plain = torch.ops.horse, (x.detach(), w.detach(), b.detach())  # the ops take no gradients
    dloss = torch.rand(11)  # a backward's: one gradient a row
    torch.library.opcheck(
        ops.linear_cross_entropy_chunks.default, (*plain, target, dloss, -100, 0.1, 0.0, True)
    )
    torch.library.opcheck(
        ops.linear_cross_entropy_chunks.default, (*plain, target, None, -100, 0.0, 0.0, True)
    )
    logits = plain[0] @ plain[1].T
    torch.library.opcheck(ops.cross_entropy_rows.default, (logits, target, dloss, -100, 0.0, 1e-3, True))
    torch.library.opcheck(ops.cross_entropy_rows.default, (logits, target, dloss, -100, 0.1, 0.0, True, 5.0))
    torch.library.opcheck(
        ops.linear_cross_entropy_chunks.default, (*plain, target, dloss, -100, 0.0, 1e-3, True, 5.0)
    )

    def loss_fn(x, w, b):
        head = kernels.linear_cross_entropy(x, w, target, b, z_loss=1e-3, softcap=30.0)
        return head + kernels.cross_entropy(x @ w.T, target, softcap=5.0)

    eager = loss_fn(x, w, b)
    expected = torch.autograd.grad(eager, (x, w, b))
    torch._dynamo.reset()
    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")  # a graph break raises
    loss = compiled(x, w, b)
    torch.testing.assert_close(loss, eager)
    for got, want in zip(torch.autograd.grad(loss, (x, w, b)), expected, strict=True):
        torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------------------------
# The model, and the memory the fused loss saves
# ----------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_the_gpt_loss_is_the_same_fused_or_not(backend):
    config = GPTConfig(vocab_size=128, vocab_used=113, block_size=16, n_layer=1, n_head=2, d_model=32)
    torch.manual_seed(0)
    fused = GPT(config, backend)
    unfused = GPT(config, backend, fused_loss=False)
    unfused.load_state_dict(fused.state_dict())
    idx, targets = torch.randint(0, 113, (2, 2, 16))
    losses = []
    for model in (fused, unfused):
        with torch.autocast("cpu", torch.float16, enabled=backend == "triton"):
            loss = model.loss(idx, targets)
        loss.backward()
        losses.append(loss)
    tol = 2e-3 if backend == "triton" else 1e-5
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=tol)
    for (name, p), q in zip(fused.named_parameters(), unfused.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=tol, atol=tol * q.grad.abs().max().item(), msg=name)


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages alive at each op, counting only those allocated while the mode is
    on (the inputs given are already there): ``peak`` is the most at once."""

    def __init__(self, *existing: torch.Tensor):
        super().__init__()
        self.known = {t.untyped_storage()._cdata for t in existing}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                key = storage._cdata
                if key not in self.live and key not in self.known:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._free, key)
        return out


def _one_rank(vocab: int):
    """The whole vocabulary as one rank's shard, its collectives identities. head_loss runs a shard's
    chunk loop as Python, where a dispatch mode sees its allocations; inside the custom op it runs on
    a whole vocabulary, a mode sees only the op's outputs."""
    return ce.VocabShard(0, vocab, all_reduce_max=lambda t: None, all_reduce_sum=lambda t: None)


@pytest.mark.interpreter
@pytest.mark.parametrize("softcap", [None, 2.0])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "plain-pytorch"])
@pytest.mark.parametrize("logits", [False, True], ids=["head", "logits"])
def test_head_loss_on_a_one_rank_shard_is_the_custom_ops(monkeypatch, logits, use_triton, softcap):
    """tp 1's shard (identity collectives) runs the statistics and gradient steps as Python; the whole
    vocabulary runs the ops (on Triton, the one-launch kernel): the same loss and gradients."""
    monkeypatch.setattr(ce, "CHUNK_BYTES", 6 * 97 * 2)
    (x, w), target = _linear_case(29, 12, 97, torch.float16, bias=False)
    if logits:
        x, w = F.linear(x, w), None
    results = []
    for shard in (None, _one_rank(97)):
        x_in, w_in = (None if t is None else t.clone().requires_grad_() for t in (x, w))
        inputs = [t for t in (x_in, w_in) if t is not None]
        options = {"label_smoothing": 0.1, "z_loss": 1e-3, "softcap": softcap}
        loss = ce.head_loss(x_in, w_in, target, use_triton=use_triton, shard=shard, **options)
        results.append((loss, *torch.autograd.grad(loss * 3.0, inputs)))
    for name, got, want in zip(("loss", "dx", "dW"), *results, strict=False):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-6, msg=name)


def _loss_peak_bytes(fused: bool, rows: int, hidden: int, vocab: int, device: str) -> int:
    """Peak bytes the LM head and its loss allocate through the forward and backward: x (rows,
    hidden) float16 and a float32 master weight (vocab, hidden), as the trainer hands them to it
    under autocast; unfused, today's F.linear in float16 and F.cross_entropy in float32."""
    x = torch.randn(rows, hidden, dtype=torch.float16, device=device).requires_grad_()
    w = torch.randn(vocab, hidden, device=device).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device=device)
    with LiveBytes(x, w, target) as memory:
        if fused:  # the reference backend's: the chunk loop on plain PyTorch, as Python (_one_rank)
            loss = ce.head_loss(x, w, target, use_triton=False, shard=_one_rank(vocab))
        else:
            loss = F.cross_entropy(F.linear(x, w.half()).float(), target)
        loss.backward()
    assert x.grad is not None and w.grad.dtype == torch.float32
    return memory.peak


def test_fused_loss_peak_memory_is_under_5_percent_of_the_unfused_at_gpt2_124m():
    # 16 x 1,024 tokens, vocabulary 50,304, d_model 768: shapes only, on the meta device.
    unfused = _loss_peak_bytes(False, 16 * 1024, 768, 50304, "meta")
    fused = _loss_peak_bytes(True, 16 * 1024, 768, 50304, "meta")
    assert unfused > 9e9  # the float16 logits, their float32 copy, the log-softmax and its gradients
    assert fused <= 0.05 * unfused, f"fused {fused / 1e6:.0f} MB, unfused {unfused / 1e6:.0f} MB"


def test_fused_loss_peak_memory_on_a_scaled_down_shape_that_runs(monkeypatch):
    # gpt2-124m's shape over 16 (rows, hidden, vocabulary); the chunk budget over 256 (16 x 16).
    monkeypatch.setattr(ce, "CHUNK_BYTES", ce.CHUNK_BYTES // 256)
    monkeypatch.setattr(ce, "DW_SLICE_BYTES", ce.DW_SLICE_BYTES // 256)
    unfused = _loss_peak_bytes(False, 1024, 48, 3144, "cpu")
    fused = _loss_peak_bytes(True, 1024, 48, 3144, "cpu")
    assert fused <= 0.05 * unfused, f"fused {fused / 1e6:.2f} MB, unfused {unfused / 1e6:.2f} MB"


def test_the_trainer_flag_turns_the_fused_loss_off():
    from horse.cli import parse_args

    assert parse_args([])[0].fused_loss is True
    assert parse_args(["--no-fused-loss"])[0].fused_loss is False
    assert dataclasses.replace(parse_args(["--fused-loss"])[0]).fused_loss is True


# ----------------------------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_gpu_gpt2_124m_head_matches_and_saves_memory(dtype):
    rows, hidden, vocab = 16 * 1024, 768, 50304
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(rows, hidden, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, hidden, device="cuda", generator=g) * 0.05).requires_grad_()
    target = torch.randint(0, vocab, (rows,), device="cuda", generator=g)
    target[::7] = -100
    peaks, results = [], []
    for fused in (True, False):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        if fused:
            loss = kernels.linear_cross_entropy(x, w, target, label_smoothing=0.1)
        else:
            loss = F.cross_entropy(F.linear(x, w.to(dtype)).float(), target, label_smoothing=0.1)
        loss.backward()
        peaks.append(torch.cuda.max_memory_allocated() - start)
        results.append((loss.detach(), x.grad.clone(), w.grad.clone()))
        del loss
    assert peaks[0] <= 0.05 * peaks[1], f"fused {peaks[0] / 1e6:.0f} MB, unfused {peaks[1] / 1e6:.0f} MB"
    for ours, theirs, name in zip(results[0], results[1], ("loss", "dx", "dW"), strict=True):
        scale = theirs.float().abs().max().item()
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2 * scale, msg=name)


def test_every_block_the_rule_picks_is_in_the_compile_report():
    from bench.compile_report.loss import loss_configs

    for arch in ce.runtime.ARCHS.values():
        built = {(c.constexprs["BLOCK_V"], c.num_warps) for c in loss_configs(arch)}
        for n_cols in (1, 7, 1000, 4097, 50304, 262208, ce.MAX_VOCAB):
            cfg = ce.row_config(n_cols, arch)
            assert (cfg.block_v, cfg.num_warps) in built, (arch.name, n_cols)
