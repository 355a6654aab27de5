"""A warning before torch's stack overflow on freeing a deep graph whose grad_fn was read.

NOTE [Deep graphs] torch frees a long chain of autograd nodes without recursion: the node
deleter buffers the nodes it would free recursively. On a torch that keeps a node's Python
object alive with the node once Python has read `tensor.grad_fn` (2.13 does;
`torch_keeps_node_objects` asks the torch at hand), a node with such an object is freed
through that object's deallocation instead, which frees the next node of the chain from
inside it: freeing a chain of ~40,000 such nodes overflows an 8 MiB stack, and the process
dies with a segmentation fault when the graph is dropped. Any code that reads `grad_fn`
along the chain does it, offload or not (on the dev VM, torch 2.13.0: a plain loop of
`y = y.sin(); y.grad_fn` died at 44,000 steps and ran at 40,000; a thread's stack of 2 MiB,
glibc's default under `ulimit -s unlimited`, died at 12,000). offload reads `grad_fn` of
every tensor it saves (the leaf and weight tests, and autograd's "modified by an inplace
operation" message needs the saving node), so its steps set up every node of a chain of
saves like this.

Nothing here changes how the graph is freed (that is torch's). A step that made more than
DEEP_GRAPH_NODES nodes, on a torch that keeps the objects, logs one warning per process,
before the graph can be freed where it can (at the backward's first unpack of a stored or
kept tensor, else at the block's exit), with the fix: a larger stack, of a size (an
unlimited one gives threads the smallest).
"""
from __future__ import annotations

import logging
import sys

import torch

from .version_check import next_sequence_nr

__all__ = ["DEEP_GRAPH_NODES", "nodes_made", "running_node_number", "check",
           "torch_keeps_node_objects"]

log = logging.getLogger("offload")

# Half of the chain that overflowed an 8 MiB stack on the dev VM (~40,000 nodes of `sin`,
# ~200 bytes of stack a node): other frames share the stack, other threads have less.
DEEP_GRAPH_NODES = 20_000

_keeps_node_objects: bool | None = None
_warned = False


def nodes_made() -> int:
    """Autograd nodes made on this thread so far (its next sequence number); -1 when this
    torch does not say."""
    return next_sequence_nr() if next_sequence_nr is not None else -1


def running_node_number() -> int:
    """The sequence number of the node the backward is running on this thread, + 1 (what
    `nodes_made()` said on the forward's thread once that node was made); -1 when none."""
    current = getattr(torch._C, "_current_autograd_node", None)
    node = current() if current is not None else None
    return node._sequence_nr() + 1 if node is not None else -1


def torch_keeps_node_objects() -> bool:
    """Whether a node keeps the Python object a read of `grad_fn` made (asked once)."""
    global _keeps_node_objects
    if _keeps_node_objects is None:
        try:
            with torch.inference_mode(False), torch.enable_grad():
                y = torch.zeros(1, requires_grad=True) + 1   # saves nothing: no hook runs
                if y.grad_fn is None:     # no graph is made here (a tracer): ask later
                    return False
                # Kept: the node holds a reference besides the one this read returns.
                _keeps_node_objects = sys.getrefcount(y.grad_fn) > 1
        except Exception:   # (called from the hooks: never fail them)
            return False
    return _keeps_node_objects


def check(first_node: int, last_node: int | None = None) -> None:
    """Warn once per process if the nodes made from `first_node` (`nodes_made()` at the
    step's start, on the thread that runs its forward) to `last_node` (default: now, on
    this thread) make a chain that may overflow the stack when freed (NOTE [Deep graphs]).
    """
    global _warned
    if _warned or first_node < 0:
        return
    made = (nodes_made() if last_node is None else last_node) - first_node
    if made <= DEEP_GRAPH_NODES or not torch_keeps_node_objects():
        return
    _warned = True
    import resource   # (POSIX only: imported when there is something to say)

    soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    limit = "unlimited" if soft == resource.RLIM_INFINITY else f"{soft >> 20} MiB"
    log.warning(
        "offload: this step made %d autograd nodes. torch %s may free a chain of nodes "
        "whose grad_fn Python has read by recursion, and offload reads grad_fn of every "
        "tensor it saves: a chain of ~40,000 such nodes overflowed an 8 MiB stack when the "
        "graph was freed (a segmentation fault; plain torch code that reads .grad_fn along "
        "the chain does the same). If the process dies there, give it a larger stack of a "
        "size (now %s): `ulimit -s 262144` (256 MiB; not `unlimited`, which gives threads "
        "2 MiB) in the shell that starts Python; for the main thread also "
        "resource.setrlimit(resource.RLIMIT_STACK, (256 << 20, hard)) at the top of the "
        "script; for a thread of your own threading.stack_size(256 << 20) before starting "
        "it", made, torch.__version__, limit)
