# Developer commands. The buf CLI is a pinned npm devDependency (package.json),
# installed into node_modules/ on first use.
BUF := npx --no-install buf

.PHONY: install up test lint gen gen-check lint-protos breaking

# Everything the mesh and its tests need on a fresh Debian machine (idempotent).
install:
	scripts/install.sh

# The whole mesh on this machine, on the embedded default model.
up: install
	kvmesh up

# The test suite: installs, checks generated code, the contracts and the Python style, runs pytest.
test: install lint gen-check lint-protos breaking
	python3 -m pytest -q

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
