"""The Llama-family runtime and the generation loop's contract (continuous batching, sampling
determinism, stop conditions, request checks, bundle fixtures) on tiny random models; their parity
with transformers is in tests/parity/test_llama_parity.py."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from batchinf.config import settings
from batchinf.errors import BundleError
from batchinf.runtime import bundle as rb
from batchinf.runtime.generation.kv import common_prefix
from batchinf.runtime.generation.runtime import GenerateRuntime
from batchinf.runtime.generation.sampling import SamplingParams, derive_seed
from batchinf.runtime.generation.seq import GenRequest, GenStats
from batchinf.runtime.llama import Fill, KVCache, load_llama
from batchinf.runtime.packing import pack_weights
from benchmarks.static_batching import StaticScheduler
from tests.helpers.tiny_llama import FAMILIES, make_family_dirs, make_tiny_llama


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_family_dirs(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def runtime(tiny_dirs: dict[str, Path]) -> GenerateRuntime:
    d = tiny_dirs["llama"]
    rt = GenerateRuntime(d, rb.build_meta(d))
    rt.load_model()
    return rt


def _requests(rt: GenerateRuntime, n: int, **params: object) -> list[GenRequest]:
    words = ["the", "people", "of", "the", "world", "make", "water", "and", "light", "every", "day"]
    return [GenRequest(i, rt.encode_prompt(" ".join(words[: 2 + (i * 5) % 9]) + f" {i}"),
                       SamplingParams(max_tokens=3 + (i * 7) % 17, **params))  # type: ignore[arg-type]
            for i in range(n)]


@pytest.mark.slow
def test_continuous_batching_equals_one_at_a_time(runtime: GenerateRuntime) -> None:
    reqs = _requests(runtime, 12)
    alone = {r.key: r for q in reqs for r in runtime.generate([q], max_slots=1)}
    stats = GenStats()
    # A budget that fits only 3 of the longest requests at once: slots are refilled many times.
    batched = list(runtime.generate(reqs, max_slots=8, max_batch_tokens=100, stats=stats))
    assert sorted(r.key for r in batched) == list(range(12))
    for r in batched:
        assert r == alone[r.key]
    assert [r.key for r in batched] != list(range(12))        # yielded as they finish, not in order
    static = {r.key: r for r in runtime.generate(reqs, max_slots=3, scheduler=StaticScheduler)}
    assert static == alone
    # A first token comes from prefill, or from the decode step a prefix-sharing request joins.
    assert stats.decode_tokens - stats.joined == sum(r.output_tokens - 1 for r in batched)
    assert stats.prompt_tokens == sum(len(q.prompt_ids) for q in reqs)
    # Freed slots are refilled at once, and compacted away once the queue is empty: no idle row is computed.
    assert stats.decode_slot_steps == stats.decode_tokens


SYSTEM = "You answer questions about the people of the world, water and light, every day of the year."


@pytest.mark.parametrize("family", list(FAMILIES))
def test_joining_a_decode_step_after_a_copied_prefix_equals_a_prefill(tiny_dirs: dict[str, Path], family: str) -> None:
    """Slots 1 and 2 copy a prefix from slot 0, get the rest of their prompts but the last token
    as a Fill, and feed that last token in a decode step beside slot 0's: same logits and same
    K/V as prefilling their prompts from scratch."""
    model = load_llama(tiny_dirs[family])
    rt = GenerateRuntime(tiny_dirs[family], {"context_length": 256})
    donor, a, b = (rt.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
                   for q in ("hello", "the people of the world make water", "light"))
    shared = [common_prefix(donor, p, len(p) - 1) for p in (a, b)]
    assert min(shared) >= 16 and all(len(p) - 1 - n >= 2 for p, n in zip((a, b), shared))
    cache = KVCache(model.config, 3, 128, torch.float32, torch.device("cpu"))
    full = KVCache(model.config, 2, 128, torch.float32, torch.device("cpu"))
    with torch.inference_mode():
        model.prefill(torch.tensor([donor]), torch.tensor([len(donor)]), torch.tensor([0]), cache)
        for layer in cache.layers:
            layer.copy_prefix(torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor(shared))
        middle = [p[n:-1] for p, n in zip((a, b), shared)]
        S = max(map(len, middle))
        fill = Fill(torch.tensor([m + [0] * (S - len(m)) for m in middle]), torch.tensor(shared),
                    torch.tensor([1, 2]), torch.tensor(list(map(len, middle))))
        got = model.decode_step(torch.tensor([7, a[-1], b[-1]]), torch.tensor([len(donor), len(a) - 1, len(b) - 1]),
                                cache, fill)[1:]
        S = max(len(a), len(b))
        want = model.prefill(torch.tensor([p + [0] * (S - len(p)) for p in (a, b)]), torch.tensor([len(a), len(b)]),
                             torch.tensor([0, 1]), full)
    assert (got - want).abs().max().item() <= 1e-4
    for i, p in enumerate((a, b)):
        for mine, theirs in zip(cache.layers, full.layers):
            assert (mine.k[1 + i, :, :len(p)] - theirs.k[i, :, :len(p)]).abs().max().item() <= 1e-4
            assert (mine.v[1 + i, :, :len(p)] - theirs.v[i, :, :len(p)]).abs().max().item() <= 1e-4


def test_prefix_sharing_changes_no_token(runtime: GenerateRuntime) -> None:
    words = ["the", "people", "of", "world", "make", "water", "and", "light", "every", "day"]
    reqs = [GenRequest(i, runtime.encode_chat([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": " ".join(words[i % 7:i % 7 + 3])}]),
                       SamplingParams(max_tokens=2 + (i * 5) % 11, temperature=0.8 if i % 3 else 0.0,
                                      seed=derive_seed(1, str(i))))
            for i in range(10)]
    alone = {r.key: r for q in reqs for r in runtime.generate([q], max_slots=1)}
    stats = GenStats()
    shared = {r.key: r for r in runtime.generate(reqs, max_slots=4, stats=stats)}
    assert shared == alone
    # Every request but the first copies the system prompt from a live slot or from the first.
    system = common_prefix(reqs[0].prompt_ids, reqs[1].prompt_ids, 1 << 30)
    assert system >= 16 and stats.cached_prompt_tokens >= (len(reqs) - 1) * system
    runtime.share_prefixes = False
    try:
        off = GenStats()
        assert {r.key: r for r in runtime.generate(reqs, max_slots=4, stats=off)} == shared
    finally:
        runtime.share_prefixes = True
    assert off.cached_prompt_tokens == 0 and off.prompt_tokens == stats.prompt_tokens
    assert stats.prefill_positions <= off.prefill_positions - stats.cached_prompt_tokens + len(reqs) * 4


def test_joining_prompts_of_very_different_lengths_fill_in_several_passes(runtime: GenerateRuntime,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Remaining prompts too unequal to pad together: all but one group are filled in passes of
    their own before the decode step, which carries the last; the tokens do not change."""
    words = "the people of the world make water and light every day".split()
    reqs = [GenRequest(i, runtime.encode_chat([{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": " ".join(words * (1 + 3 * (i % 2)))[:4 + 40 * i]}]),
                       SamplingParams(max_tokens=4)) for i in range(4)]
    alone = {r.key: r for q in reqs for r in runtime.generate([q], max_slots=1)}
    model = type(runtime.model)
    passes: list[tuple[int, ...]] = []
    fill = model.fill
    monkeypatch.setattr(model, "fill", lambda self, f, cache: (passes.append(tuple(f.tokens.shape)), fill(self, f, cache)))
    assert {r.key: r for r in runtime.generate(reqs, max_slots=4)} == alone
    assert passes, "every joining prompt rode along the decode step: the separate fill pass went untested"


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3, 4], [1, 2, 3, 5], 10) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3, 4], 10) == 3
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix([7], [1], 10) == 0 and common_prefix([], [1], 10) == 0


@pytest.fixture
def fresh_home(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], None]]:
    """Points BATCHINF_HOME at a directory whose cache remembers no packing decision
    (pack_weights keeps them there); settings are read afresh after the test."""
    def use(home: Path) -> None:
        monkeypatch.setenv("BATCHINF_HOME", str(home))
        settings.cache_clear()

    yield use
    monkeypatch.undo()
    settings.cache_clear()


def test_packed_weights_match_plain_ones(tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                         tmp_path: Path, fresh_home: Callable[[Path], None]) -> None:
    import torch.nn.functional as F

    from batchinf.runtime import packing
    from batchinf.runtime.packing import Linear

    fresh_home(tmp_path)
    monkeypatch.setattr(packing, "packing_pays", lambda *a: True)     # packed where MKL is, faster or not
    monkeypatch.setattr(packing, "PACKED_BUDGET", float("inf"))        # ... and whatever the memory
    packed = load_llama(tiny_dirs["qwen2"])
    monkeypatch.setenv("BATCHINF_PACK_WEIGHTS", "0")
    settings.cache_clear()                  # settings are read once per process
    try:
        plain = load_llama(tiny_dirs["qwen2"])
    finally:
        monkeypatch.delenv("BATCHINF_PACK_WEIGHTS")
        settings.cache_clear()
    linears = [m for m in packed.modules() if isinstance(m, Linear)]
    assert all(m.packed is not None for m in linears) == torch.backends.mkl.is_available()
    assert all(m.packed is None for m in plain.modules() if isinstance(m, Linear))
    for m in linears:
        x = torch.randn(7, m.in_features)
        assert (m(x) - F.linear(x, m.weight, m.bias)).abs().max().item() <= 1e-4
    cache = [KVCache(mod.config, 5, 32, torch.float32, torch.device("cpu")) for mod in (packed, plain)]
    tokens = torch.randint(0, packed.config.vocab_size, (5, 9))
    with torch.inference_mode():
        for mod, c in zip((packed, plain), cache):
            mod.prefill(tokens, torch.full((5,), 9), torch.arange(5), c)
        steps = [mod.decode_step(tokens[:, 0], torch.arange(9, 14), c) for mod, c in zip((packed, plain), cache)]
    assert (steps[0] - steps[1]).abs().max().item() <= 1e-4


def test_packing_is_kept_only_where_it_is_faster(tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Path, fresh_home: Callable[[Path], None]) -> None:
    """The packed copies cost memory (2-16x the weights): a machine where they are not faster keeps
    none, and one shape that pays packs that shape alone (each distinct shape timed once, and the
    answer remembered in the home's cache: the next load times nothing)."""
    from batchinf.runtime import packing

    fresh_home(tmp_path / "a")
    seen: list[tuple[int, int]] = []

    def slower(linear: torch.nn.Linear, gen: torch.Generator) -> bool:
        seen.append(tuple(linear.weight.shape))
        return False

    monkeypatch.setattr(packing, "packing_pays", slower)
    model = load_llama(tiny_dirs["qwen2"])
    linears = [m for m in model.modules() if isinstance(m, packing.Linear)]
    assert all(m.packed is None for m in linears)
    if not torch.backends.mkl.is_available():
        return
    shapes = {tuple(m.weight.shape) for m in linears}
    assert sorted(seen) == sorted(shapes)
    load_llama(tiny_dirs["qwen2"])
    assert len(seen) == len(shapes)                     # remembered: nothing timed again
    largest = max(shapes, key=lambda s: s[0] * s[1])
    fresh_home(tmp_path / "b")
    monkeypatch.setattr(packing, "packing_pays", lambda linear, gen: tuple(linear.weight.shape) == largest)
    monkeypatch.setattr(packing, "PACKED_BUDGET", float("inf"))
    model = load_llama(tiny_dirs["qwen2"])
    for m in model.modules():
        if isinstance(m, packing.Linear):
            assert (m.packed is not None) == (tuple(m.weight.shape) == largest), m.weight.shape


def test_packed_copies_fit_a_budget_cheapest_shapes_first(tiny_dirs: dict[str, Path], monkeypatch: pytest.MonkeyPatch,
                                                           tmp_path: Path, fresh_home: Callable[[Path], None]) -> None:
    """Where every shape pays, the packed copies (2 to 21 times their weights) still fit the budget:
    whole shapes, the cheapest in memory first; a shape that does not fit is not packed, and the
    sizes remembered with the timings serve the next load."""
    from batchinf.runtime import packing

    if not torch.backends.mkl.is_available():
        pytest.skip("MKL packing needs a torch build with MKL")
    fresh_home(tmp_path)
    monkeypatch.setattr(packing, "packing_pays", lambda *a: True)
    model = load_llama(tiny_dirs["qwen2"])
    linears = [m for m in model.modules() if isinstance(m, packing.Linear)]
    groups: dict[tuple[int, int], list[packing.Linear]] = {}
    for m in linears:
        groups.setdefault(tuple(m.weight.shape), []).append(m)
    cost = {s: len(g) * packing._packed_bytes(g[0]) for s, g in groups.items()}
    order = sorted(cost, key=cost.get)
    weights = sum(m.weight.nbytes for m in linears)
    # a budget that fits the two cheapest shapes and not the third
    budget = (cost[order[0]] + cost[order[1]] + cost[order[2]] / 2) / weights
    monkeypatch.setattr(packing, "PACKED_BUDGET", budget)
    monkeypatch.setattr(packing, "packing_pays", lambda *a: pytest.fail("timed again: the answer was remembered"))
    model = load_llama(tiny_dirs["qwen2"])
    for m in model.modules():
        if isinstance(m, packing.Linear):
            assert (m.packed is not None) == (tuple(m.weight.shape) in order[:2]), m.weight.shape
    monkeypatch.setattr(packing, "PACKED_BUDGET", 0.0)
    assert not packing.pack_weights(load_llama(tiny_dirs["qwen2"]))


def _mapped_from(t: torch.Tensor, path: Path) -> bool:
    """Whether the tensor's memory lies in a mapping of `path` (/proc/self/maps)."""
    addr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, *rest = line.split()
        lo, hi = (int(x, 16) for x in span.split("-"))
        if rest and rest[-1] == str(path.resolve()) and lo <= addr < hi:
            return True
    return False


def test_cpu_weights_are_one_shared_map_of_the_bundle_file(tiny_dirs: dict[str, Path]) -> None:
    """On CPU a model's weights are views of a copy-on-write map of its safetensors file (worker
    processes share one copy in the page cache), equal to what safetensors reads; a write to one
    stays in this process and never reaches the file."""
    from safetensors.torch import load_file

    from batchinf.runtime.weights import load_safetensors

    path = tiny_dirs["llama"] / "model.safetensors"
    before = path.read_bytes()
    mapped, read = load_safetensors(path), load_file(path)
    assert mapped.keys() == read.keys()
    for k, t in read.items():
        assert mapped[k].dtype == t.dtype and torch.equal(mapped[k], t), k
        assert _mapped_from(mapped[k], path), k
    model = load_llama(tiny_dirs["llama"])
    w = model.model.layers[0].mlp.down_proj.weight
    assert _mapped_from(w, path)
    with torch.no_grad():
        w.mul_(2.0)
    assert path.read_bytes() == before


def test_a_damaged_safetensors_file_is_refused_naming_it(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    from batchinf.runtime.weights import load_safetensors

    path = tmp_path / "model.safetensors"
    save_file({"w": torch.ones(4, 4)}, str(path))
    path.write_bytes(path.read_bytes()[:-8])             # truncated: the last tensor's bytes are short
    with pytest.raises(BundleError, match="model.safetensors.*damaged"):
        load_safetensors(path)
    path.write_bytes(b"\xff" * 16)
    with pytest.raises(BundleError, match="not a safetensors file"):
        load_safetensors(path)


def test_static_batching_wastes_finished_slots(runtime: GenerateRuntime) -> None:
    reqs = _requests(runtime, 12)
    cont, stat = GenStats(), GenStats()
    list(runtime.generate(reqs, max_slots=4, stats=cont))
    list(runtime.generate(reqs, max_slots=4, stats=stat, scheduler=StaticScheduler))
    assert cont.decode_tokens - cont.joined == stat.decode_tokens - stat.joined
    assert stat.decode_slot_steps > cont.decode_slot_steps


@pytest.mark.slow
def test_sampling_is_reproducible_and_seeded(runtime: GenerateRuntime) -> None:
    reqs = [GenRequest(q.key, q.prompt_ids, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95,
                                                           seed=derive_seed(7, f"rec-{q.key}")))
            for q in _requests(runtime, 8)]
    first = list(runtime.generate(reqs, max_slots=3))
    assert list(runtime.generate(reqs, max_slots=3)) == first      # same requests, same order: identical
    reseeded = [GenRequest(q.key, q.prompt_ids, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95,
                                                               seed=q.params.seed + 1)) for q in reqs]
    assert {r.key: r.token_ids for r in runtime.generate(reseeded, max_slots=3)} != \
        {r.key: r.token_ids for r in first}
    greedy = {r.key: r.token_ids for r in runtime.generate(
        [GenRequest(q.key, q.prompt_ids, SamplingParams(max_tokens=12)) for q in reqs])}
    for params in ({"temperature": 1.5, "top_k": 1}, {"temperature": 1.0, "top_p": 1e-6}):
        narrowed = [GenRequest(q.key, q.prompt_ids, SamplingParams(max_tokens=12, seed=3, **params))  # type: ignore[arg-type]
                    for q in reqs]
        assert {r.key: r.token_ids for r in runtime.generate(narrowed)} == greedy


def test_derive_seed_is_stable() -> None:
    assert derive_seed(1, "a") == derive_seed(1, "a")
    assert len({derive_seed(1, "a"), derive_seed(2, "a"), derive_seed(1, "b")}) == 3
    assert 0 <= derive_seed(123, "x" * 100) < 2**63


def test_stop_token_stop_string_and_max_tokens(runtime: GenerateRuntime) -> None:
    prompt = runtime.encode_prompt("the people of the world")
    base = next(runtime.generate([GenRequest(0, prompt, SamplingParams(max_tokens=16))]))
    assert base.finish_reason == "length" and len(base.token_ids) == 16 and base.output_tokens == 16
    ids = base.token_ids
    k = next(i for i in range(3, 16) if ids[i] not in ids[:i])        # first new token after position 3
    by_id = next(runtime.generate([GenRequest(0, prompt, SamplingParams(max_tokens=16, stop_token_ids=(ids[k],)))]))
    assert (by_id.token_ids, by_id.finish_reason, by_id.output_tokens) == (ids[:k], "stop", k + 1)
    assert by_id.text == runtime.decode(ids[:k])
    full = runtime.decode(ids)
    j = len(runtime.decode(ids[:k]))                                   # a stop string starting inside the text
    stop = full[j:j + 3]
    cut = full.find(stop)
    by_str = next(runtime.generate([GenRequest(0, prompt, SamplingParams(max_tokens=16, stop=("zzzz", stop)))]))
    assert by_str.finish_reason == "stop" and by_str.text == full[:cut]
    assert stop not in by_str.text and len(by_str.token_ids) < 16
    short = next(runtime.generate([GenRequest(0, prompt, SamplingParams(max_tokens=5))]))
    assert (short.token_ids, short.finish_reason) == (ids[:5], "length")
    eos_rt = GenerateRuntime(runtime.root, {**runtime.meta, "special_tokens": {"eos_ids": [ids[k]]}})
    eos_rt.model = runtime.model
    by_eos = next(eos_rt.generate([GenRequest(0, prompt, SamplingParams(max_tokens=16))]))
    assert (by_eos.token_ids, by_eos.finish_reason) == (ids[:k], "stop")


def test_impossible_requests_fail_before_anything_runs(runtime: GenerateRuntime) -> None:
    ok = GenRequest(1, [5, 6, 7], SamplingParams(max_tokens=4))
    too_long = GenRequest(2, [5] * 250, SamplingParams(max_tokens=10))        # context length is 256
    gen = runtime.generate([ok, too_long])
    with pytest.raises(ValueError, match="request 2.*context length 256"):
        next(gen)
    with pytest.raises(ValueError, match="request 1.*max_batch_tokens 5"):
        next(runtime.generate([ok], max_batch_tokens=5))
    with pytest.raises(ValueError, match="request 3.*empty"):
        next(runtime.generate([GenRequest(3, [], SamplingParams())]))


def test_chat_template_errors_are_value_errors(tmp_path: Path) -> None:
    d = make_tiny_llama(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}x"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    rt = GenerateRuntime(d, {"context_length": 256})
    assert rt.encode_chat([{"role": "user", "content": "hi"}]) == rt.tokenizer.encode("x", add_special_tokens=False).ids
    with pytest.raises(ValueError, match="user first"):
        rt.encode_chat([{"role": "system", "content": "hi"}])


def test_generate_bundle_meta_and_open_runtime(bi_home: Path, tiny_dirs: dict[str, Path]) -> None:
    from batchinf.bundles import import_bundle, open_runtime

    info = import_bundle(tiny_dirs["qwen2"], "tiny-qwen", alias="prod")
    assert (info.task, info.family) == ("generate", "llama")
    tok_only = open_runtime(info.digest, with_model=False)
    assert isinstance(tok_only, GenerateRuntime) and tok_only.model is None
    meta = tok_only.meta
    assert meta["model_type"] == "qwen2" and meta["context_length"] == 256 and meta["chat_template"] is True
    assert meta["special_tokens"]["eos_ids"] == [tok_only.tokenizer.token_to_id("<|im_end|>")]
    assert meta["decoding"] == {"temperature": 0.0, "top_k": 0, "top_p": 1.0}
    pinned = [fx for fx in meta["fixtures"] if "continuation" in fx]
    assert len(pinned) == rb.GREEDY_FIXTURES and all(len(fx["continuation"]) <= 8 for fx in pinned)
    rt = open_runtime(info.digest)
    assert rt.model is not None
    got = list(rt.generate([GenRequest(0, pinned[0]["token_ids"], SamplingParams(max_tokens=8))]))
    assert got[0].token_ids == pinned[0]["continuation"]


def test_tampered_weights_are_refused(bi_home: Path, tiny_dirs: dict[str, Path], tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from batchinf.bundles import _loaded, import_bundle, local_dir, open_runtime

    digest = import_bundle(tiny_dirs["llama"], "tiny-llama").digest
    path = local_dir(digest) / "model.safetensors"
    state = load_file(path)
    state["model.layers.0.mlp.down_proj.weight"] *= 1.5
    save_file(state, str(path), metadata={"format": "pt"})
    with pytest.raises(BundleError, match="model.safetensors was modified"):
        open_runtime(digest)
    # Weights that changed without the file digest noticing (e.g. a runtime change) are caught by the
    # greedy fixtures.
    _loaded.clear()
    rt = GenerateRuntime(tiny_dirs["llama"], rb.read_meta(local_dir(digest)))
    rt.load_model()
    rb.verify_model_fixtures(rt)
    with torch.no_grad():
        rt.model.model.layers[0].mlp.down_proj.weight.mul_(1.5)
    pack_weights(rt.model)                  # the packed copy (CPU, MKL) is a snapshot of the weights
    with pytest.raises(BundleError, match="greedy continuation"):
        rb.verify_model_fixtures(rt)


def test_kv_cache_commits_only_what_is_written() -> None:
    """The cache starts as zeros whose memory the kernel commits a page at a time on first write."""
    from batchinf.runtime.lazy_memory import lazy_zeros

    def anonymous_kib() -> int:
        for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if line.startswith("Anonymous:"):
                return int(line.split()[1])
        raise AssertionError("no Anonymous line")

    before = anonymous_kib()
    t = lazy_zeros((64, 4, 1024, 64), torch.float32, torch.device("cpu"))     # 64 MiB
    assert t.shape == (64, 4, 1024, 64) and t.dtype == torch.float32 and t.is_contiguous()
    assert float(t[::7, :, ::100].abs().sum()) == 0.0          # reads see zeros and commit nothing
    assert anonymous_kib() - before < 16 * 1024
    t[3, 1, :16] = 1.0
    assert float(t.sum()) == 16 * 64 and anonymous_kib() - before < 16 * 1024
    assert torch.equal(lazy_zeros((2, 3), torch.float32, torch.device("cpu")), torch.zeros(2, 3))


def test_a_finished_or_moved_slot_hands_its_cache_memory_back(tiny_dirs: dict[str, Path]) -> None:
    """release(slot) and move(src, dst) leave the emptied slot all zeros, its pages returned;
    the other slots keep their K/V."""
    from batchinf.runtime.lazy_memory import forget, lazy_zeros

    model = load_llama(tiny_dirs["qwen2"])
    cache = model.new_cache(4, 300)
    for layer in cache.layers:
        for t in (layer.k, layer.v):
            t.copy_(torch.arange(4, dtype=t.dtype)[:, None, None, None] + 1)
    cache.move(3, 1, 300)
    cache.release(2)
    for layer in cache.layers:
        for t in (layer.k, layer.v):
            assert [float(t[i].abs().max()) for i in range(4)] == [1.0, 4.0, 0.0, 0.0]
    big = lazy_zeros((8, 4, 1024, 64), torch.float32, torch.device("cpu"))     # 8 MiB, 1 MiB a slot
    big.fill_(2.0)
    before = Path("/proc/self/smaps_rollup").read_text()
    for i in range(8):
        forget(big, i)
    after = Path("/proc/self/smaps_rollup").read_text()

    def anon(text: str) -> int:
        return next(int(line.split()[1]) for line in text.splitlines() if line.startswith("Anonymous:"))

    assert anon(before) - anon(after) >= 6 * 1024 and float(big.abs().sum()) == 0.0
    plain = torch.ones(3, 5)
    forget(plain, 1)                                            # not a lazy tensor: zeroed in place
    assert plain.sum().item() == 10.0
