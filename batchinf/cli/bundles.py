"""`batchinf bundle`: import a model directory or a GGUF file, list, verify, alias."""

from __future__ import annotations

from typing import Any

import click
from rich.table import Table

from batchinf.cli.common import emit, friendly, json_option, stdout_console


@click.group("bundle")
def bundle() -> None:
    """Model bundles: import, list, verify, alias."""


def endpoint_options(fn: Any) -> Any:
    """--engine openai-http and the server it names (pinned into the bundle)."""
    for opt in reversed([
        click.option("--engine", type=click.Choice(["native", "openai-http"]), default="native", show_default=True,
                     help="openai-http: the bundle is executed by the OpenAI-compatible server at --base-url; its "
                          "answers to the fixture prompts are pinned now"),
        click.option("--base-url", default=None, help="--engine openai-http: the server, e.g. http://127.0.0.1:8080/v1"),
        click.option("--served-model", default=None, help="--engine openai-http: the server's model name"),
        click.option("--api-key-env", default=None,
                     help="--engine openai-http: the worker's variable holding the key (BATCHINF_OPENAI_HTTP_*; "
                          "default BATCHINF_OPENAI_HTTP_API_KEY)"),
        click.option("--concurrency", type=int, default=None, help="--engine openai-http: requests in flight per worker"),
    ]):
        fn = opt(fn)
    return fn


def endpoint_of(engine: str, base_url: str | None, served_model: str | None, api_key_env: str | None,
                concurrency: int | None) -> dict[str, Any] | None:
    if engine != "openai-http":
        if base_url or served_model:
            raise click.BadParameter("only with --engine openai-http", param_hint="--base-url/--served-model")
        return None
    if not base_url or not served_model:
        raise click.BadParameter("--engine openai-http needs --base-url and --served-model", param_hint="--engine")
    from batchinf.engines.openai_http import endpoint_spec

    return endpoint_spec(base_url, served_model, api_key_env=api_key_env, concurrency=concurrency)


@bundle.command("import")
@click.argument("directory", type=click.Path(exists=True, file_okay=False))
@click.option("--name", required=True)
@click.option("--alias", default=None)
@click.option("--max-length", type=int, default=None, help="Default: the model's own setting.")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default="float32",
              show_default=True, help="Compute dtype on CUDA (CPU always runs float32).")
@click.option("--precision", type=click.Choice(["float32", "int8"]), default="float32", show_default=True,
              help="int8: int8 linear layers on CPU (BERT-family embedding models), refused unless the fixtures "
                   "stay within cosine 0.995 of float32.")
@click.option("--int8-scheme", type=click.Choice(["vnni", "avx2"]), default=None,
              help="--precision int8: vnni (8-bit weights, every projection int8; runs only on CPUs with AVX-512 "
                   "VNNI or AVX-VNNI) or avx2 (7-bit weights, the FFN output in float32; runs on any x86-64). "
                   "Default: vnni where this CPU has VNNI.")
@click.option("--matryoshka-dims", default=None, metavar="N,N,...",
              help="Embedding models trained for truncation (Matryoshka): the vector sizes they may be cut to, "
                   "e.g. 256,128,64; requests may then ask for `dimensions`.")
@click.option("--onnx", is_flag=True, default=False,
              help="Encoders (embed, score, classify): add an ONNX export for the onnxruntime engine (ONNX Runtime's "
                   "BERT optimizer; int8: its dynamic quantizer), checked against the fixtures; the bundle declares "
                   "onnxruntime when it measures faster than native here. Needs pip install 'batchinf[onnx]'.")
@endpoint_options
@json_option
@friendly
def bundle_import(directory: str, name: str, alias: str | None, max_length: int | None, dtype: str,
                  precision: str, int8_scheme: str | None, matryoshka_dims: str | None, onnx: bool, engine: str,
                  base_url: str | None, served_model: str | None, api_key_env: str | None, concurrency: int | None,
                  as_json: bool) -> None:
    """Import a model directory as a bundle; prints its digest."""
    from batchinf.bundles import import_bundle

    try:
        dims = [int(d) for d in matryoshka_dims.split(",")] if matryoshka_dims else None
    except ValueError:
        raise click.BadParameter(f"{matryoshka_dims!r} is not a comma-separated list of sizes",
                                 param_hint="--matryoshka-dims") from None
    if int8_scheme and precision != "int8":
        raise click.BadParameter("only with --precision int8", param_hint="--int8-scheme")
    info = import_bundle(directory, name, alias=alias, max_length=max_length, dtype=dtype, matryoshka_dims=dims,
                         precision=precision, int8_scheme=int8_scheme, onnx=onnx,
                         endpoint=endpoint_of(engine, base_url, served_model, api_key_env, concurrency))
    emit(info.to_dict(), as_json, lambda i: click.echo(i["digest"]))


@bundle.command("import-gguf")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", required=True)
@click.option("--alias", default=None)
@click.option("--dtype", type=click.Choice(["float32", "bfloat16"]), default="float32", show_default=True,
              help="Stored weights and CUDA compute dtype (CPU always runs float32).")
@endpoint_options
@json_option
@friendly
def bundle_import_gguf(file: str, name: str, alias: str | None, dtype: str, engine: str, base_url: str | None,
                       served_model: str | None, api_key_env: str | None, concurrency: int | None,
                       as_json: bool) -> None:
    """Convert a GGUF Llama-family model (dequantised) into a bundle; prints its digest."""
    from batchinf.bundles import import_gguf

    info = import_gguf(file, name, alias=alias, dtype=dtype,
                       endpoint=endpoint_of(engine, base_url, served_model, api_key_env, concurrency))
    emit(info.to_dict(), as_json, lambda i: click.echo(i["digest"]))


@bundle.command("list")
@json_option
@friendly
def bundle_list(as_json: bool) -> None:
    """List imported bundles and their aliases."""
    from batchinf.bundles import list_bundles

    def human(rows: list[dict[str, Any]]) -> None:
        t = Table("name", "digest", "task", "aliases")
        for b in rows:
            t.add_row(b["name"], b["digest"], b["task"], ", ".join(b["aliases"]))
        stdout_console().print(t)

    emit([b.to_dict() for b in list_bundles()], as_json, human)


@bundle.command("verify")
@click.argument("ref")
@json_option
@friendly
def bundle_verify(ref: str, as_json: bool) -> None:
    """Check every file digest and fixture of a bundle (NAME, NAME@ALIAS or sha256:HEX)."""
    from batchinf.bundles import verify_bundle

    emit(verify_bundle(ref), as_json, lambda r: click.echo(f"ok {r['digest']}"))


@bundle.command("alias")
@click.argument("ref")
@click.argument("digest")
@json_option
@friendly
def bundle_alias(ref: str, digest: str, as_json: bool) -> None:
    """Point NAME@ALIAS at DIGEST. Jobs already submitted keep the digest they resolved."""
    from batchinf.bundles import set_alias

    set_alias(ref, digest)
    emit({"alias": ref, "digest": digest}, as_json, lambda r: click.echo(f"{r['alias']} -> {r['digest']}"))


COMMANDS = [bundle]
