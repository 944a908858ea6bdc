"""Import or run Crucible code as it runs in an image without the model extra: torch, torchao,
safetensors and ray are unimportable.

    python tests/torchless.py services.api      # like `python -m services.api`
"""

from __future__ import annotations

import importlib.abc
import runpy
import sys

BLOCKED = ("torch", "torchao", "safetensors", "ray")


class _Missing(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object, target: object = None) -> None:
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not installed in this image)", name=name)
        return None


def block() -> None:
    for name in [m for m in sys.modules if m.partition(".")[0] in BLOCKED]:
        del sys.modules[name]
    sys.meta_path.insert(0, _Missing())


if __name__ == "__main__":
    block()
    module = sys.argv[1]
    sys.argv = [module, *sys.argv[2:]]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
