"""The one way effitrain renders a chat template (training's encoding, the generation-prompt check, `predict`,
`evaluate`): transformers' `apply_chat_template`, with a time and a size limit in any thread.

A chat template is code from a model folder or a user's file. transformers runs it in Jinja's immutable
sandbox (no attribute escapes, `range` capped at 100,000), which bounds neither time nor memory: a loop
over loops runs for hours, a string doubled 40 times asks for a terabyte, and Jinja's compiler folds
constant expressions (`10 ** 10 ** 8`) while it compiles. Here:

- the environment transformers builds is `BoundedEnvironment` (`bounded()` puts it in the place of the
  sandbox class transformers names): `*`, `**`, `+`, `%` and `~` are computed only when their result stays
  under MAX_CHARS characters (or MAX_BITS bits), which also keeps the compiler from folding them; filters
  refuse a width or count above MAX_CHARS; the output of one render stops at MAX_CHARS;
- a render that runs longer than SECONDS is stopped by an exception raised in its own thread (CPython's
  PyThreadState_SetAsyncExc, from one watchdog thread): any thread, main or not, the sandbox's loops
  included (they are Python code). A single C call still finishes first, which the size limits keep small.

Each limit ends the render with `TemplateLimit`, which the callers say in one line."""

from __future__ import annotations

import contextlib
import ctypes
import functools
import heapq
import itertools
import threading
import time

SECONDS = 10  # one conversation renders in milliseconds; a template still running loops without end
MAX_CHARS = 16 * 2**20  # of one value or of one render's output: 16 Mi characters (a conversation is far less)
MAX_BITS = 4096  # of an integer a template computes


class TemplateLimit(Exception):
    """A render stopped at a limit: `str(err)` says which."""


class TooSlow(TemplateLimit):
    def __init__(self):
        super().__init__(f"it ran more than {SECONDS} s (a loop that does not end?)")


def _too_large(what: str) -> TemplateLimit:
    return TemplateLimit(f"it builds {what}, over the limit of {MAX_CHARS:,} characters")


def _size(value) -> int | None:
    return len(value) if isinstance(value, (str, bytes, list, tuple)) else None


def _check_binop(operator: str, left, right) -> None:
    if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
        if right * max(abs(left).bit_length() - 1, 1) > MAX_BITS:
            raise TemplateLimit(f"it computes {left} ** {right}, over the limit of {MAX_BITS} bits")
    if operator == "*":
        if isinstance(left, int) and isinstance(right, int):
            if abs(left).bit_length() + abs(right).bit_length() > MAX_BITS:
                raise TemplateLimit(f"it multiplies integers over the limit of {MAX_BITS} bits")
            return
        for sized, count in ((left, right), (right, left)):
            if _size(sized) is not None and isinstance(count, int) and _size(sized) * count > MAX_CHARS:
                raise _too_large(f"a value of {_size(sized):,} x {count:,}")
    if operator == "+" and _size(left) is not None and _size(right) is not None \
            and _size(left) + _size(right) > MAX_CHARS:
        raise _too_large(f"a value of {_size(left) + _size(right):,}")
    if operator == "%" and isinstance(left, str):
        widths = [int(run) for run in "".join(c if c.isdigit() else " " for c in left).split()]
        widths += [abs(v) for v in (right if isinstance(right, tuple) else (right,)) if _is_int(v)]  # `%*d`
        if widths and max(widths) > MAX_CHARS:
            raise _too_large(f"a formatted field {max(widths):,} wide")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_counts(what: str, values) -> None:
    """A width or count above MAX_CHARS passed to a filter or a method (`ljust`, `center`, `format`)."""
    for value in values:
        if _is_int(value) and abs(value) > MAX_CHARS:
            raise TemplateLimit(f"it passes {value:,} to {what}, over the limit of {MAX_CHARS:,}")


def _check_replace(text, old, new, count=None) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        times = text.count(old) if old else len(text) + 1
        times = min(times, count) if _is_int(count) and count >= 0 else times
        if len(text) + times * (len(new) - len(old)) > MAX_CHARS:
            raise _too_large(f"a replacement of {len(text) + times * (len(new) - len(old)):,}")


def _check_join(separator, items: list) -> None:
    total = sum(len(str(item)) for item in items) + max(len(items) - 1, 0) * len(str(separator))
    if total > MAX_CHARS:
        raise _too_large(f"a join of {total:,}")


def _checked_join(values) -> str:
    parts = [str(value) for value in values]
    total = sum(len(part) for part in parts)
    if total > MAX_CHARS:
        raise _too_large(f"a value of {total:,}")
    return "".join(parts)


def _bounded_filter(name: str, function):
    """A filter that refuses a number above MAX_CHARS among its arguments (a width, a count), a `replace` or
    `join` whose result would be over MAX_CHARS before it is built, and any result over MAX_CHARS."""
    first = 1 if hasattr(function, "jinja_pass_arg") else 0  # the context jinja passes first, for some

    @functools.wraps(function)  # keeps jinja's pass_context / pass_environment marks
    def bounded(*args, **kwargs):
        _check_counts(f"the filter {name}", itertools.chain(args[first + 1:], kwargs.values()))
        if name == "replace":
            _check_replace(*args[first:first + 4])
        if name == "join" and len(args) > first:
            items = list(args[first])  # a generator is read once, here
            _check_join(args[first + 1] if len(args) > first + 1 else kwargs.get("d", ""), items)
            args = (*args[:first], items, *args[first + 1:])
        result = function(*args, **kwargs)
        if _size(result) is not None and _size(result) > MAX_CHARS:
            raise _too_large(f"a value of {_size(result):,}")
        return result
    return bounded


def _counted(render):
    """A template's root render function whose output is counted: every render and generate goes through it."""
    def root(context):
        written = 0
        for chunk in render(context):
            written += len(chunk)
            if written > MAX_CHARS:
                raise _too_large(f"an output of more than {written:,}")
            yield chunk
    return root


def _checked_call(function, args: tuple, kwargs: dict) -> tuple:
    """A method the template calls (`'x'.ljust(n)`, `sep.join(...)`, `s.replace(...)`, `format`): a width or
    count above MAX_CHARS, or a join or replacement over it, refused before it runs; the arguments to call
    it with (a joined generator read once, here)."""
    name, owner = getattr(function, "__name__", ""), getattr(function, "__self__", None)
    name = "range" if name == "safe_range" else name  # the sandbox's own range, as the template says it
    _check_counts(f"{name or 'a call'}", itertools.chain(args, kwargs.values()))
    if isinstance(owner, str) and name == "replace":
        _check_replace(owner, *args[:3])
    if isinstance(owner, str) and name == "join" and args:
        args = (list(args[0]), *args[1:])
        _check_join(owner, args[0])
    return args


def _environment_class():
    """BoundedEnvironment, made on first use (jinja2 is imported with transformers, not before)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.environment import Template
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BoundedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: through the environment's checked join
            self.write("environment.checked_join((")
            for argument in node.nodes:
                self.visit(argument, frame)
                self.write(", ")
            self.write("))")

    class BoundedTemplate(Template):
        @classmethod
        def _from_namespace(cls, environment, namespace, globals):
            template = super()._from_namespace(environment, namespace, globals)
            template.root_render_func = _counted(template.root_render_func)
            return template

    class BoundedEnvironment(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})
        code_generator_class = BoundedCodeGenerator
        template_class = BoundedTemplate

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.filters = {name: _bounded_filter(name, f) for name, f in self.filters.items()}
            self.checked_join = _checked_join

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's own signature
            result = super().call(__context, __obj, *_checked_call(__obj, args, kwargs), **kwargs)
            if _size(result) is not None and _size(result) > MAX_CHARS:
                raise _too_large(f"a value of {_size(result):,}")
            return result

    return BoundedEnvironment


@functools.cache
def bounded():
    """transformers' chat templates compiled in BoundedEnvironment from now on (idempotent): the class it
    names `ImmutableSandboxedEnvironment` when it builds each template's environment is this subclass, and
    the templates it compiled before are forgotten. Returns the class."""
    from transformers.utils import chat_template_utils

    environment = _environment_class()
    chat_template_utils.ImmutableSandboxedEnvironment = environment
    chat_template_utils._compile_jinja_template.cache_clear()
    return environment


def render(tokenizer, messages: list[dict], **options):
    """`tokenizer.apply_chat_template(messages, **options)` within SECONDS and MAX_CHARS; TemplateLimit at a
    limit, the template's own errors as they are. A template stopped once is refused at once after that (a
    command renders several times: a second 10 s wait would say nothing new), and so is one whose renders
    have taken SECONDS in all at more than SLOW each on average: under the limit one by one, a data set's
    thousands of conversations would take hours."""
    bounded()
    template = str(getattr(tokenizer, "chat_template", None))
    if template in _STOPPED:
        raise TemplateLimit(_STOPPED[template])
    started = time.monotonic()
    try:
        with time_limit(SECONDS):
            result = tokenizer.apply_chat_template(messages, **options)
    except TemplateLimit as err:
        _STOPPED[template] = str(err)
        raise
    renders, seconds = _SPENT.get(template, (0, 0.0))
    renders, seconds = renders + 1, seconds + time.monotonic() - started
    _SPENT[template] = (renders, seconds)
    if seconds > SECONDS and seconds / renders > SLOW:
        _STOPPED[template] = (f"it takes {seconds / renders:.2f} s a conversation ({renders} rendered in "
                              f"{seconds:.0f} s; a template renders one in milliseconds)")
        raise TemplateLimit(_STOPPED[template])
    return result


SLOW = 0.1  # seconds a render on average, past SECONDS in all
_STOPPED: dict[str, str] = {}  # template -> why it was stopped, in this process
_SPENT: dict[str, tuple[int, float]] = {}  # template -> (renders, seconds), in this process


def compile_template(text: str):
    """The template compiled as `apply_chat_template` compiles it (bounded, its {% generation %} tag known),
    within SECONDS."""
    from transformers.utils.chat_template_utils import _compile_jinja_template

    bounded()
    with time_limit(SECONDS):
        return _compile_jinja_template(text)


# -- the time limit, in any thread ----------------------------------------------------------------------
class _Watchdog:
    """One daemon thread that raises TooSlow in a thread still inside `time_limit` at its deadline."""

    def __init__(self):
        self.lock = threading.Condition()
        self.deadlines: list[tuple[float, int, int]] = []  # (deadline, ticket, thread id), a heap
        self.inside: dict[int, int] = {}  # ticket -> thread id, while its block runs
        self.tickets = itertools.count()
        threading.Thread(target=self._watch, name="effitrain-template-watchdog", daemon=True).start()

    def enter(self, seconds: float) -> int:
        ticket, thread = next(self.tickets), threading.get_ident()
        with self.lock:
            self.inside[ticket] = thread
            heapq.heappush(self.deadlines, (time.monotonic() + seconds, ticket, thread))
            self.lock.notify()
        return ticket

    def leave(self, ticket: int) -> None:
        with self.lock:
            thread = self.inside.pop(ticket)
            _raise_in(thread, None)  # an exception set but not yet raised is withdrawn

    def _watch(self) -> None:
        with self.lock:
            while True:
                while self.deadlines and self.deadlines[0][1] not in self.inside:
                    heapq.heappop(self.deadlines)  # left in time
                if not self.deadlines:
                    self.lock.wait()
                    continue
                deadline, ticket, thread = self.deadlines[0]
                if time.monotonic() < deadline:
                    self.lock.wait(deadline - time.monotonic())
                    continue
                heapq.heappop(self.deadlines)
                _raise_in(thread, TooSlow)


def _raise_in(thread: int, exception) -> None:
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread),
                                               ctypes.py_object(exception) if exception is not None else None)


@functools.cache
def _watchdog() -> _Watchdog:
    return _Watchdog()


@contextlib.contextmanager
def time_limit(seconds: float):
    """TooSlow raised in the block (whatever thread runs it) once it has run `seconds`."""
    watchdog = _watchdog()
    ticket = watchdog.enter(seconds)
    try:
        yield
    finally:
        watchdog.leave(ticket)
