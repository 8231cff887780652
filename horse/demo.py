"""The main job until the trainer lands: the fused norms against torch's own, forward and backward.

    python -m horse.demo [--rows 512] [--hidden 1024]

Builds FusedLayerNorm and FusedRMSNorm from the state dicts of randomly initialised torch modules,
runs both on the same input, forward and backward (also the fused residual path), and prints the
largest difference from the float32 reference for each. On a GPU the Triton kernels run natively
in float16; without one they run in Triton's interpreter on the CPU (slow, but the same kernels).
Exits 1 if any result is outside the dtype's tolerance.
"""

import argparse
import os
import sys
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported, by kernels below

from torch import nn  # noqa: E402

from horse.layers import FusedLayerNorm, FusedRMSNorm  # noqa: E402

TOLERANCE = 2e-2  # float16: about 16 units of its last place on values of order 1


def _max_errors(ref_module: nn.Module, fused: nn.Module, x: torch.Tensor, residual: torch.Tensor | None):
    """Largest |fused - reference| over y and every gradient; the reference runs in float32."""
    ref32 = ref_module.float()
    xs = [x.detach().clone().requires_grad_(), x.detach().float().requires_grad_()]
    rs = [None, None]
    if residual is not None:
        rs = [residual.detach().clone().requires_grad_(), residual.detach().float().requires_grad_()]
    dy = torch.randn_like(x)
    if residual is None:
        y = fused(xs[0])
        y_ref = ref32(xs[1])
    else:
        y, _ = fused.forward_residual(xs[0], rs[0])
        h_ref = xs[1] + rs[1]
        h_ref = h_ref + (h_ref.to(x.dtype).float() - h_ref).detach()  # round as the kernel does
        y_ref = ref32(h_ref)
    y.backward(dy)
    y_ref.backward(dy.float())
    pairs = [("y", y, y_ref), ("dx", xs[0].grad, xs[1].grad)]
    pairs.append(("dweight", fused.weight.grad, ref32.weight.grad))
    if getattr(fused, "bias", None) is not None:
        pairs.append(("dbias", fused.bias.grad, ref32.bias.grad))
    return {name: (a.float() - b).abs().max().item() / max(1.0, b.abs().max().item()) for name, a, b in pairs}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float16
    where = torch.cuda.get_device_name() if device == "cuda" else "CPU, Triton interpreter"
    print(f"fused norms on {where}, {dtype}, input ({args.rows}, {args.hidden})")
    torch.manual_seed(0)
    failed = False
    for name, make_ref, fused_cls in (
        ("LayerNorm", lambda: nn.LayerNorm(args.hidden), FusedLayerNorm),
        ("RMSNorm", lambda: nn.RMSNorm(args.hidden), FusedRMSNorm),
    ):
        for residual in (False, True):
            ref = make_ref()
            with torch.no_grad():  # away from the ones/zeros init, so the weights matter
                for p in ref.parameters():
                    p.add_(torch.randn_like(p) * 0.1)
            fused = fused_cls(args.hidden, device=device, dtype=dtype)
            fused.load_state_dict(ref.state_dict())
            ref.to(device)
            x = torch.randn(args.rows, args.hidden, device=device, dtype=dtype)
            r = torch.randn_like(x) if residual else None
            start = time.perf_counter()
            errors = _max_errors(ref, fused, x, r)
            seconds = time.perf_counter() - start
            ok = all(e <= TOLERANCE for e in errors.values())
            failed |= not ok
            label = f"{name}{' + residual' if residual else ''}"
            detail = "  ".join(f"{k} {v:.1e}" for k, v in errors.items())
            print(f"  {label:<20} {'ok  ' if ok else 'FAIL'}  max rel. error  {detail}  ({seconds:.2f} s)")
    print("all match the float32 reference" if not failed else "MISMATCH against the float32 reference")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
