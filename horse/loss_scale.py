"""Dynamic fp16 loss scaling that every rank agrees on, with a floor, hysteresis and a give-up; and,
in every precision, the skip of a step whose gradients are not finite.

The loss is multiplied by the scale before the backward, so that small gradients do not vanish in
float16; ``unscale_`` divides them back. A step whose gradients hold an inf or NaN on any rank of
the world is skipped by every rank (weights and AdamW's moments untouched; the run's step and
learning-rate schedule go on). In fp16 the unscale finds them; in bf16 and fp32, which scale
nothing, :meth:`LossScaler.check_norm` finds them in the gradient norm (inf or NaN on any rank).
Without the skip a NaN gradient with a finite loss went into AdamW, and a checkpoint of the
poisoned weights passed its checksums. The fp16 scale:

* halves when ``hysteresis`` steps in a row were skipped, and at every further skip in that row
  (one overflow, common early in training, costs a step but not half the scale);
* never goes below ``min_scale`` (1 by default: below it the scale would shrink the gradients,
  and 144 halvings from 2^16 overflow float32, which crashed runs before this floor);
* doubles after ``growth_interval`` clean steps in a row.

``check(step, loss)`` after each optimizer step raises a FloatingPointError once
``max_skipped_steps`` steps in a row were skipped, in every precision: the gradients are not
finite at any scale, and skipping on would only burn GPU time. Megatron's DynamicGradScaler works
the same way; torch.amp.GradScaler has none of the three, skips nothing in bf16 and agrees on its
inf check across ranks only for DTensor gradients.
"""

import math

import torch

from horse.parallel.collectives import found_nonfinite, local
from horse.parallel.mesh import Parallel


class LossScaler:
    """fp16 loss scaling with GradScaler's interface: scale(loss), unscale_(optimizer),
    step(optimizer), update(), state_dict(), load_state_dict(). Disabled (bf16, fp32), it scales
    by 1, and skips a step whose gradient norm (:meth:`check_norm`) is not finite on some rank."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_interval: int = 1000,
        enabled: bool = True,
        parallel: Parallel | None = None,
        *,
        min_scale: float = 1.0,
        hysteresis: int = 2,
        max_skipped_steps: int = 100,
    ):
        if not 0 < min_scale <= init_scale:
            raise ValueError(f"min_scale must be positive and at most init_scale {init_scale}: {min_scale}")
        if hysteresis < 1 or max_skipped_steps < 1 or growth_interval < 1:
            raise ValueError("growth_interval, hysteresis and max_skipped_steps must be at least 1")
        self.scale_factor, self.growth_interval, self.enabled = init_scale, growth_interval, enabled
        self.min_scale, self.hysteresis, self.max_skipped_steps = min_scale, hysteresis, max_skipped_steps
        self.parallel = parallel or Parallel()
        self.clean_steps = 0  # in a row
        self.skipped_steps = 0  # in a row
        self.last_finite_loss: float | None = None
        # This step's, agreed by every rank; set by unscale_ (fp16) or check_norm (bf16, fp32).
        self.found_inf: torch.Tensor | None = None
        self.skipped = False  # whether step() skipped; read on the host once, before the optimizer runs

    @classmethod
    def from_config(cls, cfg, enabled: bool, parallel: Parallel | None = None) -> "LossScaler":
        """The scaler a horse.train.TrainConfig asks for: --loss-scale, --loss-scale-window,
        --min-loss-scale, --loss-scale-hysteresis, --max-skipped-steps."""
        return cls(
            cfg.loss_scale,
            cfg.loss_scale_window,
            enabled,
            parallel,
            min_scale=cfg.min_loss_scale,
            hysteresis=cfg.loss_scale_hysteresis,
            max_skipped_steps=cfg.max_skipped_steps,
        )

    def is_enabled(self) -> bool:
        return self.enabled

    def get_scale(self) -> float:
        return self.scale_factor if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_factor if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients (float32 master weights, one device) by the scale in
        place, and find whether any rank's hold an inf or NaN: one all-reduce (MAX) over the world.
        Under FSDP each rank checks the rows of the gradients it holds (their local shards)."""
        if not self.enabled:
            return
        grads = [
            local(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None
        ]
        found_inf = torch.zeros(1, device=grads[0].device)
        inv_scale = torch.full((1,), 1.0 / self.scale_factor, device=grads[0].device)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        self.found_inf = found_nonfinite(found_inf, self.parallel)

    def check_norm(self, grad_norm: torch.Tensor) -> None:
        """bf16 and fp32: find whether the gradient norm (a scalar tensor; ``horse.parallel.
        global_grad_norm``) is inf or NaN on any rank: one all-reduce (MAX) over the world, since a
        norm need not be the same everywhere (a tp-replicated gradient poisoned on one tp rank).
        fp16's unscale_ has checked every gradient already."""
        if not self.enabled:
            self.found_inf = found_nonfinite(~torch.isfinite(grad_norm), self.parallel)

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), unless a rank found an inf or NaN (fp16: unscales first if not yet
        done; bf16 and fp32: steps unchecked unless check_norm ran)."""
        if self.enabled and self.found_inf is None:
            self.unscale_(optimizer)
        self.skipped = self.found_inf is not None and bool(self.found_inf.item())
        if not self.skipped:
            optimizer.step()

    def update(self) -> None:
        """Count the steps skipped in a row. fp16: after a skipped step, halve the scale from the
        hysteresis-th skip in a row on, down to min_scale; after growth_interval clean steps in a
        row, double it."""
        self.found_inf = None
        if self.skipped:
            self.clean_steps = 0
            self.skipped_steps += 1
            if self.enabled and self.skipped_steps >= self.hysteresis:
                self.scale_factor = max(self.min_scale, self.scale_factor / 2)
        else:
            self.skipped_steps = 0
            self.clean_steps += 1
            if self.enabled and self.clean_steps == self.growth_interval:
                self.scale_factor *= 2
                self.clean_steps = 0

    def check(self, step: int, loss: float) -> None:
        """After optimizer step ``step`` (its loss, on the host): raise a FloatingPointError once
        max_skipped_steps steps in a row were skipped."""
        if math.isfinite(loss):
            self.last_finite_loss = loss
        if self.skipped_steps < self.max_skipped_steps:
            return
        last = "none" if self.last_finite_loss is None else f"{self.last_finite_loss:.4f}"
        skipped = (
            f"the last {self.skipped_steps} steps were all skipped for inf/NaN gradients "
            f"(--max-skipped-steps {self.max_skipped_steps})"
        )
        if self.enabled:
            raise FloatingPointError(
                f"fp16 loss scaling gave up at step {step}: {skipped}, at loss scale {self.scale_factor:g} "
                f"(--min-loss-scale {self.min_scale:g}); last finite loss {last}. The gradients overflow "
                "at every scale: lower --lr, or train in bf16"
            )
        raise FloatingPointError(
            f"training gave up at step {step}: {skipped}, without loss scaling (bf16/fp32); last finite "
            f"loss {last}. The gradients are not finite with a finite loss: lower --lr or --grad-clip, "
            "or look for a bad batch or a broken kernel"
        )

    def state_dict(self) -> dict:
        """The steps skipped in a row (every precision), and fp16's scale and clean steps."""
        if not self.enabled:
            return {"skipped_steps": self.skipped_steps}
        return {
            "scale": self.scale_factor,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        """A state of any precision's scaler: a scale that a bf16 or fp32 run saved none of stays."""
        if "scale" in state:
            self.scale_factor = max(self.min_scale, state["scale"])
            self.clean_steps = state.get("clean_steps", 0)
        self.skipped_steps = state.get("skipped_steps", 0)
