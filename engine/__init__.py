"""specserve's decoding engine: sampling, rejection sampling, proposers, model runners, the speculative loop.

Pure torch / numpy / transformers; never imports ray (tests/engine/test_purity.py checks).
"""

from engine.factory import EngineConfig, build_engine
from engine.models.transformers_runner import ContextWindowError, ModelRunner
from engine.proposers.base import IncompatibleDraftError, Proposal, Proposer
from engine.proposers.draft_model import DraftModelProposer
from engine.proposers.ngram import NgramProposer
from engine.request.sampling import BatchSampling, SamplingParams, logits_to_probs
from engine.request.sequence import EmptyPromptError, PromptTooLongError, RequestOutput, SequenceState
from engine.spec.rejection import RejectionResult, greedy_accept, rejection_sample
from engine.spec.stats import EngineTimings, SpecStats
from engine.speculative import Completion, SpeculativeEngine

__all__ = [
    "BatchSampling", "Completion", "ContextWindowError", "DraftModelProposer", "EmptyPromptError", "EngineConfig",
    "EngineTimings", "IncompatibleDraftError", "PromptTooLongError", "SequenceState", "ModelRunner", "NgramProposer", "Proposal", "Proposer",
    "RejectionResult", "RequestOutput", "greedy_accept", "SamplingParams", "SpecStats", "SpeculativeEngine", "build_engine",
    "logits_to_probs", "rejection_sample",
]
