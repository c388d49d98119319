# The two commands of the README's quick start, and the steps they stand on.
# Everything installs from this repository's own files into .venv (pinned by constraints.txt).

PY      := .venv/bin/python
STAMP   := .venv/.installed-stamp
DATA    := data/shakespeare-byte/manifest.json

.PHONY: demo test test-quick lint install clean

# The main job: a coordinator and three nodes on loopback train together for three minutes.
demo: $(STAMP) $(DATA)
	$(PY) -m murmur.cli testnet up --nodes 3 --config configs/testnet-small.toml --duration 180

# The whole suite (what CI runs) on two workers, a test file to a worker: most of the process tests
# wait on their processes, so two workers fit two cores. TEST_WORKERS=0 runs it in this process.
# --no-loadscope-reorder keeps tests/conftest.py's order (the longest process files first, compose
# last): xdist would otherwise hand out the files with the most tests first.
TEST_WORKERS ?= 2
test: $(STAMP)
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The unit tier only (pyproject.toml's markers): what a contributor runs after each change.
test-quick: $(STAMP)
	$(PY) -m pytest -q -m unit -n $(TEST_WORKERS) --dist loadfile

lint: $(STAMP)
	.venv/bin/ruff check .

install: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || python3 -m venv .venv
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -c constraints.txt -e '.[dev]'
	touch $(STAMP)

$(DATA): $(STAMP)
	$(PY) -m murmur.cli data prepare --out data/shakespeare-byte

clean:
	rm -rf .venv data runs
