# Two entry points: `make train` (the default job on the built-in dataset) and `make test`;
# `make docs` builds the MkDocs site into site/.
# Both create the virtual environment .venv when missing and install the package into it.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# torch/torchvision pinned to the builds the project is tested with (CUDA wheels run on CPU too)
TORCH_PINS ?= torch==2.14.1 torchvision==0.29.1

.PHONY: train test test-slow docs setup browser clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install $(TORCH_PINS)
	$(BIN)/pip install -e '.[test]'
	touch $@

setup: $(VENV)/.installed

# headless Chromium renders the built docs site in the docs test (Debian package; needs root)
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null)

train: setup
	$(BIN)/fastscale-train $(ARGS)

test: setup browser  # lint and import order (ruff, configured in pyproject.toml), then the suite
	$(BIN)/ruff check .
	$(BIN)/pytest -q $(PYTEST_ARGS)

test-slow: setup  # the multi-minute tests `make test` leaves out
	$(BIN)/pytest -q -m slow $(PYTEST_ARGS)

docs: setup
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) outputs multirun site
