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
    """A replica refused a lease: its KV cache holds as many sequences as it has slots for
    (deployments/router/admission.py). The request waits for space and tries again; past its wait it is answered like
    any overload (503)."""


class TensorParallelBroken(RuntimeError):
    """A target rank's tensor-parallel group cannot compute any more (a peer died): the replica must go. Raised by
    the worker (deployments/workers/draft.py), it crosses the channel to the lease, which takes it as ReplicaGone."""


class RequestFailed(RuntimeError):
    """One request failed on a worker after admission (a deployments/transport/messages.RowFailure: its grammar would
    not compile there, say). The round loop ends that request with this error and goes on with the others; the router
    answers it as a 500 with the failure's code (router.Router.run)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @staticmethod
    def of(failure) -> "RequestFailed":
        return RequestFailed(failure.code, failure.message)


class StartupError(RuntimeError):
    """A Draft or Target worker cannot start with this configuration (its KV-cache budget holds no sequence, a model
    path does not exist): the one-line message names the cause and the setting to change. Retrying cannot help, so
    the replica raises this instead of Ray's report of a dead worker actor, and Serve's status shows it
    (deployments/app.py bounds the retries; deployments/api/readiness.py puts it in /health's 503)."""

    MARK = "StartupError: "

    def __init__(self, message: str) -> None:
        super().__init__(" ".join(message.split()))  # one line: found again in a traceback's text (`found_in`)

    @classmethod
    def found_in(cls, text: str) -> "StartupError | None":
        """The StartupError whose traceback `text` ends with (a Ray error's or Serve's status message), or None."""
        at = text.rfind(cls.MARK)
        if at < 0:
            return None
        return cls(text[at + len(cls.MARK):].split("\n", 1)[0])
