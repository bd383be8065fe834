"""Reading a ``pynative.yaml`` and the command line's dotted overrides into one mapping.

Every config path goes through here (``lit_moe fit``, ``lit_moe plan``, ``convert-config``,
``convert-hf``), so the same rules hold everywhere:

* the file is UTF-8 YAML holding a mapping; a binary or non-UTF-8 file, a directory or an unreadable
  path is a one-line :class:`ConfigError` naming it;
* a key given twice in one mapping is an error naming the key and both lines (PyYAML silently keeps
  the second);
* hostile YAML is bounded: aliases may not expand the document beyond ``MAX_VALUES`` values, nest
  beyond ``MAX_DEPTH`` or refer to themselves (an "alias bomb" is refused in milliseconds, before
  anything is built from it);
* ``--a.b.c VALUE`` sets one key at any depth and keeps its siblings; VALUE is read as YAML there
  (``true``, ``[1, 2]``, ``{k: v}``). Several ``--config`` files merge the same way, in order;
* numbers are read as YAML 1.2 reads them: ``3.76e14``, ``1e-5`` and ``1.e-8`` are floats in files and
  overrides alike (YAML 1.1, PyYAML's default, leaves an exponent without a dot or sign a string);
* only a regular file is read (a FIFO, a device or a socket could block the read forever).
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Optional

import yaml

from lit_moe.config import TOP_LEVEL_KEYS, ConfigError, check_top_level, suggest

MAX_VALUES = 1_000_000   # values after alias expansion (a 671B config has a few hundred)
MAX_DEPTH = 64           # nesting of mappings and lists
MAX_BYTES = 16 * 1024 ** 2

_MERGE_TAG = "tag:yaml.org,2002:merge"


# YAML 1.2's float forms (PyYAML's YAML 1.1 resolver wants a dot and a signed exponent: ``1.0e+14``).
_FLOAT_1_2 = re.compile(r"""^(?:[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?(?:[eE][-+]?[0-9]+)?
    |[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?
    |[-+]?\.(?:inf|Inf|INF)
    |\.(?:nan|NaN|NAN))$""", re.X)


class _StrictLoader(yaml.SafeLoader):
    """``SafeLoader`` that refuses a key repeated within one mapping (or, with ``repeated`` a list, records
    ``(key, first line, line)`` there and keeps the last value, as PyYAML and so MindFormers do), and
    reads YAML 1.2 floats."""

    source = "<string>"
    repeated: Optional[list] = None
    # Own copy of the resolvers, float resolved after int (ints still resolve as ints).
    yaml_implicit_resolvers = {key: [(tag, rx) for tag, rx in value if tag != "tag:yaml.org,2002:float"]
                               for key, value in yaml.SafeLoader.yaml_implicit_resolvers.items()}

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict[Any, int] = {}
            for key_node, _ in node.value:
                if key_node.tag == _MERGE_TAG:
                    continue
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                try:
                    first = seen.get(key)
                except TypeError:  # an unhashable key; SafeLoader reports it
                    continue
                seen.setdefault(key, line)
                if first is not None and self.repeated is not None:
                    self.repeated.append((key, first, line))
                elif first is not None:
                    raise ConfigError(f"{self.source}: key {key!r} is given twice in one mapping (lines {first} "
                                      f"and {line}); keep one")
        return super().construct_mapping(node, deep=deep)


_StrictLoader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT_1_2, list("-+0123456789."))


def _check_expansion(root: yaml.Node, source: str) -> None:
    """Refuse documents whose aliases expand beyond ``MAX_VALUES`` values or ``MAX_DEPTH`` levels,
    or refer to themselves. Linear in the number of distinct nodes (expansions are memoised)."""
    sizes: dict[int, tuple[int, int]] = {}
    active: set[int] = set()

    def visit(node: yaml.Node) -> tuple[int, int]:
        key = id(node)
        if key in sizes:
            return sizes[key]
        if key in active:
            raise ConfigError(f"{source}: a YAML alias refers to the value that contains it (line "
                              f"{node.start_mark.line + 1}); such recursive documents are refused")
        if isinstance(node, yaml.ScalarNode):
            return 1, 0
        active.add(key)
        children = node.value if isinstance(node, yaml.SequenceNode) else \
            [n for pair in node.value for n in pair]
        count, depth = 1, 0
        for child in children:
            c, d = visit(child)
            count += c
            depth = max(depth, d)
        depth += 1
        active.discard(key)
        if count > MAX_VALUES:
            raise ConfigError(f"{source}: the YAML expands to more than {MAX_VALUES:,} values through aliases "
                              f"(line {node.start_mark.line + 1}); refused (an alias bomb?)")
        if depth > MAX_DEPTH:
            raise ConfigError(f"{source}: the YAML nests deeper than {MAX_DEPTH} levels (line "
                              f"{node.start_mark.line + 1}); refused")
        sizes[key] = (count, depth)
        return count, depth

    visit(root)


def parse_yaml(text: str, source: str, repeated: Optional[list] = None) -> Any:
    """The value of one YAML document, with the checks of this module. ``source`` names it in errors;
    ``repeated`` (a list) collects repeated keys instead of refusing them (see :class:`_StrictLoader`)."""
    loader = _StrictLoader(text)
    loader.source = source
    loader.repeated = repeated
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_expansion(node, source)
        return loader.construct_document(node)
    except yaml.YAMLError as err:
        raise ConfigError(f"{source}: not valid YAML ({' '.join(str(err).split())})") from None
    except RecursionError:
        raise ConfigError(f"{source}: the YAML nests too deeply to read; refused") from None
    finally:
        loader.dispose()


def read_text(path: str, field: str) -> str:
    """A UTF-8 text file's contents; every way it can fail is one line naming ``field`` and ``path``."""
    try:
        if os.path.exists(path) and not os.path.isdir(path) and not os.path.isfile(path):
            raise ConfigError(f"{field}: {path!r} is not a regular file (a FIFO, device or socket); give a YAML file")
        with open(path, "rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except IsADirectoryError:
        raise ConfigError(f"{field}: {path!r} is a directory, not a YAML file") from None
    except OSError as err:
        raise ConfigError(f"{field}: cannot read {path!r} ({err.strerror or err})") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"{field}: {path!r} is larger than {MAX_BYTES // 1024 ** 2} MiB; not a config file")
    if b"\x00" in raw:
        raise ConfigError(f"{field}: {path!r} is a binary file (it holds NUL bytes), not YAML")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise ConfigError(f"{field}: {path!r} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset "
                          f"{err.start})") from None


def load_yaml(path: str, field: str = "--config", repeated: Optional[list] = None) -> dict:
    """Read a YAML file holding a mapping (a pynative.yaml or graph.yaml); an empty file is ``{}``.
    ``repeated``: see :func:`parse_yaml`."""
    data = parse_yaml(read_text(path, field), f"{field} {path}", repeated)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{field}: {path!r} does not hold a mapping of sections (it holds a "
                          f"{type(data).__name__})")
    return data


# ----------------------------------------------------------------------------------------------
# merging and dotted overrides
# ----------------------------------------------------------------------------------------------
def parse_value(text: str, option: str) -> Any:
    """A command-line value read as YAML (``true`` → True, ``[0-3]`` → ["0-3"], ``1e-5`` → 1e-05)."""
    if text == "":
        return ""
    return parse_yaml(text, option)


def merge(base: dict, other: dict) -> dict:
    """``other`` merged into a copy of ``base``: mappings merge key by key at every depth, any other
    value replaces."""
    out = dict(base)
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def set_dotted(cfg: dict, dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in ``cfg`` in place, keeping every sibling; a mapping value merges."""
    parts = dotted.split(".")
    if any(not p for p in parts):
        raise ConfigError(f"--{dotted}: empty key in the dotted name")
    node = cfg
    for i, key in enumerate(parts[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        elif not isinstance(child, dict):
            where = ".".join(parts[:i + 1])
            raise ConfigError(f"--{dotted}: {where} is {child!r}, not a mapping; cannot set a key inside it")
        node = child
    leaf = parts[-1]
    if isinstance(value, dict) and isinstance(node.get(leaf), dict):
        node[leaf] = merge(node[leaf], value)
    else:
        node[leaf] = value


def split_argv(argv: list[str], top_level_keys: Iterable[str],
               passthrough: Iterable[str] = ()) -> tuple[list[str], list[tuple[str, str]], list[str]]:
    """Split a command line into ``--config`` paths, ``(dotted key, raw value)`` overrides and the
    remaining arguments. An option whose first component is not a top-level key (nor in
    ``passthrough``) is an error with a did-you-mean suggestion."""
    keys = set(top_level_keys)
    passthrough = set(passthrough)
    configs: list[str] = []
    overrides: list[tuple[str, str]] = []
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name, eq, inline = arg.partition("=")
        if name in ("--config", "-c"):
            if eq:
                configs.append(inline)
            elif i + 1 < len(argv):
                configs.append(argv[i + 1])
                i += 1
            else:
                raise ConfigError(f"{name}: expected a file path after it")
        elif name.startswith("--") and name[2:].split(".")[0] in keys:
            dotted = name[2:]
            if eq:
                overrides.append((dotted, inline))
            elif i + 1 < len(argv):
                overrides.append((dotted, argv[i + 1]))
                i += 1
            else:
                raise ConfigError(f"--{dotted}: expected a value after it")
        elif name.startswith("--") and name not in passthrough:
            head = name[2:].split(".")[0]
            hint = suggest(head, keys | {p[2:] for p in passthrough})
            raise ConfigError(f"{name}: unknown option{hint}; options are --config FILE, --SECTION.KEY VALUE "
                              "(SECTION one of " + ", ".join(sorted(keys)) + ") and --print_config")
        else:
            rest.append(arg)
        i += 1
    return configs, overrides, rest


def resolve(configs: list[str], overrides: list[tuple[str, str]]) -> dict:
    """The run's configuration: the ``--config`` files merged in order, then the overrides applied."""
    cfg: dict = {}
    for path in configs:
        cfg = merge(cfg, load_yaml(path))
    for dotted, raw in overrides:
        set_dotted(cfg, dotted, parse_value(raw, f"--{dotted}"))
    return cfg


def known_keys_error(where: str, key: str, known: Iterable[str], extra: Optional[str] = None) -> ConfigError:
    """``where.key: unknown key (did you mean 'x'?); known keys: ...``."""
    known = sorted(known)
    msg = f"{where}.{key}: unknown key{suggest(key, known)}" if where else f"{key}: unknown key{suggest(key, known)}"
    if extra:
        msg += f"; {extra}"
    return ConfigError(msg + "; known keys: " + ", ".join(known))


def load_run_config(argv: list[str], passthrough: Iterable[str] = ("--print_config",)
                    ) -> tuple[dict, list[str], list[str]]:
    """``(configuration, remaining arguments, config paths)`` of a ``fit``/``plan`` command line, with
    the top-level and fixed-section keys checked."""
    configs, overrides, rest = split_argv(argv, TOP_LEVEL_KEYS, passthrough)
    cfg = resolve(configs, overrides)
    check_top_level(cfg)
    return cfg, rest, configs
