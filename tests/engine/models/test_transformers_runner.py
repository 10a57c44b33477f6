"""Slotted KV cache + batched forward: equal to a plain full forward, rollback without recomputation."""

import pytest
import torch

from engine.models.transformers_runner import ContextWindowError, ModelRunner
from tests.conftest import make_tiny_model

FAMILIES = ["llama", "qwen2", "mistral", "gemma", "gpt2"]


def reference_logits(model, tokens, last):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0, -last:]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_ragged_forward_matches_full_forward(family):
    model = make_tiny_model(family)
    runner = ModelRunner(model)
    gen = torch.Generator().manual_seed(0)
    seqs = {name: torch.randint(2, 64, (n,), generator=gen).tolist() for name, n in [("a", 20), ("b", 7), ("c", 45)]}
    for name in seqs:
        runner.add(name)
    names = list(seqs)
    runner.forward(names, [runner.sync(n, seqs[n][:-3]) for n in names], [1, 1, 1])
    # feed two wrong "drafts", then roll back and feed the true tail: the cache must forget the drafts
    runner.forward(names, [runner.sync(n, seqs[n][:-3]) + [5, 6] for n in names], [3, 3, 3])
    feeds = [runner.sync(n, seqs[n]) for n in names]
    assert [len(f) for f in feeds] == [3, 3, 3], "rollback keeps the accepted prefix, feeds only the rest"
    out = runner.forward(names, feeds, [3, 2, 1])
    for b, (name, last) in enumerate(zip(names, [3, 2, 1])):
        torch.testing.assert_close(out[b, :last], reference_logits(model, seqs[name], last), atol=1e-4, rtol=1e-4)


def test_release_compacts_slots_and_keeps_other_caches():
    model = make_tiny_model("llama")
    runner = ModelRunner(model)
    seqs = {"a": list(range(2, 12)), "b": list(range(20, 26)), "c": list(range(30, 45))}
    for name, toks in seqs.items():
        runner.add(name)
        runner.forward([name], [runner.sync(name, toks)], [1])
    runner.release("a")  # "c" moves into slot 0
    assert runner.num_live == 2 and not runner.has("a")
    for name in ("b", "c"):
        toks = seqs[name] + [7]
        feed = runner.sync(name, toks)
        assert feed == [7]
        out = runner.forward([name], [feed], [1])
        torch.testing.assert_close(out[0, 0], reference_logits(model, toks, 1)[0], atol=1e-4, rtol=1e-4)


def test_cache_grows_beyond_initial_capacity():
    model = make_tiny_model("llama")
    runner = ModelRunner(model)
    runner.add("x")
    toks = list(range(2, 60)) * 5  # 290 tokens > initial capacity 256
    toks = toks[:250]
    out = runner.forward(["x"], [runner.sync("x", toks)], [1])
    torch.testing.assert_close(out[0, 0], reference_logits(model, toks, 1)[0], atol=1e-4, rtol=1e-4)
    assert runner.cache.capacity >= 250


def test_context_window_is_enforced():
    runner = ModelRunner(make_tiny_model("llama"), max_model_len=16)
    runner.add("x")
    with pytest.raises(ContextWindowError, match="context window of 16"):
        runner.sync("x", list(range(2, 20)))
