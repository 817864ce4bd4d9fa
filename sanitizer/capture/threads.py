"""Host threads: the synchronisation edges the program makes between its threads (issue 54,
class 2; docs/capture.md, "Host threads"; docs/trace-format.md for the events).

Every event is its issuing thread's (the writer writes a `thread` event where the issuing thread
changes), and a thread's CPU accesses are on its own lane (`cpu@<K>`, runtime.cpu_lane). What
orders two threads is what the program did to order them, recorded here as TSan records it: a
`release` of a synchronisation key publishes what the current thread knows, an `acquire` of it
makes the current thread learn what was published there.

  * threading.Thread: start() writes `thread_start` K once the new thread K has its ident and
    before it runs any of the program's code (it waits at the door of its run() for that: a lock
    the starter holds until the event is written, a few microseconds); its last event is
    `thread_end`, written when its run ends (also by an exception). join() that returns with the
    thread dead writes `thread_join`.
  * threading.Event: set() releases the event's key (`event:<n>`) before setting it; wait()
    that returns true, and is_set() that returns true, acquire it.
  * queue.Queue (and its subclasses): put() releases the queue's key (`queue:<n>`) before the
    item is in the queue; get() acquires it once it has the item.
  * torch futures (torch._C.Future, so torch.futures.Future too): set_result() releases the
    future's key (`future:<n>`); wait(), value() and a done() that returns true acquire it. A
    callback given to then() or add_done_callback() runs on whichever thread completes the
    future: it starts with the `acquire` of the parent's key and the `coll_done` of the parent's
    collectives on its thread (it runs after them: the program's order), and then()'s callback
    ends with the `release` of the key of the future then() returned (its wait() acquires it).
  * concurrent.futures (_patch_concurrent): a Future's completion releases, its result() and
    friends acquire; a ThreadPoolExecutor job is released at submit and acquired by its worker.

An acquire that learns nothing new (the key released no more since this thread last acquired it)
is not written. Keys are per object, from a counter (`event:<n>`, `queue:<n>`, `future:<n>`):
an object's key is never another's.

Not recorded: threading.Lock, RLock and Condition (C types, or Python objects made of them, used
everywhere in the interpreter and libraries: a Python wrapper would cost every lock of the
program a Python call and two events; docs/capture.md says what that leaves out), Semaphore,
Barrier, queue.SimpleQueue (a C type; the executor's own handoff is recorded at its ends),
multiprocessing. Objects whose first use comes from
threading itself or from capture (the `_started` Event of each Thread, the time flush's, the
testbed's comm threads and queues) and threads capture starts are left alone.

Every wrapper runs the program's call whatever happens to the recording: a failure is counted
(capture.failed) and never raised into the program.
"""
from __future__ import annotations

import itertools
import queue
import sys
import threading

_get_ident = threading.get_ident
_allocate_lock = threading._allocate_lock
_keys = itertools.count(1)
ATTR = "_hazsan_sync"        # an object's key, or False: not recorded
COUNT = "_hazsan_n"          # how many times it was released


class _Seen(threading.local):
    def __init__(self):
        self.n: dict = {}      # key -> the release count this thread last acquired


def _internal(depth: int) -> bool:
    """Whether the call `depth` frames up comes from threading itself or from capture."""
    try:
        name = sys._getframe(depth).f_globals.get("__name__") or ""
    except ValueError:
        return False
    return name == "threading" or name.startswith("sanitizer.")


class HostEdges:
    """The recording half: events for the wrappers below (never raises)."""

    def __init__(self, capture):
        self.capture = capture
        self.seen = _Seen()
        self.fkeys: dict = {}      # id(torch future) -> (weakref, key)

    # ------------------------------------------------------------------ events
    def release(self, key) -> None:
        self.capture.emit({"ev": "release", "sync": key})

    def acquire(self, key) -> None:
        self.capture.emit({"ev": "acquire", "sync": key})

    # ------------------------------------------------------------------ Python objects
    def key_of(self, obj, kind: str, depth: int):
        """obj's key, made at its first use (False: not recorded; see _internal)."""
        key = obj.__dict__.get(ATTR)
        if key is None:
            key = False if _internal(depth + 1) else f"{kind}:{next(_keys)}"
            obj.__dict__[ATTR] = key
            obj.__dict__[COUNT] = 0
        return key

    def released(self, obj, kind: str) -> None:
        try:
            key = self.key_of(obj, kind, 3)
            if key:
                self.release(key)
                obj.__dict__[COUNT] += 1      # after the event: an acquire that sees it sees the event
        except Exception as exc:
            self.capture.failed(f"threads.{kind}", exc)

    def acquired(self, obj, kind: str) -> None:
        try:
            key = self.key_of(obj, kind, 3)
            if not key:
                return
            n = obj.__dict__[COUNT]
            seen = self.seen.n
            if n and seen.get(key) != n:
                if len(seen) > 4096:
                    seen.clear()
                seen[key] = n
                self.acquire(key)
        except Exception as exc:
            self.capture.failed(f"threads.{kind}", exc)

    # ------------------------------------------------------------------ threads
    def starting(self, thread):
        """Before Thread.start: the lock its run() waits for (None: not recorded)."""
        try:
            if ATTR in thread.__dict__:
                return None
            if _internal(3) or (thread.name or "").startswith("hazsan"):
                thread.__dict__[ATTR] = False
                return None
            gate = _allocate_lock()
            gate.acquire()
            thread.__dict__[ATTR] = gate
            return gate
        except Exception as exc:
            self.capture.failed("threads.start", exc)
            return None

    def started(self, thread, gate) -> None:
        """Thread.start returned (the thread has its ident, and waits for `gate`)."""
        try:
            thread.__dict__[ATTR] = True
            if thread.ident is not None:
                self.capture.emit({"ev": "thread_start", "thread": thread.ident})
        except Exception as exc:
            self.capture.failed("threads.start", exc)
        finally:
            gate.release()

    def joined(self, thread) -> None:
        try:
            if thread.__dict__.get(ATTR) is True and not thread.is_alive() and thread.ident is not None:
                self.capture.emit({"ev": "thread_join", "thread": thread.ident})
        except Exception as exc:
            self.capture.failed("threads.join", exc)

    # ------------------------------------------------------------------ torch futures
    def future_key(self, fut, make: bool = True):
        entry = self.fkeys.get(id(fut))
        if entry is not None and entry[0]() is fut:
            return entry[1]
        if not make:
            return None
        return self._file(fut, f"future:{next(_keys)}")

    def _file(self, fut, key):
        import weakref
        fkeys, k = self.fkeys, id(fut)

        def forget(ref, k=k):
            entry = fkeys.get(k)
            if entry is not None and entry[0] is ref:
                del fkeys[k]
        self.fkeys[k] = (weakref.ref(fut, forget), key)
        return key

    def future_done(self, fut) -> None:
        """wait()/value() returned, or done() said true: learn what its completion published."""
        try:
            key = self.future_key(fut, make=False)
            if key is not None:
                seen = self.seen.n
                if seen.get(key) != 1:
                    if len(seen) > 4096:
                        seen.clear()
                    seen[key] = 1
                    self.acquire(key)
        except Exception as exc:
            self.capture.failed("threads.future", exc)

    def callback(self, parent, fn, child_key):
        """`fn` wrapped to run as the program's order says: after what completed `parent` (its
        key, its collectives), and, for then(), before what waits for the child (child_key)."""
        pkey = self.future_key(parent)
        colls = getattr(self.capture, "collectives", None)
        cids = colls.cids_of(parent) if colls is not None else None
        cids = list(cids) if cids else None
        edges = self

        def run(fut):
            try:
                seen = edges.seen.n
                seen[pkey] = 1
                edges.acquire(pkey)
                if cids:
                    colls.learnt(cids)
            except Exception as exc:
                edges.capture.failed("threads.callback", exc)
            try:
                return fn(fut)
            finally:
                if child_key is not None:
                    try:
                        edges.release(child_key)
                    except Exception as exc:
                        edges.capture.failed("threads.callback", exc)
        try:
            run.__name__ = getattr(fn, "__name__", "callback")
            run.__qualname__ = getattr(fn, "__qualname__", run.__name__)
            run.__wrapped__ = fn
        except Exception:
            pass
        return run


def install(capture) -> HostEdges | None:
    """Wrap the methods above (once per process). Returns the recorder, None if already done."""
    if getattr(threading.Thread.start, "_hazsan_threads", False):
        return None
    edges = HostEdges(capture)
    capture.host_edges = edges
    _patch_threads(capture, edges)
    _patch_event(capture, edges)
    _patch_queue(capture, edges)
    try:
        _patch_concurrent(capture, edges)
    except Exception as exc:
        capture.failed("install.threads.concurrent", exc)
    try:
        _patch_futures(capture, edges)
    except Exception as exc:
        capture.failed("install.threads.future", exc)
    capture.installed.append("host-threads")
    return edges


def _mark(fn, original, qualname):
    fn._hazsan_threads = True
    fn.__name__ = original.__name__
    fn.__qualname__ = qualname
    fn.__doc__ = original.__doc__
    fn.__wrapped__ = original
    return fn


def _patch_threads(capture, edges: HostEdges) -> None:
    T = threading.Thread
    t_start, t_join, t_boot = T.start, T.join, T._bootstrap_inner
    emit = capture.emit

    def start(self):
        gate = edges.starting(self)
        if gate is None:
            return t_start(self)
        try:
            return t_start(self)
        finally:
            edges.started(self, gate)      # (also when start failed: the gate opens)

    def _bootstrap_inner(self):
        gate = self.__dict__.get(ATTR)
        if not gate:
            return t_boot(self)
        try:
            # the program's run() waits until the starter wrote thread_start (t_boot first sets the
            # ident and `_started`, which start() waits for)
            run = self.run

            def run_after_start(*a, **k):
                self.__dict__.pop("run", None)
                gate.acquire()
                gate.release()
                return run(*a, **k)
            self.__dict__["run"] = run_after_start
        except Exception as exc:
            capture.failed("threads.start", exc)
        try:
            return t_boot(self)
        finally:
            try:
                emit({"ev": "thread_end", "thread": _get_ident()})
            except Exception as exc:
                capture.failed("threads.end", exc)

    def join(self, timeout=None):
        r = t_join(self, timeout)
        edges.joined(self)
        return r

    T.start = _mark(start, t_start, "Thread.start")
    T._bootstrap_inner = _mark(_bootstrap_inner, t_boot, "Thread._bootstrap_inner")
    T.join = _mark(join, t_join, "Thread.join")


def _patch_event(capture, edges: HostEdges) -> None:
    E = threading.Event
    e_set, e_wait, e_is_set = E.set, E.wait, E.is_set

    def set(self):
        edges.released(self, "event")
        return e_set(self)

    def wait(self, timeout=None):
        r = e_wait(self, timeout)
        if r:
            edges.acquired(self, "event")
        return r

    def is_set(self):
        r = e_is_set(self)
        if r:
            edges.acquired(self, "event")
        return r

    E.set = _mark(set, e_set, "Event.set")
    E.wait = _mark(wait, e_wait, "Event.wait")
    E.is_set = _mark(is_set, e_is_set, "Event.is_set")


def _patch_queue(capture, edges: HostEdges) -> None:
    Q = queue.Queue
    q_put, q_get = Q.put, Q.get

    def put(self, item, block=True, timeout=None):
        edges.released(self, "queue")
        return q_put(self, item, block, timeout)

    def get(self, block=True, timeout=None):
        item = q_get(self, block, timeout)
        edges.acquired(self, "queue")
        return item

    Q.put = _mark(put, q_put, "Queue.put")
    Q.get = _mark(get, q_get, "Queue.get")


def _patch_concurrent(capture, edges: HostEdges) -> None:
    """concurrent.futures: a Future completed (set_result, set_exception) releases its key
    (`cfuture:<n>`), result(), exception() and a true done() acquire it, a done-callback starts
    with the acquire; a ThreadPoolExecutor work item releases `work:<n>` when submitted, and the
    worker acquires it before running it (the executor hands it over through a SimpleQueue)."""
    import concurrent.futures as cf
    import concurrent.futures.thread as cft
    F = cf.Future
    f_set, f_exc, f_result, f_exception, f_done, f_add = (F.set_result, F.set_exception, F.result,
                                                          F.exception, F.done, F.add_done_callback)

    def set_result(self, result):
        edges.released(self, "cfuture")
        return f_set(self, result)

    def set_exception(self, exception):
        edges.released(self, "cfuture")
        return f_exc(self, exception)

    def result(self, timeout=None):
        try:
            return f_result(self, timeout)
        finally:
            if f_done(self):
                edges.acquired(self, "cfuture")

    def exception(self, timeout=None):
        r = f_exception(self, timeout)
        edges.acquired(self, "cfuture")
        return r

    def done(self):
        r = f_done(self)
        if r:
            edges.acquired(self, "cfuture")
        return r

    def add_done_callback(self, fn):
        future = self

        def run(f):
            edges.acquired(future, "cfuture")
            return fn(f)
        try:
            run.__wrapped__ = fn
        except Exception:
            pass
        return f_add(self, run)

    for name, fn, orig in (("set_result", set_result, f_set), ("set_exception", set_exception, f_exc),
                           ("result", result, f_result), ("exception", exception, f_exception),
                           ("done", done, f_done), ("add_done_callback", add_done_callback, f_add)):
        setattr(F, name, _mark(fn, orig, f"Future.{name}"))

    W = getattr(cft, "_WorkItem", None)
    if W is None:
        return
    w_init, w_run = W.__init__, W.run

    def __init__(self, *a, **k):
        w_init(self, *a, **k)
        edges.released(self, "work")

    def run(self, *a, **k):
        edges.acquired(self, "work")
        return w_run(self, *a, **k)

    W.__init__ = _mark(__init__, w_init, "_WorkItem.__init__")
    W.run = _mark(run, w_run, "_WorkItem.run")


def _patch_futures(capture, edges: HostEdges) -> None:
    import torch
    F = torch._C.Future
    f_then, f_add, f_set = F.then, F.add_done_callback, F.set_result
    f_wait, f_value, f_done = F.wait, F.value, F.done

    def then(self, callback):
        child_key = None
        fn = callback
        try:
            child_key = f"future:{next(_keys)}"
            fn = edges.callback(self, callback, child_key)
        except Exception as exc:
            capture.failed("threads.future", exc)
        child = f_then(self, fn)
        if child_key is not None:
            try:
                edges._file(child, child_key)
            except Exception as exc:
                capture.failed("threads.future", exc)
        return child

    def add_done_callback(self, callback):
        fn = callback
        try:
            fn = edges.callback(self, callback, None)
        except Exception as exc:
            capture.failed("threads.future", exc)
        return f_add(self, fn)

    def set_result(self, result):
        try:
            edges.release(edges.future_key(self))
        except Exception as exc:
            capture.failed("threads.future", exc)
        return f_set(self, result)

    def wait(self):
        r = f_wait(self)
        edges.future_done(self)
        return r

    def value(self):
        r = f_value(self)
        edges.future_done(self)
        return r

    def done(self):
        r = f_done(self)
        if r:
            edges.future_done(self)
        return r

    for name, fn, orig in (("then", then, f_then), ("add_done_callback", add_done_callback, f_add),
                           ("set_result", set_result, f_set), ("wait", wait, f_wait),
                           ("value", value, f_value), ("done", done, f_done)):
        setattr(F, name, _mark(fn, orig, f"Future.{name}"))
