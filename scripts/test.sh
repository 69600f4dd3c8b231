#!/usr/bin/env bash
# The whole test suite: installs libtorch if needed (scripts/setup.sh), then runs every
# test of the workspace. Tests that compare with PyTorch use the environment setup.sh made.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup.sh"
cd "$repo"
# The examples as runnable programs: crates/strata-cli/tests/launch/library.rs runs them
# (`cargo test` alone builds them only as test harnesses).
# STRATA_TEST_FEATURES (e.g. `strata/mpi`) builds and tests everything with those cargo
# features, once.
features=()
if [ -n "${STRATA_TEST_FEATURES:-}" ]; then
  features=(--features "$STRATA_TEST_FEATURES")
fi
cargo build --workspace --examples ${features[@]+"${features[@]}"}
cargo test --workspace --all-targets ${features[@]+"${features[@]}"} "$@"
cargo test --workspace --doc ${features[@]+"${features[@]}"}
