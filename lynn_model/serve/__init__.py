"""``lynn serve``'s engine: continuous batching of requests over one model (:mod:`.engine`); the HTTP layer comes
later and drives :meth:`Engine.step` from one task.

Example::

    from lynn_model.serve import Engine
    engine = Engine(model, rows=8)
    req = engine.submit(prompt_ids, 32, temperature=0.7, seed=1)
    for token in engine.stream(req):                   # steps the engine, every request's tokens advance
        ...
"""

from .engine import FINISH_REASONS, Counters, Engine, Refused, Request

__all__ = ["Engine", "Request", "Refused", "Counters", "FINISH_REASONS"]
