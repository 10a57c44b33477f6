"""deployments/router/prepare.py: what a request becomes before its rounds (its speculation options here)."""

import asyncio

from deployments.api.request_models import CompletionRequest
from deployments.router.router import Router
from engine.spec.options import SpeculationOptions
from tests.deployments.conftest import LocalBroker, tiny_config


def test_the_api_field_becomes_one_value_that_the_row_keeps(tiny_model_dirs):
    router = Router(tiny_config(tiny_model_dirs), LocalBroker(tiny_config(tiny_model_dirs)))
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2}
    [plain] = router.prepare_completion(CompletionRequest(**body))
    assert plain.speculation == SpeculationOptions()
    [off] = router.prepare_completion(CompletionRequest(**body, speculative={"enabled": False, "k": 3}))
    assert off.speculation.k == 0, "disabled: plain decoding whatever k says"
    [pinned] = router.prepare_completion(CompletionRequest(**body, speculative={"k": 2, "adaptive": False,
                                                                                 "overlap": False}))
    assert pinned.speculation == SpeculationOptions(2, False, False)
    [chains] = router.prepare_completion(CompletionRequest(**body, speculative={"tree": False}))
    assert chains.speculation == SpeculationOptions(tree=False), "a request may keep its drafts chains"

    async def rows_options():
        stream = router.scheduler.generate(pinned.prompt_ids, pinned.params, pinned.speculation)
        await stream.__anext__()
        live = list(router.scheduler._live.values())
        await stream.aclose()
        return [(row.options, row.seq.k, row.overlap) for row in live]

    assert asyncio.run(rows_options()) == [(SpeculationOptions(2, False, False), 2, False)]
