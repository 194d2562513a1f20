"""Chat questions the engine benchmarks send (engine_vllm.py, engine_openai_http.py): short,
varied, deterministic."""

from __future__ import annotations

TOPICS = ("the sea", "a mountain", "the city at night", "a small cat", "rain", "the moon", "bread", "trains",
          "a library", "autumn leaves", "the desert", "snow", "a garden", "coffee", "the river", "stars")
KINDS = ("Write one sentence about {}.", "Name two facts about {}.", "Describe {} in a few words.",
         "What rhymes with {}?", "Tell a very short story about {}.", "Why do people like {}?",
         "Give a title for a poem about {}.", "List three words about {}.")


def questions(n: int, kinds: int = len(KINDS), numbered: bool = False) -> list[str]:
    """n questions over the first `kinds` question shapes and every topic; `numbered` appends the
    question's number, so no two are the same text (no server-side prompt cache can serve one)."""
    shapes = KINDS[:kinds]
    return [shapes[i % len(shapes)].format(TOPICS[(i // len(shapes)) % len(TOPICS)]) + (f" ({i})" if numbered else "")
            for i in range(n)]
