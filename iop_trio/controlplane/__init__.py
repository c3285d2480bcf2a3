"""The control-plane: node registry, registration tokens, scheduling. Embedded in the edge."""

from .inbox import RunInbox, RunLost
from .registry import NodeRegistry
from .scheduler import NoNodeAvailable, Scheduler
from .session import NodeSession
from .tokens import IssuedToken, TokenCheck, TokenStore

__all__ = [
    "IssuedToken",
    "NoNodeAvailable",
    "NodeRegistry",
    "NodeSession",
    "RunInbox",
    "RunLost",
    "Scheduler",
    "TokenCheck",
    "TokenStore",
]
