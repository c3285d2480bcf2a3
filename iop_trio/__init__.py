"""IOP-Trio: an Inference Operations Platform on Trio."""

__version__ = "0.1.0"
