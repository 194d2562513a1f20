"""GGUF files made by llama.cpp's own converter (convert_hf_to_gguf.py, with its gguf-py, from the
`llama-cpp-python` source package on PyPI) from tiny HF model directories, so the import is tested
on what llama.cpp really writes (tensor names, metadata keys, Gemma's folded norm offset).

The converter is extracted once into the tool cache (see llama_quantize.cache_dir()); converted files
are cached there too, keyed by the digest of the HF directory. The converter recognises BPE
tokenizers by a hash of their output; the tiny test tokenizer is unknown to it, so the driver names it
`gpt-2`, which is what it is (byte-level BPE, GPT-2's split; the parity test checks that). Gemma 2's
converter insists on a SentencePiece tokenizer.model (and Qwen's imports sentencepiece before looking
for one); the driver gives them the BPE path Gemma 3's converter takes when that file is absent."""

from __future__ import annotations

import fcntl
import hashlib
import os
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.helpers.llama_quantize import VERSION, cache_dir
from tests.helpers.services import unavailable

_DRIVER = """
import sys
sys.path[:0] = [sys.argv[1], sys.argv[1] + "/gguf-py"]
sys.argv = ["convert_hf_to_gguf.py"] + sys.argv[2:]
import conversion.base as base
import conversion.gemma as gemma
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def no_sentencepiece(self, *args, **kwargs):
    raise FileNotFoundError("no tokenizer.model")
base.TextModel._set_vocab_sentencepiece = no_sentencepiece
def gemma2_vocab(self):
    self._set_vocab_gpt2()
gemma.Gemma2Model.set_vocab = gemma2_vocab
import runpy
runpy.run_path(sys.path[0] + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def converter_dir() -> Path:
    """vendor/llama.cpp of the extracted sdist: convert_hf_to_gguf.py, conversion/ and gguf-py/."""
    root = cache_dir() / f"llama-convert-{VERSION}"
    src = root / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if (src / "convert_hf_to_gguf.py").is_file():
        return src
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (src / "convert_hf_to_gguf.py").is_file():
            return src
        sdist = root / f"llama_cpp_python-{VERSION}.tar.gz"
        if not sdist.is_file():
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                                f"llama-cpp-python=={VERSION}", "-d", str(root)],
                               capture_output=True, text=True, timeout=900)
            if r.returncode or not sdist.is_file():
                unavailable(f"downloading the llama-cpp-python {VERSION} sdist failed: {r.stderr[-500:]}")
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        with tarfile.open(sdist) as tf:
            members = [m for m in tf.getmembers() if m.name == prefix + "convert_hf_to_gguf.py"
                       or m.name.startswith((prefix + "conversion/", prefix + "gguf-py/"))]
            tf.extractall(root, members=members, filter="data")
    return src


def hf_to_gguf(hf_dir: Path, outtype: str = "f32") -> Path:
    """`hf_dir` converted by llama.cpp's converter to a GGUF file of `outtype` (f32, f16, bf16, q8_0)."""
    digest = hashlib.sha256()
    for f in sorted(Path(hf_dir).iterdir()):
        if f.is_file():
            digest.update(f.name.encode() + b"\0" + f.read_bytes())
    out = cache_dir() / "tiny-gguf" / f"{digest.hexdigest()[:20]}.{outtype}.gguf"
    if out.is_file():
        return out
    src = converter_dir()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.part")   # parallel test workers may convert the same model
    r = subprocess.run([sys.executable, "-c", _DRIVER, str(src), str(hf_dir), "--outtype", outtype,
                        "--outfile", str(tmp)], capture_output=True, text=True, timeout=600)
    if r.returncode or not tmp.is_file():
        raise RuntimeError(f"convert_hf_to_gguf.py failed on {hf_dir}:\n{r.stdout[-2000:]}\n{r.stderr[-3000:]}")
    tmp.replace(out)
    return out
