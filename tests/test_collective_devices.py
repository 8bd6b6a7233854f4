"""NCCL takes only tensors on the rank's GPU (gloo, which CI runs, takes CPU tensors too): a tensor made for a
collective without naming its device works on every CPU test and fails the first CUDA step. So every tensor made
in a function that hands tensors to a collective names its device; scripts/gpu_check.sh runs the NCCL path itself."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "echo2cli"
TENSOR_COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                      "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single", "scatter", "gather"}  # fmt: skip
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "rand", "randn"}


def attribute_calls(node: ast.AST, owner: str, names: set[str]) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(node)
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr in names
        and isinstance(n.func.value, ast.Name)
        and n.func.value.id == owner
    ]


def unplaced_tensors(source: str) -> list[str]:
    """`torch.<factory>(...)` calls without `device=` inside functions that call `dist.<tensor collective>`."""
    out = []
    for fn in ast.walk(ast.parse(source)):
        if isinstance(fn, ast.FunctionDef) and attribute_calls(fn, "dist", TENSOR_COLLECTIVES):
            for call in attribute_calls(fn, "torch", FACTORIES):
                if not any(k.arg == "device" for k in call.keywords):
                    out.append(f"{fn.name}:{call.lineno}")
    return out


def test_every_tensor_made_for_a_collective_names_its_device():
    found = {p.name: unplaced_tensors(p.read_text()) for p in PACKAGE.rglob("*.py")}
    assert not {k: v for k, v in found.items() if v}


def test_the_check_finds_the_slip_that_failed_the_first_nccl_step():
    slip = "def count(mine):\n    n = torch.tensor([mine])\n    dist.all_reduce(n, op=dist.ReduceOp.MAX)\n"
    assert unplaced_tensors(slip) == ["count:2"]
    fixed = "def count(self, mine):\n    n = torch.tensor([mine], device=self.device)\n    dist.all_reduce(n)\n"
    assert unplaced_tensors(fixed) == []
