#!/usr/bin/env bash
# The whole test suite: installs libtorch if needed (scripts/setup.sh), then runs every
# test of the workspace. Tests that compare with PyTorch use the environment setup.sh made.
set -euo pipefail
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
"$repo/scripts/setup.sh"
cd "$repo"
# The examples as runnable programs: crates/strata-cli/tests/launch/library.rs runs them
# (`cargo test` alone builds them only as test harnesses).
cargo build --workspace --examples
cargo test --workspace --all-targets "$@"
cargo test --workspace --doc
