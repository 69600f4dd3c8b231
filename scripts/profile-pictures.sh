#!/usr/bin/env bash
# Records three profiles with the release build and draws their pictures into a folder
# (default target/pictures): a 2-rank fsdp run with recomputation, an offload run that places
# parameters and optimizer states under a device budget, and a 2-stage pipeline.
#   scripts/profile-pictures.sh [OUT]
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="${1:-$root/target/pictures}"
export LD_LIBRARY_PATH="$root/.libtorch/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
strata="$root/target/release/strata"
[ -x "$strata" ] || (cd "$root" && cargo build --release -p strata-cli)
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
model=(--model gpt --threads 1 --ctx 64)

"$strata" train "${model[@]}" --layers 4 --dim 128 --batch-size 8 --steps 4 --accumulation 2 --nproc 2 \
  --strategy '["fsdp", ["checkpoint", ["GptBlock"]]]' --profile "$work/fsdp" --metrics "$work/fsdp.jsonl"
"$strata" train "${model[@]}" --layers 8 --dim 256 --batch-size 4 --steps 3 \
  --strategy '[["offload", {"params": "auto", "optimizer": "auto", "policy": "auto"}], ["checkpoint", ["GptBlock"]]]' \
  --device-memory 40000000 --host-memory 2000000000 --profile "$work/offload"
"$strata" train "${model[@]}" --layers 4 --dim 128 --batch-size 8 --steps 3 --accumulation 4 --nproc 2 \
  --strategy '[["parallel_mode", [[["pipeline", 2]], null]]]' --profile "$work/pipeline"
"$strata" train "${model[@]}" --layers 4 --dim 128 --batch-size 8 --steps 4 --accumulation 2 \
  --strategy '[["checkpoint", ["GptBlock"]]]' --metrics "$work/one-process.jsonl"

for run in fsdp offload pipeline; do
  "$strata" profile plot "$work/$run" -o "$out/$run"
done
"$strata" plot "$work/fsdp.jsonl" "$work/one-process.jsonl" -o "$out/metrics.png"
