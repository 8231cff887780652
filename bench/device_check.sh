#!/usr/bin/env bash
# The one-command device check, for the GPU machine (torch 2.11, triton 3.6, no network): the
# GPU-marked tests, the bench suite with --gate on its quick shapes, and a short training
# throughput run of gpt2-124m in fp16, each under its own time limit (8 minutes in all, the grace
# after each limit included). At its limit a step gets SIGINT: pytest, the bench suite and
# bench.train then stop where they are and still report (and write) what they measured. Writes
# everything under $1, or $OUT, or bench/results/latest, and prints a summary table last.
#
#   device tool:  run(command="bash bench/device_check.sh", timeout_s=540)
#
# Five files come back (the device tool returns at most 8): device_check.log (every step's
# output), summary.txt, results.json (the bench suite), train.json (bench.train) and plots.tgz.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results/latest}}"
mkdir -p "$out/bench"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
: > "$out/summary.txt"

step() {  # step NAME SECONDS COMMAND...: run under a time limit, log it, note rc and seconds
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name: $*" >> "$out/device_check.log"
  timeout -s INT -k 10 "$limit" "$@" >> "$out/device_check.log" 2>&1  # then 10 s to report
  rc=$?
  printf '%-10s rc=%-4s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$*" >> "$out/summary.txt"
  tail -n 25 "$out/device_check.log"
}

# Each GPU test compiles kernels of its own: with pytest-xdist (on the GPU machine) 12 processes
# compile at once.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 12)
step tests 110 python3 -m pytest -m gpu -q -p no:cacheprovider ${workers[@]+"${workers[@]}"} tests
# The training step is timed by bench.train below, with its own budget, not twice.
step bench 200 python3 -m bench --quick --gate --only norms attention mlp --out "$out/bench"
# 60 s of timed steps shared by the two backends, after their warm-up (Triton and torch.compile
# compile there); the rest of the limit is for that compilation.
step train 140 python3 -m bench.train --preset gpt2-124m --precision fp16 --batch-size 16 --seq-len 1024 \
  --backends triton reference-compile --steps 1000 --seconds 60 --gate --out "$out"

mv "$out/bench/results.json" "$out/results.json" 2>/dev/null
tar -czf "$out/plots.tgz" -C "$out/bench" . 2>/dev/null && rm -rf "$out/bench"
echo
echo "=== summary (rc 124: the step ran past its limit)"
cat "$out/summary.txt"
grep -E "^  (PASS|FAIL)" "$out/device_check.log" | sort | uniq -c | sort -rn | head -20
grep -E "^train_step .* tokens/s" "$out/device_check.log"
