"""offload/schedule/arguments.py: a call's arguments taken apart and rebuilt as new
containers (NOTE [Arguments as at the call]), dataclasses included."""
from __future__ import annotations

import dataclasses
from collections import namedtuple

import torch

from offload.schedule.arguments import flatten_call


@dataclasses.dataclass
class Inner:
    t: torch.Tensor
    tags: list


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    scale: float
    later: int = dataclasses.field(init=False, default=3)


@dataclasses.dataclass(slots=True)
class Slotted:
    a: torch.Tensor
    b: dict


Pair = namedtuple("Pair", "x y")


def test_rebuilt_arguments_are_new_containers_holding_the_leaves_as_at_the_call():
    t1, t2, t3 = torch.ones(1), torch.zeros(2), torch.full((3,), 2.0)
    inner = Inner(t1, ["a"])
    args = (Outer(inner, 0.5), [Pair(t2, 1)])
    kwargs = {"s": Slotted(t3, {"k": t1})}
    leaves, rebuild = flatten_call(args, kwargs)
    assert [x for x in leaves if isinstance(x, torch.Tensor)] == [t1, t2, t3, t1]
    # the caller changes its objects after the call
    inner.t = torch.ones(5)
    inner.tags.append("b")
    kwargs["s"].b["k"] = t2
    a, kw = rebuild(list(leaves))
    assert a[0] is not args[0] and a[0].inner is not inner and a[0].later == 3
    assert a[0].inner.t is t1 and a[0].inner.tags == ["a"] and a[0].scale == 0.5
    assert isinstance(a[1][0], Pair) and a[1][0].x is t2
    assert kw["s"] is not kwargs["s"] and kw["s"].a is t3 and kw["s"].b == {"k": t1}
    # other leaves replace the tensors, in order
    new = [torch.tensor(float(i)) if isinstance(x, torch.Tensor) else x
           for i, x in enumerate(leaves)]
    a, kw = rebuild(new)
    assert a[0].inner.t is new[0] and kw["s"].b["k"] is new[-1]


def test_a_dataclass_holding_itself_is_a_leaf_inside_itself():
    @dataclasses.dataclass
    class Node:
        value: torch.Tensor
        me: object = None

    node = Node(torch.ones(1))
    node.me = node
    leaves, rebuild = flatten_call((node,), {})
    assert leaves == [node.value, node]
    (copy,), _ = rebuild(leaves)
    assert copy is not node and copy.me is node and copy.value is node.value


def test_plain_tensors_and_other_objects_are_leaves_as_they_are():
    marker = object()
    t = torch.ones(2)
    leaves, rebuild = flatten_call((t, marker, 3), {"k": None})
    assert leaves == [t, marker, 3, None]
    assert rebuild(leaves) == ((t, marker, 3), {"k": None})
