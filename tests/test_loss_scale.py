"""horse.loss_scale: the fp16 loss scale's floor and hysteresis, and the clear error after too many
skipped steps in a row (which once crashed with a float overflow), in the scaler and in a run."""

import pytest
import torch

from horse import train
from horse.loss_scale import LossScaler
from horse.train import TrainConfig

SMALL = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 16}


def scales_after(scaler: LossScaler, skips: str) -> list[float]:
    """The scale after each step of ``skips``: "x" a skipped step, "." a clean one."""
    scales = []
    for mark in skips:
        scaler.skipped = mark == "x"
        scaler.update()
        scales.append(scaler.get_scale())
    return scales


def test_the_scale_halves_from_the_hysteresis_th_skip_in_a_row_down_to_its_floor():
    scaler = LossScaler(16.0, growth_interval=3, min_scale=2.0, hysteresis=2)
    assert scales_after(scaler, "x.x.") == [16.0] * 4  # lone overflows cost a step each, not the scale
    assert scales_after(scaler, "xxxxx") == [16.0, 8.0, 4.0, 2.0, 2.0]  # then every skip, to the floor
    assert scales_after(scaler, "...x..") == [2.0, 2.0, 4.0, 4.0, 4.0, 4.0]
    assert scaler.state_dict() == {"scale": 4.0, "clean_steps": 2, "skipped_steps": 0}
    assert scales_after(LossScaler(16.0, hysteresis=1), "xx") == [8.0, 4.0]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="min_scale"):
        LossScaler(1.0, min_scale=2.0)
    with pytest.raises(ValueError, match="--min-loss-scale 4.0 exceeds --loss-scale 2.0"):
        TrainConfig(loss_scale=2.0, min_loss_scale=4.0)
    for name in ("loss_scale_hysteresis", "max_skipped_steps"):
        with pytest.raises(ValueError, match=f"--{name.replace('_', '-')} must be at least 1"):
            TrainConfig(**{name: 0})


def test_the_defaults_are_the_flags_defaults_in_the_trainer_and_the_benches():
    scaler = LossScaler.from_config(TrainConfig(), enabled=True)
    assert (scaler.get_scale(), scaler.min_scale, scaler.hysteresis, scaler.max_skipped_steps) == (
        2.0**16, 1.0, 2, 100)  # fmt: skip
    default = LossScaler()
    assert (default.min_scale, default.hysteresis, default.max_skipped_steps) == (1.0, 2, 100)


def every_gradient_overflows(monkeypatch):
    """Every fp16 step finds an inf gradient, as a run whose gradients overflow at any scale."""
    check_and_unscale = torch._amp_foreach_non_finite_check_and_unscale_

    def overflowing(grads, found_inf, inv_scale):
        check_and_unscale(grads, found_inf, inv_scale)
        found_inf.fill_(1.0)

    monkeypatch.setattr(torch, "_amp_foreach_non_finite_check_and_unscale_", overflowing)


def test_a_run_that_skips_every_step_stops_with_a_clear_error(monkeypatch, tmp_path):
    # Before the floor, the 144th halving from 2^16 made 1 / scale overflow float32 and the run
    # crashed with "value cannot be converted to type float without overflow".
    every_gradient_overflows(monkeypatch)
    cfg = TrainConfig(preset="tiny", batch_size=2, max_steps=150, warmup_steps=1, eval_interval=1000,
                      eval_tokens=128, sample_tokens=0, device="cpu", precision="fp16",
                      out_dir=str(tmp_path / "run"))  # fmt: skip
    with pytest.raises(FloatingPointError) as error:
        train.train(cfg, SMALL)
    message = str(error.value)
    assert "gave up at step 100: the last 100 steps were all skipped" in message
    assert "at loss scale 1 (--min-loss-scale 1)" in message and "last finite loss 5.5" in message


def test_a_non_finite_fp16_loss_stops_the_run_as_in_the_other_precisions(monkeypatch, tmp_path):
    def nan_loss(*args, **kwargs):
        return torch.tensor(float("nan")), torch.tensor(0.0), 0.0, True  # loss, aux loss, grad norm, skipped

    monkeypatch.setattr(train, "train_step", nan_loss)
    for precision in ("fp32", "fp16"):
        cfg = TrainConfig(preset="tiny", batch_size=2, max_steps=3, eval_interval=1000, sample_tokens=0,
                          device="cpu", precision=precision, out_dir=str(tmp_path / precision))  # fmt: skip
        with pytest.raises(FloatingPointError, match="loss is nan at step 1"):
            train.train(cfg, SMALL)
