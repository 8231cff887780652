"""Peak host memory (RSS) a rank takes to build its part of a fresh GPT at a layout: 4 CPU processes
under gloo, each resetting its peak after the imports and process groups, then calling the
trainer's ``make_model``; printed as each rank's peak above that baseline, and as a fraction of the
whole float32 model's bytes (issue 46's target: at most 0.5). With --init-from, the model of a
Hugging Face folder, its weights read as the trainer's --init-from reads them.

    PYTHONPATH=. python -m bench.start_memory --preset gpt2-124m --tp 2 --dp-shard 2
    python -c "import transformers as t; t.GPT2LMHeadModel(t.GPT2Config()).save_pretrained('/tmp/gpt2')"
    PYTHONPATH=. python -m bench.start_memory --init-from /tmp/gpt2 --tp 2 --dp-shard 2
"""

import argparse
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from horse import hf, train
from horse.model import GPTConfig, num_params, preset
from horse.parallel import init_from_env

WORLD = 4


def _kib(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM) in KiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _rank(rank: int, port: int, args: argparse.Namespace, peaks) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.update(LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    parallel = init_from_env(tp=args.tp, device_type="cpu", dp_shard=args.dp_shard)
    config = _config(args)
    Path("/proc/self/clear_refs").write_text("5")  # the peak (VmHWM) restarts from the current RSS
    baseline = _kib("VmRSS")
    cfg = train.TrainConfig(init_from=args.init_from)
    train.make_model(cfg, config, "reference", parallel, "cpu", pretrained=bool(args.init_from))
    peaks[rank] = (_kib("VmHWM") - baseline) * 1024
    dist.destroy_process_group()


def _config(args: argparse.Namespace) -> GPTConfig:
    """The model measured: --init-from's, or the preset."""
    return hf.pretrained_config(args.init_from) if args.init_from else preset(args.preset)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2-124m")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--dp-shard", type=int, default=4)
    parser.add_argument("--init-from", default="", help="a Hugging Face folder: start from its weights")
    parser.add_argument("--port", type=int, default=29517)
    args = parser.parse_args()
    peaks = mp.Manager().dict()
    mp.spawn(_rank, args=(args.port, args, peaks), nprocs=WORLD)
    whole = num_params(_config(args)) * 4
    model = args.init_from or args.preset
    print(f"{model} (float32 {whole / 2**30:.2f} GiB), tp {args.tp} x dp_shard {args.dp_shard}:")
    for rank in range(WORLD):
        peak = peaks[rank]
        print(
            f"  rank {rank}: peak +{peak / 2**30:.3f} GiB above baseline, {peak / whole:.2f}x the whole model"
        )


if __name__ == "__main__":
    main()
