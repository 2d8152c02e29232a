#!/usr/bin/env python
"""Write docs/options.md, every config option with its type, default and one line, from the code.

The sections are the pydantic models of ``ardiff_server/config.py`` (``server``, ``engine``, ``ray``)
and each registered policy's config model (``policy`` with ``name: dreamzero`` / ``lingbot_va`` / ``noop``). A field's
line is its ``description=`` where it has one, else the comment on its line in the source, else the
comment block right above it. ``tests/scripts/test_gen_options.py`` fails when the committed file
differs from what this prints.

    python scripts/gen_options.py            # rewrite docs/options.md
    python scripts/gen_options.py --check    # exit 1 (and say so) when docs/options.md is stale
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import re
import sys
import textwrap
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

import pydantic
from pydantic_core import PydanticUndefined

from ardiff_policies.registry import policy_entry
from ardiff_server.config import EngineConfig, RayConfig, ServerConfig

OUT = Path(__file__).resolve().parents[1] / "docs" / "options.md"

HEADER = """\
# Config options

Generated from `ardiff_server/config.py` and the policies' config models by
`python scripts/gen_options.py` (`tests/scripts/test_gen_options.py` fails when this file and the
code differ): edit the code's comments, then re-run it. Set any option in a YAML file of `configs/`
or with `ardiff-serve --set section.key=value` (values are YAML: `--set 'engine.devices=[cuda:0,cuda:1]'`);
an unknown key or a wrong type stops the server at start-up, naming the file and the key.
Files given as a Hugging Face id (`org/name[@revision]`) are fetched into the hub cache before any
worker starts (`HF_HOME`, `HF_TOKEN`, `HF_HUB_OFFLINE=1` apply). The README has the few options
people need first.
"""

SECTIONS: list[tuple[str, str, type[pydantic.BaseModel]]] = [
    (
        "server",
        "The websocket front end (`ardiff-serve` flags `--host`, `--port`, `--api-key-file`, `--tls-cert`/`--tls-key` and `--record` set some).",
        ServerConfig,
    ),
    ("engine", "The engine workers: devices, precision, KV cache, batching, replicas, warm-up.", EngineConfig),
    ("ray", "The Ray Serve deployment (`ardiff-serve --ray`, docs/deploy.md).", RayConfig),
]
POLICIES: list[tuple[str, str]] = [
    ("dreamzero", "`policy:` with `name: dreamzero`: DreamZero (14B and Wan2.2-5B families, every embodiment)."),
    ("lingbot_va", "`policy:` with `name: lingbot_va`: LingBot-VA (docs/lingbot-va.md)."),
    ("noop", "`policy:` with `name: noop`: zero-compute actions (protocol and load tests)."),
]
TOP_LEVEL = (
    "`plugins:` (list of module names, default `[]`): modules imported before the config is validated (they may register more policies).\n\n"
    "`bench:` (bool, default `false`): a benchmark's config (`scripts/bench_fleet.py`); only such a config may set bench-only options "
    "(`engine.modelled_step_time`), and it must never serve robots."
)


def field_comments(model: type) -> dict[str, str]:
    """Field name -> the comment on its line (else the comment block right above it), from the class source."""
    source = textwrap.dedent(inspect.getsource(model))
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#").strip()
    lines = source.splitlines()
    out: dict[str, str] = {}
    for node in ast.parse(source).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        trailing = [comments[n] for n in range(node.lineno, node.end_lineno + 1) if n in comments and not lines[n - 1].lstrip().startswith("#")]
        above, n = [], node.lineno - 1
        while n in comments and lines[n - 1].lstrip().startswith("#"):
            above.insert(0, comments[n])
            n -= 1
        text = " ".join(trailing) or " ".join(above)
        out[node.target.id] = re.sub(r"\s*\(fmt: skip\)|\s*fmt: skip", "", text).strip()
    return out


def type_name(annotation: Any) -> str:
    """``int | None`` -> ``int or null``, ``Literal['a', 'b']`` -> ``a, b``, lists as ``list of ...``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if a is type(None) else type_name(a) for a in args)
    if origin is list:
        return f"list of {type_name(args[0])}"
    if origin is tuple:
        return f"[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return "mapping"
    if annotation is typing.Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


def default_text(field: pydantic.fields.FieldInfo) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, pydantic.BaseModel):
        return ""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        return f"`{value}` ({value // 2**20} MiB)"
    if isinstance(value, str) and len(value) > 40:
        return f"`{value[:37]}...`"
    if isinstance(value, list) and len(str(value)) > 40:
        return f"{len(value)} items"
    if isinstance(value, str):
        return f"`{value}`" if value else '`""`'
    return f"`{value}`"


def rows(prefix: str, model: type[pydantic.BaseModel]) -> list[str]:
    comments = {}
    for base in reversed(model.__mro__):  # a subclass's comment wins
        if isinstance(base, type) and issubclass(base, pydantic.BaseModel) and base is not pydantic.BaseModel:
            comments.update(field_comments(base))
    out = []
    for name, field in model.model_fields.items():
        meaning = field.description or comments.get(name, "")
        if not meaning:
            raise SystemExit(f"{model.__name__}.{name} has neither a description nor a comment: say in one line what it does")
        meaning = meaning.replace("|", "\\|")
        annotation, args = field.annotation, typing.get_args(field.annotation)
        if isinstance(annotation, type) and issubclass(annotation, pydantic.BaseModel):  # a nested section, then its keys
            out.append(f"| `{prefix}.{name}` | section | | {meaning} |")
            out += rows(f"{prefix}.{name}", annotation)
            continue
        out.append(f"| `{prefix}.{name}` | {type_name(annotation)} | {default_text(field)} | {meaning} |")
        if typing.get_origin(annotation) is dict and isinstance(args[1], type) and issubclass(args[1], pydantic.BaseModel):
            out += rows(f"{prefix}.{name}.<key>", args[1])  # a mapping of sections: the keys of each
    return out


def render() -> str:
    parts = [HEADER]
    table = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for section, intro, model in SECTIONS:
        parts += [f"## `{section}`", "", intro, "", *table, *rows(section, model), ""]
    for name, intro in POLICIES:
        parts += [f"## `policy` (`{name}`)", "", intro, "", *table, *rows("policy", policy_entry(name).config_model()), ""]
    parts += ["## Top level", "", TOP_LEVEL, ""]
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare with docs/options.md instead of writing it")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/gen_options.py", file=sys.stderr)
            return 1
        print(f"{OUT} matches the code")
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
