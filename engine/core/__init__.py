"""The engine's core: the engine thread and what it schedules.

- ``runtime``: the engine thread (``EngineCore``): schedule -> forward -> sample -> update, once a tick.
- ``scheduler``: continuous batching under a per-tick token budget; ``tick_cost`` sizes prefill chunks.
- ``block_manager``: the paged KV cache's blocks and its prefix cache.
- ``sequence``: one request's tokens and its slot in the scheduler; ``request``: a request's state.

Nothing here imports the public surface (``engine.api`` and the modules beside it); the model
interface it drives, ``ForwardBatch``, is in ``engine/batch.py``, which the models import too.
"""
