"""Structured outputs: a request's grammar, compiled once per distinct spec, and one matcher per sequence that says
which tokens the grammar allows at each draft and verify position.

Grammars (OpenAI's `response_format` and vLLM's `structured_outputs`, mapped to a `GrammarSpec` at the HTTP
boundary): a JSON schema, any JSON object, a regular expression, a choice among strings, an EBNF / Lark grammar.

The library is llguidance (the Rust engine under Microsoft's guidance, one of vLLM's structured-output backends),
not xgrammar (vLLM's and SGLang's default): llguidance is one abi3 wheel with no dependencies, where xgrammar needs
triton on Linux x86_64, a large install for the CPU machines this project runs on. llguidance computes a mask
lazily from an Earley parser over a derivative-based lexer, with no per-grammar pass over the vocabulary, and its
matcher rolls back consumed tokens (`LLMatcher.rollback`), which speculation needs. Measured here (SmolLM2's 49k
vocabulary, 2 cores; bench/RESULTS.md): its tokenizer table is the one large cost, paid once per process; a small
JSON schema's compile, a mask and a copy of a compiled matcher are small beside a decode step.

Speculation under a grammar (the requirement that keeps it lossless, Chen et al. 2023, arXiv 2302.01318, Sec. 2.3:
any modification of the target distribution applies to both sides): at verify position j the target's mask is the
grammar's state after the committed tokens plus drafts[:j] (`GrammarMatcher.masks`); disallowed logits become -inf
before the usual temperature / top-k / top-p processing, so the rejection sampler draws exactly from the constrained
target distribution. A draft the grammar does not allow has constrained target probability 0 and is rejected; the
drafts a round rejects are rolled back (`GrammarMatcher.sync` keeps only the common prefix with the committed
tokens). The draft model masks its own proposals with its own matcher only to be accepted more often; n-gram drafts
are not masked at all. EOS is allowed exactly where the grammar accepts, so a finished grammar stops the row.

EOS is never fed to llguidance's matcher: in a stopped matcher (the grammar can take no more bytes) an EOS is
accepted without being counted, so a later rollback would undo a real token. A matcher here holds the output up to
its first EOS; past it, the only allowed token is EOS.
"""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
SLOW_COMPILE_S = 0.05  # a compile this slow is logged (it holds up the thread that compiles it)

log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A grammar that cannot be compiled (a bad schema, regex or grammar), a tokenizer llguidance cannot read, or a
    matcher that failed mid-sequence (a rollback llguidance refused)."""


@dataclass(frozen=True)
class GrammarSpec:
    """A request's grammar, hashable: the compile cache's key, and what travels to the workers (once per sequence)."""

    kind: str  # one of KINDS
    # json: the schema as JSON text; regex: the pattern; choice: a JSON list of strings; grammar: EBNF / Lark text;
    # json_object: unused ("")
    source: str = ""
    any_whitespace: bool = True  # JSON kinds: flexible whitespace between tokens (vLLM's default)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise GrammarError(f"unknown grammar kind {self.kind!r}; one of {', '.join(KINDS)}")

    @staticmethod
    def json_schema(schema: dict | str, any_whitespace: bool = True) -> "GrammarSpec":
        text = schema if isinstance(schema, str) else json.dumps(schema, separators=(",", ":"))
        return GrammarSpec("json", text, any_whitespace)

    @staticmethod
    def choice(options: Sequence[str]) -> "GrammarSpec":
        if not options or any(not isinstance(o, str) for o in options):
            raise GrammarError("a choice needs at least one string")
        return GrammarSpec("choice", json.dumps(list(options)))

    def wire(self) -> tuple:
        return (self.kind, self.source, self.any_whitespace)

    @staticmethod
    def from_wire(wire: tuple | None) -> "GrammarSpec | None":
        return None if wire is None else GrammarSpec(*wire)


def grammar_text(spec: GrammarSpec) -> str:
    """llguidance's grammar definition of `spec` (vLLM's guidance backend's mapping, serialize_guidance_grammar)."""
    import llguidance

    whitespace = {"whitespace_flexible": spec.any_whitespace}
    try:
        if spec.kind == "json":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=whitespace)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
        return llguidance.grammar_from(spec.kind, spec.source)
    except (ValueError, TypeError) as exc:
        raise GrammarError(str(exc)) from exc


def grammar_tokenizer(tokenizer, vocab_size: int, eos_ids: Iterable[int]):
    """llguidance's table of each token's bytes for a Hugging Face fast tokenizer, `vocab_size` wide (the logits'
    width; ids past the tokenizer's are never allowed), with the model's EOS ids."""
    try:
        import llguidance.hf
    except ImportError as exc:
        raise GrammarError(f"structured outputs need the llguidance package: {exc}") from exc

    eos = sorted(int(e) for e in eos_ids)
    try:
        return llguidance.hf.from_tokenizer(tokenizer, n_vocab=max(vocab_size, len(tokenizer)),
                                            eos_token=eos or None)
    except (ValueError, TypeError) as exc:
        raise GrammarError(f"structured outputs cannot read this model's tokenizer: {exc}") from exc


@dataclass
class CompileStats:
    """How many distinct grammars were compiled, in how long, and how often the cache answered instead."""

    compiles: int = 0
    cache_hits: int = 0
    seconds: float = 0.0  # total compile time
    max_seconds: float = 0.0
    tokenizer_seconds: float = 0.0  # building the tokenizer table (once)

    def as_dict(self) -> dict:
        return {"compiles": self.compiles, "cache_hits": self.cache_hits, "compile_seconds": self.seconds,
                "max_compile_seconds": self.max_seconds, "tokenizer_seconds": self.tokenizer_seconds}


class GrammarCompiler:
    """Compiles grammar specs for one tokenizer, each distinct spec once (an LRU of `capacity` compiled grammars);
    a sequence's matcher is a copy of its spec's compiled one."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: Iterable[int], capacity: int = 256) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size  # the logits' width: every mask is [.., vocab_size]
        self.eos_ids = sorted(int(e) for e in eos_ids)
        self.capacity = capacity
        self.stats = CompileStats()
        self._table = None  # llguidance's tokenizer table: built by `prepare` (start-up), else on first use
        # why the table cannot be built (llguidance cannot read the tokenizer): kept, every compile raises it
        self.unavailable: GrammarError | None = None
        self._compiled: OrderedDict[GrammarSpec, object] = OrderedDict()

    def prepare(self) -> None:
        """Build the tokenizer table now (a server's start-up: a large vocabulary's table would otherwise
        stall the first constrained round for every row). GrammarError if llguidance cannot read the tokenizer (or
        is not installed); the error is kept, and every later compile raises it again."""
        self._tokenizer_table()

    def _tokenizer_table(self):
        if self.unavailable is not None:
            raise self.unavailable
        if self._table is None:
            start = time.perf_counter()
            try:
                self._table = grammar_tokenizer(self._hf_tokenizer, self.vocab_size, self.eos_ids)
            except GrammarError as exc:
                self.unavailable = exc
                raise
            self.stats.tokenizer_seconds = time.perf_counter() - start
        return self._table

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec` (an llguidance matcher at its start, never advanced); GrammarError if the
        grammar is bad."""
        compiled = self._compiled.get(spec)
        if compiled is not None:
            self._compiled.move_to_end(spec)
            self.stats.cache_hits += 1
            return compiled
        table = self._tokenizer_table()  # first: it says so when llguidance is missing
        import llguidance

        text = grammar_text(spec)
        start = time.perf_counter()
        compiled = llguidance.LLMatcher(table, text, log_level=0)
        seconds = time.perf_counter() - start
        if compiled.is_error():
            raise GrammarError(compiled.get_error())
        self.stats.compiles += 1
        self.stats.seconds += seconds
        self.stats.max_seconds = max(self.stats.max_seconds, seconds)
        if seconds > SLOW_COMPILE_S:
            log.warning("a %s grammar took %.0f ms to compile", spec.kind, 1000 * seconds)
        self._compiled[spec] = compiled
        if len(self._compiled) > self.capacity:
            self._compiled.popitem(last=False)
        return compiled

    def matcher(self, spec: GrammarSpec) -> "GrammarMatcher":
        return GrammarMatcher(self.compile(spec).deep_copy(), self.vocab_size, self.eos_ids)


class GrammarMatcher:
    """One sequence's grammar state over its output tokens (the prompt is not the grammar's).

    `sync(output)` brings it to an output (rolling back to the common prefix, then consuming the rest: a rejected
    draft disappears, an accepted one stays); `allowed()` is the mask at the state; `masks(drafts)` the masks at
    each verify position, probing the drafts and rolling them back. An output token the grammar does not allow
    (a draft worker's guessed continuation, say) leaves the matcher `off_grammar`: no mask until a sync rolls it
    back. EOS is never consumed (see the module docstring): past it only EOS is allowed.
    """

    def __init__(self, matcher, vocab_size: int, eos_ids: Sequence[int]) -> None:
        self._matcher = matcher
        self.vocab_size = vocab_size
        self.eos_ids = frozenset(int(e) for e in eos_ids)
        self._output: list[int] = []  # the output the matcher was synced to
        self._consumed = 0  # its first tokens consumed by the matcher (up to the first EOS or disallowed token)

    @property
    def off_grammar(self) -> bool:
        """The output has a token the grammar does not allow (EOS where the grammar does not accept, say)."""
        return self._consumed < len(self._output) and not self._ended_by_eos()

    @property
    def accepting(self) -> bool:
        """The output so far is a complete match (EOS allowed here)."""
        return not self.off_grammar and self._matcher.is_accepting()

    def _ended_by_eos(self) -> bool:
        return (self._consumed < len(self._output) and self._output[self._consumed] in self.eos_ids
                and self._matcher.is_accepting())

    def sync(self, output: Sequence[int]) -> None:
        """Hold `output`: roll back what differs from it, then consume the rest up to an EOS or a token the grammar
        does not allow."""
        output = [int(t) for t in output]
        limit = min(self._consumed, len(output))
        same = limit
        if output[:limit] != self._output[:limit]:
            same = next(i for i in range(limit) if output[i] != self._output[i])
        if same < self._consumed:
            self.rollback(self._consumed - same)
        self._output = output
        rest = output[same:]
        for i, token in enumerate(rest):
            if token in self.eos_ids:
                rest = rest[:i]
                break
        if rest and self._consumed == same:
            self._consumed += self._matcher.try_consume_tokens(rest)

    def advance(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the output (consumed up to an EOS or the first token the grammar does not allow)."""
        self.sync(self._output + list(tokens))

    def rollback(self, n: int) -> None:
        """Undo the last `n` consumed tokens."""
        assert 0 <= n <= self._consumed, f"cannot roll back {n} of {self._consumed} tokens"
        if n:
            if not self._matcher.rollback(n):
                raise GrammarError(f"grammar rollback failed: {self._matcher.get_error()}")
            self._consumed -= n
            del self._output[self._consumed:]

    def allowed(self) -> torch.Tensor | None:  # [V] bool, or None: off the grammar (no constraint can be given)
        """The tokens the grammar allows next: EOS only where it accepts, EOS alone once it has ended."""
        if self.off_grammar:
            return None
        if self._ended_by_eos():
            return self._eos_only()
        bits = np.unpackbits(np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[: self.vocab_size].astype(bool))
        if not bool(allowed.any()):  # an error state: end the row rather than sample from nothing
            return self._eos_only()
        return allowed

    def _eos_only(self) -> torch.Tensor:  # [V] bool
        eos_only = torch.zeros(self.vocab_size, dtype=torch.bool)
        eos_only[[e for e in sorted(self.eos_ids) if e < self.vocab_size]] = True
        return eos_only

    def masks(self, drafts: Sequence[int]) -> torch.Tensor | None:  # [len(drafts) + 1, V] bool, or None
        """The allowed tokens at each verify position: row j is the grammar's state after the synced output plus
        drafts[:j]. Probing stops at the first draft the grammar does not allow (the target rejects it there; the
        later rows allow everything, never read). The matcher ends as it began. None when the output itself is off
        the grammar."""
        base = list(self._output)
        first = self.allowed()
        if first is None:
            return None
        out = torch.ones(len(drafts) + 1, self.vocab_size, dtype=torch.bool)
        out[0] = first
        for j, token in enumerate(drafts):
            if not (0 <= token < self.vocab_size and bool(out[j, token])):
                break
            self.sync(base + list(drafts[: j + 1]))
            row = self.allowed()
            if row is None:  # the matcher would not take a token its mask allowed: refuse it here instead
                out[j, token] = False
                if not bool(out[j].any()):
                    out[j] = self._eos_only()
                break
            out[j + 1] = row
        self.sync(base)
        return out


@dataclass
class SequenceGrammars:
    """The matchers of the live sequences that asked for a grammar, by sequence id (a worker's, or the in-process
    engine's), with the output start of each (the prompt's length: the grammar covers the output only).

    A sequence whose grammar failed here (it would not compile, or its matcher broke) is remembered until it is
    released or tracked afresh: every later call for it raises that GrammarError again, so a caller that goes on
    with it never masks it silently unconstrained (the grammar travels with a sequence's first call only)."""

    compiler: GrammarCompiler  # the process's (its tokenizer table built at start-up: GrammarCompiler.prepare)
    _rows: dict[str, tuple[GrammarMatcher, int]] = field(default_factory=dict)
    _specs: dict[str, GrammarSpec] = field(default_factory=dict)
    _failed: dict[str, GrammarError] = field(default_factory=dict)

    def track(self, seq_id: str, spec: GrammarSpec, output_start: int) -> None:
        """Give `seq_id` a matcher for `spec` (a no-op when it has one for the same spec and start). GrammarError
        (remembered for the sequence) when the grammar cannot be compiled here."""
        held = self._rows.get(seq_id)
        if held is not None and self._specs[seq_id] == spec and held[1] == output_start:
            return
        self.release(seq_id)
        try:
            matcher = self.compiler.matcher(spec)
        except GrammarError as exc:
            self._failed[seq_id] = exc
            raise
        self._rows[seq_id] = (matcher, output_start)
        self._specs[seq_id] = spec

    def has(self, seq_id: str) -> bool:
        return seq_id in self._rows

    def check(self, seq_id: str) -> None:
        """Raise the GrammarError the sequence's grammar failed with, if it did."""
        failed = self._failed.get(seq_id)
        if failed is not None:
            raise failed

    def matcher(self, seq_id: str, tokens: Sequence[int]) -> GrammarMatcher | None:
        """The sequence's matcher synced to its `tokens` (prompt + output), or None if it has no grammar.
        GrammarError if its grammar failed (now or before)."""
        self.check(seq_id)
        held = self._rows.get(seq_id)
        if held is None:
            return None
        matcher, start = held
        try:
            matcher.sync(tokens[start:])
        except GrammarError as exc:
            self.fail(seq_id, exc)
            raise
        return matcher

    def masks(self, seq_id: str, tokens: Sequence[int], drafts: Sequence[int]) -> torch.Tensor | None:
        """[len(drafts) + 1, V] bool: the allowed tokens at each verify position of a sequence holding `tokens`
        (None: no grammar). GrammarError if its grammar failed (now or before)."""
        matcher = self.matcher(seq_id, tokens)
        if matcher is None:
            return None
        try:
            return matcher.masks(drafts)
        except GrammarError as exc:
            self.fail(seq_id, exc)
            raise

    def fail(self, seq_id: str, exc: GrammarError) -> None:
        """Drop the sequence's matcher and remember why (`check` raises it from now on)."""
        self._rows.pop(seq_id, None)
        self._specs.pop(seq_id, None)
        self._failed[seq_id] = exc

    def release(self, seq_id: str) -> None:
        self._rows.pop(seq_id, None)
        self._specs.pop(seq_id, None)
        self._failed.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._rows)


class GrammarProcessor:
    """A sequence's grammar as a logits processor of engine/request/logits_processing.py's seam: row t of `logits`
    scores the token after the context's history t, so it gets the grammar's mask there (GrammarMatcher.masks over the
    context's drafts). The same mask as `RowVerify.allowed` and the draft's `mask_draft_logits` apply today; this
    is the piece that lets the grammar ride in a row's processors instead (see the issue note)."""

    def __init__(self, matcher: GrammarMatcher) -> None:
        self.matcher = matcher

    def __call__(self, logits: torch.Tensor, context) -> torch.Tensor:  # [T, V] -> [T, V], in place
        output = list(context.tokens[context.prompt_len:]) + list(context.drafts[: context.first])
        self.matcher.sync(output)
        width = logits.shape[0]
        masks = self.matcher.masks(list(context.drafts[context.first: context.first + width - 1]))
        if masks is not None:
            vocab = min(logits.shape[-1], masks.shape[-1])
            logits[:, :vocab].masked_fill_(~masks[:width, :vocab].to(logits.device), float("-inf"))
            logits[:, vocab:] = float("-inf")  # ids past the grammar's table: never allowed
        return logits
