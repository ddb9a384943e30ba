"""Chat templates rendered as transformers renders them, with their work bounded.

A chat template is code from the artifact, an untrusted file, run over a client's messages.
Jinja's ``ImmutableSandboxedEnvironment``, which transformers renders it in, keeps it from
reaching Python, but not from working without end: two nested ``range(10000)`` loops run for
seconds, and ``'x' * 10**10`` (which Jinja folds while compiling) asks for 10 GB.
:class:`ChatTemplate` compiles the template once, with no evaluation at compile time, in a
subclass of that sandbox that carries transformers' own globals, filters, tests and extensions
(taken from the environment transformers builds, so the text is the same), and meters every
render:

* **CPU time**: every loop iteration, call, filter, operator, attribute lookup and output piece
  ticks; a render whose thread has used more than ``cpu_seconds`` of CPU stops.
* **What it produces**: every output piece (in blocks, macros and ``{% set %}`` captures too),
  and every string or list that an operator (``+``, ``*``, ``%``, ``~``), a slice, a call or a
  filter makes, is charged to a budget of ``max_chars`` characters (items for a list). An operation
  whose result size follows from its arguments (``'x' * n``, ``s.center(n)``,
  ``s.replace(a, b)``, ``sep.join(xs)``, ``'%*d' % (n, 1)``, ``'{:>{}}'.format(...)``, the
  ``center``, ``indent``, ``wordwrap``, ``replace``, ``join``, ``batch``, ``slice``, ``format``,
  ``sum`` and ``tojson(indent)`` filters, ``lipsum``) is refused *before* it allocates; an int
  may not grow past 4096 bits.

Either limit raises :class:`TemplateLimitError`; anything else the template raises (its own
``raise_exception``, an undefined name, a sandbox violation) is a :class:`ChatTemplateError`.
"""

from __future__ import annotations

import contextvars
import functools
import re
import string
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from attnexport.errors import UserError

MAX_INT_BITS = 4096
"""The largest int a template may make with ``*`` or ``**``."""


@dataclass(frozen=True)
class TemplateLimits:
    """What one render of a chat template may use."""

    cpu_seconds: float = 5.0
    """CPU time of the rendering thread (waiting for the GIL does not count)."""
    max_chars: int = 64 << 20
    """Characters (items, for lists) the render may produce in all: its output and every
    string or list it makes on the way, freed or not."""


class ChatTemplateError(UserError):
    """The chat template failed on these messages, or does not compile."""


class TemplateLimitError(ChatTemplateError):
    """A render went past its :class:`TemplateLimits`."""


class ChatTemplate:
    """A chat template compiled in the bounded sandbox (see the module's docstring).

    Args:
        source: the Jinja source (``tokenizer.chat_template``).

    Raises:
        ChatTemplateError: the template does not compile (a syntax error, an unknown filter).
        MissingDependencyError: jinja2 or transformers is not installed.
    """

    def __init__(self, source: str) -> None:
        import jinja2

        self.source = source
        try:
            self.template = _environment().from_string(source)
        except jinja2.TemplateError as error:
            line = f" (line {error.lineno})" if getattr(error, "lineno", None) else ""
            raise ChatTemplateError(
                f"the chat template does not compile{line}: {type(error).__name__}: {error}"
            ) from None

    def render(self, limits: TemplateLimits = TemplateLimits(), **variables: Any) -> str:
        """The template's text for ``variables`` (``messages``, ``add_generation_prompt``,
        the special tokens...), rendered in the calling thread within ``limits``.

        Raises:
            TemplateLimitError: the render went past ``limits`` (or recursed past Python's
                limit).
            ChatTemplateError: the template raised (``raise_exception``, an undefined value, a
                sandbox violation, a type error).
        """
        import jinja2

        token = _BUDGET.set(_Budget(limits))
        try:
            return self.template.render(**variables)
        except ChatTemplateError:
            raise
        except RecursionError:
            raise TemplateLimitError("the chat template recursed too deeply") from None
        except MemoryError:
            raise TemplateLimitError("the chat template ran out of memory") from None
        except jinja2.TemplateError as error:
            raise ChatTemplateError(f"the chat template refused them: {error}") from None
        except Exception as error:
            raise ChatTemplateError(
                f"the chat template failed: {type(error).__name__}: {error}"
            ) from None
        finally:
            _BUDGET.reset(token)


# ---------------------------------------------------------------------- the budget
class _Budget:
    """One render's meter (in a context variable, so concurrent renders in other threads each
    have their own)."""

    __slots__ = ("deadline", "left", "limits", "ticks")

    def __init__(self, limits: TemplateLimits) -> None:
        self.limits = limits
        self.deadline = time.thread_time() + limits.cpu_seconds
        self.left = limits.max_chars
        self.ticks = 0

    def tick(self) -> None:
        self.ticks += 1
        if not self.ticks & 63 and time.thread_time() > self.deadline:
            raise TemplateLimitError(
                f"the chat template ran past its limit of {self.limits.cpu_seconds:g} s of CPU time"
            )

    def require(self, size: int, what: str) -> None:
        """Refuses an operation that would make ``size`` characters or items, before it
        runs."""
        if size > self.left:
            raise TemplateLimitError(
                f"the chat template would make {size} characters with {what}, past its limit of "
                f"{self.limits.max_chars} characters in all"
            )

    def charge(self, size: int, what: str) -> None:
        self.require(size, what)
        self.left -= size


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "attnexport_chat_template_budget", default=None
)


def _budget() -> _Budget:
    budget = _BUDGET.get()
    if budget is None:  # Jinja tries to fold constants while compiling: it must not
        raise RuntimeError("not rendering")
    return budget


def _size(value: object) -> int:
    """Characters of a string, items of a container; 0 for anything else."""
    if isinstance(value, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(value)
    return 0


def _int(value: object, default: int = 0) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


# ---------------------------------------------------------------------- size estimates
_PERCENT = re.compile(r"%(\([^)]*\))?[#0\- +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?(.)", re.S)


def _percent_size(fmt: str, args: object) -> int:
    """An upper bound of ``fmt % args`` beyond the arguments' own text: its widths and
    precisions (``%*d`` takes them from ``args``)."""
    values = list(args) if isinstance(args, tuple) else [args]
    size, index = len(fmt), 0
    for keyed, width, precision, kind in _PERCENT.findall(fmt):
        if kind == "%":
            continue
        for number in (width, precision):
            if number == "*":
                size += abs(_int(values[index] if index < len(values) else 0))
                index += 1
            elif number:
                size += int(number)
        index += not keyed
    return size


def _format_size(fmt: str) -> int:
    """An upper bound of ``fmt.format(...)`` beyond the arguments' own text."""
    size = len(fmt)
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec and "{" in spec:
            raise TemplateLimitError("the chat template uses a nested format spec ('{:{}}')")
        size += sum(int(number) for number in re.findall(r"\d+", spec or ""))
    return size


def _replace_size(text: object, old: object, new: object, count: object = -1) -> int:
    if not (isinstance(text, str) and isinstance(old, str) and isinstance(new, str)):
        return 0
    hits = text.count(old) if old else len(text) + 1
    if _int(count, -1) >= 0:
        hits = min(hits, _int(count))
    return len(text) + hits * len(new)


def _join_size(separator: object, items: list) -> int:
    texts = sum(len(item) for item in items if isinstance(item, str))
    return texts + max(len(items) - 1, 0) * len(str(separator))


def _json_shape(value: object) -> tuple[int, int]:
    """(containers' items, deepest nesting) of plain data."""
    items, depth, stack = 0, 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = node.values() if isinstance(node, dict) else node
        if isinstance(node, (dict, list, tuple)):
            items += len(node) + 1
            depth = max(depth, level)
            stack.extend((child, level + 1) for child in children)
    return items, depth


def _tojson_size(value: object, *args: object, indent: object = None, **kwargs: object) -> int:
    """The indentation ``tojson(indent=...)`` adds: a line per item, each indented by its
    depth."""
    if args:
        indent = args[1] if len(args) > 1 else indent
    width = len(indent) if isinstance(indent, str) else _int(indent)
    if not width:
        return 0
    items, depth = _json_shape(value)
    return items * depth * width


def _sum_size(iterable: object, attribute: object = None, start: object = 0) -> int:
    """``sum(xs, start=[])`` concatenates: each step copies what was summed so far."""
    if not isinstance(start, (str, list, tuple)) or not isinstance(iterable, (list, tuple)):
        return 0
    total, copied = len(start), 0
    for item in iterable:
        total += _size(item)
        copied += total
    return copied


def _text(value: object) -> int:
    return len(value) if isinstance(value, str) else 0


# filter name -> estimate(value, *params, **params) of its result's size (the filter's own
# signature, after the context/environment argument)
_FILTER_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda value, width=80, *a, **k: _text(value) + _int(width),
    "indent": lambda s, width=4, *a, **k: (
        _text(s)
        + (s.count("\n") + 1 if isinstance(s, str) else 1)
        * (len(width) if isinstance(width, str) else _int(width))
    ),
    "wordwrap": lambda s, width=79, brk=True, wrapstring=None, *a, **k: (
        _text(s)
        + (_text(s) // max(_int(width, 1), 1) + (s.count("\n") if isinstance(s, str) else 0) + 1)
        * (len(wrapstring or "\n") + 1)
    ),
    "replace": _replace_size,
    "batch": lambda value, linecount=0, *a, **k: _size(value) + abs(_int(linecount)),
    "slice": lambda value, slices=0, *a, **k: _size(value) + abs(_int(slices)),
    "format": lambda value, *args, **kwargs: (
        _percent_size(value, kwargs or args) if isinstance(value, str) else 0
    ),
    "tojson": _tojson_size,
    "sum": _sum_size,
}

# str method -> estimate(text, *args) of its result's size
_STR_METHOD_SIZES: dict[str, Callable[..., int]] = {
    "center": lambda s, width=0, *a: len(s) + abs(_int(width)),
    "ljust": lambda s, width=0, *a: len(s) + abs(_int(width)),
    "rjust": lambda s, width=0, *a: len(s) + abs(_int(width)),
    "zfill": lambda s, width=0, *a: len(s) + abs(_int(width)),
    "expandtabs": lambda s, tabsize=8, *a, **k: (
        len(s) + s.count("\t") * abs(_int(k.get("tabsize", tabsize)))
    ),
    "replace": _replace_size,
    "translate": lambda s, table=None, *a: len(s) * _longest_value(table),
}


def _longest_value(table: object) -> int:
    if not isinstance(table, dict):
        return 1
    return max([1, *(_text(value) for value in table.values())])


# ---------------------------------------------------------------------- the environment
@functools.lru_cache(maxsize=1)
def _environment():
    """The bounded sandbox, configured as transformers configures its own."""
    from jinja2.compiler import CodeGenerator
    from jinja2.nodes import Filter, Slice, Tuple
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.visitor import NodeTransformer

    reference = _transformers_environment()

    class Meter(NodeTransformer):
        """Routes every loop's iterable, ``~`` and output piece through the meter filters."""

        def __init__(self, environment) -> None:
            self.environment = environment

        def meter(self, node, name: str):
            metered = Filter(node, name, [], [], None, None, lineno=node.lineno)
            return metered.set_environment(self.environment)

        def visit_For(self, node):
            node = self.generic_visit(node)
            node.iter = self.meter(node.iter, _ITER)
            return node

        def visit_Concat(self, node):
            node = self.generic_visit(node)
            return self.meter(Tuple(node.nodes, "load", lineno=node.lineno), _CONCAT)

        def visit_Output(self, node):
            node = self.generic_visit(node)
            node.nodes = [self.meter(child, _OUTPUT) for child in node.nodes]
            return node

        def visit_Getitem(self, node):  # Jinja slices without the sandbox's getitem
            node = self.generic_visit(node)
            return self.meter(node, _SLICE) if isinstance(node.arg, Slice) else node

    class MeteredCodeGenerator(CodeGenerator):
        def visit_Template(self, node, frame=None):
            return super().visit_Template(Meter(self.environment).visit(node), frame)

    class BoundedSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"+", "*", "**", "%"})
        code_generator_class = MeteredCodeGenerator

        def call_binop(self, context, operator: str, left, right):
            budget = _budget()
            budget.tick()
            if operator == "+" and type(left) is str and type(right) is str:  # the usual one
                budget.charge(len(left) + len(right), "'+'")
                return left + right
            budget.require(_binop_size(operator, left, right), f"'{operator}'")
            result = super().call_binop(context, operator, left, right)
            if operator != "**":
                budget.charge(_size(result), f"'{operator}'")
            return result

        def getattr(self, obj, attribute):
            _budget().tick()
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            budget = _budget()
            budget.tick()
            return super().getitem(obj, argument)

        def wrap_str_format(self, value):
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            text = value.__self__

            @functools.wraps(wrapped)
            def bounded(*args, **kwargs):
                budget = _budget()
                budget.require(_format_size(text), "str.format")
                result = wrapped(*args, **kwargs)
                budget.charge(len(result), "str.format")
                return result

            bounded.attnexport_metered = True
            return bounded

        def call(__self, __context, __obj, *args, **kwargs):
            budget = _budget()
            budget.tick()
            if getattr(__obj, "attnexport_metered", False):
                return super().call(__context, __obj, *args, **kwargs)
            owner = getattr(__obj, "__self__", None)
            name = getattr(__obj, "__name__", "")
            if isinstance(owner, str) and name == "join" and args:
                items = list(args[0])
                budget.charge(len(items), "str.join")
                args = (items, *args[1:])
                budget.require(_join_size(owner, items), "str.join")
            elif isinstance(owner, str) and name in _STR_METHOD_SIZES:
                budget.require(_STR_METHOD_SIZES[name](owner, *args, **kwargs), f"str.{name}")
            elif __obj is __self.globals.get("lipsum"):
                n = args[0] if args else kwargs.get("n", 5)
                most = args[3] if len(args) > 3 else kwargs.get("max", 100)
                budget.require(abs(_int(n)) * abs(_int(most)) * 16, "lipsum")
            elif __obj is __self.globals.get("strftime_now") and args:
                budget.require(_percent_size(str(args[0]), ()), "strftime_now")
            result = super().call(__context, __obj, *args, **kwargs)
            if result is not owner and not any(result is arg for arg in args):
                budget.charge(_size(result), f"calling {name or type(__obj).__name__}")
            return result

    options = {
        name: getattr(reference, name)
        for name in (
            "block_start_string",
            "block_end_string",
            "variable_start_string",
            "variable_end_string",
            "comment_start_string",
            "comment_end_string",
            "line_statement_prefix",
            "line_comment_prefix",
            "trim_blocks",
            "lstrip_blocks",
            "newline_sequence",
            "keep_trailing_newline",
            "undefined",
            "finalize",
            "autoescape",
        )
    }
    extensions = [type(extension) for extension in reference.extensions.values()]
    environment = BoundedSandbox(extensions=extensions, optimized=False, **options)
    environment.globals.update(reference.globals)
    environment.tests.update(reference.tests)
    environment.policies.update(reference.policies)
    environment.filters.update(
        {name: _metered_filter(name, f) for name, f in reference.filters.items()}
    )
    environment.filters.update(
        {
            _ITER: _metered_iter,
            _CONCAT: _metered_concat,
            _OUTPUT: _metered_output,
            _SLICE: _metered_slice,
        }
    )
    return environment


def _transformers_environment():
    """The Jinja environment transformers renders chat templates in (built by compiling an
    empty template: compiling the artifact's template there could already run it)."""
    from attnexport.errors import require

    require("jinja2", "hf", "chat templates")
    utils = require("transformers.utils.chat_template_utils", "hf", "chat templates")
    compile_template = getattr(utils, "_compile_jinja_template", None)
    if compile_template is None:
        import transformers

        raise ChatTemplateError(
            f"transformers {transformers.__version__} no longer exposes the Jinja environment "
            "of its chat templates (chat_template_utils._compile_jinja_template), which "
            "attnexport renders them like; install the transformers version of pyproject.toml"
        )
    return compile_template("").environment


def _binop_size(operator: str, left: object, right: object) -> int:
    """An upper bound of the result's size (bits / 8 for ints), before it is computed."""
    if operator == "+" and type(left) is type(right) and isinstance(left, (str, list, tuple)):
        return len(left) + len(right)
    if operator == "*":
        if isinstance(right, int) and isinstance(left, (str, list, tuple)):
            return len(left) * max(right, 0)
        if isinstance(left, int) and isinstance(right, (str, list, tuple)):
            return len(right) * max(left, 0)
        if isinstance(left, int) and isinstance(right, int):
            return _int_bits(left.bit_length() + right.bit_length())
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and right > 0:
        return _int_bits(right * max(abs(left).bit_length() - 1, 0))
    if operator == "%" and isinstance(left, str):
        return _percent_size(left, right)
    return 0


def _int_bits(bits: int) -> int:
    if bits > MAX_INT_BITS:
        raise TemplateLimitError(
            f"the chat template would make an int of {bits} bits (at most {MAX_INT_BITS})"
        )
    return 0


def _metered_filter(name: str, f: Callable) -> Callable:
    """``f`` with its result charged, and refused first when ``_FILTER_SIZES`` can bound
    it."""
    skip = 1 if getattr(f, "jinja_pass_arg", None) is not None else 0
    estimate = _FILTER_SIZES.get(name)

    @functools.wraps(f)
    def metered(*args, **kwargs):
        budget = _budget()
        budget.tick()
        if name == "join" and len(args) > skip:  # a generator is consumed once
            items = list(args[skip])
            budget.charge(len(items), "the join filter")
            args = (*args[:skip], items, *args[skip + 1 :])
            separator = args[skip + 1] if len(args) > skip + 1 else kwargs.get("d", "")
            budget.require(_join_size(separator, items), "the join filter")
        elif estimate is not None and len(args) > skip:
            budget.require(estimate(*args[skip:], **kwargs), f"the {name} filter")
        result = f(*args, **kwargs)
        if len(args) <= skip or result is not args[skip]:
            budget.charge(_size(result), f"the {name} filter")
        return result

    return metered


_ITER = "attnexport_metered_iter"
_CONCAT = "attnexport_metered_concat"
_OUTPUT = "attnexport_metered_output"
_SLICE = "attnexport_metered_slice"


def _metered_iter(iterable: Iterable) -> Iterator:
    budget = _budget()
    for item in iterable:
        budget.tick()
        yield item


def _metered_concat(values: tuple) -> str:
    budget = _budget()
    budget.tick()
    parts = [str(value) for value in values]
    budget.charge(sum(len(part) for part in parts), "'~'")
    return "".join(parts)


def _metered_slice(value: object) -> object:
    budget = _budget()
    budget.tick()
    budget.charge(_size(value), "a slice")
    return value


def _metered_output(value: object) -> str:
    budget = _budget()
    budget.tick()
    text = str(value)
    budget.charge(len(text), "the output")
    return text
