# Flotilla: `make run` opens the app, `make test` runs the whole suite.
# Both set everything up on a fresh Linux machine and skip what is done.

VENV    ?= .venv
PYTHON  ?= python3
PY      := $(VENV)/bin/python
PIP     := $(PY) -m pip
STAMP   := $(VENV)/.flotilla-installed
# Demo models and exported IRs go here, so tests and `make run` share one cache.
export FLOTILLA_CACHE ?= $(CURDIR)/.cache/flotilla

# System libraries Qt needs on a bare Debian/Ubuntu, xvfb for GUI screenshots,
# iproute2 for the multi-host tests (network namespaces).
SYSTEM_PKGS := libgl1 libegl1 libxkbcommon0 libxkbcommon-x11-0 libxcb-cursor0 \
               libxcb-icccm4 libxcb-keysyms1 libxcb-shape0 libxcb-randr0 \
               libxcb-render-util0 libxcb-image0 libxcb-xkb1 libfontconfig1 \
               libdbus-1-3 fonts-dejavu-core xvfb xauth iproute2 dpkg-dev binutils

.PHONY: run test setup sysdeps demo-models lint clean dist

run: setup demo-models
	$(VENV)/bin/flotilla

test: setup demo-models lint
	$(PY) -m pytest tests -q -p no:cacheprovider --durations=30

setup: sysdeps $(STAMP)

# Installs what is missing with apt when we are root on Debian/Ubuntu; elsewhere
# it only says what to install.
sysdeps:
	@missing=""; \
	if command -v dpkg-query >/dev/null 2>&1; then \
	  for p in $(SYSTEM_PKGS); do \
	    dpkg-query -W -f='$${Status}' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	  done; \
	fi; \
	if [ -n "$$missing" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    echo "installing system libraries for Qt:$$missing"; \
	    DEBIAN_FRONTEND=noninteractive apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $$missing >/dev/null; \
	  else \
	    echo "please install these system packages:$$missing"; \
	  fi; \
	fi

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first, pinned: 2.13.0 is the CPU wheel; any other spec pulls a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q torch==2.13.0 -e '.[test]'
	# optimum-intel drags in torchvision, whose only build on PyPI is CUDA and
	# breaks `import optimum.intel` beside CPU torch ("operator torchvision::nms
	# does not exist"). Flotilla never uses it: remove it.
	$(PIP) uninstall -q -y torchvision || true
	$(PY) -c "import optimum.intel, openvino, torch; assert torch.__version__.startswith('2.13.0')"
	touch $(STAMP)

# Builds the bundled demo models into the cache if they are missing (seconds).
demo-models: setup
	$(VENV)/bin/flotilla models build-demos

# Architecture contracts: engine never imports app or Qt; app reaches the
# engines only through engine.protocol and engine.client.
lint: setup
	$(VENV)/bin/lint-imports --no-cache

# Installers: the Linux package (.deb) into dist/, built by installers/build.py
# from a clean copy of the tree; reuses a cached build of the same sources
# (build/dist-cache). PyInstaller comes from the `dist` extra. docs/install.md.
dist: setup
	# only the extra's own requirements: re-resolving '.[dist]' would bring torchvision back.
	$(PY) -c "import PyInstaller" 2>/dev/null || $(PIP) install -q $$($(PY) -m installers.project dist-requirements)
	$(PY) -m installers.build --out dist

clean:
	rm -rf $(VENV) .cache build dist *.egg-info
