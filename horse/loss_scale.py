"""Dynamic fp16 loss scaling that every rank agrees on, with a floor, hysteresis and a give-up.

The loss is multiplied by the scale before the backward, so that small gradients do not vanish in
float16; ``unscale_`` divides them back. A step whose gradients hold an inf or NaN on any rank of
the world is skipped by every rank (weights and AdamW's moments untouched). The scale:

* halves when ``hysteresis`` steps in a row were skipped, and at every further skip in that row
  (one overflow, common early in training, costs a step but not half the scale);
* never goes below ``min_scale`` (1 by default: below it the scale would shrink the gradients,
  and 144 halvings from 2^16 overflow float32, which crashed runs before this floor);
* doubles after ``growth_interval`` clean steps in a row.

``check(step, loss)`` after each optimizer step raises a FloatingPointError once
``max_skipped_steps`` steps in a row were skipped: the gradients overflow at every scale, and
skipping on would only burn GPU time. Megatron's DynamicGradScaler works the same way;
torch.amp.GradScaler has none of the three and agrees on its inf check across ranks only for
DTensor gradients.
"""

import math

import torch

from horse.parallel.collectives import found_nonfinite, local
from horse.parallel.mesh import Parallel


class LossScaler:
    """fp16 loss scaling with GradScaler's interface: scale(loss), unscale_(optimizer),
    step(optimizer), update(), state_dict(), load_state_dict(). Disabled (bf16, fp32), it scales
    by 1 and checks nothing."""

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
        self.found_inf: torch.Tensor | None = None  # this step's, agreed by every rank; set by unscale_
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

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """optimizer.step(), unless a rank found an inf or NaN (unscales first if not yet done)."""
        if self.enabled and self.found_inf is None:
            self.unscale_(optimizer)
        self.skipped = self.enabled and bool(self.found_inf.item())
        if not self.skipped:
            optimizer.step()

    def update(self) -> None:
        """After a skipped step: halve the scale from the hysteresis-th skip in a row on, down to
        min_scale. After growth_interval clean steps in a row: double it."""
        if not self.enabled:
            return
        self.found_inf = None
        if self.skipped:
            self.clean_steps = 0
            self.skipped_steps += 1
            if self.skipped_steps >= self.hysteresis:
                self.scale_factor = max(self.min_scale, self.scale_factor / 2)
        else:
            self.skipped_steps = 0
            self.clean_steps += 1
            if self.clean_steps == self.growth_interval:
                self.scale_factor *= 2
                self.clean_steps = 0

    def check(self, step: int, loss: float) -> None:
        """After optimizer step ``step`` (its loss, on the host): raise a FloatingPointError once
        max_skipped_steps steps in a row were skipped."""
        if math.isfinite(loss):
            self.last_finite_loss = loss
        if self.enabled and self.skipped_steps >= self.max_skipped_steps:
            last = "none" if self.last_finite_loss is None else f"{self.last_finite_loss:.4f}"
            raise FloatingPointError(
                f"fp16 loss scaling gave up at step {step}: the last {self.skipped_steps} steps were all "
                f"skipped for inf/NaN gradients (--max-skipped-steps {self.max_skipped_steps}), at loss "
                f"scale {self.scale_factor:g} (--min-loss-scale {self.min_scale:g}); last finite loss {last}."
                " The gradients overflow at every scale: lower --lr, or train in bf16"
            )

    def state_dict(self) -> dict:
        if not self.enabled:
            return {}
        return {
            "scale": self.scale_factor,
            "clean_steps": self.clean_steps,
            "skipped_steps": self.skipped_steps,
        }

    def load_state_dict(self, state: dict) -> None:
        self.scale_factor = max(self.min_scale, state["scale"])
        # "_growth_tracker": torch.amp.GradScaler's name for it, in checkpoints written before this class.
        self.clean_steps = state.get("clean_steps", state.get("_growth_tracker", 0))
        self.skipped_steps = state.get("skipped_steps", 0)
