# Two commands: `make run` starts everything, `make test` runs the suite.
# Both create the virtual environment on first use.

PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-compose lint schemas bench clean .env wheels

# A venv left half-made (no pip: the system lacked its venv package) or made
# with an older Python is made again, not reused on every later run.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { \
		echo "Python 3.11 or later is needed; $(PYTHON) is older (try PYTHON=python3.11)"; exit 1; }
	$(BIN)/python -c 'import sys, pip; assert sys.version_info >= (3, 11)' 2>/dev/null \
		|| { rm -rf $(VENV) && $(PYTHON) -m venv $(VENV); }
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python scripts/run.py

# Three workers, a file each at a time, each worker with a NATS of its own:
# the tests mostly wait on processes, so even on two cores a third worker
# cuts the run by a fifth (6 min 34 s against 8 min 12 s, docs/performance.md).
# Against one given NATS_URL, workers would answer each other's queries, so
# they run one at a time.
TEST_WORKERS ?= $(if $(NATS_URL),0,3)

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile

# compose.yaml on a real Docker engine (started here if none answers), with
# images built locally: see tests/test_compose.py.
test-compose: $(STAMP)
	scripts/with_docker.sh $(BIN)/python -m pytest -q -m compose tests/test_compose.py

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/mypy services schemas

# The contract's files, both made from schemas/: run after changing a message.
schemas: $(STAMP)
	$(BIN)/python scripts/export_schemas.py
	$(BIN)/python scripts/export_asyncapi.py

# The NATS passwords for compose, made once (mode 0600, never committed). Run
# again, it keeps those made and adds any a newer version needs.
.env: $(STAMP)
	$(BIN)/python scripts/nats_passwords.py .env

# What an image build without PyPI installs (WHEELS_ONLY=1, see wheels/README):
# the project's dependencies; the project itself is built from its sources.
wheels: $(STAMP)
	$(BIN)/python -m pip wheel --quiet --wheel-dir wheels . setuptools
	rm -f wheels/compacting_chat-*.whl

bench: $(STAMP)
	$(BIN)/python scripts/bench.py

clean:
	rm -rf $(VENV) .data .pytest_cache .mypy_cache .ruff_cache
