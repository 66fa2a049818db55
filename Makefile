# Developer commands. The buf CLI is a pinned npm devDependency (package.json),
# installed into node_modules/ on first use.
BUF := npx --no-install buf

.PHONY: install up test test-fast durations flaky-check lint gen gen-check lint-protos breaking

# The suite's pytest-xdist runners. Tests that share a mesh, or a module's fixtures, run on one runner
# (the groups: tests/conftest.py); each runner picks ports from its own slice.
TEST_RUNNERS ?= 2
PYTEST := python3 -m pytest -q -n $(TEST_RUNNERS) --dist loadgroup

# Everything the mesh and its tests need on a fresh Debian machine (idempotent).
install:
	scripts/install.sh

# The whole mesh on this machine, on the embedded default model.
up: install
	kvmesh up

# The test suite: installs, checks generated code, the contracts and the Python style, runs pytest
# (each test's and fixture's seconds into build/test-durations.json). The option's value is joined by "=":
# given apart, pytest's first pass over the arguments takes it for a path, and once build/ exists it looks
# for conftest.py files there instead of in tests/, so it never learns the option and the run stops.
test: install lint gen-check lint-protos breaking
	$(PYTEST) --durations-json=build/test-durations.json

# The inner loop: every test that starts no process and is not marked slow (docs/testing.md).
test-fast:
	$(PYTEST) -m "not processes and not slow"

# Run the suite and regenerate docs/test-durations.md: where the time goes, per folder, file and fixture.
durations:
	$(PYTEST) --durations-json=build/test-durations.json; status=$$?; \
	python3 scripts/test_durations.py build/test-durations.json > docs/test-durations.md; exit $$status

# The end-to-end set (whole meshes as real processes) three times in a row: any test whose outcome
# changed is named, and the check fails.
E2E_TESTS := tests/e2e tests/openai tests/clients tests/compose
flaky-check:
	python3 scripts/flaky_check.py --runs 3 --pytest-args "-n $(TEST_RUNNERS) --dist loadgroup" $(E2E_TESTS)

# ruff: lint and format check (configuration in pyproject.toml; `ruff format .` and `ruff check --fix .` mend).
lint:
	python3 -m ruff check .
	python3 -m ruff format --check .

# Regenerate kvmesh/api/ (Python), clients/go/gen/ and clients/typescript/src/gen/ from protos/.
gen: node_modules/.bin/buf
	scripts/gen_protos.sh

# Fail when any generated tree is stale (CI).
gen-check: node_modules/.bin/buf
	scripts/check_generated.sh

node_modules/.bin/buf: package.json package-lock.json
	npm ci --no-audit --no-fund
	touch $@

lint-protos: node_modules/.bin/buf
	$(BUF) lint protos

# Breaking-change check (FILE rules) against branch main's protos/. Skipped
# while main has no protos/buf.yaml yet (no commits, or the contracts are not
# merged): there is nothing to break.
breaking: node_modules/.bin/buf
	@if git cat-file -e main:protos/buf.yaml 2>/dev/null; then \
		$(BUF) breaking protos --against '.git#branch=main,subdir=protos'; \
	else \
		echo "breaking: skipped, branch main has no protos/buf.yaml to compare against"; \
	fi
