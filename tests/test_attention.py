"""Flash attention (horse.kernels.attention) against the float64 truth, forward and backward."""

import dataclasses
import functools
import itertools
from dataclasses import dataclass

import pytest
import torch
from helpers import (
    all_pairs,
    assert_close,
    device_has_tma,
    record_launches,
    record_tma_choices,
    run_family_tables,
)

from horse import kernels
from horse.kernels import reference, runtime
from horse.kernels.attention import configs, launch


@dataclass(frozen=True)
class Shape:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    kv_heads: int
    head_dim: int

    def __str__(self):
        gqa = "" if self.heads == self.kv_heads else f"/{self.kv_heads}kv"
        return f"b{self.batch}-q{self.seqlen_q}-k{self.seqlen_k}-h{self.heads}{gqa}-d{self.head_dim}"


# Seqlens 1, 17, 128, 129, 300, unequal lengths both ways (decoding against a longer cache; more
# queries than keys, where causal rows see nothing), GQA and MQA, head dims 64, 128, 256 and
# padded ones (80, 96, 24).
SHAPES = [
    Shape(1, 1, 1, 2, 2, 64),
    Shape(2, 17, 17, 2, 2, 64),
    Shape(1, 128, 128, 2, 2, 128),
    Shape(1, 129, 129, 4, 2, 64),
    Shape(1, 300, 300, 2, 1, 80),
    Shape(1, 17, 129, 2, 2, 96),
    Shape(1, 129, 17, 4, 1, 64),
    Shape(1, 1, 300, 4, 2, 64),
    Shape(1, 33, 40, 2, 2, 256),
    Shape(3, 20, 20, 3, 3, 24),
]


def make_qkv(shape: Shape, dtype, device, scale: float = 1.0, seed: int = 0, requires_grad: bool = True):
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(seqlen, heads):
        t = torch.randn(shape.batch, seqlen, heads, shape.head_dim, generator=gen) * scale
        return t.to(device=device, dtype=dtype).requires_grad_(requires_grad)

    q = randn(shape.seqlen_q, shape.heads)
    return q, randn(shape.seqlen_k, shape.kv_heads), randn(shape.seqlen_k, shape.kv_heads)


def run_reference(q, k, v, dout, causal, upcast, dlse=None, window_size=(-1, -1)):
    """The float64 truth (upcast) or PyTorch's attention computed in the inputs' dtype."""
    leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention(*leaves, causal=causal, upcast=upcast, window_size=window_size)
    outputs, grad_outputs = [out], [dout.to(out.dtype)]
    if dlse is not None:
        outputs.append(lse)
        grad_outputs.append(dlse.to(lse.dtype))
    grads = torch.autograd.grad(outputs, leaves, grad_outputs)
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def assert_lse_close(lse, truth, baseline):
    # Rows that see no key have lse = -inf in all three; compare the finite rest.
    assert torch.equal(torch.isinf(lse), torch.isinf(truth)), "lse: -inf rows differ from the reference"
    finite = torch.isfinite(truth)
    assert_close(
        "lse",
        torch.where(finite, lse, 0.0),
        torch.where(finite, truth, 0.0),
        torch.where(finite, baseline, 0.0),
    )


def check(shape: Shape, causal: bool, dtype, device, scale: float = 1.0, window_size=(-1, -1)):
    q, k, v = make_qkv(shape, dtype, device, scale)
    out, lse = kernels.flash_attention(q, k, v, causal=causal, return_lse=True, window_size=window_size)
    dout = torch.randn_like(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ours = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    truth = run_reference(q, k, v, dout, causal, upcast=True, window_size=window_size)
    baseline = run_reference(q, k, v, dout, causal, upcast=False, window_size=window_size)
    for name, value in ours.items():
        assert torch.isfinite(value).all(), f"{name} has non-finite values"
        assert_close(name, value, truth[name], baseline[name])
    assert_lse_close(lse, truth["lse"], baseline["lse"].float())


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference(shape, causal, device):
    check(shape, causal, torch.float16, device)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", [Shape(2, 17, 33, 4, 2, 40), Shape(1, 300, 300, 2, 1, 80)], ids=str)
def test_reference_matches_sdpa(shape, causal):
    # The explicit reference against PyTorch's own attention, float32, bottom-right causal mask.
    q, k, v = make_qkv(shape, torch.float32, "cpu", requires_grad=False)
    mask = None
    if causal:
        rows = torch.arange(shape.seqlen_q)[:, None]
        mask = torch.arange(shape.seqlen_k)[None, :] <= rows + shape.seqlen_k - shape.seqlen_q
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    torch.testing.assert_close(reference.attention(q, k, v, causal)[0], sdpa, rtol=1e-5, atol=1e-5)


# Sliding windows (left, right) in the interpreter's 32x16 tiles: narrower than a block and wider
# than the sequence, one side or both, with causal, unequal lengths both ways (rows that see no
# key), GQA and a padded head dim.
WINDOW_CASES = [
    (Shape(1, 129, 129, 4, 2, 64), True, (40, -1)),
    (Shape(1, 129, 129, 2, 2, 64), False, (7, 20)),
    (Shape(1, 17, 129, 2, 2, 96), False, (-1, 3)),
    (Shape(1, 129, 17, 4, 1, 64), True, (3, -1)),
    (Shape(2, 100, 100, 2, 1, 80), False, (0, 0)),
    (Shape(1, 64, 64, 2, 2, 64), False, (100, 100)),
    (Shape(1, 1, 300, 2, 2, 64), True, (33, -1)),
]


@pytest.mark.parametrize(("shape", "causal", "window"), WINDOW_CASES, ids=str)
def test_sliding_window_matches_reference(shape, causal, window, device):
    check(shape, causal, torch.float16, device, window_size=window)


def test_window_folds_into_causal(device):
    # (-1, 0) is the causal mask itself, and causal caps any window's right side at 0.
    q, k, v = make_qkv(Shape(1, 70, 90, 2, 1, 32), torch.float16, device, requires_grad=False)
    causal = kernels.flash_attention(q, k, v, causal=True)
    assert torch.equal(kernels.flash_attention(q, k, v, window_size=(-1, 0)), causal)
    assert torch.equal(kernels.flash_attention(q, k, v, causal=True, window_size=(-1, 9)), causal)
    assert torch.equal(
        kernels.flash_attention(q, k, v, causal=True, window_size=(12, 30)),
        kernels.flash_attention(q, k, v, window_size=(12, 0)),
    )


def test_window_reads_only_the_key_blocks_inside_it(device):
    # One query against 300 keys sees keys 266..299 through a (33, -1) causal window. NaN keys and
    # values in the key blocks before that would reach the output and every gradient if read.
    shape = Shape(1, 1, 300, 2, 2, 64)
    q, k, v = make_qkv(shape, torch.float16, device)
    block_n = max(
        configs.attn_config(t, 64, torch.device(device)).block_n
        for t in (configs.FWD_CONFIGS, configs.BWD_DQ_CONFIGS)
    )
    unread = (shape.seqlen_k - 1 - 33) // block_n * block_n
    poisoned_k, poisoned_v = (t.detach().clone() for t in (k, v))
    poisoned_k[:, :unread] = poisoned_v[:, :unread] = float("nan")
    poisoned_k.requires_grad_(), poisoned_v.requires_grad_()
    out = kernels.flash_attention(q, poisoned_k, poisoned_v, causal=True, window_size=(33, -1))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, poisoned_k, poisoned_v), dout)
    expected = kernels.flash_attention(q, k, v, causal=True, window_size=(33, -1))
    assert torch.equal(out, expected)
    assert torch.equal(grads[0], torch.autograd.grad(expected, q, dout)[0])
    assert all(torch.equal(g[:, :unread], torch.zeros_like(g[:, :unread])) for g in grads[1:])
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.parametrize("window", [(4, 0), (0, 6), (5, 5)], ids=str)
def test_reference_window_matches_sdpa(window):
    # The reference's window against PyTorch's attention with the mask written out position by position.
    shape = Shape(2, 17, 33, 4, 2, 40)
    q, k, v = make_qkv(shape, torch.float32, "cpu", requires_grad=False)
    offset = shape.seqlen_k - shape.seqlen_q
    mask = torch.tensor(
        [[i + offset - window[0] <= j <= i + offset + window[1] for j in range(shape.seqlen_k)]
         for i in range(shape.seqlen_q)]
    )  # fmt: skip
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    out = reference.attention(q, k, v, window_size=window)[0]
    torch.testing.assert_close(out, sdpa, rtol=1e-5, atol=1e-5)


# Packed batches (flash_attention_varlen), as (query lengths, key lengths, heads, kv_heads, head_dim):
# lengths 1 and ragged, unequal query and key lengths, empty sequences, a batch without keys and
# one without queries, GQA and a padded head dim.
VARLEN_CASES = [
    ([5, 129, 1, 40], [5, 129, 1, 40], 4, 2, 64),
    ([3, 17, 0, 50], [40, 20, 7, 0], 2, 2, 80),
    ([33, 70], [33, 70], 2, 1, 32),
    ([3, 2], [0, 0], 2, 2, 32),
    ([0, 0], [4, 5], 2, 2, 32),
]


def make_packed(lengths_q, lengths_k, heads, kv_heads, head_dim, dtype, device):
    gen = torch.Generator(device="cpu").manual_seed(0)

    def randn(rows, heads):
        t = torch.randn(rows, heads, head_dim, generator=gen)
        return t.to(device=device, dtype=dtype).requires_grad_()

    def offsets(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)

    q, k, v = randn(sum(lengths_q), heads), randn(sum(lengths_k), kv_heads), randn(sum(lengths_k), kv_heads)
    return q, k, v, offsets(lengths_q), offsets(lengths_k)


def check_varlen(case, causal: bool, window, dtype, device):
    lengths_q, lengths_k, *heads_dim = case
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, *heads_dim, dtype, device)
    out, lse = kernels.flash_attention_varlen(
        q,
        k,
        v,
        cu_q,
        cu_k,
        max(lengths_q),
        max(lengths_k),
        causal=causal,
        return_lse=True,
        window_size=window,
    )
    dout = torch.randn_like(out)
    ours = dict(
        zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, (q, k, v), dout)), strict=True)
    )
    results = []
    for upcast in (True, False):
        leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference.attention_varlen(
            *leaves, cu_q, cu_k, causal, upcast=upcast, window_size=window
        )
        grads = torch.autograd.grad(ref_out, leaves, dout.to(ref_out.dtype), allow_unused=True)
        grads = [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)]
        results.append({"out": ref_out, "lse": ref_lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]})
    truth, baseline = results
    for name, value in ours.items():
        assert torch.isfinite(value).all(), f"{name} has non-finite values"
        assert_close(name, value, truth[name], baseline[name])
    assert lse.shape == (q.shape[1], q.shape[0])
    assert_lse_close(lse, truth["lse"], baseline["lse"].float())


VARLEN_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (10, -1))]


@pytest.mark.parametrize(("causal", "window"), VARLEN_MASKS, ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
def test_varlen_matches_reference_sequence_by_sequence(case, causal, window, device):
    check_varlen(case, causal, window, torch.float16, device)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("case", "causal", "window", "dtype"),
    [(([1000, 1, 333, 2048], [1000, 1, 333, 2048], 8, 2, 128), True, (-1, -1), torch.float16),
     (([7, 300], [900, 0], 4, 4, 96), False, (-1, -1), torch.bfloat16)],
    ids=str,
)  # fmt: skip
def test_gpu_varlen(case, causal, window, dtype):
    check_varlen(case, causal, window, dtype, "cuda")


def test_varlen_equals_padded_batches_of_its_sequences(device):
    # Sequences of equal length packed are the padded-batch kernel's own batch: the same tiles, the
    # same values (bit for bit in the interpreter; on a GPU the padded batch may load by TMA).
    q, k, v = make_qkv(Shape(3, 40, 40, 4, 2, 64), torch.float16, device, requires_grad=False)
    cu = torch.arange(0, 121, 40, dtype=torch.int32, device=device)
    dense, dense_lse = kernels.flash_attention(q, k, v, causal=True, return_lse=True)
    packed, packed_lse = kernels.flash_attention_varlen(
        q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 40, 40, causal=True, return_lse=True
    )
    exact = {"rtol": 0, "atol": 0} if device == "cpu" else {"rtol": 1e-3, "atol": 1e-3}
    torch.testing.assert_close(packed, dense.flatten(0, 1), **exact)
    torch.testing.assert_close(packed_lse, dense_lse.transpose(0, 1).flatten(1), **exact)


# The packed forward by TMA, its descriptors built on the device and bounded by each sequence, and
# by pointers: lengths 1, ragged ones and a long one, unequal query and key lengths, GQA.
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
def test_varlen_forward_by_tma_and_by_pointers_matches_reference(use_tma, causal, device, monkeypatch):
    monkeypatch.setattr(launch, "USE_TMA", use_tma)
    choices = record_tma_choices(monkeypatch, launch)
    case = ([1, 45, 130, 2], [3, 45, 150, 1], 2, 1, 64)
    check_varlen(case, causal, (-1, -1), torch.float16, device)
    assert choices[0] == (use_tma and device_has_tma(device)), "the forward's choice of loads"


# The packed backward by TMA (forced on in both backward tables), each pass building descriptors bounded
# by each sequence on the device: lengths 1, 2, odd and block-crossing (the interpreter's 32x16 tiles),
# unequal query and key lengths, GQA whose query heads split over programs (float32 partials), each
# mask; at head dim 256 dv and dk by launches of their own (split outputs, K and V by pointers; the
# causal dk launch runs as the window (-1, 0)). Outputs are poisoned (conftest).
@pytest.mark.parametrize(("causal", "window"), VARLEN_MASKS, ids=str)
@pytest.mark.parametrize(
    "case", [([1, 2, 37, 70], [2, 1, 45, 70], 4, 2, 64), ([2, 33, 1], [17, 33, 5], 2, 1, 256)], ids=str
)
def test_varlen_backward_by_tma_matches_reference(case, causal, window, device, monkeypatch):
    arch = runtime.arch(torch.device(device)).name
    for table in (configs.BWD_DKDV_CONFIGS, configs.BWD_DQ_CONFIGS):
        monkeypatch.setitem(
            table, arch, {d: dataclasses.replace(c, tma=True) for d, c in table[arch].items()}
        )
    dkdv = configs.BWD_DKDV_CONFIGS[arch]
    dkdv[256] = dataclasses.replace(dkdv[256], split_outputs=True, column_splits=1, pointer=None)
    choices = record_tma_choices(monkeypatch, launch)
    launches = record_launches(monkeypatch)
    check_varlen(case, causal, window, torch.float16, device)
    assert choices == [device_has_tma(device)] * 3, "forward, dk/dv and dq by TMA"
    grids = dkdv_grids(launches)
    group_size = case[2] // case[3]
    assert [grid[1] for grid in grids] == [group_size] * (2 if case[-1] == 256 else 1), grids


# Head dim 512 (Gemma 4's global layers) and 320, padded to it: GQA, causal and not, unequal lengths,
# a window, a packed batch, the sinks with their gradient (decode: CACHE_CASES; the softcap:
# test_softcap_above_its_backwards_head_dims_runs_forward_only). Tiny: the interpreter is slow at 512.
HEAD_DIM_512_SHAPES = [Shape(1, 20, 20, 2, 1, 512), Shape(2, 13, 17, 2, 2, 320)]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", HEAD_DIM_512_SHAPES, ids=str)
def test_head_dim_512_matches_reference(shape, causal, device):
    check(shape, causal, torch.float16, device)


def test_head_dim_512_window_and_packed_batch_match_reference(device):
    check(Shape(1, 20, 20, 2, 1, 320), True, torch.float16, device, window_size=(5, -1))
    check_varlen(([7, 12], [7, 12], 2, 1, 512), True, (-1, -1), torch.float16, device)


def test_head_dim_512_sinks_match_reference(device):
    q, k, v = make_qkv(Shape(1, 17, 17, 2, 1, 512), torch.float16, device, scale=1.5)
    sinks = make_sinks(2, device)

    def run(q, k, v, sinks):
        return kernels.flash_attention(q, k, v, causal=True, sinks=sinks, return_lse=True)

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention(q, k, v, causal=True, upcast=upcast, sinks=sinks)

    check_score_mods(run, reference_of, (q, k, v, sinks))


def test_varlen_bad_input_is_named():
    q = torch.randn(10, 4, 16, dtype=torch.float16)
    k = torch.randn(10, 2, 16, dtype=torch.float16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    varlen = kernels.flash_attention_varlen
    with pytest.raises(ValueError, match=r"q must be \(total_tokens, heads, head_dim\)"):
        varlen(q[None], k, k, cu, cu, 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_q must be an int32 tensor"):
        varlen(q, k, k, cu.long(), cu, 6, 6)
    with pytest.raises(ValueError, match="same length"):
        varlen(q, k, k, cu, cu[:2], 6, 6)
    with pytest.raises(ValueError, match="cu_seqlens_k must rise from 0 to 10"):
        varlen(q, k, k, cu, torch.tensor([0, 7, 4], dtype=torch.int32), 6, 6)
    with pytest.raises(ValueError, match="max_seqlen_q is 5 but a sequence has 6 rows"):
        varlen(q, k, k, cu, cu, 5, 6)
    with pytest.raises(ValueError, match="max_seqlen_k must be an int >= 0"):
        varlen(q, k, k, cu, cu, 6, -1)
    with pytest.raises(ValueError, match="flash_attention_varlen: window_size"):
        varlen(q, k, k, cu, cu, 6, 6, window_size=(1,))


def test_large_logits_stay_finite(device):
    # Scores of several hundred: exp overflows float16 and float32 unless the max is subtracted.
    check(Shape(1, 129, 129, 2, 2, 64), True, torch.float16, device, scale=6.0)


def test_query_that_sees_no_key_is_zero(device):
    shape = Shape(1, 20, 5, 2, 2, 64)
    q, k, v = make_qkv(shape, torch.float16, device)
    out, lse = kernels.flash_attention(q, k, v, causal=True, return_lse=True)
    out.sum().backward()
    blind = shape.seqlen_q - shape.seqlen_k  # queries 0..14 see no key under bottom-right causal
    assert torch.equal(out[:, :blind], torch.zeros_like(out[:, :blind]))
    assert torch.isneginf(lse[:, :, :blind]).all() and torch.isfinite(lse[:, :, blind:]).all()
    assert torch.equal(q.grad[:, :blind], torch.zeros_like(q.grad[:, :blind]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_gradient_through_lse(device):
    shape = Shape(1, 40, 40, 2, 1, 64)
    q, k, v = make_qkv(shape, torch.float16, device)
    out, lse = kernels.flash_attention(q, k, v, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ours = torch.autograd.grad([out, lse], (q, k, v), [dout, dlse])
    truth = run_reference(q, k, v, dout, True, upcast=True, dlse=dlse)
    baseline = run_reference(q, k, v, dout, True, upcast=False, dlse=dlse)
    for name, got in zip(("dq", "dk", "dv"), ours, strict=True):
        assert_close(name, got, truth[name], baseline[name])


def test_varlen_gradient_through_lse(device):
    lengths = [17, 40, 5]
    q, k, v, cu, _ = make_packed(lengths, lengths, 2, 1, 64, torch.float16, device)
    out, lse = kernels.flash_attention_varlen(q, k, v, cu, cu, 40, 40, causal=True, return_lse=True)
    dout, dlse = torch.randn_like(out), torch.randn_like(lse)
    ours = torch.autograd.grad([out, lse], (q, k, v), [dout, dlse])
    results = []
    for upcast in (True, False):
        leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
        ref_out, ref_lse = reference.attention_varlen(*leaves, cu, cu, True, upcast=upcast)
        results.append(
            torch.autograd.grad([ref_out, ref_lse], leaves, [dout.to(ref_out.dtype), dlse.to(ref_lse.dtype)])
        )
    for name, got, truth, baseline in zip(("dq", "dk", "dv"), ours, *results, strict=True):
        assert_close(name, got, truth, baseline)


def test_backward_is_deterministic(device):
    shape = Shape(2, 129, 129, 4, 1, 64)
    results = []
    for _ in range(2):
        q, k, v = make_qkv(shape, torch.float16, device)
        out = kernels.flash_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), q.grad, k.grad, v.grad])
    for name, first, again in zip(("out", "dq", "dk", "dv"), *results, strict=True):
        assert torch.equal(first, again), f"{name} changed between identical runs"


def dkdv_grids(launches) -> list[tuple[int, ...]]:
    dkdv_kernels = ("_attn_bwd_dkdv_kernel", "_attn_bwd_dkdv_split_outputs_kernel")
    return [grid for name, grid in launches if name in dkdv_kernels]


# GQA and MQA at awkward sizes: groups of 3, 5 and 7 query heads (splits of unequal heads), a prime
# key count (a ragged key block), causal rows that see no key, a padded head dim.
HEAD_SPLIT_CASES = [
    (Shape(1, 37, 53, 6, 2, 64), True),
    (Shape(2, 29, 17, 5, 1, 40), False),
    (Shape(2, 20, 11, 7, 1, 32), True),
]


@pytest.mark.parametrize("split", [True, False], ids=["split", "whole-group"])
@pytest.mark.parametrize(("shape", "causal"), HEAD_SPLIT_CASES, ids=str)
def test_gqa_dkdv_split_over_query_heads_matches_reference(shape, causal, split, device, monkeypatch):
    # Few key blocks: the dk/dv pass shares each group's query heads among programs (132 SMs stand in
    # for a GPU's in the interpreter); one SM makes the grid large enough without a split.
    if not split:
        monkeypatch.setattr(launch, "INTERPRETER_NUM_SMS", 1)
    launches = record_launches(monkeypatch)
    check(shape, causal, torch.float16, device)
    (grid,) = dkdv_grids(launches)
    group_size = shape.heads // shape.kv_heads
    assert (grid[1] == group_size) if split else (grid[1] == 1), grid


def test_gqa_dkdv_split_is_deterministic(device):
    shape = Shape(1, 45, 45, 6, 1, 64)
    results = []
    for _ in range(2):
        q, k, v = make_qkv(shape, torch.float16, device)
        out = kernels.flash_attention(q, k, v, causal=True)
        out.backward(torch.ones_like(out))
        results.append([k.grad, v.grad])
    for name, first, again in zip(("dk", "dv"), *results, strict=True):
        assert torch.equal(first, again), f"{name} changed between identical runs"


def test_varlen_gqa_dkdv_split_matches_reference(device, monkeypatch):
    lengths_q, lengths_k = [9, 30, 1], [20, 13, 40]
    q, k, v, cu_q, cu_k = make_packed(lengths_q, lengths_k, 6, 2, 32, torch.float16, device)
    launches = record_launches(monkeypatch)
    out = kernels.flash_attention_varlen(q, k, v, cu_q, cu_k, 30, 40, causal=True)
    dout = torch.randn_like(out)
    ours = torch.autograd.grad(out, (q, k, v), dout)
    assert dkdv_grids(launches)[0][1] == 3
    results = []
    for upcast in (True, False):
        leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
        ref_out, _ = reference.attention_varlen(*leaves, cu_q, cu_k, True, upcast=upcast)
        results.append(torch.autograd.grad(ref_out, leaves, dout.to(ref_out.dtype)))
    for name, got, truth, baseline in zip(("dq", "dk", "dv"), ours, *results, strict=True):
        assert_close(name, got, truth, baseline)


# dv and dk by launches of their own (AttnConfig.split_outputs: the sm90 head-dim-256 entry's TMA
# tile), forced at every head dim: GQA whose heads split over programs (float32 partials), causal
# rows that see no key, a sliding window, MQA, a padded head dim. Outputs are poisoned (conftest).
@pytest.mark.parametrize(
    ("shape", "causal", "window"),
    [(Shape(1, 37, 53, 6, 2, 64), True, (-1, -1)), (Shape(2, 45, 29, 4, 1, 40), False, (9, 20))],
    ids=str,
)
def test_dkdv_split_outputs_match_reference(shape, causal, window, device, monkeypatch):
    arch = runtime.arch(torch.device(device)).name
    split = {
        d: dataclasses.replace(c, split_outputs=True, column_splits=1, pointer=None)
        for d, c in configs.BWD_DKDV_CONFIGS[arch].items()
    }
    monkeypatch.setitem(configs.BWD_DKDV_CONFIGS, arch, split)
    launches = record_launches(monkeypatch)
    check(shape, causal, torch.float16, device, window_size=window)
    assert [name for name, _ in launches if "dkdv" in name] == ["_attn_bwd_dkdv_split_outputs_kernel"] * 2


def test_split_outputs_refuse_column_splits():
    # The split outputs' kernel takes whole head-dim rows: a table entry asking for both is refused.
    with pytest.raises(ValueError, match="split_outputs takes whole head-dim rows: column_splits 2"):
        configs.AttnConfig(64, 128, 8, 1, column_splits=2, split_outputs=True)


def test_softcap_tiles_refuse_split_outputs():
    # The split outputs' kernel has no softcap: an entry whose softcap tile asks for them is refused.
    split = configs.AttnConfig(64, 128, 8, 1, split_outputs=True)
    with pytest.raises(ValueError, match="softcap: the split-output dk/dv kernel has no softcap"):
        configs.AttnConfig(64, 128, 8, 1, softcap=split)


def test_forward_takes_its_entrys_softcap_tile_with_the_softcap_on(monkeypatch):
    # A forward entry with a softcap tile (sm_100's at 32, whose TMA tile spilled with the softcap): the
    # launcher takes it with the softcap on, the entry's own tile without. Grids only: a query tile
    # of 128 rows, or of 64 (the softcap tile's), over 256 queries of 2 heads.
    entry = configs.AttnConfig(128, 64, 8, 2, softcap=configs.AttnConfig(64, 64, 4, 1, tma=False))
    monkeypatch.setattr(configs, "INTERPRETER_BLOCKS", {})
    monkeypatch.setitem(configs.FWD_CONFIGS["sm90"], 64, entry)
    launches = record_launches(monkeypatch, execute=False)
    q, k, v = make_qkv(Shape(1, 256, 256, 2, 2, 64), torch.float16, "cpu")
    for softcap in (0.0, 50.0):
        kernels.flash_attention(q, k, v, causal=True, softcap=softcap)
    assert [grid for name, grid in launches if name == "_attn_fwd_kernel"] == [(4,), (8,)], launches


@pytest.mark.parametrize("head_dim", [128, 256])
def test_mqa_dkdv_launches_two_programs_per_sm(head_dim, monkeypatch):
    # MQA, batch 1, 4K keys on an H200 (132 SMs) at the sm90 table's tiles: 32 key blocks of 128 at
    # head dim 128 alone would leave 100 SMs idle. Grids only (the interpreter is too slow here).
    monkeypatch.setattr(configs, "INTERPRETER_BLOCKS", {})
    launches = record_launches(monkeypatch, execute=False)
    q, k, v = make_qkv(Shape(1, 4096, 4096, 16, 1, head_dim), torch.float16, "cpu")
    kernels.flash_attention(q, k, v, causal=True).sum().backward()
    grids = dkdv_grids(launches)
    assert all(grid[0] * grid[1] >= 2 * 132 for grid in grids), grids
    # 32 key blocks of 128 want 9 splits, the 16 heads give 16 of one; at 256 dv and dk launch apart.
    assert grids == {128: [(32, 16)], 256: [(32, 16)] * 2}[head_dim], grids


def test_strided_inputs_are_read_in_place(device):
    shape = Shape(2, 33, 33, 4, 4, 64)
    qkv = torch.randn(2, 33, 3, 4, 64, dtype=torch.float16, device=device, requires_grad=True)
    q, k, v = qkv.unbind(dim=2)  # views into one packed projection, rows 3 * 4 * 64 apart
    assert not q.is_contiguous()
    out = kernels.flash_attention(q, k, v, causal=True)
    out.sum().backward()  # dout arrives expanded, with stride 0
    packed_grad = qkv.grad.clone()
    qkv.grad = None
    q2, k2, v2 = (t.detach().contiguous().requires_grad_() for t in (q, k, v))
    out2 = kernels.flash_attention(q2, k2, v2, causal=True)
    out2.sum().backward()
    assert torch.equal(out, out2)
    assert torch.equal(packed_grad, torch.stack([q2.grad, k2.grad, v2.grad], dim=2))
    assert shape.seqlen_q == out.shape[1]


def test_nothing_quadratic_is_allocated_or_saved(device, monkeypatch):
    seqlen = 300
    q, k, v = make_qkv(Shape(1, seqlen, seqlen, 1, 1, 16), torch.float16, device)
    allocated = []
    real_empty = runtime.empty

    def recording_empty(shape, dtype, device):
        out = real_empty(shape, dtype, device)
        allocated.append(out.numel())
        return out

    monkeypatch.setattr(runtime, "empty", recording_empty)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = kernels.flash_attention(q, k, v, causal=True)
    out.sum().backward()
    assert saved and allocated
    assert max(saved) < seqlen * seqlen and max(allocated) < seqlen * seqlen, (saved, allocated)


BAD_INPUTS = [
    (
        lambda q, k, v: kernels.flash_attention(q, k.half(), v),
        TypeError,
        "k is torch.float16 but q is torch.bfloat16",
    ),
    (
        lambda q, k, v: kernels.flash_attention(q.float(), k.float(), v.float()),
        TypeError,
        "float16 or bfloat16",
    ),
    (
        lambda q, k, v: kernels.flash_attention(q, *[torch.cat([k, k[:, :, :1]], dim=2)] * 2),
        ValueError,
        "multiple of",
    ),
    (lambda q, k, v: kernels.flash_attention(q, k, v[:, :5]), ValueError, "same shape"),
    (lambda q, k, v: kernels.flash_attention(q, k[:1], v[:1]), ValueError, "batch 2"),
    (lambda q, k, v: kernels.flash_attention(q, k.to("meta"), v), ValueError, "k is on meta"),
    (
        lambda q, k, v: kernels.flash_attention(q[0], k, v),
        ValueError,
        r"q must be \(batch, seqlen, heads, head_dim\)",
    ),
    (
        lambda q, k, v: kernels.flash_attention(q.transpose(1, 3), k, v),
        ValueError,
        "q must have a contiguous last",
    ),
    (
        lambda q, k, v: kernels.flash_attention(*(torch.zeros(1, 2, 1, 513, dtype=torch.bfloat16),) * 3),
        ValueError,
        r"head_dim must be in \[1, 512\]",
    ),
    *[
        (
            lambda q, k, v, s=scale: kernels.flash_attention(q, k, v, softmax_scale=s),
            ValueError,
            "softmax_scale",
        )
        for scale in [-0.5, 0.0, float("nan")]
    ],
    *[
        (lambda q, k, v, w=window: kernels.flash_attention(q, k, v, window_size=w), ValueError, "window_size")
        for window in [(-2, 0), (3,), 4, (1.5, 2), (True, 0)]
    ],
]


@pytest.mark.interpreter
@pytest.mark.parametrize("call,error,message", BAD_INPUTS)
def test_bad_input_is_named(call, error, message):
    q = torch.randn(2, 6, 4, 16, dtype=torch.bfloat16)
    k = torch.randn(2, 6, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(error, match=message):
        call(q, k, k.clone())


def test_cpu_without_interpreter_uses_the_reference(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    q, k, v = make_qkv(Shape(1, 9, 9, 2, 1, 32), torch.float32, "cpu", requires_grad=False)
    out = kernels.flash_attention(q, k, v, causal=True)
    torch.testing.assert_close(out, reference.attention(q, k, v, causal=True)[0], rtol=0, atol=0)


@pytest.mark.interpreter
def test_custom_op_passes_opcheck_and_compiles_fullgraph():
    q, k, v = make_qkv(Shape(1, 24, 24, 2, 1, 32), torch.float16, "cpu")
    sinks = torch.randn(2, requires_grad=True)
    for mods in ((None, 0.0), (sinks, 4.0)):
        for mask in ((True, 0.125, -1, -1), (False, 0.125, 5, 3)):
            args = (q, k, v, *mods, *mask, None, None, 0, 0)
            torch.library.opcheck(torch.ops.horse.flash_attn_fwd.default, args)
    cu = torch.tensor([0, 9, 24], dtype=torch.int32)
    packed = (q[0], k[0], v[0], None, 0.0, True, 0.125, -1, -1, cu, cu, 15, 15)
    torch.library.opcheck(torch.ops.horse.flash_attn_fwd.default, packed)
    eager = kernels.flash_attention(q, k, v, causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(lambda q, k, v: kernels.flash_attention(q, k, v, causal=True), fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), eager, rtol=0, atol=0)
    varlen = functools.partial(kernels.flash_attention_varlen, max_seqlen_q=15, max_seqlen_k=15, causal=True)
    compiled = torch.compile(varlen, fullgraph=True)
    torch.testing.assert_close(compiled(*packed[:3], cu, cu), varlen(*packed[:3], cu, cu), rtol=0, atol=0)
    modified = functools.partial(kernels.flash_attention, causal=True, softcap=4.0)
    torch._dynamo.reset()
    compiled = torch.compile(modified, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v, sinks=sinks), modified(q, k, v, sinks=sinks), rtol=0, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize(
    "shape",
    [Shape(2, 1024, 1024, 16, 16, 128), Shape(1, 4096, 4096, 8, 2, 64), Shape(2, 333, 1000, 8, 1, 96),
     Shape(1, 1000, 333, 4, 4, 256), Shape(4, 1, 2048, 8, 8, 128), Shape(2, 777, 777, 6, 3, 16)],
    ids=str,
)  # fmt: skip
def test_gpu_matches_reference(shape, causal, dtype):
    check(shape, causal, dtype, "cuda")


# Few GPU cases, each a new set of compiled kernels: the device check runs every GPU test in 110 s.
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "causal", "window", "dtype"),
    [(Shape(2, 1024, 1024, 8, 2, 128), True, (256, -1), torch.float16),
     (Shape(1, 333, 1000, 4, 4, 96), False, (100, 50), torch.bfloat16)],
    ids=str,
)  # fmt: skip
def test_gpu_sliding_window(shape, causal, window, dtype):
    check(shape, causal, dtype, "cuda", window_size=window)


def test_autocast_runs_float32_inputs_in_half_precision(device):
    """Under torch.autocast(float16) float32 q, k, v go through the float16 kernel, as they would
    through a matmul, and their gradients come back in float32."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 19, 2, 32, device=device, requires_grad=True) for _ in range(3))
    with torch.autocast(device, torch.float16):
        out = kernels.flash_attention(q, k, v, causal=True)
    assert out.dtype == torch.float16
    out.float().sum().backward()
    expected, _ = reference.attention(q.half(), k.half(), v.half(), True, 32**-0.5)
    torch.testing.assert_close(out.float(), expected, rtol=2e-3, atol=2e-3)
    assert all(t.grad.dtype == torch.float32 and torch.isfinite(t.grad).all() for t in (q, k, v))


# Each shape with TMA and with pointers, and with each mask (pairwise: 6 of the 12 combinations).
@pytest.mark.parametrize(
    ("shape", "window", "use_tma"),
    all_pairs([Shape(2, 129, 129, 4, 2, 64), Shape(1, 17, 129, 2, 2, 80), Shape(1, 129, 17, 4, 1, 32)],
              [(-1, -1), (50, -1)], [True, False]),
    ids=lambda v: {True: "tma", False: "pointer", (-1, -1): "causal", (50, -1): "window"}.get(v, str(v)),
)  # fmt: skip
def test_tma_and_pointer_loads_both_match_reference(shape, window, use_tma, device, monkeypatch):
    monkeypatch.setattr(launch, "USE_TMA", use_tma)
    choices = record_tma_choices(monkeypatch, launch)
    check(shape, True, torch.float16, device, window_size=window)
    # Every pass's table entry allows TMA at these head dims (the dk/dv pass at 80 pads to 128).
    allowed = [configs.attn_config(table, shape.head_dim, torch.device(device)).tma for table in
               (configs.FWD_CONFIGS, configs.BWD_DKDV_CONFIGS, configs.BWD_DQ_CONFIGS)]  # fmt: skip
    assert choices == [use_tma and a and device_has_tma(device) for a in allowed]


def test_unaligned_strides_take_the_pointer_path(device, monkeypatch):
    # head_dim 20: a row of one head is 40 bytes, not a multiple of TMA's 16.
    choices = record_tma_choices(monkeypatch, launch)
    check(Shape(2, 33, 40, 3, 1, 20), True, torch.float16, device)
    assert choices == [False, False, False]
    choices.clear()
    qkv = torch.randn(1, 24, 3, 2, 64, dtype=torch.float16, device=device)
    q, k, v = qkv[..., 1:57].unbind(dim=2)  # starts 2 bytes into the buffer
    kernels.flash_attention(q, k, v)
    assert choices == [False]


@pytest.mark.parametrize("family", list(runtime.ARCHS))
def test_every_gpu_familys_tiles_match_reference(family, device, monkeypatch):
    # The interpreter runs small tiles of its own; here every entry of a GPU family's tables at its
    # real tile shape (pointer loads before sm_90), a head dim per padded block, two of them padded.
    if device != "cpu":
        pytest.skip("a GPU launches its own family's entries (the other tests)")
    chosen = run_family_tables(monkeypatch, family, configs, "INTERPRETER_BLOCKS", "attn_config")
    for head_dim in (12, 32, 64, 96, 256):
        check(Shape(1, 150, 140, 2, 1, head_dim), True, torch.float16, device)
    check(Shape(1, 40, 36, 2, 1, 500), True, torch.float16, device)  # the slowest in the interpreter: small
    tables = (configs.FWD_CONFIGS, configs.BWD_DKDV_CONFIGS, configs.BWD_DQ_CONFIGS)
    assert chosen == {cfg for table in tables for cfg in table[family].values()}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    ("shape", "causal"),
    [(Shape(2, 333, 1000, 8, 2, 128), True), (Shape(1, 1024, 1024, 4, 4, 64), False)],
    ids=str,
)
def test_gpu_pointer_loads(shape, causal, dtype, monkeypatch):
    # The default GPU tests take TMA (aligned inputs); these take pointer loads.
    monkeypatch.setattr(launch, "USE_TMA", False)
    check(shape, causal, dtype, "cuda")


# Past 65,535 (batch x heads): CUDA's limit on grid axes 1 and 2. 4,097 packed documents x 16 heads,
# or a padded batch of 2,049 x 32; tiny sequences keep them small.
MANY_HEADS_PADDED = Shape(2049, 3, 3, 32, 32, 16)
MANY_DOCS_PACKED = ([1, 2] * 2048 + [3], 16, 16, 16)


def many_heads(packed: bool, dtype, device):
    """(q, k, v, ours, reference): inputs of more than 65,535 (sequence, head) pairs, and a causal
    attention over them, ours and the reference's (taking upcast)."""
    if packed:
        lengths, heads, kv_heads, head_dim = MANY_DOCS_PACKED
        q, k, v, cu, _ = make_packed(lengths, lengths, heads, kv_heads, head_dim, dtype, device)
        sequences = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": 3, "max_seqlen_k": 3}
        ours = functools.partial(kernels.flash_attention_varlen, **sequences, causal=True)
        ref = functools.partial(reference.attention_varlen, cu_seqlens_q=cu, cu_seqlens_k=cu, causal=True)
    else:
        q, k, v = make_qkv(MANY_HEADS_PADDED, dtype, device)
        ours = functools.partial(kernels.flash_attention, causal=True)
        ref = functools.partial(reference.attention, causal=True)
    return q, k, v, ours, ref


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_more_than_65535_heads_launch_within_cudas_grid_limits(packed, monkeypatch):
    # The interpreter would take an hour over so many programs: check every launch's grid (the forward
    # and the backward's three passes), run none. test_gpu_more_than_65535_heads runs them.
    launches = record_launches(monkeypatch, execute=False)
    q, k, v, ours, _ = many_heads(packed, torch.float16, "cpu")
    ours(q, k, v).sum().backward()
    kernel_names = [name for name, _ in launches]
    assert kernel_names == [
        "_attn_fwd_kernel", "_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"
    ]  # fmt: skip
    assert all(grid[0] > 65535 for _, grid in launches)


@pytest.mark.gpu
@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_gpu_more_than_65535_heads(packed):
    q, k, v, ours, ref = many_heads(packed, torch.float16, "cuda")
    out = ours(q, k, v)
    dout = torch.randn_like(out)
    results = {"ours": (out, *torch.autograd.grad(out, (q, k, v), dout))}
    for upcast in (True, False):
        leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
        ref_out, _ = ref(*leaves, upcast=upcast)
        results[upcast] = (ref_out, *torch.autograd.grad(ref_out, leaves, dout.to(ref_out.dtype)))
    for i, name in enumerate(("out", "dq", "dk", "dv")):
        assert_close(name, results["ours"][i], results[True][i], results[False][i])


@pytest.mark.parametrize("use_tma", [True, False], ids=["tma", "pointer"])
def test_rows_past_2_31_elements_are_addressed_in_64_bits(use_tma, device, monkeypatch):
    # q's rows 2**30 elements apart (a view into a larger buffer): its third row starts past 2**31,
    # where row * stride in 32 bits wraps. 4 GiB of address space; only the rows' pages are touched.
    monkeypatch.setattr(launch, "USE_TMA", use_tma)
    shape = Shape(1, 3, 5, 2, 2, 16)
    q, k, v = make_qkv(shape, torch.float16, device)
    row_stride = 2**30
    buffer = torch.empty(2 * row_stride + shape.heads * shape.head_dim, dtype=torch.float16, device=device)
    strides = (3 * row_stride, row_stride, shape.head_dim, 1)
    q = buffer.as_strided(q.shape, strides).copy_(q.detach()).requires_grad_()
    out = kernels.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    ours = dict(
        zip(("out", "dq", "dk", "dv"), (out, *torch.autograd.grad(out, (q, k, v), dout)), strict=True)
    )
    truth = run_reference(q, k, v, dout, True, upcast=True)
    baseline = run_reference(q, k, v, dout, True, upcast=False)
    for name, value in ours.items():
        assert_close(name, value, truth[name], baseline[name])


@pytest.mark.parametrize(
    ("trained", "passes"),
    [("q", ["_attn_bwd_preprocess_kernel", "_attn_bwd_dq_kernel"]),  # frozen k and v: no dk/dv pass
     ("kv", ["_attn_bwd_preprocess_kernel", "_attn_bwd_dkdv_kernel"])],  # frozen q: no dq pass
)  # fmt: skip
def test_frozen_inputs_launch_no_pass_for_their_gradient(trained, passes, device, monkeypatch):
    shape = Shape(2, 17, 17, 2, 2, 32)
    q, k, v = make_qkv(shape, torch.float16, device)
    out = kernels.flash_attention(q, k, v, causal=True)
    dout = torch.randn_like(out)
    full = dict(zip("qkv", torch.autograd.grad(out, (q, k, v), dout), strict=True))
    leaves = {
        name: t.detach().requires_grad_(name in trained) for name, t in zip("qkv", (q, k, v), strict=True)
    }
    out = kernels.flash_attention(*leaves.values(), causal=True)
    launches = record_launches(monkeypatch)
    out.backward(dout)
    assert [name for name, _ in launches] == passes
    for name, leaf in leaves.items():
        assert (leaf.grad is not None) == (name in trained)
        if name in trained:  # the same gradient as with every input trained, bit for bit
            assert torch.equal(leaf.grad, full[name]), name


# ----------------------------------------------------------------------------------------------
# Decoding against a KV cache (flash_attention_with_kvcache)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CacheCase:
    batch: int
    seqlen_q: int
    seqlen_new: int  # new keys appended (0: none given)
    heads: int
    kv_heads: int
    head_dim: int
    seqlen_cache: int
    cached: tuple[int, ...]  # tokens in each sequence's cache before the append

    def __str__(self):
        return (
            f"b{self.batch}-q{self.seqlen_q}-new{self.seqlen_new}-h{self.heads}/{self.kv_heads}kv-"
            f"d{self.head_dim}-cache{self.seqlen_cache}-{'.'.join(map(str, self.cached))}"
        )


# One token and a few (2, 5, 16), GQA groups of 1, 3, 4 and 8 (a group's rows filling one tile
# or two), MQA, padded head dims, empty caches, a cache filled to its end, and in the interpreter
# (16-key blocks, 4 SMs) splits of the keys: 1 to 8.
CACHE_CASES = [
    CacheCase(1, 1, 1, 8, 1, 64, 70, (40,)),
    CacheCase(3, 1, 1, 6, 2, 40, 37, (0, 17, 36)),
    CacheCase(2, 5, 5, 4, 4, 32, 29, (24, 3)),
    CacheCase(1, 9, 9, 4, 1, 24, 50, (11,)),
    CacheCase(2, 16, 0, 3, 1, 64, 33, (33, 16)),
    CacheCase(2, 2, 2, 2, 2, 128, 19, (0, 0)),
    CacheCase(1, 3, 1, 2, 1, 256, 23, (7,)),
    CacheCase(1, 2, 1, 2, 1, 512, 19, (9,)),
]


def sdpa_on_cache(q, k_cache, v_cache, lengths, causal, window, dtype):
    """SDPA of each sequence's queries on its first lengths[b] cache rows, computed in dtype; rows
    that see no key are zero."""
    outs = []
    for b, n in enumerate(lengths):
        qb, kb, vb = (
            t[b : b + 1, : n if t is not q else None].to(dtype).transpose(1, 2) for t in (q, k_cache, v_cache)
        )
        rows = torch.arange(q.shape[1])[:, None] + n - q.shape[1]
        cols = torch.arange(n)[None, :]
        visible = torch.ones(q.shape[1], n, dtype=torch.bool)
        if causal:
            visible &= cols <= rows
        if window[0] >= 0:
            visible &= cols >= rows - window[0]
        if window[1] >= 0:
            visible &= cols <= rows + window[1]
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=visible, enable_gqa=True)
        outs.append(torch.where(visible.any(-1)[:, None], out.nan_to_num(), 0.0).transpose(1, 2))
    return torch.cat(outs)


@pytest.mark.parametrize(
    "causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (6, -1))], ids=["causal", "full", "window6"]
)
@pytest.mark.parametrize("case", CACHE_CASES, ids=str)
def test_kvcache_matches_sdpa_on_the_cache(case, causal, window, device):
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=torch.float16)

    q = randn(case.batch, case.seqlen_q, case.heads, case.head_dim)
    kv_shape = (case.batch, case.seqlen_cache, case.kv_heads, case.head_dim)
    k_cache, v_cache = randn(*kv_shape), randn(*kv_shape)
    new_shape = (case.batch, case.seqlen_new, case.kv_heads, case.head_dim)
    k, v = (randn(*new_shape), randn(*new_shape)) if case.seqlen_new else (None, None)
    before = k_cache.clone(), v_cache.clone()
    cached = torch.tensor(case.cached, dtype=torch.int32, device=device)
    out = kernels.flash_attention_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=cached, k=k, v=v, causal=causal, window_size=window
    )
    lengths = [n + case.seqlen_new for n in case.cached]
    for cache, old, new in zip((k_cache, v_cache), before, (k, v), strict=True):
        expected = old.clone()
        for b, n in enumerate(case.cached):
            if new is not None:
                expected[b, n : n + case.seqlen_new] = new[b]
        assert torch.equal(cache, expected), "the append wrote outside its rows, or not at all"
    truth = sdpa_on_cache(q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths, causal, window, torch.float64)
    baseline = sdpa_on_cache(q.cpu(), k_cache.cpu(), v_cache.cpu(), lengths, causal, window, torch.float32)
    assert_close("out", out.cpu(), truth, baseline.to(out.dtype))


def test_kvcache_int_lengths_and_whole_cache_match_a_tensor_of_lengths(device):
    q, k_cache, v_cache = make_qkv(Shape(2, 1, 21, 4, 2, 64), torch.float16, device, requires_grad=False)
    k_new, v_new = (t[:, :1].clone() for t in (k_cache, v_cache))
    whole = kernels.flash_attention_with_kvcache(q, k_cache, v_cache, causal=True)
    lengths = torch.full((2,), 21, dtype=torch.int32, device=device)
    torch.testing.assert_close(
        whole, kernels.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths, causal=True)
    )
    by_int = kernels.flash_attention_with_kvcache(
        q, k_cache.clone(), v_cache.clone(), cache_seqlens=20, k=k_new, v=v_new, causal=True
    )
    caches = k_cache.clone(), v_cache.clone()
    by_tensor = kernels.flash_attention_with_kvcache(
        q, *caches, cache_seqlens=lengths - 1, k=k_new, v=v_new, causal=True
    )
    torch.testing.assert_close(by_int, by_tensor, rtol=0, atol=0)


def test_kvcache_splits_the_keys_and_packs_the_group(device, monkeypatch):
    # The cases above run split: record the launches of one of them.
    launches = []
    decode = launch.attention_decode

    def spy(q, k_cache, *args):
        cfg = configs.attn_config(configs.DECODE_CONFIGS, q.shape[-1], q.device)
        launches.append(launch.decode_splits(k_cache.shape[2] * q.shape[0], k_cache.shape[1], cfg.block_n,
                                                runtime.num_sms(q.device)))  # fmt: skip
        return decode(q, k_cache, *args)

    monkeypatch.setattr(launch, "attention_decode", spy)
    monkeypatch.setattr(configs, "DECODE_REDUCE_BLOCK_S", 2)  # the reduce's loop over the splits
    q, k_cache, v_cache = make_qkv(Shape(1, 1, 400, 8, 1, 64), torch.float16, device, requires_grad=False)
    out = kernels.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=300)
    assert launches[0] > 2
    lengths = torch.tensor([300])
    truth = reference.attention_kvcache(*(t.double() for t in (q, k_cache, v_cache)), lengths)
    baseline = reference.attention_kvcache(q, k_cache, v_cache, lengths).to(out.dtype)
    assert_close("out", out, truth, baseline)
    assert launch.decode_splits(1, 4096, 64, 132) == 64  # 2 programs per SM at batch 1, MQA


def test_kvcache_bad_input_is_named():
    q = torch.randn(2, 1, 4, 16, dtype=torch.float16)
    cache = torch.randn(2, 10, 2, 16, dtype=torch.float16)
    new = torch.randn(2, 1, 2, 16, dtype=torch.float16)
    fn = kernels.flash_attention_with_kvcache
    with pytest.raises(ValueError, match="k and v must be given together"):
        fn(q, cache, cache.clone(), cache_seqlens=3, k=new)
    with pytest.raises(ValueError, match=r"k and v must be \(batch, seqlen_new, kv_heads, head_dim\)"):
        fn(q, cache, cache.clone(), cache_seqlens=3, k=new[:, :, :1], v=new[:, :, :1])
    with pytest.raises(ValueError, match="cache_seqlens must be an int or an int32 tensor"):
        fn(q, cache, cache.clone(), cache_seqlens=torch.tensor([1, 2]))
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new must lie in \[0, 10\]"):
        fn(q, cache, cache.clone(), cache_seqlens=10, k=new, v=new.clone())
    with pytest.raises(ValueError, match=r"cache_seqlens \+ seqlen_new must lie in \[0, 10\]"):
        fn(q, cache, cache.clone(), cache_seqlens=torch.tensor([2, 11], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be a multiple of"):
        fn(torch.randn(2, 1, 3, 16, dtype=torch.float16), cache, cache.clone())


# Softcapping and attention sinks (issue 49)
# ----------------------------------------------------------------------------------------------


def make_sinks(heads: int, device, seed: int = 1) -> torch.Tensor:
    """Sink logits around the scores' own size, float32 and learnable."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return (torch.randn(heads, generator=gen) * 1.5).to(device).requires_grad_()


def reference_grads(leaves, upcast: bool, outputs_of, grad_outputs) -> dict:
    """The float64 truth (upcast) or PyTorch's computation in the inputs' dtype, of outputs_of(q, k, v,
    sinks): out, lse and the gradients of q, k, v and the sinks (those given, float32 in the baseline)."""
    q, k, v, sinks = leaves
    given = [t for t in (q, k, v, sinks) if t is not None]
    tensors = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in given]
    out, lse = outputs_of(*tensors[:3], tensors[3] if sinks is not None else None)
    outputs = [out, lse][: len(grad_outputs)]
    grad_outputs = [g.to(o.dtype) for g, o in zip(grad_outputs, outputs, strict=True)]
    grads = torch.autograd.grad(outputs, tensors, grad_outputs, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(tensors, grads, strict=True)]
    return dict(zip(("out", "lse", "dq", "dk", "dv", "dsinks"), (out, lse, *grads), strict=False))


def sinks_grad_baseline(truth: dict, baseline: dict, sinks, grad_outputs) -> torch.Tensor:
    """PyTorch's error at the baseline's precision for d sink = -Σ_rows exp(sink - lse) (dO · O - dlse),
    propagated from its output's and lse's errors without cancellation: every flash backward (ours,
    flash-attn's) forms dO · O of the output as stored, which PyTorch's autograd never does, so its
    sum over rows cancels by chance (4x under this, measured on b2-q17-k17 with a window). Returned
    as the truth plus that error, so that assert_close reads it as PyTorch's."""
    out_error = (grad_outputs[0].double() * (baseline["out"].double() - truth["out"])).abs().sum(-1)
    delta = (grad_outputs[0].double() * truth["out"]).sum(-1).movedim(-2, -1)  # lse's layout
    if len(grad_outputs) > 1:
        delta = delta - grad_outputs[1].double()
    lse_error = (baseline["lse"].double() - truth["lse"]).abs()
    p_sink = torch.exp(sinks.detach().double().view(-1, 1) - truth["lse"].detach())
    per_row = p_sink * (out_error.movedim(-2, -1) + delta.abs() * lse_error)
    return truth["dsinks"] + per_row.movedim(-2, 0).flatten(1).sum(1)


def check_score_mods(run, reference_of, leaves, with_dlse: bool = False):
    """run(q, k, v, sinks) -> (out, lse) of the kernels against reference_of(q, k, v, sinks, upcast):
    out, lse and every gradient (the sinks' too), by the suite's rule."""
    q, k, v, sinks = leaves
    out, lse = run(q, k, v, sinks)
    gen = torch.Generator().manual_seed(2)  # the same gradients whatever ran before

    def randn_like(t):
        return torch.randn(t.shape, generator=gen).to(t)

    grad_outputs = [randn_like(out)] + ([randn_like(lse)] if with_dlse else [])
    wanted = [t for t in leaves if t is not None]
    grads = torch.autograd.grad([out, lse][: len(grad_outputs)], wanted, grad_outputs)
    ours = dict(zip(("out", "dq", "dk", "dv", "dsinks"), (out, *grads), strict=False))
    truth, baseline = (
        reference_grads(leaves, upcast, functools.partial(reference_of, upcast=upcast), grad_outputs)
        for upcast in (True, False)
    )
    if sinks is not None:
        baseline["dsinks"] = sinks_grad_baseline(truth, baseline, sinks, grad_outputs)
    for name, value in ours.items():
        assert torch.isfinite(value).all(), f"{name} has non-finite values"
        assert_close(name, value, truth[name], baseline[name].to(value.dtype))
    assert_lse_close(lse, truth["lse"], baseline["lse"].float())


# (softcap, sinks): each alone and both; a softcap of 2 bends most scores of these unit-variance
# inputs (scaled scores ~ N(0, 1)) into tanh's curve, so a missing derivative shows.
SCORE_MODS = [(2.0, False), (0.0, True), (5.0, True)]
MOD_SHAPES = [
    Shape(1, 1, 1, 2, 2, 64),
    Shape(2, 17, 17, 2, 2, 64),
    Shape(1, 129, 129, 4, 2, 64),
    Shape(1, 129, 17, 4, 1, 64),
    Shape(1, 17, 129, 2, 2, 48),
]
MOD_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (10, -1)), (False, (6, 9))]


def score_mods_id(mods) -> str:
    softcap, sinks = mods
    return "-".join([f"softcap{softcap:g}"] * (softcap > 0) + ["sinks"] * sinks)


@pytest.mark.parametrize(("causal", "window"), MOD_MASKS, ids=str)
@pytest.mark.parametrize("mods", SCORE_MODS, ids=score_mods_id)
@pytest.mark.parametrize("shape", MOD_SHAPES, ids=str)
def test_softcap_and_sinks_match_reference(shape, mods, causal, window, device):
    softcap, with_sinks = mods
    q, k, v = make_qkv(shape, torch.float16, device, scale=1.5)
    sinks = make_sinks(shape.heads, device) if with_sinks else None
    options = dict(causal=causal, window_size=window, softcap=softcap)

    def run(q, k, v, sinks):
        return kernels.flash_attention(q, k, v, sinks=sinks, return_lse=True, **options)

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention(q, k, v, upcast=upcast, sinks=sinks, **options)

    check_score_mods(run, reference_of, (q, k, v, sinks))


@pytest.mark.parametrize("mods", SCORE_MODS, ids=score_mods_id)
def test_softcap_and_sinks_gradient_through_lse(mods, device):
    softcap, with_sinks = mods
    shape = Shape(1, 40, 40, 4, 2, 64)
    q, k, v = make_qkv(shape, torch.float16, device, scale=1.5)
    sinks = make_sinks(shape.heads, device) if with_sinks else None

    def run(q, k, v, sinks):
        return kernels.flash_attention(q, k, v, causal=True, softcap=softcap, sinks=sinks, return_lse=True)

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention(q, k, v, True, upcast=upcast, softcap=softcap, sinks=sinks)

    check_score_mods(run, reference_of, (q, k, v, sinks), with_dlse=True)


@pytest.mark.parametrize(("causal", "window"), VARLEN_MASKS, ids=str)
@pytest.mark.parametrize("mods", SCORE_MODS, ids=score_mods_id)
@pytest.mark.parametrize("case", [VARLEN_CASES[i] for i in (0, 2, 3, 4)], ids=str)  # head dims <= 64
def test_varlen_softcap_and_sinks_match_reference(case, mods, causal, window, device):
    softcap, with_sinks = mods
    lengths_q, lengths_k, heads, *_ = case
    q, k, v, cu_q, cu_k = make_packed(*case[:2], *case[2:], torch.float16, device)
    sinks = make_sinks(heads, device) if with_sinks else None
    options = dict(causal=causal, window_size=window, softcap=softcap)

    def run(q, k, v, sinks):
        longest = (max(lengths_q), max(lengths_k))
        return kernels.flash_attention_varlen(
            q, k, v, cu_q, cu_k, *longest, sinks=sinks, return_lse=True, **options
        )

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention_varlen(q, k, v, cu_q, cu_k, upcast=upcast, sinks=sinks, **options)

    check_score_mods(run, reference_of, (q, k, v, sinks), with_dlse=True)


def test_sinks_backward_is_deterministic(device):
    """The same inputs, several runs: every gradient, the sinks' (a reduction over every row of a
    head) included, bit-equal."""
    shape = Shape(2, 129, 129, 4, 1, 64)
    results = []
    for _ in range(3):
        q, k, v = make_qkv(shape, torch.float16, device)
        sinks = make_sinks(shape.heads, device)
        out, lse = kernels.flash_attention(q, k, v, causal=True, softcap=3.0, sinks=sinks, return_lse=True)
        torch.autograd.backward([out, lse], [torch.ones_like(out), torch.full_like(lse, 0.5)])
        results.append([out.detach(), q.grad, k.grad, v.grad, sinks.grad])
    for again in results[1:]:
        for name, first, other in zip(("out", "dq", "dk", "dv", "dsinks"), results[0], again, strict=True):
            assert torch.equal(first, other), f"{name} changed between identical runs"


def reference_on_cache(q, k_cache, v_cache, lengths, upcast: bool, **options):
    """reference.attention of each sequence's queries on its first lengths[b] cache rows, in float64
    (upcast) or in the inputs' dtype."""
    outs = []
    for b, n in enumerate(lengths):
        tensors = [t[b : b + 1, : n if t is not q else None] for t in (q, k_cache, v_cache)]
        if upcast:
            tensors = [t.double() for t in tensors]
        outs.append(reference.attention(*tensors, upcast=upcast, **options)[0])
    return torch.cat(outs)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (6, -1))], ids=str)
@pytest.mark.parametrize("mods", SCORE_MODS, ids=score_mods_id)
@pytest.mark.parametrize("case", [CACHE_CASES[i] for i in (0, 1, 3, 6, 7)], ids=str)
def test_kvcache_softcap_and_sinks_match_reference(case, mods, causal, window, device):
    softcap, with_sinks = mods
    gen = torch.Generator().manual_seed(0)

    def randn(*shape):
        return (torch.randn(*shape, generator=gen) * 1.5).to(device=device, dtype=torch.float16)

    q = randn(case.batch, case.seqlen_q, case.heads, case.head_dim)
    kv_shape = (case.batch, case.seqlen_cache, case.kv_heads, case.head_dim)
    k_cache, v_cache = randn(*kv_shape), randn(*kv_shape)
    new_shape = (case.batch, case.seqlen_new, case.kv_heads, case.head_dim)
    k, v = randn(*new_shape), randn(*new_shape)
    sinks = make_sinks(case.heads, device).detach() if with_sinks else None
    cached = torch.tensor(case.cached, dtype=torch.int32, device=device)
    options = dict(causal=causal, window_size=window, softcap=softcap, sinks=sinks)
    out = kernels.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=cached, k=k, v=v, **options)
    lengths = [n + case.seqlen_new for n in case.cached]
    tensors = [t.cpu() for t in (q, k_cache, v_cache)]
    options["sinks"] = None if sinks is None else sinks.cpu()
    truth = reference_on_cache(*tensors, lengths, upcast=True, **options)
    baseline = reference_on_cache(*tensors, lengths, upcast=False, **options)
    assert_close("out", out.cpu(), truth, baseline.to(out.dtype))


def test_kvcache_prompt_with_softcap_and_sinks_takes_the_prefill_kernel(device, monkeypatch):
    """More than DECODE_MAX_SEQLEN_Q new tokens: the forward kernel on the cache's rows, with the
    score modifications too."""
    launches = record_launches(monkeypatch)
    q, k_cache, v_cache = make_qkv(
        Shape(2, 20, 50, 4, 2, 64), torch.float16, device, 1.5, requires_grad=False
    )
    sinks = make_sinks(4, device).detach()
    options = dict(causal=True, softcap=2.0, sinks=sinks)
    out = kernels.flash_attention_with_kvcache(q, k_cache, v_cache, cache_seqlens=30, **options)
    assert [name for name, _ in launches] == ["_attn_fwd_kernel"]
    tensors = [t.cpu() for t in (q, k_cache, v_cache)]
    options["sinks"] = sinks.cpu()
    truth = reference_on_cache(*tensors, [30, 30], upcast=True, **options)
    baseline = reference_on_cache(*tensors, [30, 30], upcast=False, **options)
    assert_close("out", out.cpu(), truth, baseline.to(out.dtype))


def test_cpu_without_interpreter_honours_softcap_and_sinks(monkeypatch):
    monkeypatch.setattr(runtime, "INTERPRET", False)
    q, k, v = make_qkv(Shape(1, 9, 9, 2, 1, 32), torch.float32, "cpu")
    sinks = make_sinks(2, "cpu")
    out = kernels.flash_attention(q, k, v, causal=True, softcap=2.0, sinks=sinks)
    expected = reference.attention(q, k, v, causal=True, softcap=2.0, sinks=sinks)[0]
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert not torch.equal(out, reference.attention(q, k, v, causal=True)[0])
    out.sum().backward()
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    cache = kernels.flash_attention_with_kvcache(
        q, k.detach(), v.detach(), causal=True, softcap=2.0, sinks=sinks.detach()
    )
    torch.testing.assert_close(cache, expected.detach().to(cache.dtype), rtol=0, atol=0)


BAD_SOFTCAPS = (-1.0, float("nan"), float("inf"), True, "50")
SCORE_MOD_BAD_INPUTS = [
    *[(dict(softcap=bad), ValueError, "softcap must be a finite number >= 0") for bad in BAD_SOFTCAPS],
    (dict(sinks=[0.0, 0.0, 0.0, 0.0]), TypeError, r"sinks must be a torch.Tensor of shape \(4,\)"),
    (dict(sinks=torch.zeros(2)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.zeros(4, 1)), ValueError, r"sinks must have shape \(4,\)"),
    (dict(sinks=torch.zeros(4, dtype=torch.float16)), TypeError, "sinks must be float32"),
    (dict(sinks=torch.zeros(4, device="meta")), ValueError, "sinks is on meta"),
]


@pytest.mark.parametrize(
    "function", ["flash_attention", "flash_attention_varlen", "flash_attention_with_kvcache"]
)
@pytest.mark.parametrize("options,error,message", SCORE_MOD_BAD_INPUTS)
def test_softcap_and_sinks_bad_input_is_named(function, options, error, message):
    q = torch.randn(2, 6, 4, 16, dtype=torch.float16)
    k = torch.randn(2, 6, 2, 16, dtype=torch.float16)
    if function == "flash_attention_varlen":
        cu = torch.tensor([0, 6, 12], dtype=torch.int32)
        call = functools.partial(
            kernels.flash_attention_varlen, q.flatten(0, 1), *[k.flatten(0, 1)] * 2, cu, cu, 6, 6
        )
    else:
        call = functools.partial(getattr(kernels, function), q, k, k.clone())
    with pytest.raises(error, match=f"{function}: {message}"):
        call(**options)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize(("causal", "window"), MOD_MASKS, ids=str)
@pytest.mark.parametrize("mods", SCORE_MODS, ids=score_mods_id)
@pytest.mark.parametrize(
    "shape",
    [
        Shape(2, 1000, 1000, 8, 2, 64),
        Shape(1, 300, 300, 4, 4, 48),
        Shape(1, 300, 300, 4, 2, 128),  # the softcap tiles of the gradient passes (sm_90's dk/dv)
        Shape(1, 300, 300, 4, 1, 256),
    ],
    ids=str,
)
def test_gpu_softcap_and_sinks(shape, mods, causal, window, dtype):
    softcap, with_sinks = mods
    q, k, v = make_qkv(shape, dtype, "cuda", scale=1.5)
    sinks = make_sinks(shape.heads, "cuda") if with_sinks else None
    options = dict(causal=causal, window_size=window, softcap=softcap)

    def run(q, k, v, sinks):
        return kernels.flash_attention(q, k, v, sinks=sinks, return_lse=True, **options)

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention(q, k, v, upcast=upcast, sinks=sinks, **options)

    check_score_mods(run, reference_of, (q, k, v, sinks), with_dlse=True)


# The softcap's backward above head dim 64, where entries whose gradient tile spilled with the softcap hold
# one of their own for it (configs.attn_config): in the interpreter (sm_90's tables) at 256 and 512 the
# dk/dv entry's split outputs, which have no softcap, give way to a fused tile with column splits.
LARGE_HEAD_DIMS = [96, 128, 256, 512]
LARGE_HEAD_DIM_MASKS = [(False, (-1, -1)), (True, (-1, -1)), (True, (5, -1))]


@pytest.mark.parametrize(("causal", "window"), LARGE_HEAD_DIM_MASKS, ids=str)
@pytest.mark.parametrize("head_dim", LARGE_HEAD_DIMS)
def test_softcap_backward_at_large_head_dims(head_dim, causal, window, device):
    shape = Shape(1, 20, 37, 2, 1, head_dim)
    q, k, v = make_qkv(shape, torch.float16, device, scale=1.5)
    sinks = make_sinks(shape.heads, device)
    options = dict(causal=causal, window_size=window, softcap=2.0)

    def run(q, k, v, sinks):
        return kernels.flash_attention(q, k, v, sinks=sinks, return_lse=True, **options)

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention(q, k, v, upcast=upcast, sinks=sinks, **options)

    check_score_mods(run, reference_of, (q, k, v, sinks), with_dlse=True)


@pytest.mark.parametrize(("causal", "window"), LARGE_HEAD_DIM_MASKS, ids=str)
@pytest.mark.parametrize("head_dim", LARGE_HEAD_DIMS)
def test_varlen_softcap_backward_at_large_head_dims(head_dim, causal, window, device):
    lengths = [5, 20, 1]
    q, k, v, cu, _ = make_packed(lengths, lengths, 2, 1, head_dim, torch.float16, device)
    options = dict(causal=causal, window_size=window, softcap=2.0)

    def run(q, k, v, sinks):
        return kernels.flash_attention_varlen(q, k, v, cu, cu, 20, 20, return_lse=True, **options)

    def reference_of(q, k, v, sinks, upcast):
        return reference.attention_varlen(q, k, v, cu, cu, upcast=upcast, **options)

    check_score_mods(run, reference_of, (q, k, v, None), with_dlse=True)
