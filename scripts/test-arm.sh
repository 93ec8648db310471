#!/usr/bin/env bash
# The CPU tests on Arm: cross-builds the test binaries for aarch64-unknown-linux-gnu (the
# NEON kernels) and runs them under qemu-aarch64 (Debian's qemu-user): the library's tests
# (kernels against references), every architecture's tiny model against transformers
# (tests/models.rs) and the LoRA tests against PEFT, each under every family the emulated
# CPU has (neon, portable). `--quick` leaves out the LoRA tests (about 9 of the 10 minutes
# under emulation on 2 cores), as CI does. Installs the Rust target, the cross linker and
# qemu-user when they are missing (as root on Debian). Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."
target=aarch64-unknown-linux-gnu
rustup target list --installed | grep -qx "$target" || rustup target add "$target"
if ! command -v qemu-aarch64 >/dev/null || ! command -v aarch64-linux-gnu-gcc >/dev/null; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "the Arm tests need qemu-user and gcc-aarch64-linux-gnu: sudo apt-get install qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross" >&2
    exit 1
  fi
  echo "installing qemu-user and the aarch64 cross linker..." >&2
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq qemu-user gcc-aarch64-linux-gnu libc6-dev-arm64-cross >/dev/null
fi
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc
export CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_RUNNER="qemu-aarch64 -L /usr/aarch64-linux-gnu"
tests=(--lib --test models --test lora)
if [ "${1:-}" = "--quick" ]; then
  shift
  tests=(--lib --test models)
fi
cargo test --release --target "$target" "${tests[@]}" "$@"
