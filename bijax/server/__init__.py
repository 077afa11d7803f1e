"""``bijax serve``: an OpenAI-compatible HTTP server (vLLM's endpoints and request fields).

- ``engine_loop``: one thread steps the ``Engine``; requests join the running batch.
- ``protocol``: request bodies, checked into ``SamplingParams``; errors name the field.
- ``app``: the FastAPI routes; ``generation``: one request's way through the loop (whole or
  streamed, aborted when its client goes away); ``render``: response shapes and ``/metrics``.
"""

from bijax.server.app import build_app
from bijax.server.engine_loop import EngineLoop

__all__ = ["EngineLoop", "build_app"]
