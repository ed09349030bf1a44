"""How a request's handling ends early, for both protocols the fake vendor speaks."""


class ClientGone(Exception):
    """The client closed or broke the connection."""


class Aborted(Exception):
    """We ended the connection on purpose (a fault)."""
