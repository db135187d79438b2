#!/usr/bin/env bash
# Set-up behind `make test-aarch64`: Debian's aarch64 cross compiler, the aarch64 C/C++
# runtime it links against, and qemu's user-mode emulator to run the test binary.
set -euo pipefail

need_apt=()
command -v aarch64-linux-gnu-g++ >/dev/null 2>&1 || need_apt+=(g++-aarch64-linux-gnu)
command -v qemu-aarch64 >/dev/null 2>&1 || need_apt+=(qemu-user)
# GoogleTest is built for the target from the sources this package ships in /usr/src/googletest.
[ -f /usr/src/googletest/CMakeLists.txt ] || need_apt+=(libgtest-dev)
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v ninja >/dev/null 2>&1 || need_apt+=(ninja-build)
if [ ${#need_apt[@]} -gt 0 ]; then
  echo "setup-aarch64: installing system packages: ${need_apt[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq --no-install-recommends "${need_apt[@]}"
fi
