"""What the round loop's collaborators raise to it (kept apart so that every module of the loop can import them)."""


class ReplicaGone(RuntimeError):
    """The leased replica (or one of its workers) died; lease another one."""


class Overloaded(RuntimeError):
    """Admission refused: too many live sequences, or the model deployments' queues are full."""
