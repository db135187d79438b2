# The README's two commands. Both set everything up from a fresh clone first.
.PHONY: demo test setup test-cpp test-python bench clean

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

bench: setup
	$(PY) benchmarks/ragged_dot.py
	$(PY) benchmarks/attention.py

clean:
	rm -rf build tokamax_torch/_C.so
