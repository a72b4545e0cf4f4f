# kimi-mlx developer entry points. `make demo` and `make test` work on a fresh machine.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

# MLX's Linux CPU wheel links the reference BLAS; OpenBLAS is ~9x faster for matmul.
# Only on Linux, never on macOS (Accelerate is used there).
ifeq ($(shell uname -s),Linux)
OPENBLAS := $(firstword $(wildcard /usr/lib/*/openblas-pthread/libblas.so.3))
ifneq ($(OPENBLAS),)
export LD_PRELOAD := $(OPENBLAS)
endif
endif

.PHONY: install clients test-clients test-e2e demo test check-real check-real-tensor bench bench-prune bench-domains bench-quant bench-server bench-spec bench-kv micro micro-moe micro-draft micro-dspark micro-dspark-copy micro-mtp micro-vision micro-vision-tune eval-micro-vision proto clean

install: $(STAMP)

$(STAMP): pyproject.toml setup.py
	@if [ "$$(uname -s)" = Linux ] && ! ls /usr/lib/*/openblas-pthread/libblas.so.3 >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libopenblas0-pthread >/dev/null)) || \
	    echo "note: libopenblas0-pthread not installed; MLX falls back to its slow reference BLAS"; \
	  else echo "note: install libopenblas0-pthread for ~9x faster CPU matmul"; fi; \
	fi
	@# the chat page's browser tests (tests/test_web.py) drive Debian's chromium; skipped without it
	@if [ "$$(uname -s)" = Linux ] && ! command -v chromium >/dev/null 2>&1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q chromium >/dev/null 2>&1 || \
	     (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) || \
	    echo "note: chromium not installed; the chat page's browser tests will be skipped"; \
	  else echo "note: install chromium to run the chat page's browser tests"; fi; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e ".[dev]"
	touch $(STAMP)

# The real client programs that tests/test_clients.py drives, all pinned: npm's
# Claude Code, Codex, opencode, Qwen Code into .clients/node_modules (`make test-clients` installs them) (exact versions and
# the lock in tests/clients/; `npm install`, not `npm ci`: a registry mirror that holds
# only this platform's optional binaries cannot give a lock with the others, which npm
# ci demands; Claude Code's and opencode's install scripts put their platform's native
# binary in place, offline; node without the OpenBLAS LD_PRELOAD, which breaks its
# threads), llm + the OpenAI Agents SDK into .venv-tools and aider into
# .venv-aider (aider pins openai 2.x, llm needs 3.x). Skips npm without node/npm.
CLIENTS_NPM   := .clients/.installed
CLIENTS_TOOLS := .venv-tools/.installed
CLIENTS_AIDER := .venv-aider/.installed

clients: $(CLIENTS_NPM) $(CLIENTS_TOOLS) $(CLIENTS_AIDER)
	@if grep -q '^lmeval-tools:' Makefile; then $(MAKE) --no-print-directory lmeval-tools; fi

$(CLIENTS_NPM): tests/clients/package.json tests/clients/package-lock.json
	@if [ "$$(uname -s)" = Linux ] && ! command -v npm >/dev/null 2>&1 && [ "$$(id -u)" = 0 ] && \
	    command -v apt-get >/dev/null; then \
	  (apt-get install -y -q nodejs npm >/dev/null 2>&1 || \
	   (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q nodejs npm >/dev/null 2>&1)) || \
	  echo "note: nodejs/npm not installed"; \
	fi
	@if command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
	  mkdir -p .clients && cp tests/clients/package.json tests/clients/package-lock.json .clients/ && \
	  cd .clients && rm -rf node_modules && \
	  env -u LD_PRELOAD npm install --no-audit --no-fund --loglevel=error && \
	  touch .installed; \
	else echo "note: node/npm not found (Debian: apt-get install nodejs npm); the npm clients' tests will be skipped"; fi

$(CLIENTS_TOOLS): tests/clients/requirements-tools.txt
	test -x .venv-tools/bin/python || $(PYTHON) -m venv .venv-tools
	.venv-tools/bin/pip install -q -r tests/clients/requirements-tools.txt
	touch $@

$(CLIENTS_AIDER): tests/clients/requirements-aider.txt
	test -x .venv-aider/bin/python || $(PYTHON) -m venv .venv-aider
	.venv-aider/bin/pip install -q -r tests/clients/requirements-aider.txt
	touch $@

# Greedy generation from the shipped micro checkpoint (kimi_mlx/assets/micro), which was
# trained on stdlib code and documentation prose; it is not chat-tuned, hence the raw prompt.
demo: install
	@printf '\n[code prompt]\nclass Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self\n'
	@printf 'class Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self' | \
	  $(BIN)/kimi-mlx generate --ignore-chat-template --temp 0 --max-tokens 64 --prompt -
	@printf '\n[prose prompt]\nThe "for" statement is used to\n'
	@$(BIN)/kimi-mlx generate --ignore-chat-template --temp 0 --max-tokens 64 \
	  --prompt 'The "for" statement is used to'
	@printf '\n[speculative decoding: the code prompt again, drafted by micro-draft, 2 drafts per step; same text]\n'
	@printf '[a 64-token run pays one-time graph compilation in its tok/s; make bench-spec measures the speed-up]\n'
	@printf 'class Queue:\n    """A simple FIFO queue."""\n\n    def __init__(self' | \
	  $(BIN)/kimi-mlx generate --ignore-chat-template --temp 0 --max-tokens 64 \
	  --draft-model kimi_mlx/assets/micro-draft --num-draft-tokens 2 --prompt -
	@printf '\n[image prompt: build/demo-shape.png (a Pillow drawing, 112 x 112), asked through micro-vision]\n'
	@mkdir -p build && $(BIN)/python -c "import numpy as np; from kimi_mlx.micro.vision_train import draw; \
	  draw('star', 'orange', np.random.default_rng(7)).save('build/demo-shape.png')"
	$(BIN)/kimi-mlx generate --model kimi_mlx/assets/micro-vision --image build/demo-shape.png \
	  --temp 0 --max-tokens 24 --verbose false --prompt "What is in the image?"

# The suite less the markers clients and e2e (pyproject's addopts), printing its 25 slowest
# set-ups/calls/teardowns; a test past 600 s is stopped and named (pytest-timeout).
test: install
	$(BIN)/python -m pytest -q

# lm-evaluation-harness (and torch's CPU wheel) in the tools virtualenv .venv-tools, apart
# from .venv, for tests/test_client_lmeval.py (skipped without it); `make clients` calls it.
.PHONY: lmeval-tools
lmeval-tools: .venv-tools/.lmeval-installed

.venv-tools/.lmeval-installed: tests/clients/requirements-lmeval.txt
	test -x .venv-tools/bin/python || $(PYTHON) -m venv .venv-tools
	.venv-tools/bin/pip install -q --upgrade pip
	.venv-tools/bin/pip install -q -r tests/clients/requirements-lmeval.txt
	touch $@

# The real clients end to end against kimi-mlx server on micro: every test marked
# `clients` (tests/test_clients.py and the lm-eval ones; ~10 min on 2 busy cores;
# excluded from `make test` by pyproject's addopts). Each test skips with the reason
# where its program is missing (`make clients`).
# The fault and recovery runs (marker e2e: a tensor group healing after seven kinds of
# loss, stages killed, hung or restarted under the launcher and the servers, prompt caches
# starved by a small --cache-bytes) and the pruned builds served by a cluster, each on
# processes of its own: apart so that `make test`
# stays under 10 minutes on 2 cores; CI (.ci/run) runs them after the suite.
test-e2e: install
	$(BIN)/python -m pytest -q -m e2e

test-clients: install
	@# the real agent programs (~1.1 GB, ~3 min); not part of `make install`, so `make demo`
	@# stays small; never fails here (each test skips with the reason)
	@$(MAKE) --no-print-directory clients || echo "note: the real clients did not install; their tests will skip"
	$(BIN)/python -m pytest -q -rP -m clients

# K3.1 Pro's real widths on this machine: a 2-layer real-width slice (~2.4 GB, in a temp
# folder) through prefill past index_topk and decode, the kernels in the emulator, and
# the planner's memory / bytes-read predictions (kimi_mlx/testing/check_real.py); then the
# same slice split across 2 tensor-parallel ranks (--tensor, kimi_mlx/testing/tp_real.py).
# Needs ~6 GB RAM.
check-real: install
	$(BIN)/python -m kimi_mlx.testing.check_real --tensor

# Only the tensor-parallel part of check-real: the slice split across 2 ranks (MLX ring on
# 127.0.0.1) against one process, each rank's bytes loaded and read per decode step
# against the planner (kimi_mlx/testing/tp_real.py).
check-real-tensor: install
	$(BIN)/python -m kimi_mlx.testing.tp_real

bench: install
	$(BIN)/python -m kimi_mlx.bench.model
	@echo
	$(BIN)/kimi-mlx bench kernels
	@echo
	$(BIN)/python -m kimi_mlx.cluster.bench.pipeline
	@echo
	$(BIN)/python -m kimi_mlx.cluster.bench.hop
	@echo
	$(BIN)/python -m kimi_mlx.bench.kv_memory

# The 8-bit DSA caches (--kv-bits 8) against BF16: bytes per token, peak memory at 4k and
# 16k, decode at 16k and mlx-lm's --kv-bits 8 (kimi_mlx/bench/kv_memory.py, also the end
# of `make bench`); then quality on micro with its sparse path active: perplexity at
# 1k/4k/16k, DSA top-k agreement, 50 greedy continuations, a 4-turn server conversation
# (kimi_mlx/bench/kv_quality.py; about an hour on 2 busy cores).
bench-kv: install
	$(BIN)/python -m kimi_mlx.bench.kv_memory
	@echo
	$(BIN)/python -m kimi_mlx.bench.kv_quality

# 1, 4, 8 concurrent HTTP clients vs one at a time: one process and a 3-stage cluster;
# then the cluster's prompt cache: time to first token of turn 3 with a 2k-token history.
bench-server: install
	$(BIN)/python -m kimi_mlx.bench.server

# Pruning methods on the micro-moe test bed (~20 min on 2 busy cores); bench-quant: quantization of micro.
bench-prune: install
	$(BIN)/python -m kimi_mlx.prune.bench.pruning

bench-quant: install
	$(BIN)/python -m kimi_mlx.prune.bench.pruning --no-prune --quant

# The pruner's domain balance chosen from evidence: micro-moe at keep 0.5 / 0.25 /
# 0.125, calibrated on code / prose / data / a mix, 3 seeds; prints the table and the rule.
bench-domains: install
	$(BIN)/python -m kimi_mlx.prune.bench.domains

micro: install
	$(BIN)/python -m kimi_mlx.micro.train

# The pruning test bed (kimi_mlx/assets/micro-moe): micro's architecture and trainer on three
# domains (code, prose, structured data) without router load balancing, so that its
# experts specialise (a router specialisation bonus, 400 steps; ~17 min on 2 busy cores).
micro-moe: install
	$(BIN)/python -m kimi_mlx.micro.moe

# The draft for speculative decoding with the micro model, distilled from it (~10 min).
micro-draft: install
	$(BIN)/python -m kimi_mlx.micro.draft

# The DSpark block drafter of micro (reads micro's hidden states; `--draft-model
# kimi_mlx/assets/micro-dspark`), trained on micro's own greedy outputs: ~32 min on 2 quiet cores.
micro-dspark: install
	$(BIN)/python -m kimi_mlx.micro.dspark_train

# continue the shipped micro-dspark on a mix with 30% copy-heavy sequences (prompts that
# quote themselves) into build/micro-dspark-copy, ~45 min on 2 busy cores; measured: more
# accepted on copy-heavy held-out prompts, fewer on code and prose (not shipped)
micro-dspark-copy: install
	$(BIN)/python -m kimi_mlx.micro.dspark_train --init-from kimi_mlx/assets/micro-dspark \
		--out build/micro-dspark-copy \
		--sequences 640 --copy-share 0.3 --steps 400 --max-minutes 38 --lr 1.5e-3

# A copy of micro with one trained MTP layer (`--draft mtp`), in build/micro-mtp; the
# shipped micro is not modified. Trunk frozen, ~15 min on 2 busy cores (niced).
micro-mtp: install
	nice $(BIN)/python -m kimi_mlx.micro.mtp_train

# micro with a small vision tower that names a synthetic picture's colour and shape
# ("a red circle") at 56-448 px a side and aspect 1:3-3:1, in build/micro-vision with its
# held-out accuracy per size / aspect bucket in MODEL_CARD.md; copy it to
# kimi_mlx/assets/micro-vision to ship it. Staged: the tower alone on colour / shape heads,
# then the projector and micro's non-expert weights on the answer, batches bucketed by
# grid. From scratch (below): 1000 + 200 steps, ~6 min of training on 2 quiet cores, not
# evaluated end to end at these sizes (1500 stage-1 steps from scratch: 59.8 % head shape;
# with --tower-pool max 100 % on the heads but 30 % colour and shape end to end).
# The shipped asset is a chain of --init-from runs (its MODEL_CARD.md): the 112 x 112
# asset of git 5a2302a, then 600 + 80 steps (git 130a7d3's asset, 75.8 %), then
# 2000 + 400 (95.0 %), then micro-vision-tune as below on that (97.5 %, 13.9 min on 2
# quiet cores); the last two took 26.6 min of training.
micro-vision: install
	nice $(BIN)/python -m kimi_mlx.micro.vision_train --out build/micro-vision

micro-vision-tune: install
	nice $(BIN)/python -m kimi_mlx.micro.vision_train --out build/micro-vision \
	  --init-from kimi_mlx/assets/micro-vision --tower-steps 2500 --tower-lr 1e-3 \
	  --answer-steps 400 --seed 1

# The shipped micro-vision on 120 held-out pictures (seed 10000) of 56-448 px a side and
# aspect 1:3-3:1: colour-and-shape accuracy per size bucket and aspect bucket (~3 min).
eval-micro-vision: install
	nice $(BIN)/python -m kimi_mlx.micro.vision_train --eval-only kimi_mlx/assets/micro-vision

bench-spec: install
	$(BIN)/kimi-mlx bench spec

# The proto's import path is kimi_mlx/cluster/net/ so the generated stub imports the installed package.
proto: install
	rm -rf build/proto && mkdir -p build/proto
	$(BIN)/python -m grpc_tools.protoc -Ikimi_mlx/cluster/net=cluster/net --python_out=build/proto --grpc_python_out=build/proto cluster/net/stage.proto
	cp build/proto/kimi_mlx/cluster/net/stage_pb2.py build/proto/kimi_mlx/cluster/net/stage_pb2_grpc.py cluster/net/

clean:
	rm -rf $(VENV) .venv-tools .venv-aider .clients build *.egg-info .pytest_cache
