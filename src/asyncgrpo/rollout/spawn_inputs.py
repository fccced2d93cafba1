"""What the trainer hands to the spawned rollout process, checked before anything starts.

The rollout process is spawned, not forked: everything it receives is pickled, functions and classes
by reference (module and name), and the child imports those modules to find them. So a lambda or a
closure cannot go at all; an object defined in the launching script (`__main__`) goes only if the child
can import that script and importing it does not start training again. Each case fails at `train()`
with an error that names the object and says what to do, instead of a child that dies while starting.

`main_module_hidden` keeps the child from importing the launching script when nothing it receives
comes from there.
"""

from __future__ import annotations

import ast
import contextlib
import pickle
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

_MAIN = b"__main__"  # in a pickle: something found by reference in the launching script

_PICKLE_ADVICE = (
    "the rollout process is spawned, so everything handed to it is pickled: use a module-level "
    "function, functools.partial or a callable class instance"
)


def check_picklable(obj: Any, what: str) -> bytes:
    """`obj` pickled, or `TypeError` naming `what` when it cannot be for the spawned rollout process.

    `what` is how the user knows the object, e.g. "reward_funcs[1]" or "environment_factory".
    """
    try:
        return pickle.dumps(obj)
    except Exception as exc:  # pickle raises PicklingError, AttributeError or TypeError
        name = getattr(obj, "__name__", None) or type(obj).__name__
        raise TypeError(f"{what} ({name}) cannot be pickled: {exc}; {_PICKLE_ADVICE}.") from exc


def _user_objects(loop_cls: type, loop_kwargs: Mapping[str, Any]) -> Iterator[tuple[str, Any]]:
    """(how the user knows it, object) for everything user-supplied that the child unpickles."""
    yield "loop_cls", loop_cls
    for i, func in enumerate(loop_kwargs.get("reward_funcs") or []):
        yield f"reward_funcs[{i}]", func
    for i, tool in enumerate(loop_kwargs.get("tools") or []):
        yield f"tools[{i}]", tool
    factory = loop_kwargs.get("environment_factory")
    if isinstance(factory, Mapping):
        for name, item in factory.items():
            yield f"environment_factory[{name!r}]", item
    elif factory is not None:
        yield "environment_factory", factory
    if loop_kwargs.get("harness") is not None:  # HarnessAsyncGRPOTrainer's
        yield "harness", loop_kwargs["harness"]
    if loop_kwargs.get("config") is not None:
        yield "config", loop_kwargs["config"]


def check_spawn_inputs(loop_cls: type, loop_kwargs: Mapping[str, Any]) -> bool:
    """Pickle the loop class and each user-supplied callable of `loop_kwargs` separately, and check that
    the child can import those defined in the launching script. Returns whether there are any (the child
    then needs the launching script as its `__main__`; see `main_module_hidden`).

    Checks `reward_funcs[i]`, `tools[i]`, `environment_factory` (or each entry of a dict of
    factories) and `config`, so the error names the one object that fails.
    """
    from_main = [(what, obj) for what, obj in _user_objects(loop_cls, loop_kwargs)
                 if _MAIN in check_picklable(obj, what)]
    if from_main:
        check_main_script(*from_main[0])
    return bool(from_main)


def check_main_script(what: str, obj: Any) -> None:
    """`obj` (`what`) is defined in the launching script, which the spawned child must import to find it:
    refuse a script it cannot import (a notebook, the REPL, standard input) and one that trains when
    imported (no `if __name__ == "__main__":` block), each with what to do, before anything starts."""
    name = getattr(obj, "__name__", None) or type(obj).__name__
    path = main_script()
    if path is None:
        raise TypeError(
            f"{what} ({name}) is defined in an interactive session (a notebook, the Python prompt or a "
            "script read from standard input), which the rollout process cannot import: it is a spawned "
            f"process that imports what it is handed by module. Move {name} into a module file (e.g. "
            "rewards.py beside the notebook) and import it from there"
        )
    if not _has_main_guard(path):
        raise RuntimeError(
            f"{what} ({name}) is defined in {path}, which has no `if __name__ == \"__main__\":` block: the "
            "rollout process imports that script to find it (it is spawned), and the script would start "
            "training again there. Put the training code under `if __name__ == \"__main__\":`"
        )


def main_script() -> Path | None:
    """The launching script's source file (`python script.py` or `python -m module`), or None when there
    is none a child process could import."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    path = getattr(spec, "origin", None) or getattr(main, "__file__", None)
    return Path(path) if path and Path(path).is_file() else None


def _has_main_guard(path: Path) -> bool:
    """Whether the script has a top-level `if __name__ == "__main__":` (either order, == only). A
    script that cannot be read or parsed is given the benefit of the doubt."""
    try:
        tree = ast.parse(path.read_text(), filename=str(path))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return True
    for node in tree.body:
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq):
            sides = [test.left, test.comparators[0]]
            if (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
                    and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides)):
                return True
    return False


@contextlib.contextmanager
def main_module_hidden(hide: bool) -> Iterator[None]:
    """Keep the spawned child from re-running the launching script when nothing needs it.

    A spawned child imports the parent's `__main__` script so that objects defined there unpickle;
    a script that trains at import time (no `if __name__ == "__main__":`) would then train again in
    the child. When no object comes from `__main__`, the child is told there is no main script.
    """
    main = sys.modules.get("__main__")
    if not hide or main is None:
        yield
        return
    saved = {name: main.__dict__[name] for name in ("__file__", "__spec__") if name in main.__dict__}
    main.__dict__.pop("__file__", None)
    main.__dict__["__spec__"] = None
    try:
        yield
    finally:
        main.__dict__.pop("__spec__", None)
        main.__dict__.update(saved)
