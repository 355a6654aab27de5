"""What offload says about torch errors and conflicts its hooks and modes cause: the
messages, and the notes added to torch's own exceptions (the exception itself is kept)."""
from __future__ import annotations

__all__ = ["INSIDE_ALLOW_MUTATION", "explain_known_failures"]


# torch's allow_mutation_on_saved_tensors() clones a saved tensor before an in-place write
# into it, from saved-tensor hooks of its own: ours, entered inside it, would be innermost
# and hide every save from them (offload and auto then raised autograd's in-place error,
# recompute's re-run gave a silently wrong gradient). Entered inside ours it is innermost
# and its region runs as without us.
INSIDE_ALLOW_MUTATION = (
    "offload.activations(): entered inside torch.autograd.graph."
    "allow_mutation_on_saved_tensors(), whose hooks must see every saved tensor to clone it "
    "before an in-place write; ours would hide them. Enter allow_mutation_on_saved_tensors() "
    "inside the offload context instead (what is saved in it then stays where it is), or "
    "leave it out")

FUNC_TRANSFORM_HINT = (
    "offload: torch.func transforms (grad, vjp, jacrev, hessian, vmap over them) refuse to run "
    "while saved-tensor hooks are installed, and offload.activations() installs them. Call the "
    "transform outside the `with offload.activations()` block: it runs its own forward and "
    "backward at once, so there is nothing in it for offload to move. (offload.no_offload() "
    "does not help: the hooks stay installed inside it, keeping what is saved there.)")


HIGHER_ORDER_HINT = (
    "offload: policy='auto' runs a block's ops under its own dispatch modes (to time them, and "
    "to store or recompute each one), and torch's higher-order ops (torch.cond, while_loop, "
    "flex_attention) do not run under them in eager mode. Use policy='recompute' for this "
    "model (bit-exact with torch.cond), or leave the block that calls it out of blocks=.")


SAVED_HOOKS_SET_HINT = (
    "offload: hooks cannot be registered on one saved tensor (grad_fn._raw_saved_*."
    "register_hooks) that was saved inside offload.activations(): torch packs every save "
    "there with the context's saved-tensor hooks, and a saved tensor takes one pair of hooks "
    "(offload.no_offload() does not help: the hooks stay installed inside it). Make that "
    "save outside the `with` block, or put your hooks around it with "
    "torch.autograd.graph.saved_tensors_hooks(pack, unpack) inside the block: the innermost "
    "hooks take the saves made under them, which offload then leaves alone.")


def explain_known_failures(exc: BaseException) -> None:
    """Add what to do to torch errors that our hooks or modes cause (the exception itself
    is kept)."""
    text = str(exc)
    if isinstance(exc, RuntimeError) and "saved tensor hooks" in text and "torch.func" in text:
        _add_note(exc, FUNC_TRANSFORM_HINT)
    elif isinstance(exc, NotImplementedError) and "HigherOrderOperator" in text \
            and "offload.schedule" in text:
        _add_note(exc, HIGHER_ORDER_HINT)
    elif isinstance(exc, RuntimeError) and "register_hooks on a saved tensor whose hooks " \
            "have already been set" in text:
        _add_note(exc, SAVED_HOOKS_SET_HINT)


def _add_note(exc: BaseException, note: str) -> None:
    if note in getattr(exc, "__notes__", ()):   # nested contexts: said once
        return
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:  # Python 3.10
        exc.args = (f"{exc.args[0] if exc.args else ''}\n{note}",)
