"""Chat templates rendered exactly as transformers renders them, in a worker process with a time and size budget.

The environment is transformers' ``apply_chat_template`` one (its ``utils/chat_template_utils.py``), written here:
an ``ImmutableSandboxedEnvironment`` with ``trim_blocks``, ``lstrip_blocks``, ``loopcontrols`` and the
``{% generation %}`` tag, a ``tojson`` that does not escape HTML, ``raise_exception``, ``strftime_now``, ``dict``
and a ``namespace`` refusing underscore names; the template sees ``messages`` (None values dropped), ``tools``,
``documents``, ``add_generation_prompt`` and the tokenizer's named special tokens. A template is code from a model
folder driven by a request, so it never runs in the server: compiled once at load (a syntax error is refused then),
rendered by :class:`Renderer` in a worker process (``python -I`` on this file: stdlib and jinja2, its address
space capped), killed past the time budget, stopped as soon as its output passes the size budget; each model has its
own workers and queue (a pool), so a template that loops on one model never delays another model's chat. Whatever it
cannot do for a request is a one-line :class:`ChatError`.
"""

from __future__ import annotations

import concurrent.futures
import functools
import hashlib
import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: Seconds one render may take, and the worker's address space (bytes).
TIME_BUDGET_S = 2.0
MEMORY_BUDGET = 1 << 30
#: The special tokens transformers hands a template (``SPECIAL_TOKENS_ATTRIBUTES``).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class ChatError(ValueError):
    """A template that cannot render these messages; ``too_large``: it passed the size or memory budget."""

    def __init__(self, message: str, too_large: bool = False):
        super().__init__(" ".join(message.split())[:300])
        self.too_large = too_large


@dataclass(frozen=True)
class ChatTemplate:
    """A folder's chat template(s), compiled once, and the special tokens it is given."""

    templates: dict[str, str]  # name ("default", "tool_use", ...) -> source
    specials: dict[str, str] = field(default_factory=dict)

    @classmethod
    def from_folder(cls, folder: Path) -> "ChatTemplate | None":
        """A tokenizer folder's template (None when it has none); a template that does not compile is refused."""
        from attnx.runtime.core.text import _read_json as read  # the parent's side: the server's own modules

        config = read(folder / "tokenizer_config.json")
        jinja = folder / "chat_template.jinja"
        found = config.get("chat_template")
        if jinja.is_file():
            templates = {"default": jinja.read_text(encoding="utf-8")}
        elif isinstance(found, str):
            templates = {"default": found}
        elif isinstance(found, list):
            templates = {t["name"]: t["template"] for t in found if isinstance(t, dict)
                         and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
        else:
            return None
        legacy = {} if "added_tokens_decoder" in config else read(folder / "special_tokens_map.json")
        specials = {}
        for key in SPECIAL_TOKENS:
            value = legacy.get(key) or config.get(key)  # transformers' legacy merge: the map file wins
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                specials[key] = value
        template = cls(templates, specials)
        for name, source in templates.items():
            try:
                environment().parse(source)
            except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and the like
                raise ValueError(f"{folder}: chat template {name!r} does not compile: {e}") from None
        return template

    @classmethod
    def from_file(cls, path: Path, folder: Path | None = None) -> "ChatTemplate":
        """``attnx serve --chat-template FILE``: a Jinja file (or a ``tokenizer_config.json``-style JSON with
        ``chat_template``) replacing the folder's template, with the folder's special tokens (``bos_token``, ...)."""
        path = Path(path)
        source = path.read_text(encoding="utf-8")
        if path.suffix == ".json":
            import json

            found = json.loads(source).get("chat_template")
            if not isinstance(found, str):
                raise ValueError(f"{path}: no 'chat_template' string in it")
            source = found
        base = cls.from_folder(folder) if folder is not None else None
        template = cls({"default": source}, dict(base.specials) if base is not None else {})
        try:
            environment().parse(source)
        except Exception as e:  # noqa: BLE001 - jinja2's TemplateSyntaxError and the like
            raise ValueError(f"{path}: chat template does not compile: {e}") from None
        return template

    def pick(self, tools) -> str:
        """The template a request renders with (transformers' ``get_chat_template``)."""
        if tools and "tool_use" in self.templates:
            return self.templates["tool_use"]
        return self.templates.get("default") or next(iter(self.templates.values()))


class Renderer:
    """Renders chat templates in worker processes (module doc); thread-safe. Each ``pool`` (the server keys them by
    model) has its own ``workers`` processes and threads and its own queue, so one model's slow template never
    delays another model's chat. A worker process is ~25 MB (python -I with jinja2): ``workers`` x the models with
    a template, started as their first requests come (or at load with :meth:`warm`)."""

    def __init__(self, workers: int = 2, time_budget_s: float = TIME_BUDGET_S, memory: int = MEMORY_BUDGET):
        self.workers, self.time_budget_s, self.memory = workers, time_budget_s, memory
        self._pools: dict[str, _Pool] = {}
        self._lock = threading.Lock()
        self._closed = False

    def _pool(self, name: str) -> "_Pool":
        with self._lock:
            if self._closed:
                raise ChatError("the server is shutting down")
            if name not in self._pools:
                self._pools[name] = _Pool(self.workers, self.memory)
            return self._pools[name]

    def render(self, template: ChatTemplate, messages: list[dict], *, tools=None, documents=None,
               add_generation_prompt: bool = True, max_chars: int = 1 << 20, pool: str = "") -> str:
        """The prompt (blocking: run it off the event loop, or use :meth:`submit`). Raises :class:`ChatError`."""
        source = template.pick(tools)
        request = {"template": source, "key": hashlib.sha256(source.encode()).hexdigest(), "max_chars": max_chars,
                   "context": {**template.specials, "messages": [{k: v for k, v in m.items() if v is not None}
                                                                 for m in messages],
                               "tools": tools, "documents": documents,
                               "add_generation_prompt": add_generation_prompt}}
        answer = self._pool(pool).ask(request, self.time_budget_s)
        if "text" in answer:
            return answer["text"]
        raise ChatError(answer["error"], answer.get("too_large", False))

    def submit(self, pool: str, template: ChatTemplate, messages: list[dict], **kw) -> concurrent.futures.Future:
        """:meth:`render` on ``pool``'s own threads (its requests queue there, never on a thread another pool
        needs): ``await asyncio.wrap_future(renderer.submit(...))``."""
        return self._pool(pool).threads.submit(functools.partial(self.render, template, messages, pool=pool, **kw))

    def warm(self, pool: str = "") -> None:
        """Start one worker of ``pool`` now (a server loading a model with a template), so no request waits for it."""
        p = self._pool(pool)
        with p.slots:
            p.give(p.take(), self._closed)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pools, self._pools = list(self._pools.values()), {}
        for p in pools:
            p.close()


class _Pool:
    """One pool's worker processes (at most ``workers`` busy) and the threads that wait on them."""

    def __init__(self, workers: int, memory: int):
        self.memory = memory
        self.idle: list[_Worker] = []
        self.slots = threading.Semaphore(workers)
        self.threads = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="attnx-chat")
        self.lock = threading.Lock()
        self.closed = False

    def ask(self, request: dict, timeout: float) -> dict:
        with self.slots:
            worker = self.take()
            try:
                answer = worker.ask(request, timeout)
            except BaseException as e:
                worker.kill()  # past the time budget, or dead: never reused
                if isinstance(e, OSError):
                    raise ChatError("the chat template's worker died rendering these messages", True) from None
                raise
            self.give(worker)
        return answer

    def take(self) -> "_Worker":
        with self.lock:
            if self.closed:
                raise ChatError("the server is shutting down")
            while self.idle:
                worker = self.idle.pop()
                if worker.alive:
                    return worker
        return _Worker(self.memory)

    def give(self, worker: "_Worker", closing: bool = False) -> None:
        with self.lock:
            if self.closed or closing:
                worker.kill()
            else:
                self.idle.append(worker)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for worker in idle:
            worker.kill()
        self.threads.shutdown(wait=False, cancel_futures=True)


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, memory: int):
        self.proc = subprocess.Popen([sys.executable, "-I", __file__, str(memory)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        assert self.proc.stdin is not None and self.proc.stdout is not None  # both PIPE
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout
        self.sent: set[str] = set()  # templates this worker has compiled

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def ask(self, request: dict, timeout: float) -> dict:
        if request["key"] in self.sent:
            request = {**request, "template": None}
        line = json.dumps(request, ensure_ascii=False).encode() + b"\n"
        answer: list = []
        reader = threading.Thread(target=lambda: answer.append(self.stdout.readline()), daemon=True)
        self.stdin.write(line)
        self.stdin.flush()
        reader.start()
        reader.join(timeout)
        if reader.is_alive() or not answer or not answer[0]:
            raise ChatError(f"the chat template did not finish within {timeout:g} s for these messages"
                            if reader.is_alive() else "the chat template's worker died rendering these messages "
                                                      "(past its memory budget?)", too_large=not reader.is_alive())
        self.sent.add(request["key"])
        return json.loads(answer[0])

    def kill(self) -> None:
        if self.alive:
            self.proc.kill()
        self.proc.wait()
        for pipe in (self.stdin, self.stdout):
            pipe.close()


# --- the worker side: the environment transformers renders in ------------------------------------------------

def environment():
    """transformers' chat-template environment (module doc), written from its definition."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # ``{% generation %}...{% endgeneration %}``: renders its body as it is
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class Namespace(jinja2.utils.Namespace):  # no dunder (or any underscore) attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"chat templates cannot store {name!r} on a namespace")

    class Dict:  # ``dict(...)`` without the class itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda f: datetime.now().strftime(f),
                       dict=Dict(), namespace=Namespace)
    return env


def _render(env, compiled: dict, request: dict) -> dict:
    key, limit = request["key"], request["max_chars"]
    if request.get("template") is not None and key not in compiled:
        compiled[key] = env.from_string(request["template"])
    out, size = [], 0
    try:
        for piece in compiled[key].generate(**request["context"]):
            out.append(piece)
            size += len(piece)
            if size > limit:
                return {"error": f"the chat template rendered more than {limit} characters, more than the model "
                                 f"can read", "too_large": True}
        return {"text": "".join(out)}
    except MemoryError:
        return {"error": "the chat template ran out of memory rendering these messages", "too_large": True}
    except RecursionError:
        return {"error": "the chat template recursed too deeply for these messages"}
    except Exception as e:  # noqa: BLE001 - raise_exception, a sandbox refusal, range() past its limit...
        return {"error": f"the chat template refused the messages: {type(e).__name__}: {e}"}


def _main() -> None:
    import resource

    memory = int(sys.argv[1])
    try:
        resource.setrlimit(resource.RLIMIT_AS, (memory, resource.getrlimit(resource.RLIMIT_AS)[1]))
    except (ValueError, OSError):  # a hard limit below it: that one holds
        pass
    env = environment()
    compiled: dict[str, Any] = {}  # template key -> its compiled jinja2 template
    for line in sys.stdin.buffer:
        try:
            answer = _render(env, compiled, json.loads(line))
        except Exception as e:  # noqa: BLE001 - a template that does not compile here (checked at load)
            answer = {"error": f"the chat template failed: {type(e).__name__}: {e}"}
        sys.stdout.write(json.dumps(answer, ensure_ascii=False) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if os.path.abspath(p) != os.path.dirname(os.path.abspath(__file__))]
    _main()
