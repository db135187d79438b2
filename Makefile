# The README's two commands. Both set everything up from a fresh clone first.
.PHONY: demo test setup test-cpp test-python sanitize tsan test-aarch64 bench clean

PY := .venv/bin/python
JOBS ?= 2

setup:
	bash scripts/setup.sh

demo: setup
	$(PY) examples/moe_demo.py

test: setup test-cpp test-python

test-cpp:
	cmake -S . -B build/cpp -G Ninja -DCMAKE_BUILD_TYPE=Release -DTOKAMAX_BUILD_TESTS=ON >/dev/null
	cmake --build build/cpp --parallel $(JOBS)
	ctest --test-dir build/cpp --output-on-failure -j $(JOBS)

test-python:
	$(PY) -m pytest tests

# The C++ core and its tests under AddressSanitizer + UndefinedBehaviorSanitizer: the first
# report fails the run. Stack use after return is checked too (off by default in GCC 12).
SANITIZER_ENV := ASAN_OPTIONS=detect_stack_use_after_return=1:check_initialization_order=1:strict_init_order=1 \
	UBSAN_OPTIONS=print_stacktrace=1
sanitize:
	cmake -S . -B build/sanitize -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTOKAMAX_BUILD_TESTS=ON \
	    -DTOKAMAX_SANITIZE=address,undefined >/dev/null
	cmake --build build/sanitize --parallel $(JOBS)
	$(SANITIZER_ENV) ctest --test-dir build/sanitize --output-on-failure -j $(JOBS)

# The same under ThreadSanitizer (the kernels' tests run on two threads). Not in CI: about
# 1.5 CPU-minutes to build and 3 minutes to run here.
tsan:
	cmake -S . -B build/tsan -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTOKAMAX_BUILD_TESTS=ON \
	    -DTOKAMAX_SANITIZE=thread >/dev/null
	cmake --build build/tsan --parallel $(JOBS) --target tokamax_core_tests
	TSAN_OPTIONS=halt_on_error=1 ctest --test-dir build/tsan --output-on-failure -j $(JOBS)

# The C++ core and its tests cross-built for aarch64 (scalar tier only) and run under qemu.
AARCH64_SYSROOT := /usr/aarch64-linux-gnu
test-aarch64:
	bash scripts/setup_aarch64.sh
	cmake -S . -B build/aarch64 -G Ninja -DCMAKE_BUILD_TYPE=Release -DTOKAMAX_BUILD_TESTS=ON \
	    -DCMAKE_TOOLCHAIN_FILE=cmake/aarch64-linux-gnu.cmake -DTOKAMAX_GTEST_SOURCE_DIR=/usr/src/googletest >/dev/null
	cmake --build build/aarch64 --parallel $(JOBS) --target tokamax_core_tests
	qemu-aarch64 -L $(AARCH64_SYSROOT) build/aarch64/tokamax_core_tests

# Every benchmarks/*.py but the shared helpers (common.py): an op's benchmark is found by its file.
BENCHMARKS := $(sort $(filter-out benchmarks/common.py,$(wildcard benchmarks/*.py)))
bench: setup
	@set -e; for script in $(BENCHMARKS); do echo "== $$script"; $(PY) $$script; done

clean:
	rm -rf build tokamax_torch/_C.so
