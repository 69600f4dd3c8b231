#!/usr/bin/env bash
# Strata on a GPU, in one command: the CUDA tests and `strata bench gpu`, with a Markdown
# report (report.md) and the figures as JSON (report.json, bench-gpu.json) in OUT, with a
# kernel trace of one step of each side of the benchmark (OUT/traces/<model>/<side>.json).
#
#   scripts/gpu-check.sh --build DIR          build the CUDA binaries (release) into DIR
#   scripts/gpu-check.sh OUT [--prebuilt DIR] run them on this machine's GPU, report in OUT
#
# BENCH_GPU_ARGS, where set, is added to `strata bench gpu`'s arguments (e.g. "--rounds 4");
# BENCH_GPU=0 leaves the benchmark out. BENCH_LONG_ARGS, where set, also runs `strata bench
# long --device cuda --reference` with those arguments (the model's shape, the budget, e.g.
# docs/benchmarks.md's TinyLlama line) into OUT/bench-long.txt and the report.
#
# Without --prebuilt the binaries are built here first (scripts/setup.sh's libtorch). With
# it, binaries built on another x86-64 machine run against the libtorch of the Python torch
# found here (python3, or $PYTHON), so the GPU machine needs no Rust toolchain.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# Builds the strata binary and the CUDA test binaries into $1, stripped.
build() {
  local into=$1
  mkdir -p "$into"
  "$repo/scripts/setup.sh"
  cd "$repo"
  cargo build --release -p strata-cli
  cp target/release/strata "$into/strata"
  # Each test binary cargo builds, found in its JSON messages: (crate, test binary, label).
  for target in "strata-ext ext ext" "strata compute cuda" "strata parallel context" "strata-cli launch gpu"; do
    set -- $target
    local exe
    exe=$(cargo test --release -p "$1" --test "$2" --no-run --message-format=json 2>/dev/null |
      python3 -c 'import json,sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == sys.argv[1]:
        print(m["executable"])' "$2" | tail -1)
    [ -n "$exe" ] || { echo "no test binary $1/$2" >&2; exit 1; }
    cp "$exe" "$into/test-$3"
  done
  strip "$into"/*
}

if [ "${1:-}" = "--build" ]; then
  build "${2:?--build needs a folder}"
  exit 0
fi

out=${1:?usage: scripts/gpu-check.sh OUT [--prebuilt DIR] | --build DIR}
mkdir -p "$out"
out=$(cd "$out" && pwd)
if [ "${2:-}" = "--prebuilt" ]; then
  bin=$(cd "${3:?--prebuilt needs a folder}" && pwd)
else
  bin="$repo/target/gpu-check"
  build "$bin"
fi

# The libtorch of the Python torch (the wheel ships libtorch, CUDA's runtime and NCCL).
python=${PYTHON:-}
[ -n "$python" ] || { [ -x "$repo/.venv/bin/python" ] && python="$repo/.venv/bin/python"; } || python=python3
site=$("$python" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))')
export LD_LIBRARY_PATH="$site/torch/lib:$site/nvidia/cu13/lib:$site/nvidia/nccl/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export STRATA_BIN="$bin/strata"
start=$(date +%s)

gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "none visible")
torch=$("$python" -c 'import torch; print(torch.__version__, "CUDA", torch.version.cuda)')
commit=${STRATA_COMMIT:-$(git -C "$repo" rev-parse --short HEAD 2>/dev/null || echo unknown)}

# The CUDA tests (the whole ext binary, the cuda and gpu modules of theirs, context
# parallelism's ranks sharing the GPU), one test at a time; each log kept, its results
# parsed below.
status=0
for t in "ext" "cuda cuda::" "context context::context_attention_on_2_ranks_of_one_gpu" "gpu gpu::"; do
  set -- $t
  (cd "$repo" && "$bin/test-$1" ${2:-} --test-threads 1 --nocapture) >"$out/test-$1.log" 2>&1 || status=1
done
if [ "${BENCH_GPU:-1}" != 0 ]; then
  # shellcheck disable=SC2086 # the extra arguments split on spaces
  "$bin/strata" bench gpu --python "$python" ${BENCH_GPU_ARGS:-} --json-out "$out/bench-gpu.json" --kernel-trace "$out/traces" >"$out/bench-gpu.txt" 2>&1 || status=1
fi
if [ -n "${BENCH_LONG_ARGS:-}" ]; then
  # shellcheck disable=SC2086
  "$bin/strata" bench long --device cuda --reference --python "$python" $BENCH_LONG_ARGS >"$out/bench-long.txt" 2>&1 || status=1
fi

"$python" - "$out" "$gpu" "$torch" "$commit" "$start" "$status" <<'EOF'
import json, os, re, sys, time
out, gpu, torch, commit, start, status = sys.argv[1:]
tests = []
for name in ("ext", "cuda", "context", "gpu"):
    log = open(os.path.join(out, f"test-{name}.log"), errors="replace").read()
    # A test's own output may follow its "test NAME ..." line: results come from the summary.
    finished = re.search(r"^test result: ", log, re.M) is not None
    failed = set(re.findall(r"^    (\S+)$", log.split("\nfailures:\n")[-1], re.M)) if "\nfailures:\n" in log else set()
    for test in re.findall(r"^test (\S+) \.\.\. ", log, re.M):
        result = "FAILED" if test in failed else "ok" if finished else "did not finish"
        # A test names itself without its module when it skips.
        if result == "ok" and f"{test.rsplit('::', 1)[-1]}: skipped" in log:
            result = "skipped"
        tests.append({"binary": name, "test": test, "result": result})
bench_path = os.path.join(out, "bench-gpu.json")
bench = json.load(open(bench_path)) if os.path.exists(bench_path) else None
report = {"gpu": gpu, "torch": torch, "commit": commit, "seconds": int(time.time()) - int(start),
          "passed": status == "0" and all(t["result"] == "ok" for t in tests if not t["test"].endswith("rank_entry")),
          "tests": tests, "bench": bench}
json.dump(report, open(os.path.join(out, "report.json"), "w"), indent=2)
lines = [f"# Strata on {gpu}", "",
         f"torch {torch}, commit {commit}, {report['seconds']} s; {'all passed' if report['passed'] else 'FAILURES'}", "",
         "## CUDA tests", "", "| binary | test | result |", "| --- | --- | --- |"]
lines += [f"| {t['binary']} | {t['test']} | {t['result']} |" for t in tests]
for bench_name in ("gpu", "long"):
    path = os.path.join(out, f"bench-{bench_name}.txt")
    if os.path.exists(path):
        lines += ["", f"## strata bench {bench_name}", "", "```", open(path, errors="replace").read().rstrip(), "```"]
open(os.path.join(out, "report.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
EOF
exit $status
