"""The reference for the speech engine: transformers' WhisperForConditionalGeneration built from a
CTranslate2 Whisper model.bin's own weights (read with batchinf.runtime.speech.ct2_file; the
fused self-attention QKV and cross-attention KV projections split back, the key projections'
zero biases dropped), and a plain greedy decoder over it with CTranslate2's suppression rules
(the config's suppress_ids always, blank and end-of-text at the first step)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch


def _weights(model_bin: Path) -> tuple[dict[str, np.ndarray], dict[str, int]]:
    from batchinf.runtime.speech.ct2_file import array, variables

    arrays, scalars = {}, {}
    for name, shape, dtype, raw in variables(model_bin):
        if shape:
            arrays[name] = array(shape, dtype, raw)
        else:
            scalars[name] = int(np.frombuffer(raw, {1: np.int8, 2: np.int16, 3: np.int32}.get(dtype, np.int8))[0])
    return arrays, scalars


def whisper_from_ct2(model_dir: Path) -> Any:
    """WhisperForConditionalGeneration (float32) with the weights of `model_dir`/model.bin (or model.ct2)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    model_bin = model_dir / "model.bin" if (model_dir / "model.bin").is_file() else model_dir / "model.ct2"
    w, s = _weights(model_bin)
    d_model = w["encoder/layer_norm/gamma"].shape[0]
    enc_layers = len({k.split("/")[1] for k in w if re.match(r"encoder/layer_\d+/", k)})
    dec_layers = len({k.split("/")[1] for k in w if re.match(r"decoder/layer_\d+/", k)})
    vocab = w["decoder/embeddings/weight"].shape[0]
    cfg = WhisperConfig(vocab_size=vocab, num_mel_bins=w["encoder/conv1/weight"].shape[1], d_model=d_model,
                        encoder_layers=enc_layers, decoder_layers=dec_layers,
                        encoder_attention_heads=s["encoder/num_heads"], decoder_attention_heads=s["decoder/num_heads"],
                        encoder_ffn_dim=w["encoder/layer_0/ffn/linear_0/weight"].shape[0],
                        decoder_ffn_dim=w["decoder/layer_0/ffn/linear_0/weight"].shape[0],
                        max_source_positions=w["encoder/position_encodings/encodings"].shape[0],
                        max_target_positions=w["decoder/position_encodings/encodings"].shape[0],
                        decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256, bos_token_id=50256)
    sd: dict[str, np.ndarray] = {}

    def linear(hf: str, ct: str, bias: bool = True) -> None:
        sd[f"{hf}.weight"] = w[f"{ct}/weight"]
        if bias:
            sd[f"{hf}.bias"] = w[f"{ct}/bias"]

    def norm(hf: str, ct: str) -> None:
        sd[f"{hf}.weight"], sd[f"{hf}.bias"] = w[f"{ct}/gamma"], w[f"{ct}/beta"]

    def split(hf: list[str], ct: str) -> None:
        ws, bs = np.split(w[f"{ct}/weight"], len(hf)), np.split(w[f"{ct}/bias"], len(hf))
        for name, wt, b in zip(hf, ws, bs):
            sd[f"{name}.weight"] = wt
            if not name.endswith("k_proj"):      # Whisper's key projections have no bias (CT2 stores zeros)
                sd[f"{name}.bias"] = b
            else:
                assert not b.any(), f"{ct}: a key bias that is not zero"

    for side in ("encoder", "decoder"):
        layers = enc_layers if side == "encoder" else dec_layers
        for i in range(layers):
            hf, ct = f"model.{side}.layers.{i}", f"{side}/layer_{i}"
            split([f"{hf}.self_attn.q_proj", f"{hf}.self_attn.k_proj", f"{hf}.self_attn.v_proj"],
                  f"{ct}/self_attention/linear_0")
            linear(f"{hf}.self_attn.out_proj", f"{ct}/self_attention/linear_1")
            norm(f"{hf}.self_attn_layer_norm", f"{ct}/self_attention/layer_norm")
            linear(f"{hf}.fc1", f"{ct}/ffn/linear_0")
            linear(f"{hf}.fc2", f"{ct}/ffn/linear_1")
            norm(f"{hf}.final_layer_norm", f"{ct}/ffn/layer_norm")
            if side == "decoder":
                linear(f"{hf}.encoder_attn.q_proj", f"{ct}/attention/linear_0")
                split([f"{hf}.encoder_attn.k_proj", f"{hf}.encoder_attn.v_proj"], f"{ct}/attention/linear_1")
                linear(f"{hf}.encoder_attn.out_proj", f"{ct}/attention/linear_2")
                norm(f"{hf}.encoder_attn_layer_norm", f"{ct}/attention/layer_norm")
        norm(f"model.{side}.layer_norm", f"{side}/layer_norm")
    linear("model.encoder.conv1", "encoder/conv1")
    linear("model.encoder.conv2", "encoder/conv2")
    sd["model.encoder.embed_positions.weight"] = w["encoder/position_encodings/encodings"]
    sd["model.decoder.embed_positions.weight"] = w["decoder/position_encodings/encodings"]
    sd["model.decoder.embed_tokens.weight"] = w["decoder/embeddings/weight"]
    sd["proj_out.weight"] = w["decoder/embeddings/weight"]
    model = WhisperForConditionalGeneration(cfg).eval()
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
                                                strict=False)
    assert not unexpected and not missing, (missing, unexpected)
    return model


def suppress_ids(model_dir: Path) -> tuple[list[int], list[int]]:
    config = json.loads((model_dir / "config.json").read_text())
    return config["suppress_ids"], config["suppress_ids_begin"]


@torch.no_grad()
def greedy(model: Any, features: np.ndarray, prompt: list[int], suppress: list[int], suppress_begin: list[int],
           eot: int, max_new: int = 200, no_timestamps: int | None = None, timestamps: bool = True) -> list[int]:
    """Greedy tokens after `prompt` (end-of-text excluded). With `timestamps`, openai-whisper's
    timestamp rules (as CTranslate2 applies them): <|notimestamps|> never; the first token a
    timestamp of at most 1 s; timestamps in pairs, never decreasing; a timestamp whenever their
    total probability beats the likeliest text token. Without, no timestamp at all."""
    enc = model.model.encoder(torch.from_numpy(features[None])).last_hidden_state
    tb = (no_timestamps or 50362) + 1
    ids = list(prompt)
    out: list[int] = []
    for step in range(max_new):
        logits = model(encoder_outputs=(enc,), decoder_input_ids=torch.tensor([ids])).logits[0, -1].clone()
        logits[suppress] = -np.inf
        if step == 0:
            logits[suppress_begin] = -np.inf
        if not timestamps:
            logits[tb - 1:] = -np.inf
        else:
            logits[tb - 1] = -np.inf
            last_ts = len(out) >= 1 and out[-1] >= tb
            before_ts = len(out) < 2 or out[-2] >= tb
            if last_ts:
                if before_ts:
                    logits[tb:] = -np.inf           # a pair closed: text next
                else:
                    logits[:eot] = -np.inf          # a segment's end: a timestamp (or end-of-text) next
            stamps = [t for t in out if t >= tb]
            if stamps:
                logits[tb:stamps[-1] + (0 if last_ts and not before_ts else 1)] = -np.inf   # never backwards
            if step == 0:
                logits[:tb] = -np.inf
                logits[tb + 51:] = -np.inf          # max_initial_timestamp: 1 s
            logprobs = torch.log_softmax(logits.float(), -1)
            if torch.logsumexp(logprobs[tb:], -1) > logprobs[:tb].max():
                logits[:tb] = -np.inf
        t = int(logits.argmax())
        if t == eot:
            break
        out.append(t)
        ids.append(t)
    return out
