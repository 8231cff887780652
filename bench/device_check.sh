#!/usr/bin/env bash
# The one-command device check, for the GPU machine (torch 2.11, triton 3.6, no network): the
# GPU-marked tests, the bench suite with --gate on its quick (gated) cases, and a short training
# throughput run of gpt2-124m in fp16. The whole check has DEVICE_CHECK_SECONDS (default 400) of
# wall time, compilation and warm-up included, so that it finishes within 7 minutes on one H200 and
# a second run fits in a 15-minute device slot: each step runs to a deadline (tests by 22 % of the
# budget, the suite by 67 %, bench.train by the end; a step that finishes early leaves its time to
# the next). DEVICE_CHECK_GRACE seconds (default 10) before its deadline a step gets SIGINT, and is
# killed at the deadline: pytest, the bench suite and bench.train then stop where they are and
# still report (and write) what they measured (rc 124 in the summary). Each step prints where its
# time went (pytest's --durations; bench.train's warm-up and timing per backend). Writes
# everything under $1, or $OUT, or bench/results/latest, and prints a summary table last.
#
#   device tool:  run(command="bash bench/device_check.sh", carry=[".git"], timeout_s=480)
#   (.git: the attention baseline of issue 25's kernels, bench.revision; without it, not measured)
#
# Five files come back (the device tool returns at most 8): device_check.log (every step's
# output), summary.txt, results.json (the bench suite), train.json (bench.train) and plots.tgz.
# Killed at any moment, the folder holds at most these: the suite writes to a scratch folder
# outside it, moved in whole at the end.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-bench/results/latest}}"
budget="${DEVICE_CHECK_SECONDS:-400}"
grace="${DEVICE_CHECK_GRACE:-10}"
began=$(date +%s)
mkdir -p "$out"
scratch=$(mktemp -d)
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
: > "$out/summary.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

pack() {  # the suite's results and plots into $out, whatever it got to write
  [ -f "$scratch/bench/results.json" ] && mv "$scratch/bench/results.json" "$out/results.json"
  [ -d "$scratch/bench" ] && tar -czf "$out/plots.tgz" -C "$scratch/bench" .
  rm -rf "$scratch"
}
trap 'pack; exit 130' INT TERM

seconds_until() {  # seconds left until FRACTION of the budget, counted from the check's start
  echo $(( began + budget * $1 / 100 - $(date +%s) ))
}

step() {  # step NAME SECONDS COMMAND...: run until SIGINT at SECONDS - grace, SIGKILL at SECONDS
  local name=$1 limit=$2 start rc
  shift 2
  start=$(date +%s)
  echo "=== $name (${limit}s): $*" >> "$out/device_check.log"
  if (( limit - grace < 1 )); then
    rc=124  # no time left
  else
    timeout -s INT -k "$grace" "$(( limit - grace ))" "$@" >> "$out/device_check.log" 2>&1
    rc=$?
  fi
  printf '%-6s rc=%-4s %4ss of %4ss  %s\n' "$name" "$rc" "$(( $(date +%s) - start ))" "$limit" "$*" \
    >> "$out/summary.txt"
  tail -n 25 "$out/device_check.log"
}

# Each GPU test compiles kernels of its own: with pytest-xdist (on the GPU machine) 12 processes
# compile at once.
workers=()
python3 -c "import xdist" 2>/dev/null && workers=(-n 12)
step tests "$(seconds_until 22)" python3 -m pytest -m gpu -q -p no:cacheprovider --durations=10 \
  ${workers[@]+"${workers[@]}"} tests
# The training step is timed by bench.train below, with its own budget, not twice. hf (issue 35): a
# transformers training step of a 1.2 B LLaMA and of GPT-2 124M, ours and sdpa (Liger where installed),
# about 60-80 s estimated (not yet measured): model builds and 105 steps of ~0.1 s / ~0.04 s each.
step bench "$(seconds_until 67)" python3 -m bench --quick --gate --only norms attention mlp hf \
  --out "$scratch/bench" --durations=15
# At most 60 s of timed steps shared by the two backends; bench.train's own deadline (its warm-up
# and compilation included) ends its timing before this step's SIGINT would.
limit=$(seconds_until 100)
step train "$limit" python3 -m bench.train --preset gpt2-124m --precision fp16 --batch-size 16 \
  --seq-len 1024 --backends triton reference-compile --steps 1000 --seconds 60 \
  --deadline "$(( limit - 2 * grace > 1 ? limit - 2 * grace : 1 ))" --gate --out "$out"

pack
trap - INT TERM
echo
echo "=== summary: $(( $(date +%s) - began )) s of a ${budget} s budget (rc 124: the step ran out of time)"
cat "$out/summary.txt"
grep -E "^  (PASS|FAIL)" "$out/device_check.log" | sort | uniq -c | sort -rn | head -20
grep -E "^train_step .* tokens/s" "$out/device_check.log"
