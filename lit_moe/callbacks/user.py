"""User callbacks from the YAML ``callbacks:`` list.

Each item names a Lightning ``Callback`` class and its constructor arguments::

    callbacks:
      - class_path: my_callbacks.PrintEvery        # module.Class: importable, or a .py file next to
        init_args: {every: 10}                      # the config / in the working directory
      - class_path: lightning.pytorch.callbacks.LearningRateMonitor
      - class_path: EarlyStopping                  # bare names: lightning.pytorch.callbacks, lit_moe.callbacks
        init_args: {monitor: train/loss}

The MindFormers form ``{type: Name, key: value, ...}`` is accepted too (bare name, kwargs inline).
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Iterable, Optional

from lightning.pytorch import Callback

from lit_moe.config import ConfigError, suggest

_BARE_NAME_MODULES = ("lightning.pytorch.callbacks", "lit_moe.callbacks")


def _import_class(path: str, field: str, search_dirs: list[str]) -> type:
    if "." not in path:
        for module_name in _BARE_NAME_MODULES:
            module = importlib.import_module(module_name)
            if hasattr(module, path):
                return getattr(module, path)
        raise ConfigError(f"{field}: {path!r} is not a callback of {' or '.join(_BARE_NAME_MODULES)}; "
                          "give module.ClassName")
    module_name, _, class_name = path.rpartition(".")
    # The user's own module: also look where the config lives and in the working directory
    # (a console script's sys.path has neither).
    for d in search_dirs:
        if d and d not in sys.path:
            sys.path.append(d)
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"{field}: cannot import module {module_name!r} ({e})") from None
    except SyntaxError as e:
        raise ConfigError(f"{field}: module {module_name!r} has a syntax error ({e.filename}, line {e.lineno}: "
                          f"{e.msg})") from None
    except Exception as e:  # the module's own code failed while it was imported
        raise ConfigError(f"{field}: importing module {module_name!r} raised {type(e).__name__}: {e}") from None
    if not hasattr(module, class_name):
        raise ConfigError(f"{field}: module {module_name!r} has no {class_name!r}")
    return getattr(module, class_name)


def load_callbacks(specs: Optional[Iterable[Any]], base_dir: Optional[str] = None) -> list[Callback]:
    """Instantiate the ``callbacks:`` list. ``base_dir``: the config file's directory (searched for
    the user's modules, as is the working directory)."""
    if specs is None:
        return []
    if not isinstance(specs, (list, tuple)):
        raise ConfigError(f"callbacks: expected a list of {{class_path, init_args}} items, got {specs!r}")
    search_dirs = [os.path.abspath(base_dir) if base_dir else "", os.getcwd()]
    callbacks = []
    for i, spec in enumerate(specs):
        field = f"callbacks[{i}]"
        if not isinstance(spec, dict):
            raise ConfigError(f"{field}: expected {{class_path: ..., init_args: {{...}}}}, got {spec!r}")
        if "class_path" in spec:
            unknown = set(spec) - {"class_path", "init_args"}
            if unknown:
                raise ConfigError(f"{field}: unknown key(s) {sorted(unknown)}; expected class_path, init_args")
            path, kwargs = spec["class_path"], spec.get("init_args") or {}
            pfield = f"{field}.class_path"
        elif "type" in spec:
            path, kwargs = spec["type"], {k: v for k, v in spec.items() if k != "type"}
            pfield = f"{field}.type"
        else:
            raise ConfigError(f"{field}: needs class_path (or MindFormers' type)")
        if not isinstance(path, str) or not path:
            raise ConfigError(f"{pfield}: expected 'module.ClassName', got {path!r}")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{field}.init_args: expected a mapping, got {kwargs!r}")
        cls = _import_class(path, pfield, search_dirs)
        if not (isinstance(cls, type) and issubclass(cls, Callback)):
            raise ConfigError(f"{pfield}: {path!r} is not a lightning.pytorch.Callback subclass")
        try:
            callbacks.append(cls(**kwargs))
        except TypeError as e:
            raise ConfigError(f"{field}.init_args: {path}: {e}") from None
    return callbacks


def check_class_specs(value: Any, field: str, base: type, base_dir: Optional[str] = None) -> None:
    """A Lightning argument given as ``{class_path, init_args}`` (or a list of them, e.g.
    ``trainer.logger``): the class imports, is a ``base``, and takes every ``init_args`` key, each
    checked here so that an error names the class and the argument (jsonargparse would report only
    that no type of the argument's union matched). Other values are left to jsonargparse."""
    import inspect

    items = value if isinstance(value, (list, tuple)) else [value]
    for i, spec in enumerate(items):
        where = f"{field}[{i}]" if isinstance(value, (list, tuple)) else field
        if not isinstance(spec, dict) or "class_path" not in spec:
            continue
        path, kwargs = spec["class_path"], spec.get("init_args") or {}
        if not isinstance(path, str) or "." not in path:
            raise ConfigError(f"{where}.class_path: expected 'module.ClassName', got {path!r}")
        cls = _import_class(path, f"{where}.class_path", [os.path.abspath(base_dir) if base_dir else "", os.getcwd()])
        if not (isinstance(cls, type) and issubclass(cls, base)):
            raise ConfigError(f"{where}.class_path: {path!r} is not a {base.__module__}.{base.__qualname__}")
        if not isinstance(kwargs, dict):
            raise ConfigError(f"{where}.init_args: expected a mapping, got {kwargs!r}")
        params = inspect.signature(cls.__init__).parameters
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            continue
        names = [n for n in params if n != "self"]
        for key in kwargs:
            if key not in names:
                raise ConfigError(f"{where}.init_args.{key}: {path} takes no argument {key!r}"
                                  f"{suggest(str(key), names)}; it takes " + ", ".join(names))
