"""Document masking in the dense attention kernels (flash_attention's document_starts) against the
float64 truth, forward and every gradient: rows packing documents shorter than a block, longer
than one, of one token, and a row that is one document."""

import functools

import pytest
import torch
from helpers import assert_close, record_launches
from test_attention import Shape, assert_lse_close, make_qkv

from horse import kernels
from horse.kernels import reference
from horse.kernels.attention import launch


def document_starts(rows: list[list[int]]) -> torch.Tensor:
    """(batch, seqlen) int32: each token's document's first column, from each row's document lengths."""
    starts = []
    for lengths in rows:
        row, first = [], 0
        for length in lengths:
            row += [first] * length
            first += length
        starts.append(row)
    return torch.tensor(starts, dtype=torch.int32)


# (shape, each row's document lengths, window): the interpreter's tiles are 32 queries by 16 keys.
# Documents of 5 (shorter than a block), 40 (longer than both), 1 and the rest; a row that is one
# document; documents that begin inside a tile and cross tiles; GQA; a window inside the documents.
CASES = [
    (Shape(2, 70, 70, 4, 2, 32), [[5, 40, 1, 24], [70]], (-1, -1)),
    (Shape(1, 33, 33, 2, 2, 64), [[1, 1, 31]], (-1, -1)),
    (Shape(3, 48, 48, 2, 1, 16), [[17, 17, 14], [1] * 48, [3, 45]], (-1, -1)),
    (Shape(2, 70, 70, 4, 2, 32), [[5, 40, 1, 24], [70]], (9, -1)),
]


def run_reference(q, k, v, dout, starts, window, upcast):
    """The float64 truth (upcast) or PyTorch's attention in the inputs' dtype, with its gradients."""
    leaves = [(t.detach().double() if upcast else t.detach().clone()).requires_grad_() for t in (q, k, v)]
    out, lse = reference.attention(
        *leaves, causal=True, upcast=upcast, window_size=window, document_starts=starts
    )
    grads = torch.autograd.grad(out, leaves, dout.to(out.dtype))
    return {"out": out, "lse": lse, "dq": grads[0], "dk": grads[1], "dv": grads[2]}


def check(shape: Shape, documents: list[list[int]], window, dtype, device):
    """Forward, lse and every gradient of flash_attention with the rows' documents against the truth."""
    q, k, v = make_qkv(shape, dtype, device)
    starts = document_starts(documents).to(device)
    out, lse = kernels.flash_attention(
        q, k, v, causal=True, window_size=window, return_lse=True, document_starts=starts
    )
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ours = {"out": out, "dq": dq, "dk": dk, "dv": dv}
    truth = run_reference(q, k, v, dout, starts, window, upcast=True)
    baseline = run_reference(q, k, v, dout, starts, window, upcast=False)
    for name, value in ours.items():
        assert_close(name, value, truth[name], baseline[name])
    assert_lse_close(lse, truth["lse"], baseline["lse"].float())


@pytest.mark.parametrize(("shape", "documents", "window"), CASES, ids=str)
def test_document_masking_matches_reference(shape, documents, window, device):
    check(shape, documents, window, torch.float16, device)


def test_document_masking_at_head_dim_512_matches_reference(device):
    # The dk/dv entry at 512 (sm_90's, the interpreter's) splits its outputs; documents take its pointer tile.
    check(Shape(1, 20, 20, 2, 1, 512), [[7, 13]], (-1, -1), torch.float16, device)


# The tables' tiles: 1,024-token rows, one document of a token among long ones; head dim 256, whose sm_90
# dk/dv entry splits its outputs by TMA and takes its pointer tile for documents.
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("shape", "documents", "window", "dtype"),
    [
        (Shape(2, 1024, 1024, 8, 2, 128), [[100, 500, 1, 423], [1024]], (-1, -1), torch.float16),
        (Shape(1, 1000, 1000, 4, 4, 64), [[1] * 10 + [700, 290]], (256, -1), torch.bfloat16),
        (Shape(1, 700, 700, 2, 1, 256), [[300, 400]], (-1, -1), torch.float16),
    ],
    ids=str,
)
def test_gpu_document_masking(shape, documents, window, dtype):
    check(shape, documents, window, dtype, "cuda")


def test_reference_documents_are_the_documents_apart():
    # The reference's mask against each document run alone, causal: the oracle itself checked.
    shape, lengths = Shape(1, 23, 23, 2, 1, 16), [4, 1, 18]
    q, k, v = make_qkv(shape, torch.float64, "cpu", requires_grad=False)
    out, lse = reference.attention(q, k, v, causal=True, document_starts=document_starts([lengths]))
    first = 0
    for length in lengths:
        rows = slice(first, first + length)
        alone, alone_lse = reference.attention(q[:, rows], k[:, rows], v[:, rows], causal=True)
        torch.testing.assert_close(out[:, rows], alone)
        torch.testing.assert_close(lse[:, :, rows], alone_lse)
        first += length


def test_document_masking_launches_the_dense_grids(device, monkeypatch):
    # A program per query tile (forward, dq) or key tile (dk/dv), as causal without documents.
    q, k, v = make_qkv(Shape(2, 70, 70, 4, 2, 32), torch.float16, device)
    starts = document_starts([[5, 40, 1, 24], [70]]).to(device)
    launches = record_launches(monkeypatch)
    for documents in (None, starts):
        out = kernels.flash_attention(q, k, v, causal=True, document_starts=documents)
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    causal, by_documents = launches[: len(launches) // 2], launches[len(launches) // 2 :]
    assert [name for name, _ in causal] == [
        "_attn_fwd_kernel",
        "_attn_bwd_preprocess_kernel",
        "_attn_bwd_dkdv_kernel",
        "_attn_bwd_dq_kernel",
    ]
    assert by_documents == causal


def test_document_starts_bad_input_is_named():
    q = torch.randn(2, 6, 4, 16, dtype=torch.float16)
    good = document_starts([[2, 4], [6]])
    bad = [
        (dict(document_starts=good.long()), ValueError, "int32 tensor"),
        (dict(document_starts=good[:1]), ValueError, r"\(batch, seqlen_q\) = \(2, 6\)"),
        (dict(document_starts=good.tolist()), TypeError, "must be a torch.Tensor"),
        (dict(document_starts=good.to("meta")), ValueError, "document_starts is on meta"),
        (dict(document_starts=good, causal=False), ValueError, "causal=True"),
        (dict(document_starts=good + 1), ValueError, r"document_starts\[b, i\] must be i"),
        (dict(document_starts=good.flip(1)), ValueError, r"document_starts\[b, i\] must be i"),
    ]
    for kwargs, error, message in bad:
        with pytest.raises(error, match=message):
            kernels.flash_attention(q, q, q, **({"causal": True} | kwargs))
    with pytest.raises(ValueError, match="seqlen_k = seqlen_q"):
        kernels.flash_attention(q, q[:, :5], q[:, :5], causal=True, document_starts=good)


@pytest.mark.interpreter
def test_document_masking_op_passes_opcheck_and_compiles_fullgraph():
    q, k, v = make_qkv(Shape(1, 24, 24, 2, 1, 32), torch.float16, "cpu")
    starts = document_starts([[9, 15]])
    first_keys = launch.document_first_keys(starts, window_left=-1)
    args = (q, k, v, None, 0.0, True, 0.125, -1, -1, None, None, 0, 0, first_keys)
    torch.library.opcheck(torch.ops.horse.flash_attn_fwd.default, args)
    call = functools.partial(kernels.flash_attention, causal=True, document_starts=starts)
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), call(q, k, v), rtol=0, atol=0)
