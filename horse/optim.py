"""The optimizer of ``horse.train``: AdamW with weight decay on the matrices, the learning-rate
schedule, and one optimizer step through the loss scaler (``horse.loss_scale``): unscale (fp16),
the whole model's gradient norm over the tp ranks, clipping, the step or, when a rank's gradients
are not finite (any precision), its skip."""

import math

import torch
from torch import nn

from horse.loss_scale import LossScaler
from horse.parallel.mesh import Parallel
from horse.parallel.shard import global_grad_norm


def make_optimizer(model: nn.Module, cfg, device: str) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices only; PyTorch's fused kernel on a GPU. cfg: a
    ``horse.train.TrainConfig`` (lr, weight_decay, beta1, beta2)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay = [p for p in model.parameters() if p.dim() >= 2 and id(p) not in embeddings]
    no_decay = [p for p in model.parameters() if p.dim() < 2 or id(p) in embeddings]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device == "cuda")


def lr_at(step: int, max_steps: int, cfg) -> float:
    """Learning rate of step (0-based): linear warm-up from 0, then decay to min_lr_ratio·lr at max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - 1 - cfg.warmup_steps))
    remaining = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * remaining)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scaler: LossScaler,
    grad_clip: float,
    parallel: Parallel | None = None,
) -> tuple[float, bool]:
    """Unscale, clip and step; returns (gradient norm, skipped). The norm is the whole model's, each
    parameter counted once over the tp ranks and its FSDP shards. A step whose gradients hold an inf
    or NaN (on any rank, in any shard; in bf16 and fp32: whose norm is inf or NaN on any rank) is
    skipped by every rank (weights and AdamW's moments untouched)."""
    parallel = parallel or Parallel()
    scaler.unscale_(optimizer)
    params = [(name, p) for name, p in model.named_parameters() if p.grad is not None]
    grad_norm = global_grad_norm(params, parallel)
    scaler.check_norm(grad_norm)
    if grad_clip > 0:  # an inf norm zeroes (NaNs) the gradients of a step that is skipped anyway
        torch.nn.utils.clip_grads_with_norm_([p for _, p in params], grad_clip, grad_norm)
    # Read on the host before the optimizer is launched, next to the scaler's inf check, so that
    # nothing waits for AdamW to finish before the next forward is queued.
    grad_norm = grad_norm.item()
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm, scaler.skipped
