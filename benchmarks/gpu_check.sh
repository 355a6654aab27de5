#!/usr/bin/env bash
# One-shot check for a lent GPU machine: the first thing to run on one. Builds the extension
# the way a user installs it (`pip install --no-build-isolation --no-deps -e .`) with the CUDA
# toolkit hidden (no nvcc on PATH, no CUDA_HOME / CUDA_PATH, CMake told not to find it: the GPU
# paths come from torch's runtime, csrc/cudart.hpp), then runs the cuda tests with the check of
# our CUDA declarations against this machine's toolkit headers, the copy path against pinned
# bandwidth, a smoke step, the scheduler's probe and Pareto run, the GPU benchmark and, when
# the checkout has it, the hook-cost measurement. Needs nothing from a package registry.
#
#   OUT=/some/dir bash benchmarks/gpu_check.sh        # everything lands in $OUT
#
# Budget: a lent machine gives a session 15 minutes of device time, start-up included, and a
# rerun must fit after a first run; so the whole script stays inside GPU_CHECK_BUDGET_S
# (default 360 s). Each step runs under min(its limit, what is left of the budget); the limits
# add up to the budget, so a step is cut short only when one before it overran. Estimates
# are what each step should take on an H200 machine (16 cores, PCIe 5, VM disk), from the
# run of 2026-11-29 and the sizes below; this version has not run on a GPU yet.
#
#   step        est. s  limit s  what
#   build           40       60  nvidia-smi, versions; the pip build, toolkit hidden; build_info
#   pytest          80      100  `-m "cuda or cuda_toolkit"` of the test files that have them
#                                (race tests, reserved memory flat over 40 steps, copy engine,
#                                the header-declaration test; stop 53's compiled blocks
#                                checkpointed whole and eval-then-train BatchNorm under auto)
#   bandwidth       15       20  pinned copies (torch, side stream) vs CopyStreams, 256 MiB and
#                                64 x 4 MiB each way, host cost per copy issued
#   smoke           15       20  a small GPT step on host and nvme: bit-exact, Chrome trace
#   probe           15       20  offload-probe --refresh: figures, PCIe ceiling (NVML, bus id)
#   pareto          40       50  benchmarks/gpu_pareto.py (Llama-style h4096 L4 seq 4096, bf16):
#                                none, recompute, offload-host, auto 50/30/15 %, torch SAC
#   bench           60       75  offload-bench none / offload-host / offload-nvme / recompute
#                                (our checkpoint + inputs moved) / ckpt+save_on_cpu (Hugging
#                                Face's offload flag): GPT h2048 L4 seq 1024 batch 8, 2 steps
#   hook_cost       10       15  benchmarks/hook_cost.py --device cuda (host time per saved
#                                tensor, the D2H issue cost among it), only if present
#   total          275      360
#
# A failing or timed-out step is recorded and the script goes on; $OUT/summary.txt has one
# line per step with its rc (124 = timed out, "skip" = no time left) and, last, the one
# VERDICT line: PASS, or FAIL naming every step that did not run or failed, and the count
# of cuda tests skipped (their reasons are in pytest.log). The script itself exits 0 unless
# it could not start. Files in $OUT: summary.txt, build.log (machine + versions + build),
# pytest.log, bandwidth.log, smoke.log, trace.json (the smoke step's OFFLOAD_TRACE),
# probe.log, probe.json, pareto.log, pareto.json, bench.log, bench.json, hook_cost.log,
# hook_cost.json.
#
# Knobs: PYTHON (default python3), GPU_CHECK_BUDGET_S, GPU_CHECK_BENCH_ARGS (extra arguments
# for offload.bench), GPU_CHECK_NVME_DIR (default /var/tmp), GPU_CHECK_SKIP (comma-separated
# step names not to run, e.g. "build" to try the script on a machine whose build you keep).
set -euo pipefail

cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu-check-out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
BUDGET_S="${GPU_CHECK_BUDGET_S:-360}"
NVME_DIR="${GPU_CHECK_NVME_DIR:-/var/tmp}"
SUMMARY="$OUT/summary.txt"
START_S=$(date +%s)
export PYTHONUNBUFFERED=1
# torch's caching allocator without expandable segments: the race tests count on blocks
# being reused at once, as in the default configuration.
unset PYTORCH_CUDA_ALLOC_CONF || true

printf 'gpu_check %s  budget %ss  %s\n' "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$BUDGET_S" "$PWD" >"$SUMMARY"

# step NAME LIMIT_S CMD...  Run CMD (a command or a function of this script) with a time
# limit, output to $OUT/NAME.log; never aborts the script.
step() {
  local name=$1 limit=$2
  shift 2
  if [[ ",${GPU_CHECK_SKIP:-}," == *",$name,"* ]]; then
    printf '%-10s rc=skip   (GPU_CHECK_SKIP)\n' "$name" | tee -a "$SUMMARY"
    return 0
  fi
  local left=$((BUDGET_S - ($(date +%s) - START_S) - 5))
  if ((left < 15)); then
    printf '%-10s rc=skip   (no time left in the %ss budget)\n' "$name" "$BUDGET_S" | tee -a "$SUMMARY"
    return 0
  fi
  ((limit > left)) && limit=$left
  echo "=== $name (limit ${limit}s)"
  local t0 rc=0
  t0=$(date +%s)
  # bash -c: timeout runs programs, and the steps below are exported shell functions
  timeout --kill-after=10 "$limit" bash -c '"$@"' "$name" "$@" >"$OUT/$name.log" 2>&1 || rc=$?
  local note=""
  ((rc == 124 || rc == 137)) && note=" (timed out after ${limit}s)"
  printf '%-10s rc=%-4s %4ss%s\n' "$name" "$rc" "$(($(date +%s) - t0))" "$note" | tee -a "$SUMMARY"
  tail -n 25 "$OUT/$name.log" || true
  return 0
}

# ---------------------------------------------------------------- 1. machine, versions, build
build() {
  env_info
  echo "--- build, CUDA toolkit hidden"
  local hidden_path="" d
  IFS=: read -ra dirs <<<"$PATH"
  for d in "${dirs[@]}"; do [[ -n $d && ! -e $d/nvcc ]] && hidden_path="${hidden_path:+$hidden_path:}$d"; done
  local -a hide=(env -u CUDA_HOME -u CUDA_PATH -u CUDACXX -u OFFLOAD_BUILD_CUDA PATH="$hidden_path"
                 CMAKE_ARGS="-DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON")
  "${hide[@]}" bash -c 'command -v nvcc && echo "nvcc still visible" && exit 1; echo "nvcc hidden"' || return
  # pip first (the install a user does); a scikit-build-core older than pyproject asks for
  # cannot, so then CMake builds the module straight into the checkout.
  if ! "${hide[@]}" "$PY" -m pip install --no-build-isolation --no-deps -e .; then
    echo "--- pip could not build; CMake directly"
    rm -f offload/_C*.so
    "${hide[@]}" cmake -S . -B build/gpu-check -G Ninja -DCMAKE_BUILD_TYPE=Release \
      -DCMAKE_DISABLE_FIND_PACKAGE_CUDAToolkit=ON -DPython_EXECUTABLE="$(command -v "$PY")" \
      -Dpybind11_DIR="$("$PY" -m pybind11 --cmakedir)" || return
    "${hide[@]}" cmake --build build/gpu-check || return
    cp build/gpu-check/offload/_C*.so offload/ || return
  fi
  readelf -d offload/_C*.so | grep NEEDED || true
  "$PY" -c "import json, offload; from offload._build_info import summary; i = offload.build_info(); print(summary(i)); print('BUILD_INFO_JSON', json.dumps(i))"
}

env_info() {
  nvidia-smi || echo "nvidia-smi failed"
  nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.max,pcie.link.width.max \
    --format=csv || true
  command -v nvcc && nvcc --version | tail -n 2 || echo "nvcc: not on PATH"
  "$PY" - <<'EOF'
import platform, torch
print("python", platform.python_version(), "| torch", torch.__version__, "| torch cuda", torch.version.cuda)
print("cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    print("device", torch.cuda.get_device_name(), "| capability", torch.cuda.get_device_capability())
EOF
}

# ---------------------------------------------------------------- 2. bandwidth: reference vs our path
bandwidth() {
  "$PY" - <<'EOF'
import json, statistics, time
import torch
from offload.tiers.copies import CopyStreams

MiB = 1 << 20
N = 256 * MiB
CHUNK, CHUNKS = 4 * MiB, 64          # many copies back to back, as in a training step
dev = torch.randint(0, 256, (N,), dtype=torch.uint8, device="cuda")
ref_host = torch.empty(N, dtype=torch.uint8, pin_memory=True)

def block_factory():
    try:
        from offload._ext import load_core
        core = load_core()
        if core.cuda_compiled and core.cuda_usable():
            arena = core.HostArena(2 * N + 16 * MiB, pinned=True)
            return "offload._C HostArena (cudaHostAlloc)", arena.allocate
    except Exception as exc:
        print("arena unavailable:", exc)
    return "torch pinned tensors", lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True).numpy()

def wall_gbps(fn, nbytes, reps=5):
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times[1:]) / 1e9   # first run is warm-up

side = torch.cuda.Stream()
def ref_d2h():
    with torch.cuda.stream(side):
        ref_host.copy_(dev, non_blocking=True)
def ref_h2d():
    with torch.cuda.stream(side):
        dev.copy_(ref_host, non_blocking=True)
def ref_d2h_chunks():
    with torch.cuda.stream(side):
        for i in range(CHUNKS):
            ref_host[i * CHUNK:(i + 1) * CHUNK].copy_(dev[i * CHUNK:(i + 1) * CHUNK], non_blocking=True)
def ref_h2d_chunks():
    with torch.cuda.stream(side):
        for i in range(CHUNKS):
            dev[i * CHUNK:(i + 1) * CHUNK].copy_(ref_host[i * CHUNK:(i + 1) * CHUNK], non_blocking=True)

kind, make_block = block_factory()
copies = CopyStreams(torch.device("cuda"))
big = make_block(N)
chunks = [make_block(CHUNK) for _ in range(CHUNKS)]
def ours_d2h():
    copies.offload(dev, big).wait()
def ours_h2d():
    copies.reload(big, N).wait()
def ours_d2h_chunks():
    tickets = [copies.offload(dev[i * CHUNK:(i + 1) * CHUNK], chunks[i]) for i in range(CHUNKS)]
    tickets[-1].wait()
def ours_h2d_chunks():
    tickets = [copies.reload(chunks[i], CHUNK) for i in range(CHUNKS)]
    tickets[-1].wait()

rows = {}
for name, ref, ours, nbytes in [("d2h 256MiB", ref_d2h, ours_d2h, N), ("h2d 256MiB", ref_h2d, ours_h2d, N),
                                ("d2h 64x4MiB", ref_d2h_chunks, ours_d2h_chunks, CHUNK * CHUNKS),
                                ("h2d 64x4MiB", ref_h2d_chunks, ours_h2d_chunks, CHUNK * CHUNKS)]:
    r, o = wall_gbps(ref, nbytes), wall_gbps(ours, nbytes)
    rows[name] = {"reference_gbps": round(r, 2), "offload_path_gbps": round(o, 2), "ratio": round(o / r, 3)}
    print(f"{name:12s} reference {r:7.2f} GB/s   offload path {o:7.2f} GB/s   ratio {o / r:.3f}"
          f"   {'OK' if o >= 0.9 * r else 'BELOW 90%'}")
# Host time to issue one copy (what bounds small copies): the loop alone, GPU left running.
def issue_us(fn):
    times = []
    for _ in range(4):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(times[1:]) / CHUNKS * 1e6
def ours_d2h_issue():
    for i in range(CHUNKS):
        copies.offload(dev[i * CHUNK:(i + 1) * CHUNK], chunks[i])
untimed = CopyStreams(torch.device("cuda"), timing=False)
def untimed_d2h_issue():
    for i in range(CHUNKS):
        untimed.offload(dev[i * CHUNK:(i + 1) * CHUNK], chunks[i])
print(f"host us per 4 MiB copy issued: reference {issue_us(ref_d2h_chunks):.1f}, "
      f"CopyStreams.offload {issue_us(ours_d2h_issue):.1f} "
      f"(timing=False: {issue_us(untimed_d2h_issue):.1f}) "
      f"(the GPU moves 4 MiB in {CHUNK / rows['d2h 256MiB']['reference_gbps'] / 1e3:.1f} us)")
# bit-exact round trip through our path
copies.offload(dev, big).wait()
back = copies.reload(big, N).tensor_for_use()
exact = bool(torch.equal(back, dev))
copies.close()
untimed.close()
print("host blocks:", kind, "| round trip exact:", exact)
print("CopyStreams stats (GPU-timed):", json.dumps(copies.stats.as_dict()))
print("BANDWIDTH_JSON", json.dumps({"blocks": kind, "exact": exact, "rows": rows}))
assert exact, "round trip through CopyStreams changed bytes"
assert all(v["ratio"] >= 0.9 for v in rows.values()), "offload path below 90% of pinned bandwidth"
EOF
}

# ---------------------------------------------------------------- 3. end-to-end smoke step
smoke() {
  OFFLOAD_TRACE="$OUT/trace.json" "$PY" - <<'EOF'
import json, os, time
import torch
import offload
from offload.bench.models import GPT, GPTConfig

torch.backends.cuda.matmul.allow_tf32 = False
cfg = GPTConfig(hidden=256, layers=4, heads=4, seq_len=256, dropout=0.0)

def step(settings):
    torch.manual_seed(0)
    model = GPT(cfg).cuda()
    x = torch.randint(0, cfg.vocab_size, (8, cfg.seq_len), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if settings is None:
        model(x).float().pow(2).mean().backward()
        stats = None
    else:
        with offload.activations(model=model, **settings) as ctx:
            model(x).float().pow(2).mean().backward()
        stats = ctx.stats.as_dict()
    torch.cuda.synchronize()
    return [p.grad for p in model.parameters()], time.perf_counter() - t0, stats

# The math attention kernel: flash / memory-efficient backward use atomics (not bit-exact).
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.MATH):
    ref, ref_s, _ = step(None)
    again, _, _ = step(None)
    deterministic = all(torch.equal(a, b) for a, b in zip(ref, again))
    print("no-offload step deterministic:", deterministic)
    # A reference that differs from itself proves nothing about ours: that is a failure of
    # this check (with the reason), never a silent pass.
    ok = deterministic
    if not deterministic:
        print("FAIL: the no-offload reference step is not deterministic, so offload's gradients "
              "cannot be compared bit for bit (a non-deterministic kernel in the model?)")
    for tiers in ("host", "nvme"):
        settings = {"tiers": tiers, "policy": "offload", "min_bytes": 0,
                    "nvme_dir": os.environ.get("NVME_DIR", "/var/tmp")}
        grads, s, stats = step(settings)
        exact = all(torch.equal(a, b) for a, b in zip(ref, grads))
        ok &= exact
        stall_ok = stats["stall_s"] <= stats["step_s"]   # each wait counted once
        ok &= stall_ok
        print(f"tiers={tiers}: exact={exact} step {s:.3f}s (no offload {ref_s:.3f}s) "
              f"stall {stats['stall_s']:.3f}s of {stats['step_s']:.3f}s ok={stall_ok}")
        print(json.dumps(stats, default=str)[:2000])
assert ok, "gradients differ from the no-offload step, or stall exceeds the step"
EOF
}

cuda_tests() {
  # Only the files that have such tests: collecting the whole suite imports every framework.
  local -a files
  mapfile -t files < <(grep -lE 'mark\.cuda(_toolkit)?\b' tests/test_*.py)
  "$PY" -m pytest -m "cuda or cuda_toolkit" -q -rs -p no:cacheprovider -o addopts= "${files[@]}"
}

export OUT PY NVME_DIR
export -f build env_info bandwidth smoke cuda_tests

# Limits add up to the 360 s default budget (header); correctness first, figures after.
step build 60 build   # the machine and versions are at the top of build.log
# -rs: every skipped test is listed with its reason (and counted in the verdict below).
step pytest 100 cuda_tests
step bandwidth 20 bandwidth
step smoke 20 smoke
# The scheduler: its figures (cached for the Pareto run's `auto`), then its Pareto run.
step probe 20 "$PY" -m offload.schedule.probe_cli --refresh --device cuda --nvme-dir "$NVME_DIR" \
  --json "$OUT/probe.json"
step pareto 50 "$PY" benchmarks/gpu_pareto.py --json "$OUT/pareto.json"
# A GPT half the depth of the 2026-11-29 run (3.6 GiB saved per step): its offload-nvme row
# took 8.7 s a step on the H200's VM disk at full depth, more than this budget allows.
# shellcheck disable=SC2086  # GPU_CHECK_BENCH_ARGS is a list of words on purpose
step bench 75 "$PY" -m offload.bench --device cuda \
  --strategies none,offload-host,offload-nvme,recompute,ckpt+save_on_cpu \
  --gpt hidden=2048,layers=4,heads=16,seq_len=1024 --batch 8 \
  --steps 2 --warmup 1 --timeout-s 45 --nvme-dir "$NVME_DIR" --json "$OUT/bench.json" \
  ${GPU_CHECK_BENCH_ARGS:-}
if [[ -f benchmarks/hook_cost.py ]]; then
  # 2 rounds x 2 steps x 1,000 tensors per path: fewer saves in all than the 3 x 1 x 2,000
  # this step's limit was sized for (each path's steps run in a row now: timed_block).
  step hook_cost 15 "$PY" benchmarks/hook_cost.py --device cuda --rounds 2 --steps 2 \
    --tensors 1000 \
    --nvme-dir "$NVME_DIR" \
    --json "$OUT/hook_cost.json"
else
  printf '%-10s absent   (no benchmarks/hook_cost.py in this checkout)\n' hook_cost | tee -a "$SUMMARY"
fi

printf 'total %ss\n' "$(($(date +%s) - START_S))" | tee -a "$SUMMARY"
echo "=== summary"
cat "$SUMMARY"
# The verdict, printed once and last: nothing that did not run, or ran and was skipped
# inside, passes silently.
failed=$(awk '$2 ~ /^rc=/ && $2 != "rc=0" {print $1 "(" substr($2, 4) ")"}' "$SUMMARY" | paste -sd ' ')
skipped_tests=$(grep -Eo '[0-9]+ skipped' "$OUT/pytest.log" 2>/dev/null | tail -n 1 || true)
if [[ -n $failed || -n $skipped_tests ]]; then
  verdict="VERDICT: FAIL  steps not passed: ${failed:-none}${skipped_tests:+ | cuda tests $skipped_tests (reasons in pytest.log)}"
else
  verdict="VERDICT: PASS  every step ran and passed; no cuda test skipped"
fi
echo "$verdict" | tee -a "$SUMMARY"
