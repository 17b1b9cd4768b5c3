"""Built-in tools: a calculator and a Python sandbox, plain functions an environment calls.

Both return text for a tool message and never raise for a bad input (the error is the text).

The sandbox (:func:`run_python`) runs code in a fresh ``python -I`` subprocess, in an empty
temporary directory with an empty environment, with

* CPU time and address-space limits (``RLIMIT_CPU``, ``RLIMIT_AS``) and no file larger than
  1 MiB (``RLIMIT_FSIZE``), set in the child before it starts;
* no network: a new network namespace where the kernel lets an unprivileged user make one
  (``unshare(CLONE_NEWUSER | CLONE_NEWNET)``: only a loopback, down), and in every case an audit
  hook installed before the code runs that refuses sockets, DNS look-ups and starting processes
  (``socket.*``, ``subprocess.Popen``, ``os.system``, ``os.exec*``, ``os.fork``, ...);
* a wall-clock timeout (the process group is killed) and the output cut to ``max_output_chars``.

It keeps a model's code from hurting the trainer by accident; it is not a boundary against
hostile code (ctypes, a C extension): run untrusted workloads in a container or a VM.
"""

from __future__ import annotations

import ast
import operator
import os
import signal
import subprocess
import sys
import tempfile

__all__ = ["calculator", "run_python"]

_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
           ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
           ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
_MAX_EXPRESSION_CHARS = 500
_MAX_EXPONENT = 64
_MAX_MAGNITUDE = 10 ** 100


def _eval(node: ast.AST):
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_eval(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise ValueError(f"exponent larger than {_MAX_EXPONENT}")
        out = _BINARY[type(node.op)](left, right)
        if abs(out) > _MAX_MAGNITUDE:
            raise ValueError("result too large")
        return out
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def calculator(expression: str) -> str:
    """The value of an arithmetic ``expression`` (numbers, ``+ - * / // % **``, parentheses) as
    text: an int prints as an int, a float with up to 12 significant digits; ``"error: ..."``
    for anything else (names, calls, too long, division by zero, results past 1e100)."""
    if not isinstance(expression, str):
        return "error: expression must be a string"
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {_MAX_EXPRESSION_CHARS} characters"
    try:
        value = _eval(ast.parse(expression.strip(), mode="eval"))
    except ZeroDivisionError:
        return "error: division by zero"
    except (SyntaxError, ValueError, TypeError, OverflowError) as e:
        return f"error: {e}"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        value = int(value)
    return str(value) if isinstance(value, int) else f"{value:.12g}"


# Runs in the child before the user's code (``python -I -c PRELUDE + code``): audit hooks cannot
# be removed once added.
_PRELUDE = r'''
import sys
def _gspo_sandbox_hook(event, args, _deny=("socket.", "subprocess.Popen", "os.system", "os.exec",
                                           "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
                                           "pty.spawn", "ctypes.dlopen")):
    if event.startswith(_deny):
        raise PermissionError(f"sandbox: {event} is not allowed")
sys.addaudithook(_gspo_sandbox_hook)
del _gspo_sandbox_hook
'''

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


def _limit(cpu_s: int, memory_mb: int):  # pragma: no cover - runs in the child
    def apply():
        import resource

        os.setsid()
        resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s))
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        except (OSError, AttributeError):
            pass  # no namespace: the audit hook still refuses sockets
    return apply


def run_python(code: str, timeout_s: float = 5.0, cpu_s: int = 2, memory_mb: int = 512,
               max_output_chars: int = 2000) -> str:
    """Run ``code`` in the sandbox (module docstring); its stdout then stderr as text, cut to
    ``max_output_chars`` (``"... [truncated]"`` appended), or ``"error: ..."`` (timeout, limits).
    Linux (``RLIMIT_*``, ``unshare``)."""
    if not isinstance(code, str):
        return "error: code must be a string"
    with tempfile.TemporaryDirectory(prefix="gspo-sandbox-") as cwd:
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-S", "-c", _PRELUDE + "\n" + code],
                                    cwd=cwd, env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"},
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, preexec_fn=_limit(cpu_s, memory_mb))
        except OSError as e:
            return f"error: cannot start the sandbox: {e}"
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return f"error: timed out after {timeout_s:g} s"
    text = out.decode("utf-8", errors="replace")
    if proc.returncode < 0:
        text += f"\nerror: killed by signal {-proc.returncode} (CPU or memory limit)"
    if len(text) > max_output_chars:
        text = text[:max_output_chars] + "... [truncated]"
    return text
