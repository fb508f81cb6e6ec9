"""A wrapper whose first call is made inside a ``torch.func`` transform (``grad``,
``vjp``, ``jacrev``, ``jacfwd``, ``vmap``): fusion stacks the members' parameters outside
the transform (made at the transform's level, the stack was freed with it, and the
process crashed on the next read of a parameter); that call and the calls after it, in
and out of transforms, equal eager. Run in a child process, so that a crash fails the
test instead of the test run."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import copy, torch
    from torch import nn
    import streamsched as ss
    from streamsched.testing import last_path

    torch.set_num_threads(1)

    class Towers(nn.Module):
        def __init__(self):
            super().__init__()
            self.towers = nn.ModuleList(
                nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4)) for _ in range(4))

        def forward(self, x):
            return torch.cat([t(x) for t in self.towers], -1)

    def close(a, b):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()

    transforms = {
        "grad": lambda f, x: torch.func.grad(lambda z: f(z).sum())(x),
        "vjp": lambda f, x: torch.func.vjp(f, x)[1](torch.ones(2, 16))[0],
        "jacrev": lambda f, x: torch.func.jacrev(f)(x),
        "jacfwd": lambda f, x: torch.func.jacfwd(f)(x),
        "vmap": lambda f, x: torch.func.vmap(f)(x.unsqueeze(1)),
    }
    for executor in ("serial", "auto"):
        for name, transform in transforms.items():
            torch.manual_seed(0)
            model = Towers()
            reference = copy.deepcopy(model)
            sm = ss.StreamScheduledModule(model, executor=executor)
            x = torch.randn(2, 8)
            close(transform(sm, x), transform(reference, x))
            for call in range(3):
                x = torch.randn(2, 8)
                close(sm(x), reference(x))
            if executor == "serial":
                assert last_path(sm) == "plan:serial", (name, last_path(sm))
            close(transform(sm, x), transform(reference, x))
            for p in model.parameters():
                p.detach().sum().item()
    print("ok")
    """
)


def test_a_first_call_inside_a_torch_func_transform_leaves_the_parameters_sound():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().endswith("ok")
