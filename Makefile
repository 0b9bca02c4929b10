# Two commands matter: `make run` (install everything, start the system) and
# `make test` (install everything, run linters, type checks and all tests).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NODE_STAMP := node_modules/.installed
NPX := npx --no-install
# buf breaking compares protos/ with this commit (CI tests a fresh clone of
# main, so HEAD~1 is the state before the change under test).
BUF_AGAINST ?= HEAD~1
PY_DIRS := services gateway tests scripts bench
export AGENTIM_DATA_DIR ?= $(CURDIR)/data

.PHONY: run test install system-deps gen check-gen lint typecheck buf-lint buf-breaking \
	compose-config pytest faults bench clean

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -c constraints.txt -e ".[dev]"
	touch $@

$(NODE_STAMP): package.json package-lock.json
	npm ci --no-audit --no-fund --loglevel=error
	touch $@

# Debian's docker-compose validates docker-compose.yml offline (no Docker
# engine runs here), Debian's chromium runs the browser test (npm's
# playwright-core drives it; `npx playwright install` cannot download
# browsers here), and Debian's libfaketime skews the clocks of runtime
# replicas in the clock-skew fault case. Each is installed only when
# missing, so a second run costs nothing; without root their tests skip
# (and fail in CI).
system-deps:
	@if command -v docker-compose >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's docker-compose"; \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker-compose; \
	else \
		echo "notice: docker-compose is missing and this is not root;" \
			"run 'sudo apt-get install -y docker-compose', or its tests will skip"; \
	fi
	@if [ -x /usr/bin/chromium ]; then \
		:; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's chromium"; \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; \
	else \
		echo "notice: /usr/bin/chromium is missing and this is not root;" \
			"run 'sudo apt-get install -y chromium', or the browser test will skip"; \
	fi
	@if ls /usr/lib/*/faketime/libfaketime.so.1 >/dev/null 2>&1; then \
		:; \
	elif [ "$$(id -u)" = 0 ]; then \
		echo "installing Debian's libfaketime"; \
		apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libfaketime; \
	else \
		echo "notice: libfaketime is missing and this is not root;" \
			"run 'sudo apt-get install -y libfaketime', or the clock-skew fault case will skip"; \
	fi

install: $(STAMP) $(NODE_STAMP) system-deps

gen: $(STAMP)
	$(BIN)/python scripts/gen_protos.py

check-gen: $(STAMP)
	$(BIN)/python scripts/gen_protos.py --check

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

# mypy refuses a directory with no Python file in it (bench/ may be empty).
TYPED_DIRS = $(foreach d,$(PY_DIRS),$(if $(shell find $(d) -name '*.py' -print -quit 2>/dev/null),$(d)))

typecheck: $(STAMP)
	$(BIN)/mypy $(TYPED_DIRS)

buf-lint: $(NODE_STAMP)
	$(NPX) buf lint

# Skips (saying why) where there is nothing to compare with: outside git, on
# the first commit, in a shallow clone without the parent, or when the
# parent has no protos/ yet (the API's first release).
buf-breaking: $(NODE_STAMP)
	@if ! git rev-parse --is-inside-work-tree >/dev/null 2>&1; then \
		echo "buf-breaking: skipped: not a git work tree"; \
	elif ! against=$$(git rev-parse --verify --quiet '$(BUF_AGAINST)^{commit}'); then \
		if [ "$$(git rev-parse --is-shallow-repository)" = true ]; then \
			echo "buf-breaking: skipped: shallow clone without $(BUF_AGAINST)" \
				"(git fetch --deepen=1 to check)"; \
		else \
			echo "buf-breaking: skipped: $(BUF_AGAINST) does not exist (first commit)"; \
		fi; \
	elif ! git cat-file -e "$$against:protos" 2>/dev/null; then \
		echo "buf-breaking: skipped: $(BUF_AGAINST) has no protos/ (first release of the API)"; \
	else \
		echo "buf-breaking: protos/ against $(BUF_AGAINST) ($$(git rev-parse --short $$against))"; \
		$(NPX) buf breaking --against ".git#ref=$$against,subdir=protos"; \
	fi

compose-config: system-deps
	docker-compose -f docker-compose.yml config -q

pytest: install
	$(BIN)/pytest -q -n auto --dist worksteal

test: install check-gen lint typecheck buf-lint buf-breaking pytest

# The fault suite (tests/faults/, also part of `make test`) with every fault
# repeated more often; its figures go to docs/reliability.md.
faults: install
	FAULTS_LONG=1 $(BIN)/pytest -q -s tests/faults

# The whole system (IM service, memory service, agent runtime, gateway) on the embedded default:
# SQLite under $(AGENTIM_DATA_DIR), in-process signals, the offline model
# unless OPENAI_BASE_URL is set.
run: $(STAMP)
	$(BIN)/python -m services.run_all

# Benchmarks (not part of `make test`); figures go to docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python -m bench.im_bench

clean:
	rm -rf $(VENV) node_modules data .mypy_cache .ruff_cache .pytest_cache
