"""The README's API claims, checked against the code.

The README is read and parsed (regular expressions) at test time, so these checks follow it
as it changes: every name it uses as `snake.X` / `from snake import X` / `snake.hf.X` exists;
every call it shows of a snake callable binds to its signature; every default it states is
the signature's; every `SnakeConfig` field (and `AdamW`'s, `Placement`'s,
`DynamicLossScale`'s) is documented; every report attribute it names exists; every exception
it names is exported and a `SnakeError`; every public name has a docstring and is documented;
and the CLI flags it shows match each command's `--help`, both ways.

A failure names the README line (or the code symbol) that differs. Nothing here trains.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import importlib
import inspect
import io
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest

import snake

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


# -- parsing the README --------------------------------------------------------------------
@cache
def _text() -> str:
    return README.read_text(encoding="utf-8")


def _line(pos: int) -> int:
    return _text().count("\n", 0, pos) + 1


def _where(pos: int) -> str:
    n = _line(pos)
    return f"README.md:{n}: {_text().splitlines()[n - 1].strip()[:110]!r}"


_FENCE = re.compile(r"```[^\n]*\n(.*?)```", re.S)


def _blanked_fences() -> str:
    """The README with its fenced code blocks blanked (positions kept)."""
    return _FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), _text())


@cache
def _spans() -> list[tuple[int, str]]:
    """Inline code spans `...` outside fenced blocks: (position, text, whitespace normalized)."""
    return [(m.start(1), " ".join(m.group(1).split())) for m in re.finditer(r"`([^`]+)`", _blanked_fences())]


@cache
def _code_blocks() -> list[tuple[int, str]]:
    """Fenced blocks and 4-space indented blocks, comments stripped: (position, text)."""
    out = [(m.start(1), re.sub(r"#[^\n]*", "", m.group(1))) for m in _FENCE.finditer(_text())]
    text = _blanked_fences()
    for m in re.finditer(r"(?:^|\n\n)((?: {4}[^\n]*\n?)+)", text):
        out.append((m.start(1), re.sub(r"#[^\n]*", "", m.group(1))))
    return out


@cache
def _fence_comments() -> list[tuple[int, str]]:
    """Comments of the fenced code blocks (the Use example documents attributes there)."""
    out = []
    for m in _FENCE.finditer(_text()):
        out += [(m.start(1) + c.start(1), c.group(1)) for c in re.finditer(r"#([^\n]*)", m.group(1))]
    return out


def _code_texts() -> list[tuple[int, str]]:
    return _spans() + _code_blocks()


def _split_args(s: str) -> list[str]:
    """Split a call's argument text at its top-level commas."""
    parts, depth, cur, quote = [], 0, [], ""
    for ch in s:
        if quote:
            cur.append(ch)
            if ch == quote:
                quote = ""
            continue
        if ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    if "".join(cur).strip():
        parts.append("".join(cur).strip())
    return parts


def _calls(text: str) -> list[tuple[int, str, str, str]]:
    """(offset, dotted prefix, name, argument text) of every call `a.b.name(...)` in `text`."""
    out = []
    for m in re.finditer(r"(?<![\w.])((?:[A-Za-z_]\w*\.)*)([A-Za-z_]\w*)\(", text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            out.append((m.start(), m.group(1), m.group(2), text[m.end():i - 1]))
    return out


def _parse_args(args: str) -> tuple[int, dict[str, str]] | None:
    """(positional count, {keyword: value text}); None for a call with * or ** arguments."""
    npos, kw = 0, {}
    for a in _split_args(args):
        if a in ("...", "") or a.startswith("*"):
            if a.startswith("*"):
                return None
            continue
        m = re.fullmatch(r"(\w+)\s*=(?!=)\s*(.*)", a, re.S)
        if m:
            kw[m.group(1)] = m.group(2).strip()
        else:
            npos += 1
    return npos, kw


# -- the code ------------------------------------------------------------------------------
def _sig(obj: Any) -> inspect.Signature:
    sig = inspect.signature(obj)
    params = list(sig.parameters.values())
    if params and params[0].name == "self":
        sig = sig.replace(parameters=params[1:])
    return sig


def _trainer_methods() -> dict[str, Any]:
    return {n: getattr(snake.SnakeTrainer, n) for n in dir(snake.SnakeTrainer) if not n.startswith("_")}


def _resolve_call(prefix: str, name: str) -> tuple[Any, str] | None:
    """The snake callable a README call names; None where it is not snake's (torch, PEFT,
    a user's function). Raises LookupError where it should be snake's and is missing."""
    import snake.hf
    import snake.lr
    from snake.trace import Tracer

    if prefix == "trainer.trace.":
        if not hasattr(Tracer, name):
            raise LookupError(f"snake.trace.Tracer.{name}")
        return getattr(Tracer, name), f"Tracer.{name}"
    if prefix == "trainer.":
        if name not in _trainer_methods():
            raise LookupError(f"SnakeTrainer.{name}")
        return _trainer_methods()[name], f"SnakeTrainer.{name}"
    if prefix in ("snake.", "snake.hf.", "snake.lr."):
        mod = importlib.import_module(prefix.rstrip("."))
        if not hasattr(mod, name):
            raise LookupError(f"{prefix}{name}")
        return getattr(mod, name), f"{prefix}{name}"
    if prefix:
        return None
    if name in _trainer_methods():
        return _trainer_methods()[name], f"SnakeTrainer.{name}"
    for mod in (snake, snake.lr, snake.hf):
        if name in getattr(mod, "__all__", ()) or (mod is snake.lr and hasattr(mod, name) and name[0].isupper()):
            return getattr(mod, name), f"{mod.__name__}.{name}"
    if name == "Tracer":
        return Tracer, "snake.trace.Tracer"
    return None


def _readme_calls() -> list[tuple[int, str, str, str]]:
    out = []
    for pos, text in _code_texts():
        for off, prefix, name, args in _calls(text):
            out.append((pos + off, prefix, name, args))
    return out


def _literal(s: str) -> Any:
    """A README value: a Python literal, or numbers combined with + - * / ** (`2.0**16`)."""
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.BinOp):
            ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
                   ast.Div: lambda a, b: a / b, ast.Pow: lambda a, b: a ** b}
            return ops[type(node.op)](ev(node.left), ev(node.right))
        return ast.literal_eval(node)

    return ev(ast.parse(s, mode="eval").body)


def _same(code_default: Any, stated: Any) -> bool:
    if isinstance(stated, (int, float)) and isinstance(code_default, (int, float)):
        return float(code_default) == float(stated)
    return code_default == stated


# -- names ---------------------------------------------------------------------------------
def _dotted_names() -> list[tuple[int, str]]:
    """Every `snake.a.b` name the README uses (in code or prose), and `from snake... import`."""
    text = _text()
    out = [(m.start(), m.group(0).rstrip(".")) for m in re.finditer(r"(?<![\w/.-])snake(?:\.[A-Za-z_]\w*)+", text)]
    for m in re.finditer(r"from (snake(?:\.\w+)*) import ([\w, ]+)", text):
        out += [(m.start(), f"{m.group(1)}.{n.strip()}") for n in m.group(2).split(",") if n.strip()]
    return out


def _resolve_dotted(name: str) -> Any:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_readme_parses() -> None:
    """The parsing below sees the README's code: spans, the Use example, the CLI lines."""
    assert len(_spans()) > 300
    assert any("SnakeTrainer(model, data=batches, config=config)" in t for _, t in _code_blocks())
    assert len(_readme_calls()) > 50
    assert len(_dotted_names()) > 30


def test_dotted_names_exist() -> None:
    bad = []
    for pos, name in _dotted_names():
        try:
            _resolve_dotted(name)
        except (ImportError, AttributeError) as e:
            bad.append(f"{_where(pos)}: `{name}` does not resolve ({e})")
    assert not bad, "\n".join(bad)


def test_top_level_names_are_exported() -> None:
    """`snake.X` (X a class or function, not a module) is in snake.__all__."""
    bad = []
    for pos, name in _dotted_names():
        parts = name.split(".")
        if len(parts) == 2 and parts[1][0].isupper() and parts[1] not in snake.__all__:
            bad.append(f"{_where(pos)}: `{name}` is not in snake.__all__")
    assert not bad, "\n".join(bad)


def test_calls_bind_to_signatures() -> None:
    """Every call of a snake callable the README shows (code block or span) binds: the
    methods exist, the keywords are parameters, the positional count fits."""
    bad = []
    for pos, prefix, name, args in _readme_calls():
        try:
            target = _resolve_call(prefix, name)
        except LookupError as e:
            bad.append(f"{_where(pos)}: `{prefix}{name}(...)`: {e} does not exist")
            continue
        parsed = _parse_args(args)
        if target is None or parsed is None:
            continue
        obj, label = target
        npos, kw = parsed
        try:
            _sig(obj).bind_partial(*([None] * npos), **dict.fromkeys(kw))
        except TypeError as e:
            bad.append(f"{_where(pos)}: `{prefix}{name}({args})` does not bind to {label}{_sig(obj)}: {e}")
    assert not bad, "\n".join(bad)


def test_trainer_attributes_named_exist() -> None:
    """`trainer.X` in the README: a method of SnakeTrainer, or an attribute its __init__ sets."""
    init = inspect.getsource(snake.SnakeTrainer.__init__)
    bad = []
    for pos, text in _code_texts():
        for m in re.finditer(r"(?<![\w.])trainer\.(\w+)", text):
            n = m.group(1)
            if n != "py" and n not in _trainer_methods() and f"self.{n} =" not in init:
                bad.append(f"{_where(pos + m.start())}: `trainer.{n}` is not an attribute of SnakeTrainer")
    assert not bad, "\n".join(bad)


def test_on_step_is_a_run_keyword() -> None:
    hits = [m.start() for m in re.finditer(r"`on_step`", _text())]
    assert hits, "README no longer names run()'s `on_step`"
    params = _sig(snake.SnakeTrainer.run).parameters
    assert "on_step" in params and params["on_step"].kind is inspect.Parameter.KEYWORD_ONLY, (
        f"{_where(hits[0])}: SnakeTrainer.run has no keyword `on_step`")


# -- stated defaults -----------------------------------------------------------------------
def _signature_declarations() -> list[tuple[int, str, Any, str]]:
    """(position, label, callable, argument text) of spans the README gives as a signature
    with its defaults (not as an example call)."""
    import snake.lr

    text, out = _text(), []
    for pos, span in _spans():
        m = re.fullmatch(r"await trainer\.(\w+)\((.*)\)", span)
        if m and "=" in m.group(2):  # `await trainer.evaluate(data, max_batches=None, ...)`
            out.append((pos, f"SnakeTrainer.{m.group(1)}", getattr(snake.SnakeTrainer, m.group(1), None), m.group(2)))
    for m in re.finditer(r"`snake\.(\w+)\(([^`]*)\)` strings", text):  # `snake.Epochs(loader, epochs=None)`
        out.append((m.start(), f"snake.{m.group(1)}", getattr(snake, m.group(1), None), m.group(2)))
    m = re.search(r"one of `snake\.lr`'s:(.*?)which\s+give", text, re.S)
    assert m, "README: the list of snake.lr's schedules moved"
    for s in re.finditer(r"`(\w+)\(([^`]*)\)`", m.group(1)):
        if s.group(2) != "...":
            out.append((m.start(1) + s.start(), f"snake.lr.{s.group(1)}", getattr(snake.lr, s.group(1), None),
                        s.group(2)))
    m = re.search(r"`loss_scale=snake\.DynamicLossScale\(\)`,\s*with GradScaler's arguments and defaults: `([^`]*)`",
                  text)
    assert m, "README: DynamicLossScale's stated defaults moved"
    out.append((m.start(1), "snake.DynamicLossScale", snake.DynamicLossScale, " ".join(m.group(1).split())))
    return out


def test_signature_defaults_as_stated() -> None:
    """`name=value` in a signature the README states is the default; `name=` (no value) is
    a parameter without one."""
    decls = _signature_declarations()
    assert len(decls) >= 5
    bad = []
    for pos, label, obj, args in decls:
        if obj is None:
            bad.append(f"{_where(pos)}: {label} does not exist")
            continue
        params = _sig(obj).parameters
        for name, value in _parse_args(args)[1].items():
            p = params.get(name)
            if p is None:
                bad.append(f"{_where(pos)}: {label} has no parameter `{name}`")
            elif value == "":
                if p.default is not inspect.Parameter.empty:
                    bad.append(f"{_where(pos)}: README shows `{name}=` without a default (as a required "
                               f"parameter), but {label}{_sig(obj)} defaults it to {p.default!r}")
            elif not _same(p.default, _literal(value)):
                bad.append(f"{_where(pos)}: README states {label}'s `{name}` defaults to {value}; "
                           f"the code's default is {p.default!r}")
    assert not bad, "\n".join(bad)


def _field_defaults(cls: type) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def test_config_defaults_as_stated() -> None:
    """`field` (default X), `Class(field=...)` (default X) and `field=X`, the default."""
    text, found, bad = _text(), 0, []
    classes = {"SnakeConfig": snake.SnakeConfig, "Placement": snake.Placement, "AdamW": snake.AdamW}
    stated: list[tuple[int, str, str, str]] = []
    for m in re.finditer(r"`(\w+)` \(default:?\s+([^;)]+)[;)]", text):
        stated.append((m.start(), "SnakeConfig", m.group(1), " ".join(m.group(2).split())))
    for m in re.finditer(r"`(\w+)\((\w+)=\.\.\.\)` \(default ([^;)]+)[;)]", text):
        stated.append((m.start(), m.group(1), m.group(2), m.group(3)))
    for m in re.finditer(r"`(\w+)=([^`]+)`, the default", text):
        stated.append((m.start(), "SnakeConfig", m.group(1), m.group(2)))
    for pos, cls_name, field, value in stated:
        cls = classes.get(cls_name)
        if cls is None or field not in {f.name for f in dataclasses.fields(cls)}:
            continue  # a default of something else (a CLI option's, PEFT's)
        found += 1
        default = _field_defaults(cls)[field] if field in _field_defaults(cls) else "<required>"
        num = re.match(r"[-+]?\d[\d_,]*(?:\.\d+)?(?:e[-+]?\d+)?", value)
        expected: Any = float(num.group(0).replace(",", "")) if num else None  # a description: set at run time
        if not _same(default, expected):
            bad.append(f"{_where(pos)}: README states {cls_name}.{field} defaults to {value!r}; "
                       f"the code's default is {default!r}")
    if re.search(r"Adam state in CPU memory by default", text):
        found += 1
        if snake.SnakeConfig.__dataclass_fields__["resident_optimizer"].default != "cpu":
            bad.append("README: the resident state is 'in CPU memory by default', but "
                       "SnakeConfig.resident_optimizer's default is not 'cpu'")
    assert found >= 4, "README's stated config defaults moved (fewer than 4 found)"
    assert not bad, "\n".join(bad)


def test_tracer_max_spans_default_as_stated() -> None:
    from snake.trace import Tracer

    m = re.search(r"keeps the\s+newest ([\d,]+) spans[^`]*`Tracer\(max_spans=\.\.\.\)`", _text())
    assert m, "README: the trace's span limit (`Tracer(max_spans=...)`) moved"
    stated = int(m.group(1).replace(",", ""))
    default = _sig(Tracer).parameters["max_spans"].default
    assert default == stated, f"{_where(m.start())}: README says {stated} spans; Tracer's max_spans is {default}"


# -- fields documented ---------------------------------------------------------------------
def _mentioned_as_code(name: str, owner: str) -> bool:
    """`name` as a whole span, `Owner.name`, or `name=` in code (not `--name`, a CLI flag)."""
    for _, t in _code_texts():
        if t == name or re.search(rf"(?<![\w-]){owner}\.{name}\b", t) or re.search(rf"(?<![\w.-]){name}\s*=(?!=)", t):
            return True
    return False


@pytest.mark.parametrize("cls", [snake.SnakeConfig, snake.AdamW, snake.Placement, snake.DynamicLossScale],
                         ids=lambda c: c.__name__)
def test_every_field_is_documented(cls: type) -> None:
    missing = [f.name for f in dataclasses.fields(cls) if not _mentioned_as_code(f.name, cls.__name__)]
    assert not missing, (f"{cls.__name__} fields the README never names (as `{cls.__name__}.name`, "
                         f"`name` or `name=`): {missing}")


def test_named_config_fields_exist() -> None:
    """Keywords of SnakeConfig(...) calls and `SnakeConfig.X` in the README are its fields."""
    fields = {f.name for f in dataclasses.fields(snake.SnakeConfig)}
    bad, seen = [], 0
    for pos, text in _code_texts():
        for m in re.finditer(r"SnakeConfig\.(\w+)", text):
            seen += 1
            if m.group(1) not in fields:
                bad.append(f"{_where(pos + m.start())}: SnakeConfig has no field `{m.group(1)}`")
    for pos, _, name, args in _readme_calls():
        if name == "SnakeConfig" and (parsed := _parse_args(args)):
            seen += 1
            bad += [f"{_where(pos)}: SnakeConfig has no field `{k}`" for k in parsed[1] if k not in fields]
    assert seen >= 3
    assert not bad, "\n".join(bad)


# -- reports -------------------------------------------------------------------------------
def _attrs(cls: type) -> set[str]:
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return fields | {n for n in dir(cls) if not n.startswith("_")}


def test_report_attributes_exist() -> None:
    from snake.actors.compute import StepReport
    from snake.evaluate import EvalReport
    from snake.trainer import RunReport

    text, bad, seen = _text(), [], 0

    def need(pos: int, cls: type, name: str) -> None:
        nonlocal seen
        seen += 1
        if name not in _attrs(cls):
            bad.append(f"{_where(pos)}: {cls.__name__} has no attribute `{name}`")

    m = re.search(r"an `EvalReport`:(.*?)\),", text, re.S)
    assert m, "README: EvalReport's attribute list moved"
    eval_names = set()
    for a in re.finditer(r"`\.(\w+)`", m.group(1)):
        eval_names.add(a.group(1))
        need(m.start(1) + a.start(), EvalReport, a.group(1))
    for pos, t in _code_texts() + _fence_comments():
        for a in re.finditer(r"report\.steps\[i\]((?:\.\w+(?: / )?)+)", t):  # .loss / .seconds / ...
            for n in re.findall(r"\.(\w+)", a.group(1)):
                need(pos + a.start(), StepReport, n)
        for a in re.finditer(r"(?<![\w.])report\.(\w+)", t):
            if a.group(1) != "json":  # `report.json`: snake train's file
                need(pos + a.start(), RunReport, a.group(1))
        for a in re.finditer(r"(?<![\w.])val\.(\w+)", t):
            need(pos + a.start(), EvalReport, a.group(1))
    for pos, t in _spans():  # `.grad_norm`, `.skipped`, ...: a step's (or, above, an evaluation's)
        if re.fullmatch(r"\.\w+", t) and not (text.rfind("`EvalReport`", 0, pos) > pos - 400 and t[1:] in eval_names):
            need(pos, StepReport, t[1:])
    assert seen >= 15
    assert not bad, "\n".join(bad)


def test_data_error_carries_report() -> None:
    m = re.search(r"raises\s+a\s+`DataError`.{0,80}?whose\s+`report`\s+holds", _text(), re.S)
    assert m, "README: DataError's `report` moved"
    assert "report" in _attrs(snake.DataError), f"{_where(m.start())}: DataError has no `report`"


# -- exceptions ----------------------------------------------------------------------------
def _exception_names() -> list[tuple[int, str]]:
    out = []
    for pos, t in _spans():
        m = re.fullmatch(r"(?:snake\.)?(\w+(?:Error|Exhausted|Failed|Overflow))", t)
        if m:
            out.append((pos, m.group(1)))
    return out


def test_named_exceptions_exported_and_snake_errors() -> None:
    names = _exception_names()
    assert len({n for _, n in names}) >= 6
    bad = []
    for pos, name in names:
        if name not in snake.__all__:
            bad.append(f"{_where(pos)}: `{name}` is not exported from snake (snake.__all__)")
        obj = getattr(snake, name, None) or getattr(importlib.import_module("snake.errors"), name, None)
        if obj is None:
            bad.append(f"{_where(pos)}: `{name}` does not exist (snake, snake.errors)")
        elif not issubclass(obj, snake.SnakeError):
            bad.append(f"{_where(pos)}: `{name}` is not a snake.SnakeError")
    assert not bad, "\n".join(dict.fromkeys(bad))


def test_exception_hierarchy_as_stated() -> None:
    text = _text()
    m = re.search(r"`DataError`\s+\(a\s+`snake\.DataExhausted`\s+where", text)
    assert m, "README: 'a `DataError` (a `snake.DataExhausted` ...)' moved"
    assert issubclass(snake.DataExhausted, snake.DataError), f"{_where(m.start())}: DataExhausted is not a DataError"
    m = re.search(r"`StorageError`\s+\(ENOSPC\)", text)
    assert m, "README: 'a `StorageError` (ENOSPC)' moved"
    assert issubclass(snake.StorageError, OSError), f"{_where(m.start())}: StorageError is not an OSError (errno)"
    errors = importlib.import_module("snake.errors")
    for name, obj in vars(errors).items():
        if isinstance(obj, type) and issubclass(obj, Exception) and obj.__module__ == errors.__name__:
            assert issubclass(obj, snake.SnakeError), f"snake.errors.{name} is not a SnakeError"


def test_named_warnings_exist() -> None:
    """`XWarning` (`snake.module`) resolves there; a bare `XWarning` is a class in snake."""
    text, bad = _text(), []
    sources = "\n".join(p.read_text(encoding="utf-8") for p in (ROOT / "snake").rglob("*.py"))
    for m in re.finditer(r"`(\w+Warning)`(?: \(`(snake(?:\.\w+)*)`\))?", text):
        name, mod = m.group(1), m.group(2)
        if name in dir(__builtins__) or hasattr(__import__("builtins"), name):
            continue
        if mod is not None:
            if not hasattr(importlib.import_module(mod), name):
                bad.append(f"{_where(m.start())}: {mod}.{name} does not exist")
        elif not re.search(rf"^class {name}\(", sources, re.M):
            bad.append(f"{_where(m.start())}: no class {name} in snake/")
    assert not bad, "\n".join(bad)


# -- public names --------------------------------------------------------------------------
def _public() -> list[tuple[str, Any]]:
    import snake.hf

    return [(f"snake.{n}", getattr(snake, n)) for n in snake.__all__] + \
        [(f"snake.hf.{n}", getattr(snake.hf, n)) for n in snake.hf.__all__]


def test_all_is_what_init_exports() -> None:
    exported = {n for n, v in vars(snake).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert exported == set(snake.__all__), f"snake/__init__.py exports {exported ^ set(snake.__all__)} " \
                                           "outside (or only in) snake.__all__"


def test_public_names_have_docstrings() -> None:
    bad = []
    for label, obj in _public():
        doc = obj.__doc__ or ""
        if dataclasses.is_dataclass(obj) and doc.startswith(f"{obj.__name__}("):
            doc = ""  # the signature dataclasses writes where there is no docstring
        if not doc.strip():
            bad.append(label)
    assert not bad, f"public names without a docstring: {bad}"


def test_public_names_are_documented() -> None:
    """Every name in snake.__all__ appears in the README (a public name it never mentions is
    undocumented)."""
    text = _text()
    missing = [n for n in snake.__all__ if not re.search(rf"(?<![\w-]){n}\b", text)]
    assert not missing, f"names in snake.__all__ the README never mentions: {missing}"


# -- the CLI -------------------------------------------------------------------------------
def _help(cmd: tuple[str, ...]) -> str:
    out = io.StringIO()
    code: Any = None
    with contextlib.redirect_stdout(out):
        try:
            if cmd[0] == "plan":
                from planner.cli import plan_main

                code = plan_main([*cmd[1:], "--help"])  # it returns argparse's exit code
            else:
                import snake.cli

                code = snake.cli.main([*cmd, "--help"])
        except SystemExit as e:
            code = e.code
    assert code in (0, None), f"snake {' '.join(cmd)} --help exited {code}"
    return out.getvalue()


@cache
def _help_flags(cmd: tuple[str, ...]) -> frozenset[tuple[str, ...]]:
    """Each option of `snake CMD --help` as its aliases, e.g. ('-o', '--out')."""
    out = set()
    for line in _help(cmd).splitlines():
        m = re.match(r"^  (-\S.*?)(?:\s{2,}|$)", line)
        if m:
            aliases = tuple(a.split()[0] for a in m.group(1).split(", ") if a.startswith("-"))
            if "--help" not in aliases:
                out.add(aliases)
    return frozenset(out)


COMMANDS = {"plan": ("plan",), "trace summarize": ("trace", "summarize"), "trace plot": ("trace", "plot"),
            "export": ("export",), "train": ("train",)}


@cache
def _bullets() -> list[tuple[int, int, tuple[str, ...]]]:
    """(start, end, command) of each item of the README's "Other commands:" list."""
    text = _text()
    start = text.find("Other commands:")
    assert start >= 0, "README: 'Other commands:' moved"
    end = text.find("\n\n", start)
    out = []
    for m in re.finditer(r"\n- `snake (export|plan|trace summarize|trace plot)\b", text[start:end]):
        out.append((start + m.start(), COMMANDS[m.group(1)]))
    return [(s, (out[i + 1][0] if i + 1 < len(out) else end), c) for i, (s, c) in enumerate(out)]


def _readme_flags() -> list[tuple[int, tuple[str, ...], str]]:
    """(position, command, flag) of every flag in a README code span: a span that starts with
    `snake CMD` is that command's; a bare flag in an "Other commands" item is its command's,
    elsewhere `snake train`'s. Spans of other programs (python, pytest, benchmarks/) are not
    snake's."""
    out, other_end = [], -1
    for pos, t in _spans():
        if re.match(r"(python|pytest|pip|bash)\b", t) or ".py" in t or "benchmarks/" in t:
            other_end = pos + len(t)  # another program's command line
            continue
        if 0 <= pos - other_end < 12 and t.startswith("-"):
            continue  # "`python x.py ARGS`, or `--demo DIR`": that program's option
        flags = re.findall(r"(?<![\w-])(--?[a-z][a-z0-9-]*)", t)
        flags = [f for f in flags if f.startswith("--") or t.startswith("snake ")]  # -o: only in a command line
        if not flags:
            continue
        m = re.match(r"snake (export|plan|trace summarize|trace plot|train)\b", t)
        if m:
            cmd = COMMANDS[m.group(1)]
        else:
            cmd = next((c for s, e, c in _bullets() if s <= pos < e), ("train",))
        if t.startswith("snake ") and not m:
            continue  # `snake trace`: no flags
        out += [(pos, cmd, f) for f in flags if f != "--help"]
    return out


def test_readme_flags_are_in_help() -> None:
    flags = _readme_flags()
    assert len(flags) > 40 and {c for _, c, _ in flags} >= {("train",), ("plan",), ("export",), ("trace", "plot")}
    bad = []
    for pos, cmd, flag in flags:
        if not any(flag in aliases for aliases in _help_flags(cmd)):
            bad.append(f"{_where(pos)}: `{flag}` is not an option of `snake {' '.join(cmd)} --help`")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("name", list(COMMANDS))
def test_help_flags_are_in_readme(name: str) -> None:
    """Every option of each command's `--help` is shown somewhere in the README (for any
    command)."""
    cmd = COMMANDS[name]
    documented = {f for _, _, f in _readme_flags()} | set(re.findall(r"`snake [^`]*?(-\w)\b", _text()))
    missing = [aliases for aliases in sorted(_help_flags(cmd)) if not documented & set(aliases)]
    assert not missing, f"options of `snake {name} --help` the README never shows: " \
                        f"{['/'.join(a) for a in missing]}"


@pytest.mark.parametrize("name", [n for n in COMMANDS if n != "train"])
def test_help_flags_are_in_their_command_item(name: str) -> None:
    """Every option of `snake plan/export/trace ... --help` is shown for that command (its
    item of "Other commands", or a `snake CMD ...` span); `snake train`'s are spread through
    the README (above)."""
    cmd = COMMANDS[name]
    documented = {f for _, c, f in _readme_flags() if c == cmd}
    missing = [aliases for aliases in sorted(_help_flags(cmd)) if not documented & set(aliases)]
    assert not missing, f"options of `snake {name} --help` the README never shows for it: " \
                        f"{['/'.join(a) for a in missing]}"
