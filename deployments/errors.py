"""What the round loop's collaborators raise to it (kept apart so that every module of the loop can import them)."""


class ReplicaGone(RuntimeError):
    """The leased replica (or one of its workers) died; lease another one."""


class DraftGone(ReplicaGone):
    """The leased Draft replica died (in a chained round: the call that had to reach the target through it)."""


class ChainBroken(RuntimeError):
    """A chained round did not complete although neither replica is known dead (the draft worker could not reach
    the target worker): the round verifies without its drafts, by a call of its own."""


class Overloaded(RuntimeError):
    """Admission refused: too many live sequences, or the model deployments' queues are full."""


class ReplicaFull(Overloaded):
    """A replica refused a lease: its KV cache holds as many sequences as it has slots for (deployments/admission.py).
    The request waits for space and tries again; past its wait it is answered like any overload (503)."""


class TensorParallelBroken(RuntimeError):
    """A target rank's tensor-parallel group cannot compute any more (a peer died): the replica must go. Raised by
    the worker (deployments/workers.py), it crosses the channel to the lease, which takes it as ReplicaGone."""


class RequestFailed(RuntimeError):
    """One request failed on a worker after admission (a deployments/messages.RowFailure: its grammar would not
    compile there, say). The round loop ends that request with this error and goes on with the others; the router
    answers it as a 500 with the failure's code (router.Router.run)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @staticmethod
    def of(failure) -> "RequestFailed":
        return RequestFailed(failure.code, failure.message)
