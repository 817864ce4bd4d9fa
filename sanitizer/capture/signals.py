"""Termination signals: the trace is flushed, and completed where the signal ends the process,
whatever handler the program installs, before or after capture starts.

Serving engines install their handlers after capture started (vLLM's EngineCore and workers, at
the start of their process: SIGTERM and SIGINT set a shutdown flag, vllm/v1/engine/core.py
`run_engine_core`; SGLang's tokenizer manager, through asyncio's `loop.add_signal_handler`), so a
handler set once at start would be replaced. Capture keeps its own handler installed and chains
the program's: `signal.signal` and `signal.getsignal` are wrapped for SIGTERM, SIGINT and SIGHUP,
so that the program sets and reads its handler as before while capture's stays in front of it.

What capture does on the signal, before the program's handler:
  * the program has a handler (a callable, Python's KeyboardInterrupt for SIGINT included): flush,
    and the header's `progress` notes the signal and its time; the program's handler then runs,
    and its shutdown ends the trace at exit as usual. If that shutdown is cut short (vLLM kills
    what is left 5 s after its SIGTERM), `hazsan check` says "killed during shutdown".
  * the default action: close the trace (flush, `end` record), then die of the signal with the
    default disposition, exactly as without capture (exit status -SIG).
  * ignored: nothing. SIG_IGN is set for real (a child the program execs inherits it).
Where the signal interrupted the writer itself (Python runs handlers between any two bytecodes of
the main thread), all of it, the program's handler included, runs as soon as the writer is left.
"""
from __future__ import annotations

import os
import signal
import threading

TERMINATING = ("SIGTERM", "SIGINT", "SIGHUP")


class SignalChain:
    """Capture's handler for the terminating signals, in front of the program's."""

    def __init__(self, capture):
        self.capture = capture
        self.program: dict[int, object] = {}    # signum -> the handler the program has (getsignal's answer)
        self._signal = signal.signal            # the stock functions
        self._getsignal = signal.getsignal

    def install(self) -> None:
        """Take the terminating signals and wrap signal.signal / getsignal (main thread only:
        only it may set handlers)."""
        if threading.current_thread() is not threading.main_thread():
            return
        for name in TERMINATING:
            signum = getattr(signal, name, None)
            if signum is None:
                continue
            current = self._getsignal(signum)
            if current is None:            # set from C, not from Python: not ours to chain
                continue
            self.program[int(signum)] = current
            if current is not signal.SIG_IGN:
                self._signal(signum, self._on_signal)
        signal.signal = self.signal
        signal.getsignal = self.getsignal

    # ------------------------------------------------------------------ what the program calls
    def signal(self, signalnum, handler):
        """signal.signal as the program sees it: returns its previous handler, raises as the stock
        one does (ValueError off the main thread, TypeError for a handler that is not one)."""
        signum = int(signalnum)
        if signum not in self.program:
            return self._signal(signalnum, handler)
        if handler not in (signal.SIG_DFL, signal.SIG_IGN) and not callable(handler):
            raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
        self._signal(signalnum, signal.SIG_IGN if handler is signal.SIG_IGN else self._on_signal)
        previous = self.program[signum]
        self.program[signum] = handler
        return previous

    def getsignal(self, signalnum):
        signum = int(signalnum)
        if signum in self.program:
            return self.program[signum]
        return self._getsignal(signalnum)

    # ------------------------------------------------------------------ the handler
    def _on_signal(self, signum, frame):
        handler = self.program.get(signum, signal.SIG_DFL)
        if handler is signal.SIG_IGN:
            return None
        result = []

        def run():
            if handler is signal.SIG_DFL or handler is None:
                self._close()
                self._die(signum)
            else:
                self._note(signum)
                result.append(handler(signum, frame))

        writer = getattr(self.capture, "writer", None)
        if writer is None:
            run()
        else:
            writer.when_outside(run)
        return result[0] if result else None

    def _note(self, signum) -> None:
        try:
            self.capture.writer.note_signal(signal.Signals(signum).name)
        except Exception as exc:
            self.capture.failed("signal", exc)

    def _close(self) -> None:
        try:
            self.capture.close()
        except Exception as exc:
            self.capture.failed("signal", exc)

    def _die(self, signum) -> None:
        """The default action, as without capture: the default disposition, the signal again."""
        self._signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        # still here (the signal is blocked in this thread): back in front for the next one
        self._signal(signum, self._on_signal)
