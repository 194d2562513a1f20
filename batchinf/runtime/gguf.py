"""Read a GGUF file (llama.cpp's format) and convert a Llama-family model into an HF-format directory
(config.json, model.safetensors, tokenizer.json, tokenizer_config.json, generation_config.json).

Our own reader: header, metadata, tensor infos; blocks are dequantised by
batchinf.runtime.gguf_quants (SUPPORTED_GGUF_TYPES: the float types, Q4_0 to Q8_0, the K-quants
Q2_K to Q6_K, IQ4_NL and IQ4_XS). llama.cpp's converter permutes the rows of Q and K of `llama` models for its
interleaved rotary; `unpermute` undoes that so the weights fit HF's rotate-half rotary again.
"""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch
from safetensors.torch import save_file

from batchinf.errors import BundleError
from batchinf.runtime.gguf_vocab import build_tokenizer
from batchinf.runtime.gguf_quants import GGML_TYPES, SUPPORTED_GGUF_TYPES, dequantize

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
MAX_DIMS = 4                # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4         # metadata arrays of arrays

# Metadata value types: id -> (struct format, size); 8 = string, 9 = array.
_SCALARS = {0: ("<B", 1), 1: ("<b", 1), 2: ("<H", 2), 3: ("<h", 2), 4: ("<I", 4), 5: ("<i", 4),
            6: ("<f", 4), 7: ("<?", 1), 10: ("<Q", 8), 11: ("<q", 8), 12: ("<d", 8)}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]     # torch order (GGUF lists the fastest-varying dimension first)
    ggml_type: int
    offset: int                # from the start of the data section


class GGUFFile:
    """Metadata and lazily dequantised tensors of one GGUF file (memory-mapped)."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:     # the map keeps its own handle
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            raise BundleError(f"cannot read GGUF file {self.path}: {e}") from e
        self._pos = 0
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError, ValueError, OverflowError) as e:
            self._mm.close()
            raise BundleError(f"{self.path} is not a valid GGUF file (truncated or corrupt header: {e})") from e
        except BundleError:
            self._mm.close()
            raise

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- header --

    def _read(self, fmt: str, size: int) -> Any:
        value = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += size
        return value

    def _fits(self, count: int, each: int, what: str) -> None:
        """`count` items of at least `each` bytes must fit in the rest of the file (a crafted
        header cannot make the reader allocate or loop past the file's size)."""
        left = len(self._mm) - self._pos
        if count * each > left:
            raise BundleError(f"{self.path}: header at byte {self._pos} claims {count} {what} "
                              f"({count * each} bytes or more), but only {left} bytes are left in the file "
                              "(truncated or corrupt file)")

    def _string(self) -> str:
        n = self._read("<Q", 8)
        self._fits(n, 1, "bytes of string")
        s = self._mm[self._pos:self._pos + n].decode("utf-8")
        self._pos += n
        return s

    def _value(self, vtype: int, depth: int = 0) -> Any:
        if vtype in _SCALARS:
            return self._read(*_SCALARS[vtype])
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            if depth >= MAX_ARRAY_DEPTH:
                raise BundleError(f"{self.path}: metadata arrays nested deeper than {MAX_ARRAY_DEPTH} levels")
            itype, n = self._read("<I", 4), self._read("<Q", 8)
            if itype in _SCALARS:   # numeric arrays in one read
                fmt, size = _SCALARS[itype]
                self._fits(n, size, "array items")
                arr = np.frombuffer(self._mm, dtype=np.dtype(fmt), count=n, offset=self._pos)
                self._pos += n * size
                return arr.tolist()
            if itype not in (_STRING, _ARRAY):
                raise BundleError(f"{self.path}: unknown GGUF metadata array item type {itype}")
            self._fits(n, 8 if itype == _STRING else 12, "array items")
            return [self._value(itype, depth + 1) for _ in range(n)]
        raise BundleError(f"{self.path}: unknown GGUF metadata value type {vtype}")

    def _parse(self) -> None:
        if self._mm[:4] != GGUF_MAGIC:
            raise BundleError(f"{self.path} is not a GGUF file (magic {self._mm[:4]!r}, expected b'GGUF')")
        self._pos = 4
        self.version = self._read("<I", 4)
        if self.version not in (2, 3):
            raise BundleError(f"{self.path}: GGUF version {self.version} is not supported (2 and 3 are)")
        n_tensors, n_kv = self._read("<Q", 8), self._read("<Q", 8)
        self._fits(n_kv, 13, "metadata entries")          # key length, value type, smallest value
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._read("<I", 4))
        self._fits(n_tensors, 24, "tensor infos")         # name length, n_dims, type, offset
        self.tensors: dict[str, TensorInfo] = {}
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I", 4)
            if not 1 <= n_dims <= MAX_DIMS:
                raise BundleError(f"{self.path}: tensor {name!r} has {n_dims} dimensions (GGUF allows 1 to {MAX_DIMS})")
            dims = [self._read("<Q", 8) for _ in range(n_dims)]
            if 0 in dims:
                raise BundleError(f"{self.path}: tensor {name!r} has an empty dimension {dims}")
            ggml_type, offset = self._read("<I", 4), self._read("<Q", 8)
            self.tensors[name] = TensorInfo(name, tuple(reversed(dims)), ggml_type, offset)
        align = self.metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align <= 0 or align & (align - 1) or align > 1 << 20:
            raise BundleError(f"{self.path}: general.alignment {align!r} is not a power of two up to 1 MiB")
        self.data_start = (self._pos + align - 1) // align * align
        for info in self.tensors.values():
            self._extent(info)

    def _extent(self, info: TensorInfo) -> tuple[int, int]:
        """(start, n_blocks) of a tensor's data, checked against the file: element counts are Python
        ints (numpy's product of crafted dims wraps around to 0)."""
        if info.ggml_type not in GGML_TYPES:
            return self.data_start + info.offset, 0     # refused with its name when it is read
        _, block, nbytes, _ = GGML_TYPES[info.ggml_type]
        count = math.prod(info.shape)
        if info.shape[-1] % block:      # ggml quantises row by row: blocks never straddle rows
            raise BundleError(f"{self.path}: tensor {info.name} has rows of {info.shape[-1]} elements, not a "
                              f"multiple of its type's block of {block}")
        n_blocks = count // block
        start = self.data_start + info.offset
        if start + n_blocks * nbytes > len(self._mm):
            raise BundleError(f"{self.path}: tensor {info.name} ({'x'.join(map(str, info.shape))}, "
                              f"{n_blocks * nbytes} bytes at offset {info.offset}) runs past the end of the "
                              f"file ({len(self._mm)} bytes; truncated download?)")
        return start, n_blocks

    # -- tensors --

    def tensor(self, name: str) -> np.ndarray:
        """Dequantised float32 array in torch order."""
        info = self.tensors[name]
        if info.ggml_type not in GGML_TYPES:
            raise BundleError(f"{self.path}: tensor {name} has ggml type {info.ggml_type}, which batchinf "
                              f"cannot dequantise (supported: {', '.join(SUPPORTED_GGUF_TYPES)}); "
                              "convert the file with llama.cpp to one of those")
        nbytes = GGML_TYPES[info.ggml_type][2]
        start, n_blocks = self._extent(info)
        raw = np.frombuffer(self._mm, dtype=np.uint8, count=n_blocks * nbytes, offset=start)
        return dequantize(raw, info.ggml_type, math.prod(info.shape)).reshape(info.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved rotary -> HF rotate-half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- rope scaling ---------------------------------------------------------------------------------

def rope_scaling(meta: dict[str, Any], arch: str, freqs: np.ndarray | None, head_dim: int,
                 theta: float) -> dict[str, Any] | None:
    """HF's rope_scaling for a file's `{arch}.rope.scaling.*` metadata, or for its `rope_freqs` tensor
    (llama.cpp's converter writes Llama 3.x's scaling as per-frequency divisors, see `_llama3_from_freqs`)."""
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    orig = meta.get(f"{arch}.rope.scaling.original_context_length")
    if freqs is not None:
        if kind not in ("none", "linear") or (kind == "linear" and factor not in (None, 1.0)):
            raise BundleError(f"this file has both rope_freqs and rope scaling {kind!r}; batchinf cannot combine them")
        return _llama3_from_freqs(np.asarray(freqs, dtype=np.float64).reshape(-1), head_dim, theta, orig)
    if kind == "none" or (kind == "linear" and factor in (None, 1.0)):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(factor)}
    if kind == "yarn":
        out = {"rope_type": "yarn", "factor": float(factor), "original_max_position_embeddings": int(orig)}
        for ours, theirs in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{ours}" in meta:
                out[theirs] = float(meta[f"{arch}.rope.scaling.{ours}"])
        return out
    raise BundleError(f"rope scaling type {kind!r} is not supported (supported: none, linear, yarn, and Llama 3's "
                      "rope_freqs)")


def _llama3_from_freqs(r: np.ndarray, head_dim: int, theta: float, orig: int | None) -> dict[str, Any] | None:
    """Llama 3's rope parameters from llama.cpp's rope_freqs: per frequency, 1 for short wavelengths,
    `factor` for long ones and 1 / ((1 - s) / factor + s) between, s linear in 1 / wavelength. The
    divisors depend on the original context and the low/high frequency factors only through the two
    boundary wavelengths, so any split of those reproduces them; the result is checked against `r`."""
    if r.shape != (head_dim // 2,) or not np.isfinite(r).all() or (r < 1 - 1e-6).any():
        raise BundleError(f"rope_freqs must be {head_dim // 2} finite divisors >= 1, got shape {r.shape}; "
                          "this file's rope scaling is not Llama 3's")
    factor = float(r.max())
    if factor <= 1 + 1e-4:
        return None
    inv_wavelen = (1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim)) / (2 * math.pi)
    ones, full = r <= 1 + 1e-4, r >= factor * (1 - 1e-4)    # float32 divisors: not exactly 1 and factor
    mid = ~ones & ~full
    if mid.sum() >= 2:          # s = (1/wavelen - 1/L) / (1/H - 1/L) at every middle frequency
        s = (1 / r[mid] - 1 / factor) / (1 - 1 / factor)
        a, b = np.polyfit(inv_wavelen[mid], s, 1)
        inv_low, inv_high = -b / a, (1 - b) / a
    elif mid.sum() == 0:        # no middle: the boundaries lie between the last 1 and the first `factor`
        if not ones.any() or not full.any():
            return {"rope_type": "linear", "factor": factor}
        inv_high, inv_low = inv_wavelen[ones].min() * 0.999, inv_wavelen[full].max() * 1.001
    else:
        raise BundleError("rope_freqs has a single frequency between the unscaled and fully scaled ones; batchinf "
                          "cannot recover Llama 3's rope parameters from it")
    old = int(orig) if orig else 8192
    out = {"rope_type": "llama3", "factor": factor, "original_max_position_embeddings": old,
           "low_freq_factor": float(old * inv_low), "high_freq_factor": float(old * inv_high)}
    smooth = np.clip((inv_wavelen - inv_low) / (inv_high - inv_low), 0, 1)
    if not np.allclose(1 / ((1 - smooth) / factor + smooth), r, rtol=1e-5, atol=0):
        raise BundleError("rope_freqs does not follow Llama 3's rope scaling; batchinf cannot import this file's "
                          "rope (import the HF checkpoint instead)")
    return out


# --- conversion ----------------------------------------------------------------------------------

_ARCH = {"llama": ("llama", "LlamaForCausalLM", True), "qwen2": ("qwen2", "Qwen2ForCausalLM", False)}
_LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
                "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
                "attn_v.weight": "self_attn.v_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
                "attn_k.bias": "self_attn.k_proj.bias", "attn_v.bias": "self_attn.v_proj.bias",
                "attn_output.weight": "self_attn.o_proj.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
                "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}

def convert_gguf(path: Path | str, out: Path, *, dtype: str = "float32") -> Path:
    """Write an HF-format Llama-family model directory for a GGUF file into `out`. A file whose
    header or metadata is malformed (wrong types, missing keys, shapes that do not fit) raises
    BundleError saying so."""
    try:
        return _convert_gguf(path, out, dtype=dtype)
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError, OverflowError, RecursionError) as e:
        what = f"missing metadata {e}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        raise BundleError(f"{path}: malformed GGUF model ({what}); the file is corrupt or was not written "
                          "by llama.cpp's converter") from e


def _convert_gguf(path: Path | str, out: Path, *, dtype: str = "float32") -> Path:
    if dtype not in ("float32", "bfloat16"):
        raise BundleError(f"dtype {dtype!r} is not supported; use float32 or bfloat16")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with GGUFFile(path) as g:
        m = g.metadata
        arch = m.get("general.architecture")
        if arch not in _ARCH:
            raise BundleError(f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(_ARCH)}")
        model_type, hf_arch, permuted = _ARCH[arch]

        def key(name: str, default: Any = None) -> Any:
            value = m.get(f"{arch}.{name}", default)
            if value is None:
                raise BundleError(f"{path}: metadata {arch}.{name} is missing")
            return value

        heads, layers = int(key("attention.head_count")), int(key("block_count"))
        kv_heads = int(key("attention.head_count_kv", heads))
        tokens = m["tokenizer.ggml.tokens"]
        config: dict[str, Any] = {
            "architectures": [hf_arch], "model_type": model_type, "vocab_size": len(tokens),
            "hidden_size": int(key("embedding_length")), "intermediate_size": int(key("feed_forward_length")),
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "head_dim": int(key("rope.dimension_count", int(key("embedding_length")) // heads)),
            "max_position_embeddings": int(key("context_length")),
            "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(key("rope.freq_base", 10000.0)), "hidden_act": "silu",
            "tie_word_embeddings": "output.weight" not in g.tensors, "torch_dtype": dtype,
            "bos_token_id": m.get("tokenizer.ggml.bos_token_id"), "eos_token_id": m.get("tokenizer.ggml.eos_token_id"),
        }
        scaling = rope_scaling(m, arch, g.tensor("rope_freqs.weight") if "rope_freqs.weight" in g.tensors else None,
                               config["head_dim"], config["rope_theta"])
        if scaling:
            config["rope_scaling"] = scaling
        state: dict[str, torch.Tensor] = {}
        for name in g.tensors:
            if name == "rope_freqs.weight":
                continue                    # became config.rope_scaling
            if name in _TOP_NAMES:
                hf = _TOP_NAMES[name]
            elif name.startswith("blk.") and name.split(".", 2)[2] in _LAYER_NAMES:
                i, rest = name.split(".", 2)[1:]
                hf = f"model.layers.{i}.{_LAYER_NAMES[rest]}"
            else:
                raise BundleError(f"{path}: unexpected tensor {name!r} for a {arch} model")
            w = g.tensor(name)
            if permuted and name.endswith(("attn_q.weight", "attn_q.bias")):
                w = unpermute(w, heads)
            elif permuted and name.endswith(("attn_k.weight", "attn_k.bias")):
                w = unpermute(w, kv_heads)
            state[hf] = torch.from_numpy(np.ascontiguousarray(w)).to(getattr(torch, dtype))
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt", "source": Path(path).name})
        (out / "config.json").write_text(json.dumps(config, indent=2))
        build_tokenizer(m).save(str(out / "tokenizer.json"))

        def tok_at(key_: str) -> str | None:
            i = m.get(f"tokenizer.ggml.{key_}")
            return tokens[i] if i is not None else None

        tok_cfg = {"bos_token": tok_at("bos_token_id"), "eos_token": tok_at("eos_token_id"),
                   "pad_token": tok_at("padding_token_id"), "unk_token": tok_at("unknown_token_id"),
                   "add_bos_token": bool(m.get("tokenizer.ggml.add_bos_token", False)),
                   "model_max_length": config["max_position_embeddings"]}
        if m.get("tokenizer.chat_template"):
            tok_cfg["chat_template"] = m["tokenizer.chat_template"]
        (out / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"], "do_sample": False},
            indent=2))
    return out
