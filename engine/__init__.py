"""specserve's decoding engine: sampling, rejection sampling, proposers, model runners, the speculative loop.

Pure torch / numpy / transformers; never imports ray (tests/engine/test_purity.py checks).
"""

from .factory import EngineConfig, build_engine
from .model_runner import ContextWindowError, ModelRunner
from .proposers import DraftModelProposer, IncompatibleDraftError, NgramProposer, Proposal, Proposer
from .rejection import RejectionResult, greedy_accept, rejection_sample
from .sampling import BatchSampling, SamplingParams, logits_to_probs
from .sequence import EmptyPromptError, PromptTooLongError, RequestOutput, SequenceState
from .speculative import Completion, SpeculativeEngine
from .stats import EngineTimings, SpecStats

__all__ = [
    "BatchSampling", "Completion", "ContextWindowError", "DraftModelProposer", "EmptyPromptError", "EngineConfig",
    "EngineTimings", "IncompatibleDraftError", "PromptTooLongError", "SequenceState", "ModelRunner", "NgramProposer", "Proposal", "Proposer",
    "RejectionResult", "RequestOutput", "greedy_accept", "SamplingParams", "SpecStats", "SpeculativeEngine", "build_engine",
    "logits_to_probs", "rejection_sample",
]
