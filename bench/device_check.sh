#!/usr/bin/env bash
# The one-command device check, for the GPU machine (torch 2.11, triton 3.6, no network): the
# GPU-marked tests, the bench suite with --gate on its quick shapes, and a short training
# throughput run of gpt2-124m in fp16, each under its own time limit (8 minutes in all). Writes
# everything under $1, or $OUT, or bench/results/latest, and prints a summary table last.
#
#   device tool:  run(command="bash bench/device_check.sh", timeout_s=540)
#
# Five files come back (the device tool returns at most 8): device_check.log (every step's
# output), summary.txt, results.json (the bench suite) and plots.tgz.
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
  timeout "$limit" "$@" >> "$out/device_check.log" 2>&1
  rc=$?
  printf '%-10s rc=%-4s %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$*" >> "$out/summary.txt"
  tail -n 25 "$out/device_check.log"
}

step tests 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests
step bench 210 python3 -m bench --quick --gate --out "$out/bench"
# Until bench.train lands: the trainer itself, gpt2-124m in fp16 for a bounded number of steps.
step train 120 python3 horse/train.py --preset gpt2-124m --precision fp16 --batch-size 16 --seq-len 1024 \
  --max-steps 60 --out-dir "$out/train"

mv "$out/bench/results.json" "$out/results.json" 2>/dev/null
tar -czf "$out/plots.tgz" -C "$out/bench" . 2>/dev/null && rm -rf "$out/bench" "$out/train"
echo
echo "=== summary (rc 124: the step ran past its limit)"
cat "$out/summary.txt"
grep -E "^  (PASS|FAIL)" "$out/device_check.log" | sort | uniq -c | sort -rn | head -20
grep -E "tokens/s" "$out/device_check.log" | tail -3
