"""Attention in the bench suite: ours against every SDPA backend, torch.compile and flash-attn.

    python -m bench --only attention        (or python -m bench.attention, the same)

The shape of the published numbers (ANCHORS.md): 16K tokens per batch (batch·seqlen = 16384),
heads·head_dim = 2048, seqlen 512…16K, equal query and key lengths, causal and not, float16.
Implementations: ours (``horse.kernels.flash_attention``); ours-pointer, the same kernels with TMA off
(``horse.kernels.attention.launch.USE_TMA = False``, masked pointer loads) to measure what TMA brings;
``scaled_dot_product_attention`` under each
of ``sdpa_kernel(FLASH_ATTENTION)``, ``CUDNN_ATTENTION``, ``EFFICIENT_ATTENTION`` and ``MATH`` (MATH
only to seqlen 4K: it materialises the S×S scores), on transposed views; ``torch.compile`` of the
explicit-softmax reference in float16, where its S×S matrices fit; ``flash_attn_func`` where the
flash-attn package imports; at head dim 128, causal, ours-7b2e7b7: the kernels as they were when
issue 25 set its targets (:mod:`bench.revision`, where the checkout's git history is at hand). A
baseline that cannot run a shape (no kernel for it, out of memory) is skipped there with the reason.
Directions: forward under no_grad; backward, ``autograd.grad`` of out w.r.t. q, k, v on a graph
built once; forward+backward in one call. Rates are TFLOP/s of the ANCHORS counts
(:func:`forward_flops` and the 2.5x and 3.5x multiples).

Beyond the published shape, in full runs only and not gated (no public figure to hold them to):
``attention_window``, a causal sliding window of WINDOW keys, against ours fully causal (what the
window saves), SDPA's efficient backend with the window as a mask and flash-attn's window; and
``attention_packed``, a batch of documents of uneven length packed (``flash_attention_varlen``)
against the same documents padded to the longest, which is what users run without it (ours, and
SDPA's flash backend: causal on right-padded rows keeps every real row exact), and flash-attn's
varlen. Their rates count the work the window or the documents need, whatever a baseline spends.
``attention_decode`` (one new token a sequence against a KV cache), in quick runs too: gated by
issue 25 against our prefill kernel and flash-attn's flash_attn_with_kvcache.
``attention_score_mods``, in quick runs too and gated (issue 49): causal attention at seqlen 4096 with
Gemma 2's logit softcap (SOFTCAP) or gpt-oss's attention sinks (a float32 logit per head), against
PyTorch's ``flex_attention`` compiled with the same modification (SDPA has neither): the softcap as its
score_mod, the sinks from its log-sum-exp, out · σ(lse - sink), which is the sink's share of the
softmax taken out exactly. The softcap at head dims 128 (Gemma 2 27B's) and 64, the sinks at 128, and
plain causal attention at head dim 512 (Gemma 4's global layers; flash-attn's kernels stop at 256),
there against SDPA's own choice of backend too; each forward and forward+backward.
"""

import contextlib
import functools
import itertools
import sys
from dataclasses import dataclass

import torch

from bench import correctness, revision, suite, timing

TOKENS = 16384  # batch · seqlen
MODEL_DIM = 2048  # heads · head_dim
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)
HEAD_DIMS = (64, 128, 256)  # 256 as in FA3's figures: times the dk/dv pass's split outputs (sm_90)
QUICK_SHAPES = ((4096, 128), (16384, 128))  # (seqlen, head_dim), where the gates apply
# Issue 25's "today's" kernels: main when it set its targets, with issue 21's GPU fixes (grid limits,
# 64-bit offsets) that let them run on a GPU; timed at head dim 128, causal (bench.revision).
FILED_AT = "7b2e7b7"
DTYPE = torch.float16
NAMES = ("out", "dq", "dk", "dv")  # what the check compares
TOLERANCE = 1e-2  # on bench.correctness.normalized_error, floor 0; ours measured <= 7e-4 in the interpreter
MATH_MAX_SEQLEN = 4096
REFERENCE_SCORE_ELEMENTS = 2**30  # the float32 check's S×S matrices, about 4 GiB each
EXPLICIT_MATRICES = 4  # S×S matrices the compiled explicit attention holds at once, at least
SDPA_BACKENDS = ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "MATH")
WINDOW = 1024  # attention_window: each query sees itself and the WINDOW keys before it (Mistral)
WINDOW_SEQLENS = (4096, 16384)
PACKED_LENGTHS = (4096, 512, 2048, 1024, 3072, 256, 1536, 2560, 1280)  # 16384 tokens in 9 documents
EXTRA_HEAD_DIM = 128  # of both, with MODEL_DIM // EXTRA_HEAD_DIM heads
# attention_decode: one new token per sequence against a KV cache (Llama-3-8B's attention: 32 query
# heads, 8 kv heads, head dim 128), batch x cache length; bytes of the cache read per call.
DECODE_HEADS, DECODE_KV_HEADS = 32, 8
DECODE_SHAPES = ((1, 4096), (1, 16384), (16, 4096), (64, 1024))
# attention_score_mods: (modification, head_dim, directions) at seqlen SCORE_MOD_SEQLEN, causal.
SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping
SCORE_MOD_SEQLEN = 4096
SCORE_MODS = (
    ("softcap", 128, ("forward", "forward+backward")),
    ("softcap", 64, ("forward", "forward+backward")),
    ("sinks", 128, ("forward", "forward+backward")),
    ("none", 512, ("forward", "forward+backward")),  # head dim 512 alone: Gemma 4's global layers
)


@dataclass(frozen=True)
class Shape:
    """Queries and keys of the same length; k and v with as many heads as q."""

    batch: int
    seqlen: int
    heads: int
    head_dim: int

    @property
    def numel(self) -> int:
        return self.batch * self.seqlen * self.heads * self.head_dim


def benchmark_shape(seqlen: int, head_dim: int) -> Shape:
    """The shape with TOKENS tokens per batch and MODEL_DIM = heads · head_dim."""
    if TOKENS % seqlen or MODEL_DIM % head_dim:
        raise ValueError(f"seqlen must divide {TOKENS} and head_dim {MODEL_DIM}, got {seqlen}, {head_dim}")
    return Shape(TOKENS // seqlen, seqlen, MODEL_DIM // head_dim, head_dim)


# Tiny, for the interpreter; 100 is not a multiple of any block size.
INTERPRETER_SHAPES = (Shape(2, 64, 2, 64), Shape(1, 100, 2, 128))


def forward_flops(batch: int, heads: int, seqlen_q: int, seqlen_k: int, head_dim: int, causal: bool) -> int:
    """4·batch·heads·seqlen_q·seqlen_k·head_dim, halved when causal: q kᵀ and p v, 2·S·S·d each
    per (batch, head); the softmax is not counted, and causal counts half whatever a kernel skips."""
    flops = 4 * batch * heads * seqlen_q * seqlen_k * head_dim
    return flops // 2 if causal else flops


def window_flops(batch: int, heads: int, seqlen: int, head_dim: int, window: int) -> int:
    """4·head_dim per visible (query, key) pair of a causal window: query i sees min(i, window) + 1."""
    near = min(seqlen, window)
    pairs = near * (near + 1) // 2 + (seqlen - near) * (window + 1)
    return 4 * batch * heads * head_dim * pairs


def packed_flops(lengths, heads: int, head_dim: int) -> int:
    """Causal forward FLOPs of each document on its own (forward_flops' halving), summed."""
    return sum(forward_flops(1, heads, n, n, head_dim, causal=True) for n in lengths)


# Backward: five matmuls against the forward's two (q kᵀ again, dv, dp, dq, dk); both: seven.
DIRECTION_MULTIPLE = {"forward": (1, 1), "backward": (5, 2), "forward+backward": (7, 2)}


def direction_flops(direction: str, shape: Shape, causal: bool, forward: int | None = None) -> int:
    """The direction's multiple of the forward: ``forward``, or the shape's :func:`forward_flops`."""
    numerator, denominator = DIRECTION_MULTIPLE[direction]
    if forward is None:
        forward = forward_flops(shape.batch, shape.heads, shape.seqlen, shape.seqlen, shape.head_dim, causal)
    return numerator * forward // denominator


def checked_batch_heads(shape: Shape, max_score_elements: int) -> tuple[int, int]:
    """(batch, heads) of the leading block the float32 reference checks: as many (batch, head)
    pairs as keep seqlen² · pairs within max_score_elements, at least one, heads first."""
    pairs = max(1, max_score_elements // (shape.seqlen * shape.seqlen))
    heads = min(shape.heads, pairs)
    return min(shape.batch, max(1, pairs // heads)), heads


def make_qkv(shape: Shape, device, requires_grad: bool = False) -> list[torch.Tensor]:
    size = (shape.batch, shape.seqlen, shape.heads, shape.head_dim)
    return [torch.randn(size, dtype=DTYPE, device=device).requires_grad_(requires_grad) for _ in range(3)]


def _ours(name: str = "flash_attention", **options):
    """The kernels package's ``name`` (flash_attention, flash_attention_varlen,
    flash_attention_with_kvcache) called with these keyword arguments; imported here, not at import:
    the CPU path sets TRITON_INTERPRET first."""
    from horse import kernels

    return functools.partial(getattr(kernels, name), **options)


def make_sinks(shape: Shape, device, requires_grad: bool = False) -> torch.Tensor:
    """Attention sinks: a float32 logit per head ~ N(0, 1), as the scores of random q, k."""
    return torch.randn(shape.heads, dtype=torch.float32, device=device).requires_grad_(requires_grad)


def check(
    shape: Shape, causal: bool, device, attention=None, window_size=(-1, -1), softcap=0.0, sinks=False
) -> tuple[dict, bool]:
    """out, dq, dk, dv of ours (or ``attention``) for a random dout against the float32 reference
    (:func:`bench.correctness.check`). Ours runs on the whole shape and must be finite everywhere;
    the reference on the leading block of :func:`checked_batch_heads` (every pair is independent).
    softcap, and sinks (then a fourth input, :func:`make_sinks`, and its gradient "dsinks") go to both."""
    from horse.kernels import reference

    torch.manual_seed(0)
    batch, heads = checked_batch_heads(shape, REFERENCE_SCORE_ELEMENTS)
    inputs = make_qkv(shape, device, requires_grad=True)
    if softcap:  # scaled scores of about ±softcap, where the cap bends them (N(0, 1) inputs score about ±1)
        inputs[0] = (inputs[0].detach() * softcap).requires_grad_()
    if sinks:
        inputs.append(make_sinks(shape, device, requires_grad=True))
    options = {"causal": causal, "window_size": window_size, "softcap": softcap}
    attention = attention or functools.partial(_with_sinks, _ours(**options))
    return correctness.check(
        attention,
        lambda *qkv: reference.attention(*qkv[:3], **options, sinks=qkv[3] if sinks else None)[0],
        inputs,
        (*NAMES, "dsinks") if sinks else NAMES,
        TOLERANCE,
        floor=0.0,
        crop=lambda t: t.detach()[:heads] if t.dim() == 1 else t.detach()[:batch, :, :heads],
    )


def _with_sinks(attention, q, k, v, sinks=None):
    """attention(q, k, v) with sinks= where given (a case's fourth input)."""
    return attention(q, k, v) if sinks is None else attention(q, k, v, sinks=sinks)


def offsets(lengths, device) -> torch.Tensor:
    """cu_seqlens of documents of these lengths: int32, 0 then the running totals."""
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)


def check_packed(lengths, heads: int, head_dim: int, device, attention=None) -> tuple[dict, bool]:
    """:func:`check` for flash_attention_varlen (or ``attention``, which takes its arguments) causal on
    documents of these lengths packed; the reference runs each document of the first two heads on its
    own."""
    from horse.kernels import reference

    attention = attention or _ours("flash_attention_varlen")
    torch.manual_seed(0)
    qkv = [t[0].detach().requires_grad_() for t in make_qkv(Shape(1, sum(lengths), heads, head_dim), device)]
    cu = offsets(lengths, device)
    return correctness.check(
        lambda *a: attention(*a, cu, cu, max(lengths), max(lengths), causal=True),
        lambda *a: reference.attention_varlen(*a, cu, cu, causal=True)[0],
        qkv,
        NAMES,
        TOLERANCE,
        floor=0.0,
        crop=lambda t: t.detach()[:, :2],
    )


def _sdpa(backend_name: str | None = None, **options):
    """scaled_dot_product_attention on our (batch, seqlen, heads, head_dim) layout (transposed views)
    under sdpa_kernel(backend_name) (None: SDPA's own choice), with these keyword arguments."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def attention(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seqlen, head_dim) views
        # SDPA's is_causal is aligned top-left, ours bottom-right: the same at equal lengths.
        with sdpa_kernel(getattr(SDPBackend, backend_name)) if backend_name else contextlib.nullcontext():
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **options).transpose(1, 2)

    return attention


def _sdpa_window(seqlen: int):
    """SDPA's efficient backend with the causal window as a boolean (seqlen, seqlen) mask, on the GPU."""
    rows = torch.arange(seqlen, device="cuda")[:, None]
    cols = torch.arange(seqlen, device="cuda")[None, :]
    return _sdpa("EFFICIENT_ATTENTION", attn_mask=(cols <= rows) & (cols >= rows - WINDOW))


def _compiled_explicit(shape: Shape, causal: bool):
    from horse.kernels import reference

    needed = EXPLICIT_MATRICES * shape.batch * shape.heads * shape.seqlen**2 * DTYPE.itemsize
    free = torch.cuda.mem_get_info()[0]
    if needed > free:
        raise suite.UnavailableError(
            f"its S×S matrices need ~{needed / 2**30:.0f} GiB, {free / 2**30:.0f} GiB are free"
        )
    return suite.compiled(lambda q, k, v: reference.attention(q, k, v, causal, upcast=False)[0])()


def _flash_attn(name: str, **options):
    """flash-attn's function ``name`` (flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache)
    called with these keyword arguments; UnavailableError where flash_attn does not import."""
    try:
        import flash_attn
    except (ImportError, OSError) as error:
        raise suite.UnavailableError(f"flash_attn does not import: {error}") from error
    return functools.partial(getattr(flash_attn, name), **options)


def implementations(shape: Shape, causal: bool, quick: bool = False) -> dict:
    """name -> a function building fn(q, k, v) -> out; built at setup, on the GPU. quick: without
    torch.compile, which no gate names and each of whose cases compiles afresh."""
    impls = {"ours": lambda: _ours(causal=causal), "ours-pointer": lambda: _ours(causal=causal)}
    for backend in SDPA_BACKENDS:
        if backend != "MATH" or shape.seqlen <= MATH_MAX_SEQLEN:
            impls["sdpa-" + backend.split("_")[0].lower()] = lambda b=backend: _sdpa(b, is_causal=causal)
    if not quick:
        impls["compile"] = lambda: _compiled_explicit(shape, causal)
    impls["flash-attn"] = lambda: _flash_attn("flash_attn_func", causal=causal)
    if shape.head_dim == 128 and causal:  # where issue 25's targets hold ours to the kernels of its day
        impls[f"ours-{FILED_AT}"] = lambda: functools.partial(
            revision.kernels_at(FILED_AT).flash_attention, causal=causal
        )
    return impls


def _setup(direction: str, make_fn, shape: Shape, pointer_loads=False, make_inputs=None):
    """The setup (:func:`bench.timing.setup`) of make_fn()(q, k, v) on inputs of ``shape`` (or from
    ``make_inputs(requires_grad)``: q, k, v of any layout). A call reads q, k, v forward, and out and
    dout as well backward."""
    make_inputs = make_inputs or functools.partial(make_qkv, shape, "cuda")
    read = (3 if direction == "forward" else 5) * shape.numel * DTYPE.itemsize
    tma_off = "horse.kernels.attention.launch" if pointer_loads else None
    return timing.setup(make_fn, make_inputs, direction, read, tma_off=tma_off)


def cases(quick: bool) -> list[suite.Case]:
    sizes = QUICK_SHAPES if quick else [(seqlen, head_dim) for head_dim in HEAD_DIMS for seqlen in SEQLENS]
    out = []
    for shape, causal in itertools.product([benchmark_shape(*s) for s in sizes], (False, True)):
        params = {
            "seqlen": shape.seqlen,
            "head_dim": shape.head_dim,
            "causal": causal,
            "batch": shape.batch,
            "heads": shape.heads,
        }
        out += suite.family_cases(
            "attention",
            params,
            implementations(shape, causal, quick),
            DIRECTION_MULTIPLE,
            work=functools.partial(direction_flops, shape=shape, causal=causal),
            unit="flop",
            setup=lambda name, make_fn, d, s=shape: _setup(
                d, make_fn, s, pointer_loads=name == "ours-pointer"
            ),
            check=functools.partial(check, shape, causal, "cuda"),
        )
    if quick:
        return out + decode_cases() + score_mod_cases()
    return out + window_cases() + packed_cases() + decode_cases() + score_mod_cases()


def window_cases() -> list[suite.Case]:
    out = []
    for seqlen in WINDOW_SEQLENS:
        shape = benchmark_shape(seqlen, EXTRA_HEAD_DIM)
        params = {
            "seqlen": seqlen,
            "head_dim": shape.head_dim,
            "window": WINDOW,
            "batch": shape.batch,
            "heads": shape.heads,
        }
        forward = window_flops(shape.batch, shape.heads, seqlen, shape.head_dim, WINDOW)
        impls = {
            "ours": lambda: _ours(causal=True, window_size=(WINDOW, -1)),
            "ours-causal": lambda: _ours(causal=True),
            "sdpa-efficient-mask": functools.partial(_sdpa_window, seqlen),
            "flash-attn": lambda: _flash_attn("flash_attn_func", causal=True, window_size=(WINDOW, 0)),
        }
        out += suite.family_cases(
            "attention_window",
            params,
            impls,
            DIRECTION_MULTIPLE,
            work=functools.partial(direction_flops, shape=shape, causal=True, forward=forward),
            unit="flop",
            setup=lambda name, make_fn, d, s=shape: _setup(d, make_fn, s),
            check=functools.partial(check, shape, True, "cuda", window_size=(WINDOW, -1)),
        )
    return out


def packed_cases() -> list[suite.Case]:
    heads, longest, device = MODEL_DIM // EXTRA_HEAD_DIM, max(PACKED_LENGTHS), torch.device("cuda")
    params = {
        "tokens": sum(PACKED_LENGTHS),
        "documents": len(PACKED_LENGTHS),
        "longest": longest,
        "head_dim": EXTRA_HEAD_DIM,
        "heads": heads,
    }
    forward = packed_flops(PACKED_LENGTHS, heads, EXTRA_HEAD_DIM)
    packed = Shape(1, sum(PACKED_LENGTHS), heads, EXTRA_HEAD_DIM)
    padded = Shape(len(PACKED_LENGTHS), longest, heads, EXTRA_HEAD_DIM)

    def packed_inputs(grad):
        return [t[0].detach().requires_grad_(grad) for t in make_qkv(packed, device)]

    def varlen(make_fn, name: str):  # the documents' offsets, made at setup on the GPU
        cu = offsets(PACKED_LENGTHS, device)
        lengths = {"cu_seqlens_q": cu, "cu_seqlens_k": cu, "max_seqlen_q": longest, "max_seqlen_k": longest}
        return make_fn(name, causal=True, **lengths)

    impls = {  # name -> (make_fn, input shape)
        "ours": (lambda: varlen(_ours, "flash_attention_varlen"), packed),
        "ours-padded": (lambda: _ours(causal=True), padded),
        "sdpa-flash-padded": (lambda: _sdpa("FLASH_ATTENTION", is_causal=True), padded),
        "flash-attn": (lambda: varlen(_flash_attn, "flash_attn_varlen_func"), packed),
    }

    def setup(name, impl, direction):
        make_fn, shape = impl
        return _setup(direction, make_fn, shape, make_inputs=packed_inputs if shape is packed else None)

    return suite.family_cases(
        "attention_packed",
        params,
        impls,
        DIRECTION_MULTIPLE,
        work=lambda d: direction_flops(d, packed, True, forward),
        unit="flop",
        setup=setup,
        check=functools.partial(check_packed, PACKED_LENGTHS, heads, EXTRA_HEAD_DIM, "cuda"),
    )


def decode_inputs(batch: int, cache: int, head_dim: int, device, requires_grad=False) -> list[torch.Tensor]:
    """q (batch, 1, DECODE_HEADS, head_dim) and the key and value caches (batch, cache,
    DECODE_KV_HEADS, head_dim), float16 ~ N(0, 1)."""
    shapes = [(batch, 1, DECODE_HEADS, head_dim), *[(batch, cache, DECODE_KV_HEADS, head_dim)] * 2]
    return [torch.randn(s, dtype=DTYPE, device=device, requires_grad=requires_grad) for s in shapes]


def check_decode(batch: int, cache: int, head_dim: int, device) -> tuple[dict, bool]:
    """Ours against the float64 reference on the same cache (flash_attention_with_kvcache, seqlen_q 1)."""
    from horse.kernels import reference

    torch.manual_seed(0)
    lengths = torch.full((batch,), cache, dtype=torch.int32)
    return correctness.check(
        _ours("flash_attention_with_kvcache", causal=True),
        lambda *qkv: reference.attention_kvcache(*qkv, lengths, causal=True),
        decode_inputs(batch, cache, head_dim, device),
        ["out"],
        TOLERANCE,
        floor=0.0,
        exact_dtype=torch.float64,
    )


def decode_cases() -> list[suite.Case]:
    """attention_decode: ours (split keys, the GQA group in one tile) against our prefill kernel on
    the same cache (the gate of issue 25: >= 3x at seqlen_q = 1), SDPA (GQA) and
    flash-attn's flash_attn_with_kvcache. Forward only; the cache is not appended to, so every
    call does the same work."""
    device, head_dim = torch.device("cuda"), EXTRA_HEAD_DIM
    impls = {
        "ours": lambda: _ours("flash_attention_with_kvcache", causal=True),
        "ours-prefill": lambda: _ours(causal=True),
        "sdpa": lambda: _sdpa(enable_gqa=True),  # SDPA's own backend, kv heads shared
        "flash-attn": lambda: _flash_attn("flash_attn_with_kvcache", causal=True),
    }
    out = []
    for batch, cache in DECODE_SHAPES:
        params = {
            "batch": batch,
            "cache": cache,
            "heads": DECODE_HEADS,
            "kv_heads": DECODE_KV_HEADS,
            "head_dim": head_dim,
        }
        # What a call must move: the cached keys and values it reads (q and out are tiny).
        work = 2 * batch * cache * DECODE_KV_HEADS * head_dim * DTYPE.itemsize
        inputs = functools.partial(decode_inputs, batch, cache, head_dim, device)
        out += suite.family_cases(
            "attention_decode",
            params,
            impls,
            ["forward"],
            work=lambda d, w=work: w,
            unit="byte",
            setup=lambda name, make_fn, d, i=inputs, w=work: timing.setup(make_fn, i, d, w),
            check=functools.partial(check_decode, batch, cache, head_dim, "cuda"),
        )
    return out


def _flex(modification: str, seqlen: int, device):
    """PyTorch's flex_attention, causal (a block mask: fully masked blocks skipped), with the
    modification on our layout (transposed views): "softcap", SOFTCAP · tanh(s / SOFTCAP) as its
    score_mod on the scaled scores; "sinks", fn(q, k, v, sinks) taking out · σ(lse - sink) from its
    natural-log lse, what a sink's exp(sink) in the denominator leaves of each row; "none", plain."""
    from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

    block_mask = create_block_mask(lambda b, h, q, kv: q >= kv, None, None, seqlen, seqlen, device=device)

    def softcap(score, batch, head, q_idx, kv_idx):
        return SOFTCAP * torch.tanh(score / SOFTCAP)

    def plain(q, k, v, score_mod=None):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seqlen, head_dim) views
        return flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask).transpose(1, 2)

    def with_sinks(q, k, v, sinks):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        out, aux = flex_attention(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
        # exp(lse) / (exp(lse) + exp(sink)), (batch, heads, seqlen); one fused pass when compiled
        kept = torch.sigmoid(aux.lse - sinks[:, None])
        return (out.float() * kept[..., None]).to(out.dtype).transpose(1, 2)

    modified = {"none": plain, "softcap": functools.partial(plain, score_mod=softcap), "sinks": with_sinks}
    return modified[modification]


def score_mod_cases() -> list[suite.Case]:
    """attention_score_mods: ours with the softcap, the sinks or neither against flex_attention compiled
    with the same (SCORE_MODS), and, with neither, against SDPA; checked against the reference with the
    same modification."""
    device, out = torch.device("cuda"), []
    for modification, head_dim, directions in SCORE_MODS:
        shape = benchmark_shape(SCORE_MOD_SEQLEN, head_dim)
        sinks = modification == "sinks"
        params = {
            "seqlen": shape.seqlen,
            "head_dim": head_dim,
            "causal": True,
            "batch": shape.batch,
            "heads": shape.heads,
            "softcap": SOFTCAP if modification == "softcap" else 0.0,
            "sinks": sinks,
        }
        options = {"causal": True, "softcap": params["softcap"]}
        impls = {
            "ours": lambda o=options: functools.partial(_with_sinks, _ours(**o)),
            "flex": lambda m=modification, s=shape: suite.compiled(_flex(m, s.seqlen, device))(),
        }
        if modification == "none":  # SDPA has no softcap or sinks; at head dim 512 no flash backend
            impls["sdpa"] = lambda: _sdpa(is_causal=True)

        def inputs(requires_grad, s=shape, with_sinks=sinks):
            qkv = make_qkv(s, device, requires_grad)
            return [*qkv, make_sinks(s, device, requires_grad)] if with_sinks else qkv

        out += suite.family_cases(
            "attention_score_mods",
            params,
            impls,
            directions,
            work=functools.partial(direction_flops, shape=shape, causal=True),
            unit="flop",
            setup=lambda name, make_fn, d, s=shape, i=inputs: _setup(d, make_fn, s, make_inputs=i),
            check=functools.partial(check, shape, True, "cuda", softcap=params["softcap"], sinks=sinks),
        )
    return out


def interpreter_checks() -> list[tuple[str, dict, bool]]:
    """The correctness checks on tiny shapes, on the CPU (in Triton's interpreter when it is on)."""
    checks = []
    for s, causal in itertools.product(INTERPRETER_SHAPES, (False, True)):
        label = f"attention seqlen={s.seqlen} head_dim={s.head_dim} {'causal' if causal else 'full'}"
        checks.append((label, *check(s, causal, "cpu")))
    (tiny, small), lengths = INTERPRETER_SHAPES, (40, 1, 77, 0, 19)
    window = check(small, True, "cpu", window_size=(20, -1))
    return checks + [
        (f"attention_window seqlen={small.seqlen} window=20", *window),
        (f"attention_packed documents={lengths}", *check_packed(lengths, 2, 64, "cpu")),
        ("attention_decode batch=2 cache=70", *check_decode(2, 70, 64, "cpu")),
        (f"attention_score_mods softcap={SOFTCAP} head_dim=64", *check(tiny, True, "cpu", softcap=SOFTCAP)),
        (f"attention_score_mods sinks seqlen={small.seqlen}", *check(small, True, "cpu", sinks=True)),
    ]


if __name__ == "__main__":
    from bench.__main__ import main

    sys.exit(main(["--only", "attention", *sys.argv[1:]]))
