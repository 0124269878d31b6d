# The two commands of the README: `make demo` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
COMFY ?= $(if $(RINGSWAP_COMFYUI),$(RINGSWAP_COMFYUI),$(CURDIR)/.comfyui)
export RINGSWAP_COMFYUI_DIR := $(COMFY)

.PHONY: env demo test test-gpu device-wheels clean

env: $(VENV)/.ringswap-ready $(COMFY)/main.py $(VENV)/.ringswap-033-ready

$(VENV)/.ringswap-ready $(COMFY)/main.py $(VENV)/.ringswap-033-ready: scripts/setup_env.sh requirements-dev.txt requirements.txt
	./scripts/setup_env.sh

demo: env
	$(PY) scripts/demo.py

test: env
	./scripts/test_all.sh

test-gpu: env
	$(PY) -m pytest -q -m gpu tests/comfyui

device-wheels:
	./scripts/prepare_device_wheels.sh

clean:
	rm -rf $(VENV) .comfyui .comfyui-0.33 .whl
