"""Word timestamps: CTranslate2's cross-attention alignment (Whisper.align: the alignment heads'
attention, median-filtered, through dynamic time warping) of each window's text tokens to its
audio frames, as faster-whisper's find_alignment reads it: tokens grouped into words at spaces
(punctuation attached to the word before it), a word's start and end the times at which the
alignment path reaches its first token and the next word's."""

from __future__ import annotations

from typing import Any

import numpy as np

TOKENS_PER_SECOND = 50        # encoder positions per second (100 frames, stride 2)
PUNCTUATION = set("\"'“¿([{-.,!?:;)]}、。，！？：”")


def word_groups(tokens: list[int], decode: Any) -> list[tuple[list[int], int]]:
    """Text tokens -> (the tokens of each word, how many of them precede its trailing
    punctuation): a new word at a leading space; punctuation joins the word before it, unless text
    follows it without a space: then the punctuation starts that word; a token that does not decode
    to whole characters joins the next one."""
    groups: list[tuple[list[int], int]] = []
    pending: list[int] = []
    for t in tokens:
        pending.append(t)
        text = decode(pending)
        if "\ufffd" in text:
            continue
        stripped = text.strip()
        punct = bool(stripped) and all(c in PUNCTUATION for c in stripped)
        if not groups or (text.startswith(" ") and not punct):
            groups.append((pending, len(pending)))
        elif punct:
            groups[-1][0].extend(pending)
        elif groups[-1][1] < len(groups[-1][0]):
            # text right after punctuation starts a word with that punctuation ("brother" "-in"
            # "-work", "U" ".S."), as faster-whisper splits at a punctuation token
            prev, core = groups[-1]
            groups[-1] = (prev[:core], core)
            word = prev[core:] + pending
            groups.append((word, len(word)))
        else:
            groups[-1][0].extend(pending)
            groups[-1] = (groups[-1][0], len(groups[-1][0]))
        pending = []
    if pending:
        if groups:
            groups[-1][0].extend(pending)
        else:
            groups.append((pending, len(pending)))
    return groups


def align_words(model: Any, encoded: Any, sot_sequence: list[int], texts: list[list[int]], frames: list[int],
                decode: Any) -> list[list[dict[str, Any]]]:
    """Per window (its text tokens, its frames of 10 ms): [{word, start, end, probability}],
    times relative to the window's start."""
    todo = [i for i, t in enumerate(texts) if t]
    out: list[list[dict[str, Any]]] = [[] for _ in texts]
    if not todo:
        return out
    results = model.align(encoded, sot_sequence, [texts[i] for i in todo], [frames[i] for i in todo],
                          median_filter_width=7)
    for i, r in zip(todo, results):
        pairs = np.asarray(r.alignments, dtype=np.int64).reshape(-1, 2)
        probs = np.asarray(r.text_token_probs, dtype=np.float64)
        text_idx, time_idx = pairs[:, 0], pairs[:, 1]
        jumps = np.concatenate(([True], np.diff(text_idx) != 0))
        jump_times = time_idx[jumps] / TOKENS_PER_SECOND      # the time the path reaches each token (and <eot>)
        groups = word_groups(texts[i], decode)
        bounds = np.concatenate(([0], np.cumsum([len(g) for g, _ in groups])))
        for k, (g, core) in enumerate(groups):
            a, b = int(bounds[k]), int(bounds[k + 1])
            start = float(jump_times[min(a, len(jump_times) - 1)])
            end = float(jump_times[min(a + core, len(jump_times) - 1)])   # its punctuation takes no time
            out[i].append({"word": decode(g), "start": start, "end": max(start, end),
                           "probability": float(probs[a:b].mean()) if b > a and probs.size >= b else 0.0,
                           "n_tokens": len(g)})
    return out


def attach_words(segments: list[dict[str, Any]], words: list[dict[str, Any]], offset: float) -> None:
    """Give each of a window's segments its words (in token order), times absolute and inside the
    segment, never going backwards."""
    k = 0
    for s in segments:
        n = sum(1 for t in s["tokens"])
        mine, used = [], 0
        while k < len(words) and used < n:
            w = words[k]
            used += w["n_tokens"]
            k += 1
            a = min(max(offset + w["start"], s["start"]), s["end"])
            b = min(max(offset + w["end"], a), s["end"])
            if mine:
                a = max(a, mine[-1]["end"])
                b = max(b, a)
            mine.append({"word": w["word"], "start": round(a, 3), "end": round(b, 3),
                         "probability": round(w["probability"], 4)})
        s["words"] = mine
