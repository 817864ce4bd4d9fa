"""Where a vLLM worker's step time goes, per rank (issue 30): put this folder on PYTHONPATH and set
STEPSTAT to a file; every vLLM worker appends one line at exit:

    STEPSTAT=/tmp/stepstat PYTHONPATH=benchmarks/vllm_step_split \\
        .venv-e2e/bin/python examples/vllm_e2e/run.py --only eager-bare,eager-native

    mark_step 73 us cpu 98 wall end_step 236 us cpu 243 wall pid 8275 steps 300: own cpu 3219 us,
    in collectives 906 us, wall 4407 us

Over the last 300 `execute_model` calls of the process: the thread CPU time of the call less the
time inside the CPU communicator's shared-memory collectives ("own"), the time inside them (which
includes spinning while the other rank catches up: a rank slowed by anything makes its peer spin),
the call's wall time, the garbage collections run inside those calls (by generation) and their
CPU time per step, and where capture runs, the CPU and wall time of its step marks
(Capture.mark_step, Capture.end_step: the flushes and header writes). The wrappers are installed
with wrapt's post-import hooks, as capture's own; capture's execute_model wrapper is installed
first (its .pth line runs before sitecustomize), so the step's figure includes the marks.
A measurement aid only: nothing here is part of hazsan, and it changes nothing the worker computes.
"""
import atexit
import os
import time

if os.environ.get("STEPSTAT"):
    import wrapt

    import gc

    stats: dict = {"steps": [], "coll": 0.0, "gc": [0, 0, 0], "gc_s": 0.0, "gc_t": None}

    def on_gc(phase, info):
        # collections by generation, and their thread CPU time (the worker's own garbage and
        # capture's event objects alike: each drained record is a tuple until it is written)
        if phase == "start":
            stats["gc_t"] = time.thread_time()
        elif stats["gc_t"] is not None:
            stats["gc"][info["generation"]] += 1
            stats["gc_s"] += time.thread_time() - stats["gc_t"]
            stats["gc_t"] = None

    gc.callbacks.append(on_gc)

    def _timed(name, original):
        def call(self, *args, **kwargs):
            t, w = time.thread_time(), time.perf_counter()
            try:
                return original(self, *args, **kwargs)
            finally:
                stats[name] = stats.get(name, 0.0) + time.thread_time() - t
                stats[name + "_w"] = stats.get(name + "_w", 0.0) + time.perf_counter() - w
                stats[name + "_n"] = stats.get(name + "_n", 0) + 1
        return call

    def on_runner(module):
        cls = getattr(module, "GPUModelRunner", None)
        if cls is None:
            return
        original = cls.execute_model

        def execute_model(self, *args, **kwargs):
            t, w, c0 = time.thread_time(), time.perf_counter(), stats["coll"]
            g0, gs0 = list(stats["gc"]), stats["gc_s"]
            try:
                return original(self, *args, **kwargs)
            finally:
                stats["steps"].append((time.thread_time() - t, stats["coll"] - c0, time.perf_counter() - w,
                                       [b - a for a, b in zip(g0, stats["gc"])], stats["gc_s"] - gs0))
        cls.execute_model = execute_model

    def on_communicator(module):
        cls = getattr(module, "_CPUSHMDistributed", None)
        if cls is None:
            return
        for method in ("all_reduce", "all_gather_into_tensor"):
            original = getattr(cls, method)

            def timed(self, *args, __original=original, **kwargs):
                t = time.thread_time()
                try:
                    return __original(self, *args, **kwargs)
                finally:
                    stats["coll"] += time.thread_time() - t
            setattr(cls, method, timed)

    def on_capture(module):
        for method in ("mark_step", "end_step"):
            setattr(module.Capture, method, _timed(method, getattr(module.Capture, method)))

    for name, hook in {"vllm.v1.worker.gpu_model_runner": on_runner,
                       "vllm.distributed.device_communicators.cpu_communicator": on_communicator,
                       "sanitizer.capture.runtime": on_capture}.items():
        wrapt.register_post_import_hook(hook, name)

    def dump():
        steps = stats["steps"][-300:]
        if len(steps) < 50:
            return
        n = len(steps)
        own = sum(s[0] - s[1] for s in steps) / n * 1e6
        coll = sum(s[1] for s in steps) / n * 1e6
        wall = sum(s[2] for s in steps) / n * 1e6
        gcs = [sum(s[3][g] for s in steps) for g in range(3)]
        gc_us = sum(s[4] for s in steps) / n * 1e6
        marks = " ".join(f"{m} {stats[m] / stats[m + '_n'] * 1e6:.0f} us cpu "
                         f"{stats[m + '_w'] / stats[m + '_n'] * 1e6:.0f} wall"
                         for m in ("mark_step", "end_step") if m in stats)
        with open(os.environ["STEPSTAT"], "a") as f:
            f.write(f"{marks} pid {os.getpid()} steps {n}: own cpu {own:.0f} us, in collectives {coll:.0f} us, "
                    f"wall {wall:.0f} us; garbage collections in those steps by generation {gcs}, "
                    f"{gc_us:.0f} us a step\n")

    atexit.register(dump)
