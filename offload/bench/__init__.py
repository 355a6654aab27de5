"""`offload-bench`: recompute against offload, side by side, honestly measured.

Layout (one job per module):

* ``cli``        — argument parsing and validation, then hands over to ``runner``.
* ``runner``     — the parent: temp dirs, one worker process per (strategy, round), alternating
                   order, gradient comparison against ``none``, rows.
* ``worker``     — runs ONE strategy in a fresh process and writes its ``result.RunResult``.
* ``strategies`` — what each strategy does around a training step, and why it may be
                   unavailable; the registry ``--plugin`` modules add to.
* ``workload``   — the model, the fixed batch and the loss (built-in GPT, ``--hf`` or
                   ``--model``); the blocks are the runtime's (offload/schedule/blocks.py).
* ``hf``         — ``--hf``: a Hugging Face causal LM from a model type's config or a
                   config.json.
* ``measure``    — step timing, peak memory (CUDA allocator / process RSS), saved-bytes
                   accounting, gradient files.
* ``maxbatch``   — ``--max-batch``: the largest batch each strategy fits.
* ``rows``       — ``Row``: the one typed record behind the table, ``--json`` and ``--plot``.
* ``report``     — the table, ``--json``, ``--plot``, ``--explain``.
* ``spec``       — the run description the parent sends to a worker.
"""
from __future__ import annotations

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``offload-bench`` console script (see :mod:`offload.bench.cli`)."""
    from offload.bench.cli import main as _main

    return _main(argv)
