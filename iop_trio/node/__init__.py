"""The node role: dials the edge, registers, and serves runs through adapters."""
