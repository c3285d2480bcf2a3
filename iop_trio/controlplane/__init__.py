"""The control-plane: node registry, registration tokens, scheduling. Embedded in the edge."""

from .inbox import RunInbox, RunLost
from .policy import KeyLimits, Placement, RateLimited, TokenBucket
from .registry import NodeRegistry
from .scheduler import Grant, NoNodeAvailable, Scheduler
from .session import NodeSession
from .tokens import IssuedToken, TokenCheck, TokenStore

__all__ = [
    "Grant",
    "IssuedToken",
    "KeyLimits",
    "Placement",
    "RateLimited",
    "TokenBucket",
    "NoNodeAvailable",
    "NodeRegistry",
    "NodeSession",
    "RunInbox",
    "RunLost",
    "Scheduler",
    "TokenCheck",
    "TokenStore",
]
