#!/usr/bin/env bash
# Everything the GPU machine runs, in one call:  bash bench/device.sh  (writes under $OUT)
# Steps: all (tests, demo, bench) | tests | demo | moshi | chunk | bench | suite | cold | sessions |
# lanes | moshi-lanes | gc-probe | reliability | mutation | mutation-cpu | timeline | warm,
# or par "<steps for GPU 0>" "<steps for GPU 1>" ... (each under PAR_LIMIT seconds, default 540).
# BENCH_ARGS passes arguments to the step's script; '+' separates them (BENCH_ARGS=--ns=1,2+--rounds=4).
# Needs the model wheels in .whl/, carried along:
#   pip wheel --no-deps minicpmo==0.1.2 -w .whl && pip download --no-deps moshi==0.2.13 -d .whl
set -uo pipefail
export PYTHONUNBUFFERED=1
BENCH_ARGS=${BENCH_ARGS:-}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [[ ! -e /tmp/site/.cadence-ready ]]; then   # once per machine (par runs its steps after it)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || python3 -m pip install --no-deps --no-build-isolation -e .
  touch /tmp/site/.cadence-ready
fi
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
{
  echo "commit: ${CADENCE_COMMIT:-unknown}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch, sys; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'python', sys.version.split()[0])"
} > "$OUT/env.txt"
cat "$OUT/env.txt"
STEP=${1:-all}
if [[ $STEP == par ]]; then
  # steps side by side, one GPU each, logs under $OUT/g<i>/, all packed into $OUT/results.tgz
  # (the device returns few files):  bash bench/device.sh par "CONFIGS=E,SRc suite" "sessions"
  shift; i=0; W=/tmp/par; rm -rf $W; mkdir -p $W
  for job in "$@"; do
    mkdir -p $W/g$i
    (export CUDA_VISIBLE_DEVICES=$i OUT=$W/g$i; end=$((SECONDS + ${PAR_LIMIT:-540}))
     for j in $job; do   # NAME=value sets the environment of the steps after it
       if [[ $j == *=* ]]; then export "$j"
       elif ((SECONDS < end)); then timeout $((end - SECONDS)) bash "$0" "$j" >> $W/g$i/step-$j.txt 2>&1; fi
     done) &
    i=$((i + 1))
  done
  wait
  cp "$OUT/env.txt" $W/; tar czf "$OUT/results.tgz" -C $W .; ls -R $W | head -50
  exit 0
fi
if [[ $STEP == all || $STEP == tests ]]; then
  # -rfE names every failed test and error at the end (the log is long). With pytest-xdist's
  # wheels in .whl/xdist/ (pip download --no-deps pytest-xdist execnet -d .whl/xdist) the tests
  # run in TEST_WORKERS processes (default 4, a file per worker): about 3 minutes instead of 5.5,
  # and a worker that crashes is replaced while the others go on
  XDIST=""
  if ls .whl/xdist/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/xdist/*.whl
    XDIST="-n ${TEST_WORKERS:-4} --dist loadfile"
  fi
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m pytest -m gpu tests -v -rfE -p no:cacheprovider $XDIST 2>&1 | tee "$OUT/gpu-tests.txt"
fi
if [[ $STEP == all || $STEP == demo ]]; then
  for model in token2wav freeze-omni toy; do
    cadence-fx demo --model $model --device cuda --json > "$OUT/demo-$model-cuda.json" 2> "$OUT/demo-$model-cuda.err"
    echo "demo $model: rc $?"; head -c 1500 "$OUT/demo-$model-cuda.json"; tail -3 "$OUT/demo-$model-cuda.err"
  done
fi
if [[ $STEP == moshi ]]; then
  # E, cadence_fx and the vendor path, each in a process of its own (bench/suite_moshi.py)
  python3 bench/suite_moshi.py --out "$OUT/moshi-frame.json" ${BENCH_ARGS//+/ } 2>&1 | tail -80
fi
if [[ $STEP == chunk ]]; then
  # the whole Token2Wav chunk, E vs SRc (the suite's whole part alone)
  python3 bench/suite_whole.py --out "$OUT/token2wav-chunk.json" ${BENCH_ARGS//+/ } 2>&1 | tail -60
fi
if [[ $STEP == all || $STEP == bench ]]; then
  python3 bench/replay.py --out "$OUT/bench-replay.json" ${BENCH_ARGS//+/ } 2>&1 | tail -80
fi
if [[ $STEP == timeline ]]; then
  # per-kernel timeline of one steady replayed chunk, CFM step (suite SRc) and flow step, vs stock
  python3 bench/replay_timeline.py --out "$OUT/timeline" ${BENCH_ARGS//+/ } > "$OUT/timeline.log" 2>&1
  echo "timeline rc $?"; tail -6 "$OUT/timeline.log"
  tar czf "$OUT/timeline.tgz" -C "$OUT" timeline && rm -rf "$OUT/timeline"   # few files come back
fi
if [[ $STEP == suite ]]; then
  # the whole suite (E, SRc, F, S, R, Rc, V, B on the CFM loop; whole chunk; Moshi); T/TM via CONFIGS
  N=${SUITE_NAME:-suite}
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/suite.py --out "$OUT/$N.json" \
    --configs "${CONFIGS:-E,SRc,F,S,R,Rc,V,B,T,TM}" --parts "${PARTS:-cfm,whole,moshi}" ${BENCH_ARGS//+/ } \
    > "$OUT/$N.out" 2> "$OUT/$N.log"; echo "suite rc $?"; tail -40 "$OUT/$N.log"
fi
if [[ $STEP == warm ]]; then
  # cold vs warm start with the persistent compile cache: fresh processes, alternated
  for model in ${WARM_MODELS:-token2wav moshi}; do
    CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/warm_start.py --model $model --device cuda \
      --runs ${WARM_RUNS:-2} --out "$OUT/warm-$model.json" ${BENCH_ARGS//+/ } > "$OUT/warm-$model.log" 2>&1
    echo "warm $model rc $?"; tail -4 "$OUT/warm-$model.log"
  done
fi
if [[ $STEP == cold ]]; then
  # the cold compile of the CFM catalog in fresh processes, COLD_RUNS times; with COLD_BASELINE (a
  # folder holding another build's cadence_fx package) alternating with that build, on one host
  # (BENCH_ARGS=--whole: the whole catalog, flow and HiFT; COLD_NAME names the files)
  N=${COLD_NAME:-cold}
  for ((k = 0; k < ${COLD_RUNS:-1}; k++)); do
    python3 bench/cold_compile.py --out "$OUT/$N-$k.json" ${BENCH_ARGS//+/ } > "$OUT/$N-$k.log" 2>&1
    tail -3 "$OUT/$N-$k.log"
    if [[ -n ${COLD_BASELINE:-} ]]; then
      PYTHONPATH=$COLD_BASELINE:$PYTHONPATH python3 bench/cold_compile.py --out "$OUT/$N-baseline-$k.json" \
        ${BENCH_ARGS//+/ } > "$OUT/$N-baseline-$k.log" 2>&1; tail -3 "$OUT/$N-baseline-$k.log"
    fi
  done
fi
if [[ $STEP == sessions ]]; then
  # BENCH_ARGS=--churn+--ns=1,2,4,8,12,14,16: the churn mode instead (speakers arrive every 3 rounds,
  # each primed inline with its own prompt; about 6 minutes at depth 16); results under "churn"
  python3 bench/sessions.py --out "$OUT/sessions.json" ${BENCH_ARGS//+/ } > "$OUT/sessions.out" 2>&1; echo "sessions rc $?"; tail -20 "$OUT/sessions.out"
fi
if [[ $STEP == lanes ]]; then
  # Token2Wav conversations per GPU with lanes, compiled priming and the deadline scheduler
  # (bench/sessions_lanes.py; BENCH_ARGS=--lanes=1,3+--ns=16,24+--threads+--host-profile)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/sessions_lanes.py \
    --out "$OUT/$(date +%F)-h200-sessions-lanes.json" ${BENCH_ARGS//+/ } > "$OUT/lanes.log" 2>&1
  echo "lanes rc $?"; grep -E '^\{"(prepare_s|lane_concurrency|host_profile|lanes)' "$OUT/lanes.log" | cut -c1-600
fi
if [[ $STEP == gc-probe ]]; then
  # the lanes tests with automatic collection off, collected after each test with what it frees
  # printed first (bench/gc_probe.py): a crash inside a collection then names its garbage
  CUBLAS_WORKSPACE_CONFIG=:4096:8 PYTHONPATH=bench:$PYTHONPATH timeout ${GC_PROBE_LIMIT:-300} \
    python3 -X faulthandler -m pytest -p gc_probe tests/test_lanes.py -v -s -p no:cacheprovider \
    > "$OUT/gc-probe.txt" 2>&1; echo "gc-probe rc $?"; grep -E "gc_probe|PASS|FAIL|Fatal" "$OUT/gc-probe.txt" | cut -c1-400 | tail -40
fi
if [[ $STEP == moshi-lanes ]]; then
  # Moshi conversations per GPU: batched frames per lane (bench/moshi_lanes.py)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 bench/moshi_lanes.py \
    --out "$OUT/$(date +%F)-h200-moshi-lanes.json" ${BENCH_ARGS//+/ } > "$OUT/moshi-lanes.log" 2>&1
  echo "moshi-lanes rc $?"; tail -20 "$OUT/moshi-lanes.log" | cut -c1-600
fi
if [[ $STEP == mutation ]]; then
  # mutation testing of cudagraphs.py (bench/mutation_gpu.py); mutmut and its dependencies travel as
  # wheels in .whl/mutation/ (pip download --only-binary=:all: --python-version 3.12 mutmut==3.8.1)
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-mut \
    $(ls .whl/mutation/*.whl | grep -vE '/(pytest|pluggy|iniconfig|packaging|typing_extensions)-')
  # the lowering tests first: any failing on the unmutated code is left out of the run (and shows)
  CUBLAS_WORKSPACE_CONFIG=:4096:8 python3 -m pytest -m gpu tests/test_gpu_lowering.py -v -rf \
    -p no:cacheprovider > "$OUT/gpu-lowering-tests.txt" 2>&1; tail -3 "$OUT/gpu-lowering-tests.txt"
  fails=$(grep -oP '^FAILED tests/test_gpu_lowering.py::\K\w+' "$OUT/gpu-lowering-tests.txt")
  PYTHONPATH=$PYTHONPATH:/tmp/site-mut timeout ${MUTATION_LIMIT:-500} python3 bench/mutation_gpu.py \
    --workers ${WORKERS:-8} ${fails:+--exclude $fails} > "$OUT/mutation-gpu.log" 2>&1; echo "mutation rc $?"
  PYTHONPATH=$PYTHONPATH:/tmp/site-mut python3 bench/mutation_gpu.py --results --diffs > "$OUT/mutation-gpu.txt" 2>&1
  cp .mutation-gpu/results.json "$OUT/mutation-gpu.json" 2>/dev/null; tail -5 "$OUT/mutation-gpu.log"; head -60 "$OUT/mutation-gpu.txt"
fi
if [[ $STEP == mutation-cpu ]]; then
  # the CPU mutation run (bench/mutation.py) on this machine's cores, CUDA hidden so the tests take
  # the CPU path they take in CI; carry .mutation (the staging tree with mutmut's test statistics)
  # and name the mutants in MUTANTS_FILE; the verdicts come back as mutmut's .meta files
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-mut \
    $(ls .whl/mutation/*.whl | grep -vE '/(pytest|pluggy|iniconfig|packaging|typing_extensions)-')
  CUDA_VISIBLE_DEVICES= PYTHONPATH=$PYTHONPATH:/tmp/site-mut timeout ${MUTATION_LIMIT:-500} \
    python3 bench/mutation.py --workers ${WORKERS:-14} --names-file "${MUTANTS_FILE:?}" \
    > "$OUT/mutation-cpu.log" 2>&1; echo "mutation-cpu rc $?"
  (cd .mutation/mutants && find . -name '*.meta' | tar czf "$OUT/mutation-cpu-meta.tgz" -T -)
  grep -E "mutations/second|self-check|Failed" "$OUT/mutation-cpu.log"; tail -c 600 "$OUT/mutation-cpu.log"
fi
if [[ $STEP == reliability ]]; then
  # the long property runs with CUDA graphs: SCHEDULES random session schedules of the selected
  # property (K picks it: stay_bit_exact = plain schedules; survive = moved weights, re-allocated
  # prompt state and failing captures), in runs of RUN_SCHEDULES with distinct hypothesis seeds from
  # SEED0, PROCS processes side by side on the one GPU (the toy is small: the work is mostly on the
  # CPU), so a job that runs out of time keeps the runs it finished; all logs end in reliability-K.txt
  total=${SCHEDULES:-10000}; per=${RUN_SCHEDULES:-1000}; procs=${PROCS:-1}; seed=${SEED0:-0}
  tag=${K:-random_schedules}; tag=${tag// /_}
  for ((p = 0; p < procs; p++)); do
    (for ((n = p * per; n < total; n += procs * per)); do
       s=$((seed + n / per)); log=$OUT/reliability-$tag-$p.txt
       echo "== -k ${K:-random_schedules} --hypothesis-seed=$s, $per schedules" >> "$log"
       CADENCE_FX_SCHEDULES=$per CADENCE_FX_DEVICE=cuda python3 -m pytest tests/test_sessions.py \
         -k "${K:-random_schedules}" --hypothesis-seed=$s -p no:cacheprovider -q \
         --hypothesis-show-statistics >> "$log" 2>&1
     done) &
  done
  wait
  cat "$OUT"/reliability-$tag-*.txt > "$OUT/reliability-$tag.txt"; rm "$OUT"/reliability-$tag-*.txt
  grep -E "passing|failed|passed" "$OUT/reliability-$tag.txt" | sort | uniq -c
fi
