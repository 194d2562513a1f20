"""A long file in pieces, without a model: its windows cut into runs that fit a piece; the
transcript stitched from its pieces' outputs equal to the one stitched from all its windows at
once (ids, monotonic times, text); a failed piece failing its file with its reason; a missing piece
reported; the task's assembly of many files' pieces; and planning, which counts a file staged in
pieces once (records), its pieces as rows (work), and makes a duplicate of one a single error row."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchinf.planning import bucketing
from batchinf.planning.summary import in_stage_order, record_count, summarize, valid_ids
from batchinf.runtime.speech.pieces import _greedy_runs, NO_SPEECH, majority, missing_pieces, piece_runs, stitch_pieces
from batchinf.runtime.speech.segments import restitch, stitch
from batchinf.tasks.transcribe import PIECE_SCHEMA, Transcribe, TranscribeOptions, piece_seconds

RATE = 16000


def test_piece_runs_cover_the_windows_in_order_within_the_piece() -> None:
    rng = random.Random(0)
    cuts = [0]
    for _ in range(40):
        cuts.append(cuts[-1] + rng.randint(15 * RATE, 30 * RATE))
    wins = list(zip(cuts, cuts[1:]))
    for seconds in (30, 45, 60, 120, 480):
        runs = piece_runs(wins, seconds * RATE)
        assert runs[0][0] == 0 and runs[-1][1] == len(wins) and all(a < b for a, b in runs)
        assert all(b == c for (_, b), (c, _) in zip(runs, runs[1:]))          # consecutive, no window twice
        assert all(j - i == 1 or wins[j - 1][1] - wins[i][0] <= seconds * RATE for i, j in runs)
        # as few runs as greedy filling gives, and none longer than its longest: even pieces
        greedy = _greedy_runs(wins, seconds * RATE)
        span = [wins[j - 1][1] - wins[i][0] for i, j in runs]
        assert len(runs) == len(greedy) and max(span) <= max(wins[j - 1][1] - wins[i][0] for i, j in greedy)
    assert piece_runs(wins, cuts[-1]) == [(0, len(wins))]                      # a file that fits is one row
    assert piece_runs([(0, 40 * RATE), (40 * RATE, 50 * RATE)], 30 * RATE) == [(0, 1), (1, 2)]   # a long window alone
    opts = TranscribeOptions()
    assert piece_seconds(opts, 30) == 4 * 30 and piece_seconds(opts, 30, 60) == 60
    assert piece_seconds(opts, 30, 1_000_000) == 16 * 30


def _windows(seed: int, n: int) -> list[tuple[float, list[dict[str, Any]], dict[str, Any]]]:
    """n windows' segments as window_segments gives them: absolute times, a window's first one may
    start before the last window's end, some windows silent (no segments)."""
    rng = random.Random(seed)
    out, at = [], 0.0
    for k in range(n):
        length = round(rng.uniform(15, 30), 2)
        segs = []
        t = at - rng.choice([0.0, 0.0, 0.4, 1.2])
        for _ in range(rng.choice([0, 1, 2, 4])):
            a = round(max(0.0, t), 3)
            b = round(min(at + length, a + rng.uniform(0.5, 8)), 3)
            segs.append({"start": a, "end": b, "text": f" w{k}-{len(segs)}", "tokens": [k, len(segs)],
                         "words": None})
            t = b - rng.choice([0.0, 0.3])
        out.append((at, segs, {"temperature": 0.0, "avg_logprob": -0.1 * k, "compression_ratio": 1.5,
                               "no_speech_prob": 0.01}))
        at = round(at + length, 2)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_pieces_stitched_apart_then_together_equal_the_whole_files_stitch(seed: int) -> None:
    wins = _windows(seed, 9)
    text, segments = stitch(wins)
    runs = piece_runs([(round(a * RATE), round(a * RATE) + 1) for a, _, _ in wins], 1)   # any cut: here 1 window
    for cut in ([(0, 9)], [(0, 3), (3, 6), (6, 9)], [(0, 1), (1, 8), (8, 9)], runs):
        parts = [stitch(wins[i:j])[1] for i, j in cut]
        assert restitch([s for p in parts for s in p]) == (text, segments)
    times = [x for s in segments for x in (s["start"], s["end"])]
    assert times == sorted(times)


def _piece(k: int, n: int, segments: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"record_id": "talk.wav", "source": "file:///in/talk.wav", "ordinal": 0, "piece": k, "pieces": n,
            "segments": segments, "languages": ["en"] * 2, "output_tokens": 10 * (k + 1), "duration_seconds": 95.0,
            "audio_sha256": "ab" * 32, "silent": False, "error": None, "message": None, "attempts": None, **fields}


def _file_pieces(seed: int = 1) -> tuple[list[dict[str, Any]], str, list[dict[str, Any]]]:
    wins = _windows(seed, 6)
    text, segments = stitch(wins)
    return [_piece(k, 3, stitch(wins[2 * k:2 * k + 2])[1]) for k in range(3)], text, segments


def test_a_files_pieces_in_any_order_give_its_transcript() -> None:
    rows, text, segments = _file_pieces()
    random.Random(3).shuffle(rows)
    got = stitch_pieces(rows)
    assert got.error is None and got.result == {"text": text, "segments": segments, "language": "en",
                                                "output_tokens": 60}
    assert majority(["de", "en", "en", "de"]) == "de" and majority([None, None]) == "en"
    assert majority(["fr", "en", "en"]) == "en"


def test_a_failed_piece_fails_its_file_with_its_reason() -> None:
    rows, _, _ = _file_pieces()
    rows[2].update(error="inference_error", attempts=2,
                   message="record 'talk.wav': audio file file:///in/talk.wav failed at window 4 (61.00-88.20 s): boom")
    rows[1].update(error="inference_error", attempts=1, message="record 'talk.wav': ... failed at window 2")
    got = stitch_pieces(list(reversed(rows)))
    assert (got.error, got.attempts, got.piece, got.result) == ("inference_error", 1, 1, None)
    assert "window 2" in got.message          # the first failed piece's, whatever the order


def test_a_file_without_text_is_no_speech_unless_silent() -> None:
    rows = [_piece(k, 2, []) for k in range(2)]
    got = stitch_pieces(rows)
    assert got.error == "no_speech_found" and got.message.endswith(NO_SPEECH) and "talk.wav" in got.message
    for r in rows:
        r["silent"] = True
    assert stitch_pieces(rows).result == {"text": "", "segments": [], "language": "en", "output_tokens": 30}


def test_missing_and_conflicting_pieces_are_named() -> None:
    rows, _, _ = _file_pieces()
    assert missing_pieces(rows) is None
    assert missing_pieces([rows[0], rows[2]]) == "pieces [1] of 3 not done"
    with pytest.raises(ValueError, match="do not fit together"):
        missing_pieces(rows + [dict(rows[1])])
    with pytest.raises(ValueError, match="do not fit together"):
        missing_pieces([rows[0], {**rows[1], "pieces": 4}])


def test_the_task_assembles_every_complete_file_once() -> None:
    rows, text, segments = _file_pieces()
    other = [{**r, "record_id": "b.wav", "source": "file:///in/b.wav"} for r in _file_pieces(2)[0]]
    other[0].update(error="inference_error", attempts=1, message="record 'b.wav': failed at window 0")
    gone = [{**r, "record_id": "c.wav", "source": "file:///in/c.wav"} for r in _file_pieces(3)[0][:2]]
    poison = [{**r, "record_id": "d.wav", "source": "file:///in/d.wav"} for r in _file_pieces(4)[0][1:]]
    everything = rows + other + gone + poison
    random.Random(5).shuffle(everything)
    got = Transcribe().assemble(pa.Table.from_pylist(everything, schema=PIECE_SCHEMA), {("file:///in/d.wav", 0)})
    res = got.results.to_pylist()
    assert [r["record_id"] for r in res] == ["talk.wav"] and got.results.schema.names[:3] == ["record_id", "source",
                                                                                              "ordinal"]
    assert res[0]["text"] == text and res[0]["duration_seconds"] == 95.0 and res[0]["output_tokens"] == 60
    assert [{k: v for k, v in s.items()} for s in res[0]["segments"]] == segments
    assert [(e["record_id"], e["error"], e["piece"]) for e in got.errors] == [("b.wav", "inference_error", 0)]
    assert got.incomplete == {("file:///in/c.wav", 0): "record 'c.wav': pieces [2] of 3 not done"}
    assert got.rows == 6


# --- planning: records and rows ---------------------------------------------------------------

def _staged(records: list[tuple[str, list[int]]]) -> pa.Table:
    """A staged table: per record (id, its rows' token lengths: one, or one per piece)."""
    rows = [{"ordinal": o, "record_id": rid, "error": None, "message": None, "n_tokens": n, "truncated": False,
             "piece": k} for o, (rid, lengths) in enumerate(records) for k, n in enumerate(lengths)]
    return in_stage_order(pa.Table.from_pylist(rows, schema=pa.schema([
        ("ordinal", pa.int64()), ("record_id", pa.string()), ("error", pa.string()), ("message", pa.string()),
        ("n_tokens", pa.int32()), ("truncated", pa.bool_()), ("piece", pa.int32())])))


def test_a_file_in_pieces_is_one_record_of_several_rows_and_a_duplicate_one_error_row(tmp_path: Path) -> None:
    first = _staged([("x", [5]), ("y", [9])])
    second = _staged([("long", [60, 58, 31]), ("x", [40, 12, 60]), ("z", [7])])   # x: a duplicate, in pieces
    assert second.column("n_tokens").to_pylist() == [7, 12, 31, 40, 58, 60, 60]           # by length: pieces apart
    summaries = [summarize(t, None, valid_ids(t)) for t in (first, second)]
    assert [(s["rows"], s["records"], s["continued"], record_count(s)) for s in summaries] == [(2, 2, 0, 2),
                                                                                              (7, 3, 4, 3)]
    assert summaries[1]["tokens"] == 60 + 58 + 31 + 40 + 12 + 60 + 7
    dups = bucketing.find_duplicates([None, None], summaries, ["file:///a", "file:///b"])
    assert list(dups) == [1] and list(dups[1]) == [1] and dups[1][1][0] == [12, 40, 60]    # every row of x, not "long"
    valid, invalid, by_code = bucketing.merge(summaries, [None, None], dups)
    assert by_code == {"duplicate_id": 1} and invalid[1] == {12: 1}
    assert sum(valid[1].values()) == 4                                     # long's three pieces and z
    paths = []
    for k, t in enumerate((first, second)):
        paths.append(str(tmp_path / f"obj-{k}.parquet"))
        pq.write_table(t, paths[-1], row_group_size=2)
    for kind, hists in ((False, valid), (True, invalid)):
        cursors = bucketing.cursors(paths, [None, None], dups, invalid=kind)
        got = [c.take(sum(h.values())).to_pylist() for c, h in zip(cursors, hists) if h and sum(h.values())]
        rows = [(r["record_id"], r["piece"], r["error"]) for g in got for r in g]
        if kind:
            assert rows == [("x", 1, "duplicate_id")]                  # its shortest row alone
        else:
            assert sorted(rows) == [("long", 0, None), ("long", 1, None), ("long", 2, None), ("x", 0, None),
                                    ("y", 0, None), ("z", 0, None)]
    assert valid_ids(second).column("record_id").to_pylist() == sorted(["long"] * 3 + ["x"] * 3 + ["z"])
