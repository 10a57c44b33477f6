"""Prefix caching: the bookkeeping, the layout-invariant forward it needs, and exact hits in the static runner."""

import random

import pytest
import torch

from engine.models.runner import KVCacheFull
from engine.models.static.prefix_cache import PrefixCache, common_prefix, why_layout_variant
from engine.models.static.runner import KVBudget, StaticRunner
from tests.conftest import make_tiny_model


# ---- bookkeeping --------------------------------------------------------------------------------------------------
def test_match_takes_the_longest_shared_prefix_within_the_limit_and_counts_it():
    cache = PrefixCache(min_tokens=4)
    cache.put(5, list(range(10)))
    cache.put(6, list(range(6)) + [99, 98])
    assert cache.match(list(range(8)) + [7, 7], limit=9) == (5, 8)
    assert cache.match(list(range(10)) + [1], limit=7) == (5, 7)  # at least the last tokens stay to compute
    assert cache.match([0, 1, 2, 50, 51], limit=4) is None  # 3 shared tokens < min_tokens
    assert cache.stats.queried_tokens == 10 + 11 + 5 and cache.stats.hit_tokens == 8 + 7


def test_an_entry_that_a_new_one_extends_is_dropped_and_a_covered_sequence_is_not_kept():
    cache = PrefixCache(min_tokens=2)
    cache.put(3, [1, 2, 3])
    assert cache.put(4, [1, 2, 3, 4, 5]) == [3]  # slot 3 is empty now
    assert cache.slots() == [4]
    assert not cache.worth_keeping([1, 2, 3])  # slot 4 holds it already
    assert not cache.worth_keeping([1])  # shorter than min_tokens
    assert cache.worth_keeping([1, 2, 9])


def test_least_recently_used_is_the_entry_matched_or_stored_longest_ago():
    cache = PrefixCache(min_tokens=2)
    cache.put(1, [1, 1, 1])
    cache.put(2, [2, 2, 2])
    cache.match([1, 1, 1, 7], limit=3)
    assert cache.least_recently_used() == 2
    cache.moved(2, 6)
    assert cache.tokens_at(6) == (2, 2, 2) and cache.tokens_at(2) is None
    cache.drop(6)
    assert cache.least_recently_used() == 1 and cache.stats.evicted == 1


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4], 5) == 2
    assert common_prefix([1, 2, 3], [1, 2, 3], 2) == 2
    assert common_prefix((1, 2, 3), [1, 2, 3, 4], 9) == 3  # a tuple against a list: the values count
    assert common_prefix([], [1], 3) == 0 and common_prefix([5], [6], 3) == 0


def test_common_prefix_finds_the_first_difference_anywhere():
    import random

    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 70))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 70))]
        limit = rng.randrange(0, 80)
        want = 0
        while want < min(len(a), len(b), limit) and a[want] == b[want]:
            want += 1
        assert common_prefix(a, b, limit) == want == common_prefix(tuple(b), a, limit)
    assert common_prefix([], [1], 3) == 0


# ---- the runner ---------------------------------------------------------------------------------------------------
def bf16_runner(prefix_caching="auto", slots=6, seed=4, layers=2, cache_dtype=torch.float32):
    model = make_tiny_model("llama", seed=seed, layers=layers).to(torch.bfloat16)
    runner = StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=slots), compile=False, prefill_chunk=32,
                          dtype=torch.float32, weight_dtype=torch.bfloat16, prefix_caching=prefix_caching,
                          cache_dtype=cache_dtype)
    assert runner.model.k_cache_0.dtype == cache_dtype
    why = why_layout_variant(runner.model)
    if why is not None:
        pytest.skip(f"no layout-invariant forward here: {why}")
    return runner


def prompts(n, seed=0, shared=20):
    rng = random.Random(seed)
    system = [rng.randrange(2, 60) for _ in range(shared)]
    return [system + [rng.randrange(2, 60) for _ in range(rng.randint(5, 70))] for _ in range(n)]


def greedy(runner, seq_ids, feeds, steps=6):
    """First logits of each row and its greedy continuation, then the rows are released."""
    for s in seq_ids:
        runner.add(s)
    logits = runner.forward(seq_ids, feeds, [1] * len(seq_ids))
    first, texts = logits.clone(), [[] for _ in seq_ids]
    for _ in range(steps):
        nxt = [int(t) for t in logits[:, 0].argmax(-1)]
        for text, t in zip(texts, nxt):
            text.append(t)
        logits = runner.forward(seq_ids, [[t] for t in nxt], [1] * len(seq_ids))
    for s in seq_ids:
        runner.release(s)
    return first, texts


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_a_rows_logits_do_not_depend_on_how_its_tokens_were_split_into_forwards(cache_dtype):
    """The layout invariance exact prefix caching needs: a prompt fed whole, or as any prefix then the rest (the
    rest a prompt chunk, a verify-width step or a decode step), gives the same bits."""
    runner = bf16_runner(prefix_caching="off", layers=6, cache_dtype=cache_dtype)  # deep enough that a last-bit change reaches the logits
    prompt = prompts(1, seed=3)[0] + list(range(2, 40)) * 3
    runner.add("whole")
    want = runner.forward(["whole"], [prompt], [1])
    runner.release("whole")
    for cut in (1, 7, 16, 17, len(prompt) - 5, len(prompt) - 1):
        runner.add("split")
        runner.forward(["split"], [prompt[:cut]], [1])
        got = runner.forward(["split"], [prompt[cut:]], [1])
        runner.release("split")
        assert torch.equal(got, want), cut


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_hits_give_the_logits_and_texts_of_computing_the_prompt(cache_dtype):
    cached, plain = bf16_runner(cache_dtype=cache_dtype), bf16_runner(prefix_caching="off", cache_dtype=cache_dtype)
    assert cached.prefix_cache is not None and plain.prefix_cache is None
    waves = [prompts(3, seed=1), prompts(3, seed=1)[::-1], [p + [7, 8, 9] for p in prompts(3, seed=1)],
             prompts(3, seed=2)]
    for w, feeds in enumerate(waves):
        ids = [f"w{w}r{i}" for i in range(len(feeds))]
        got, want = greedy(cached, ids, feeds), greedy(plain, ids, feeds)
        assert torch.equal(got[0], want[0]) and got[1] == want[1], w
    stats = cached.prefix_cache_stats()
    # waves 2 and 3 repeat / extend wave 1's sequences (prompt and generated tokens); wave 4 shares its system part
    assert stats["hit_tokens"] >= sum(len(p) for p in waves[1]) - 3 + 20 * 3
    assert plain.forward_rows == cached.forward_rows  # same calls; the hits only fed fewer tokens


def chunked_greedy(runner, seq_id, prompt, chunk, steps=4):
    """As the router feeds a long prompt: `chunk` tokens a round (one logit each), then greedy decode steps."""
    runner.add(seq_id)
    for lo in range(0, len(prompt), chunk):
        logits = runner.forward([seq_id], [prompt[lo : lo + chunk]], [1])
    text = []
    for _ in range(steps):
        text.append(int(logits[0, 0].argmax()))
        logits = runner.forward([seq_id], [[text[-1]]], [1])
    runner.release(seq_id)
    return text, logits


def test_a_prompt_fed_in_chunks_copies_past_its_first_chunk():
    """The router sends a long prompt a chunk a round: every chunk that an entry holds is copied, not only the
    first (a hit was capped at the first chunk before), and the text and logits are those of computing it."""
    cached, plain = bf16_runner(layers=3), bf16_runner(prefix_caching="off", layers=3)
    rng = random.Random(5)
    prompt = [rng.randrange(2, 60) for _ in range(150)]
    for runner in (cached, plain):
        chunked_greedy(runner, "first", prompt, chunk=40)
    before = cached.prefix_cache_stats()["hit_tokens"]
    for other in (prompt, prompt[:97] + [3, 4, 5] + prompt[100:]):  # the same prompt; one that parts at token 97
        got, want = chunked_greedy(cached, "again", other, chunk=40), chunked_greedy(plain, "again", other, chunk=40)
        assert got[0] == want[0] and torch.equal(got[1], want[1])
    stats = cached.prefix_cache_stats()
    # chunks [0, 40) [40, 80) [80, 120) [120, 150): each copies all but its last token, which computes its logit;
    # the second prompt copies up to where it parts from the first
    assert stats["hit_tokens"] - before == (39 + 39 + 39 + 29) + (39 + 39 + 17)


def test_entries_never_take_a_slot_a_live_sequence_needs():
    runner, plain = bf16_runner(slots=4), bf16_runner(slots=4, prefix_caching="off")
    first = prompts(2, seed=5)
    greedy(runner, ["a", "b"], first)  # two entries now, in free slots
    assert len(runner.prefix_cache) == 2
    feeds = prompts(4, seed=6)[:2] + first  # every slot live: entries move or go
    ids = ["c", "d", "e", "f"]
    got, want = greedy(runner, ids, feeds), greedy(plain, ids, feeds)
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    for s in ids:
        runner.add(s)
    with pytest.raises(KVCacheFull):
        runner.add("g")
    assert len(runner.prefix_cache) == 0  # all four slots live


def test_a_full_cache_keeps_the_latest_entry_and_gives_up_the_least_recently_used():
    """One stream through a full cache: the new sequence's slot holds its predecessor's entry, which moves into the
    least recently used entry's slot (that one goes), so a request sharing its predecessor's prompt still hits."""
    runner, plain = bf16_runner(slots=3), bf16_runner(slots=3, prefix_caching="off")
    unrelated = [prompts(1, seed=10 + i, shared=40)[0] for i in range(3)]  # each its own 40-token start
    for i, feed in enumerate(unrelated):
        greedy(runner, [f"u{i}"], [feed])
    assert len(runner.prefix_cache) == 3, "every slot holds an entry"
    follow = unrelated[-1][:30] + [7, 8, 9]  # shares its predecessor's first 30 tokens
    before = runner.prefix_cache_stats()["hit_tokens"]
    got, want = greedy(runner, ["next"], [follow]), greedy(plain, ["next"], [follow])
    assert runner.prefix_cache_stats()["hit_tokens"] - before == 30
    assert torch.equal(got[0], want[0]) and got[1] == want[1]
    starts = [(runner.prefix_cache.index.tokens_at(s) or ())[:40] for s in range(3)]
    assert tuple(unrelated[0][:40]) not in starts and tuple(unrelated[2][:40]) in starts, "the oldest made room"


def test_on_refuses_a_forward_whose_hits_would_not_be_exact():
    model = make_tiny_model("llama", seed=0)  # fp32 weights: prompt chunks take MKL, steps the kernel
    with pytest.raises(ValueError, match="layout-invariant"):
        StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=2), compile=False, prefix_caching="on")
    assert StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=2), compile=False).prefix_cache is None
    with pytest.raises(ValueError, match="auto, on or off"):
        StaticRunner(model, budget=KVBudget(gib=1.0, max_num_seqs=2), compile=False, prefix_caching="yes")
