"""In-process stand-ins for the Draft/Target replicas (the real worker cores, no Ray) and tiny model dirs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import pytest

from deployments.config import SpecServeConfig
from deployments.errors import ChainBroken, DraftGone, ReplicaFull, ReplicaGone
from deployments.router.admission import refusal
from deployments.transport.messages import DraftResult, VerifyResult
from deployments.workers.draft import DraftWorkerCore
from deployments.workers.target import TargetWorkerCore
from tests.conftest import BYTE_VOCAB, make_byte_tokenizer, make_tiny_model, make_tiny_tokenizer, perturbed_copy


@pytest.fixture(scope="package")
def readme_app_with_draft_model(tmp_path_factory):
    """`serve run` of serve_config.yaml with a draft model (tests/deployments/serve_cluster.py), Ray's Prometheus
    endpoint on its own port: one cluster for the modules that drive it over HTTP (test_observability runs first,
    on the fresh cluster its exact counter sums need, then test_serve_e2e; the Makefile orders them). Package scope:
    stopped once this package's last test has run, before another module starts its own cluster on the same ports.
    Yields the `serve run` process and the metrics port."""
    from tests.deployments.serve_cluster import free_port, readme_config_with_draft_model, serve_app

    tmp = tmp_path_factory.mktemp("readme_app")
    metrics_port = free_port()
    with serve_app(tmp, metrics_port=metrics_port, config=readme_config_with_draft_model(tmp)) as proc:
        yield proc, metrics_port


def save_model_pair(root, target, draft, tokenizer=None):
    """Save a target and a draft (safetensors, the tiny tokenizer or `tokenizer`, EOS id 1) as model dirs; returns
    their paths."""
    tokenizer = tokenizer or make_tiny_tokenizer()
    for name, model in [("target", target), ("draft", draft)]:
        model.generation_config.eos_token_id = 1
        model.save_pretrained(root / name, safe_serialization=True)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory):
    target = make_tiny_model("llama", seed=0)
    return save_model_pair(tmp_path_factory.mktemp("models"), target, perturbed_copy(target, 0.02))


@pytest.fixture(scope="session")
def byte_model_dirs(tmp_path_factory):
    """A tiny pair over the byte-level tokenizer (any text tokenizes: JSON, regexes), with a chat template."""
    target = make_tiny_model("llama", vocab=BYTE_VOCAB, seed=0)
    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant: "
    return save_model_pair(tmp_path_factory.mktemp("byte_models"), target, perturbed_copy(target, 0.05), tokenizer)


# a chat template that reads tools (compactly: the tiny models' context is 256 tokens) and renders calls as the
# hermes parser reads them
TOOL_CHAT_TEMPLATE = (
    '{% if tools %}tools:{% for t in tools %} {{ t.function.name }}{% endfor %}\n{% endif %}'
    '{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %}<tool_call>{"name": '
    '"{{ c.function.name }}", "arguments": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}\n'
    '{% endfor %}assistant: ')
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                   "required": ["city"], "additionalProperties": False}}}
WEATHER_QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
WEATHER_ANSWER = "It is sunny in Paris."


def weather_turns(call_id: str = "call_1") -> list[tuple[list[dict], str]]:
    """An agent loop's two turns, (conversation, the reply the tool model learned): a call, then an answer."""
    called = {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    result = {"role": "tool", "tool_call_id": call_id, "content": "sunny"}
    return [(WEATHER_QUESTION, WEATHER_CALL), (WEATHER_QUESTION + [called, result], WEATHER_ANSWER)]


@pytest.fixture(scope="session")
def tool_model_dirs(tmp_path_factory):
    """A tiny byte-level pair whose chat template reads tools, and whose target was trained (a few seconds here) to
    answer the weather question with a hermes tool call and the tool's result with a sentence: an agent loop a
    tiny model can run. The draft is a perturbed copy."""
    import torch

    tokenizer = make_byte_tokenizer()
    tokenizer.chat_template = TOOL_CHAT_TEMPLATE
    rows = []
    for messages, reply in weather_turns():
        template_messages = [dict(m, content=m["content"] or "") for m in messages]
        for m in template_messages:
            for call in m.get("tool_calls", ()):
                call["function"] = dict(call["function"], arguments={"city": "Paris"})
        prompt = tokenizer.apply_chat_template(template_messages, tools=[WEATHER_TOOL], tokenize=True,
                                               return_dict=True)["input_ids"]
        rows.append((list(prompt), tokenizer(reply)["input_ids"] + [tokenizer.eos_token_id]))
    width = max(len(p) + len(r) for p, r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    labels = torch.full((len(rows), width), -100)
    for i, (prompt, reply) in enumerate(rows):
        ids[i, :len(prompt) + len(reply)] = torch.tensor(prompt + reply)
        labels[i, len(prompt):len(prompt) + len(reply)] = torch.tensor(reply)
    target = make_tiny_model("llama", vocab=BYTE_VOCAB, seed=0).train()
    optimizer = torch.optim.Adam(target.parameters(), lr=3e-3)
    for _ in range(120):
        loss = target(ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    target.eval()
    return save_model_pair(tmp_path_factory.mktemp("tool_models"), target, perturbed_copy(target, 0.02), tokenizer)


# the tiny WordLevel tokenizer has no chat template; this one maps any conversation to known words
TINY_CHAT_TEMPLATE = "{% for m in messages %}w5 w9 w{{ 10 + m['content'] | length % 50 }} {% endfor %}"


def tiny_config(dirs, **overrides) -> SpecServeConfig:
    target, draft = dirs
    # fp32 on every machine (`auto` is bf16 on CPUs that compute it): the served texts are checked against the fp32
    # transformers forward
    model = {"target": str(target), "target_dtype": "float32", "draft": str(draft), "draft_dtype": "float32",
             "served_model_name": "tiny",
             "max_model_len": 256, **overrides.pop("model", {})}
    limits = {"max_prompt_tokens": 200, "max_tokens": 128, **overrides.pop("limits", {})}
    # tiny draft and target cost the same, so the adaptive policy would (rightly) never draft: tests of the round
    # machinery use fixed K unless they ask for the policy
    # and measure costs every start, never reading or writing a cost cache in the home directory
    speculation = {"adaptive": False, "cost_cache": None, **overrides.pop("speculation", {})}
    # the static runner, eager: compiling its steps is tested in tests/engine (it would take minutes here)
    runner = {"compile": False, "kv_cache_gib": 0.05, **overrides.pop("runner", {})}
    # model threads keep Ray's niceness: the tests' Ray clusters saturate two cores, where a niceness-0 model
    # thread would starve the routers and Serve's control plane
    workers = {role: {"niceness": None, **overrides.pop(role, {})} for role in ("draft", "target")}
    return SpecServeConfig.model_validate({"model": model, "limits": limits, "speculation": speculation,
                                           "runner": runner, **workers, **overrides})


class _Relay:
    """Stands in for a draft worker's ChannelRelay: keeps the call it was to pass on."""

    def send(self, route, method, *args) -> None:
        self.sent = (method, args)


class _Lease:
    def __init__(self, broker, kind: str, core, key: str, seq_id: str) -> None:
        self.broker, self.kind, self.core, self.key, self.seq_id = broker, kind, core, key, seq_id
        self.closed = False
        self.costs = core.costs

    def _maybe_fail(self) -> None:
        self.broker.calls[self.kind] += 1
        if self.broker.calls[self.kind] == self.broker.fail_at_call.get(self.kind):
            self.broker.replace(self.kind)
            raise (DraftGone if self.kind == "draft" else ReplicaGone)(f"{self.kind} replica killed")

    async def propose(self, calls, ahead_id=None):
        self._maybe_fail()
        await asyncio.sleep(0)  # like a remote call: the round's verify can start before the draft is done
        # as the channel carries them, and as RayDraftLease reads the reply
        return DraftResult.from_wire(self.core.propose([call.wire() for call in calls], ahead_id))

    async def chain(self, calls, target, verify_calls, members):
        """What RayDraftLease.chain does, in-process: the worker cores' own chained handlers, with the draft's
        relay handing its call to this target's core."""
        self.broker.chained += 1
        self._maybe_fail()
        await asyncio.sleep(0)
        relay = _Relay()
        self.core._relay = relay
        self.core.propose_chained([c.wire() for c in calls], [c.wire() for c in verify_calls], members,
                                  ("target endpoint", 1))
        if self.broker.break_chains:  # drafted, but could not pass the drafts on to the target
            self.broker.break_chains -= 1
            raise ChainBroken("could not pass verify_chained on")
        method, args = relay.sent
        return await target._verify(lambda: getattr(target.core, method)(*args))

    def cancel(self, ahead_id) -> None:
        self.broker.cancels += 1
        self.core.cancel(ahead_id)

    async def verify(self, calls):
        return await self._verify(lambda: self.core.verify([call.wire() for call in calls]))

    async def _verify(self, run) -> VerifyResult:
        self._maybe_fail()
        return VerifyResult.from_wire(run())

    async def release(self) -> None:
        self.broker.direct_releases[self.kind] += 1
        self.core.release([self.seq_id])  # the router's own release through the channel (_RayLease.release)

    async def close(self) -> None:
        self.closed = True
        self.core.release([self.seq_id])  # what the replica does when a lease ends
        self.broker.open_leases[self.kind] -= 1  # its slot is free once the worker released the sequence
        self.broker.live[self.key] -= 1


class LocalBroker:
    """One draft and one target 'replica'; `fail_at_call[kind] = n` kills it at its n-th call.

    Like the replicas (deployments/workers/replicas._LeasedReplica), it refuses a target lease when the target core's
    runner holds `kv_capacity` leased sequences already; `starting` names the deployments whose replicas do not answer
    `ready` yet."""

    def __init__(self, config: SpecServeConfig) -> None:
        self.engine_config = config.engine_config()
        self.uses_draft = config.draft_source().remote
        # like the replicas: measure costs at start when the router's K policy wants them
        self.calibrate = config.speculation.adaptive and config.speculation.calibration is None
        self.counter = itertools.count()
        self.cores = {"target": self._core("target")}
        if self.uses_draft:
            self.cores["draft"] = self._core("draft")
        self.keys = {kind: f"{kind}-0" for kind in self.cores}
        self.fail_at_call: dict[str, int] = {}
        self.calls = {"draft": 0, "target": 0}
        self.open_leases = {"draft": 0, "target": 0}
        self.leases_taken = {"draft": 0, "target": 0}
        self.refuse_draft_leases = 0  # the next n draft leases fail (no Draft replica available)
        self.cancels = 0
        self.chained = 0  # chained rounds (draft hands its drafts to the target)
        self.direct_releases = {"draft": 0, "target": 0}  # freed by the router through the channel after the last round
        self.break_chains = 0  # the next n chained rounds fail after drafting (the target unreachable from the draft)
        self.held_target_leases: set[str] = set()
        self.leased_targets: set[str] = set()
        self.release_leases = asyncio.Event()
        self.live: dict[str, int] = {}  # open leases per replica key
        self.refused = 0  # target leases refused for want of a KV-cache slot
        self.starting: set[str] = set()
        self.ready_probes = {"draft": 0, "target": 0}

    def _core(self, kind: str):
        if kind == "draft":
            return DraftWorkerCore(self.engine_config, calibrate=self.calibrate)
        core = TargetWorkerCore(self.engine_config)
        if self.calibrate:
            core.calibrate(max(self.engine_config.num_speculative_tokens, 1))
        return core

    def replace(self, kind: str) -> None:
        self.cores[kind] = self._core(kind)
        self.keys[kind] = f"{kind}-{next(self.counter) + 1}"

    async def _lease(self, kind: str, seq_id: str):
        if kind == "draft" and self.refuse_draft_leases:
            self.refuse_draft_leases -= 1
            raise ReplicaGone("no draft replica available")
        key = self.keys[kind]
        if kind == "target":
            refused = refusal(key, self.live.get(key, 0), self.cores[kind].stats()["kv_capacity"])
            if refused is not None:  # what RayLeaseBroker raises for a replica's LeaseRefused
                self.refused += 1
                raise ReplicaFull(refused.message())
        self.live[key] = self.live.get(key, 0) + 1
        self.open_leases[kind] += 1
        self.leases_taken[kind] += 1
        return _Lease(self, kind, self.cores[kind], key, seq_id)

    async def draft(self, seq_id):
        return await self._lease("draft", seq_id)

    async def target(self, seq_id):
        if seq_id in self.held_target_leases and seq_id in self.leased_targets:
            await self.release_leases.wait()  # a test holds this request's re-lease (a slow replacement)
        lease = await self._lease("target", seq_id)
        self.leased_targets.add(seq_id)
        return lease

    async def ready(self, kind, timeout_s):
        self.ready_probes[kind] += 1
        if kind in self.starting:  # like a Serve call to a deployment with no running replica: held, then timed out
            await asyncio.sleep(timeout_s)
            return False
        return kind in self.cores


class _BoundedRunner:
    """A runner whose KV cache holds `capacity` sequences (whatever runner it wraps): `add` raises KVCacheFull past
    it, like the preallocated runner's."""

    def __init__(self, runner, capacity: int) -> None:
        self._runner, self.capacity = runner, capacity

    def add(self, seq_id, *args, **kwargs):
        from engine.models.runner import KVCacheFull

        if self._runner.num_live >= self.capacity:
            raise KVCacheFull(f"all {self.capacity} KV-cache slots are taken")
        return self._runner.add(seq_id, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._runner, name)


def bound_kv_cache(core, capacity: int) -> None:
    """Give a target core's runner a KV cache with `capacity` sequence slots."""
    core.runner = _BoundedRunner(core.runner, capacity)


@contextlib.contextmanager
def http_server(router):
    """The router's app under uvicorn in a thread (real HTTP, real streaming); yields the base URL."""
    import asyncio
    import threading
    import time

    import uvicorn

    from deployments.api.routes import create_app

    uv = uvicorn.Server(uvicorn.Config(create_app(router), host="127.0.0.1", port=0, log_level="error"))
    thread = threading.Thread(target=lambda: asyncio.run(uv.serve()), daemon=True)
    thread.start()
    while not uv.started:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{uv.servers[0].sockets[0].getsockname()[1]}"
    finally:
        uv.should_exit = True
        thread.join(10)


def write_profile(path, knee_batch: int, prefill_per_token: float = 0.0) -> str:
    """A cost profile where drafting pays up to `knee_batch` sequences and extra verify tokens are ruinous above."""
    from engine.spec.policy import CostProfile

    sizes = (1, 2, 4, 8)
    verify = tuple(tuple(0.01 * (1 + (w * 10 if b > knee_batch else w * 0.05)) for w in range(4)) for b in sizes)
    CostProfile(sizes, verify, (0.001,) * len(sizes), prefill_per_token).to_json(path)
    return str(path)
