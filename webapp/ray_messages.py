"""What an engine replica sends the Ray Serve ingress for one generation request.

``EngineReplica.generate`` (webapp.ray_serve) streams a StreamHead (or an APIError instead of it),
then lists of StreamEvents (streamed requests) or one list of Completions, then a StreamEnd;
an APIError instead when the engine fails mid-way. The ingress (webapp.ray_ingress) reads them.
Both sides import this module, so neither imports the other's.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StreamHead:
    """A replica's first answer to a generation request (or an APIError instead of it)."""

    request_id: str
    num_prompt_tokens: int
    echo_texts: list[str] | None
    replica_id: str


@dataclass(frozen=True)
class StreamEnd:
    """A replica's last item for a request that ran to its end."""

    queue_s: float | None  # submission -> first scheduled (the request_queue_time metric)
