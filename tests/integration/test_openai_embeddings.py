"""Embeddings batches as OpenAI serves them, against sentence-transformers' own vectors for
all-MiniLM-L6-v2, through a real embedded `batchinf serve` and the official `openai` client: list
input in order, token arrays, `dimensions` on a bundle declaring Matryoshka sizes (ST's
`truncate_dim`, normalised), `encoding_format: base64` decoded by the SDK's own parser, and a line
with any bad input failing whole."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers.corpus import texts
from tests.helpers.openai_server import Server, file_lines, serving, upload, wait_for
from tests.helpers.real_models import minilm_dir

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")


def bundle_import(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchinf.cli", "bundle", "import", str(minilm_dir()), *args],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False)


def import_minilm(root: Path) -> None:
    r = bundle_import("--name", "minilm", "--alias", "prod", "--matryoshka-dims", "256,128", "--json")
    assert r.returncode == 0, r.stderr
    bad = bundle_import("--name", "bad", "--matryoshka-dims", "512")     # beyond the model's 384
    assert bad.returncode != 0 and "between 1 and the model's 384 dimensions" in bad.stderr, bad.stderr


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("oai-emb"), ["--workers", "1", "--device", "cpu", "--threads", "1"],
                 import_minilm) as srv:
        yield srv


def sdk_body(body: dict[str, Any]) -> Any:
    """A response body as the SDK's `client.embeddings.create` hands it back when the caller did not
    choose a format: built as the SDK builds responses, base64 vectors decoded by its own parser."""
    from openai._models import construct_type
    from openai._types import omit
    from openai.lib._parsing._embeddings import parse_embedding_response
    from openai.types import CreateEmbeddingResponse

    parsed = parse_embedding_response(construct_type(type_=CreateEmbeddingResponse, value=body),
                                      encoding_format=omit)
    return CreateEmbeddingResponse.model_validate(parsed.model_dump())    # floats now: the model validates


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": "minilm@prod", **body}}


def test_list_input_dimensions_and_base64_match_sentence_transformers(served: Server, tmp_path: Path) -> None:
    from sentence_transformers import SentenceTransformer

    t = texts(9, seed=11)
    st = SentenceTransformer(str(minilm_dir()), device="cpu")
    full = st.encode(t, normalize_embeddings=True, convert_to_numpy=True)
    short = SentenceTransformer(str(minilm_dir()), device="cpu", truncate_dim=128).encode(
        t, normalize_embeddings=True, convert_to_numpy=True)
    ids = st.tokenizer(t[6])["input_ids"]
    neutral = {"user": "u-1", "prompt_cache_key": "k", "safety_identifier": "s", "service_tier": "auto",
               "metadata": {"team": "search"}}
    lines = [line("list", input=[t[0], t[1], t[2]], **neutral),
             line("one", input=t[3], encoding_format="base64"),
             line("dims", input=[t[4], t[5]], dimensions=128, encoding_format="base64"),
             line("ids", input=ids),
             line("id-lists", input=[ids, st.tokenizer(t[7])["input_ids"]], encoding_format="float"),
             line("bad-id", input=[ids, [101, 10 ** 6, 102]]),         # one bad input: the whole line fails
             line("mixed", input=[t[8], [101, 102]]),
             line("dims-100", input=t[8], dimensions=100),             # not a size the bundle declares
             line("too-many", input=["x"] * 2049)]
    client = served.client()
    f = upload(client, lines, tmp_path, "emb")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    b = wait_for(client, b.id, {"completed", "failed"}, log=served.log)
    assert b.status == "completed", b
    out = {x["custom_id"]: x for x in file_lines(client, b.output_file_id)}
    err = {x["custom_id"]: x for x in file_lines(client, b.error_file_id)}
    assert sorted(out) == ["dims", "id-lists", "ids", "list", "one"]
    assert {k: v["error"]["code"] for k, v in err.items()} == {
        "bad-id": "invalid_input", "mixed": "invalid_input", "dims-100": "unsupported_dimensions",
        "too-many": "invalid_input"}
    assert "vocabulary" in err["bad-id"]["error"]["message"] and "body.input[1]" in err["bad-id"]["error"]["message"]
    assert "256, 128" in err["dims-100"]["error"]["message"]
    assert err["bad-id"]["response"]["status_code"] == 400

    def vectors(custom_id: str) -> tuple[Any, np.ndarray]:
        body = sdk_body(out[custom_id]["response"]["body"])
        assert [d.index for d in body.data] == list(range(len(body.data))) and body.model == "minilm@prod"
        return body, np.asarray([d.embedding for d in body.data], dtype=np.float32)

    body, got = vectors("list")
    assert np.allclose(got, full[:3], atol=2e-5)             # one response, the inputs' order
    lengths = [len(x) for x in st.tokenizer(t[:3])["input_ids"]]
    assert body.usage.prompt_tokens == body.usage.total_tokens == sum(lengths)
    assert isinstance(out["one"]["response"]["body"]["data"][0]["embedding"], str)     # base64 on the wire
    assert np.allclose(vectors("one")[1], full[3:4], atol=2e-5)
    _, got = vectors("dims")
    assert got.shape == (2, 128) and np.allclose(got, short[4:6], atol=2e-5)
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert np.allclose(vectors("ids")[1], full[6:7], atol=2e-5)
    assert np.allclose(vectors("id-lists")[1], full[6:8], atol=2e-5)


def test_a_job_with_options_dimensions_gives_truncated_normalised_vectors(served: Server, tmp_path: Path) -> None:
    import json

    import yaml
    from sentence_transformers import SentenceTransformer

    from batchinf.parts import read_table
    from tests.helpers.corpus import manifest, write_jsonl

    src = tmp_path / "in.jsonl"
    write_jsonl(src, 12, seed=4, bad=False)
    m = tmp_path / "m.yaml"
    m.write_text(yaml.safe_dump(manifest(str(src), str(tmp_path / "out"), bundle="minilm@prod",
                                         options={"dimensions": 256})))
    r = served.cli("submit", str(m), "--wait", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "succeeded", r.stderr
    rows = sorted(read_table(str(tmp_path / "out" / "part-00000.parquet")).to_pylist(), key=lambda x: x["record_id"])
    got = np.asarray([x["embedding"] for x in rows], dtype=np.float32)
    text = {json.loads(x)["id"]: json.loads(x)["text"] for x in src.read_text().splitlines()}
    want = SentenceTransformer(str(minilm_dir()), device="cpu", truncate_dim=256).encode(
        [text[x["record_id"]] for x in rows], normalize_embeddings=True, convert_to_numpy=True)
    assert got.shape == (12, 256) and np.allclose(got, want, atol=2e-5)
