"""Triton's interpreter (TRITON_INTERPRET=1) made fit to run this repository's kernels on a CPU.

Test harness only: `install_interpreter_shims` patches triton's interpreter in this process, never a compiled
kernel; call it before the first interpreted launch, with TRITON_INTERPRET=1 set before the kernel's module is
imported (its @triton.jit functions read the variable as they are decorated). The patches touch triton 3.6's
private interpreter names and do nothing where those are absent.
"""

from __future__ import annotations

import numpy as np


def install_interpreter_shims() -> None:
    """Patches three gaps of Triton 3.6's interpreter (idempotent; kernels themselves are unchanged):
    - triton is imported early (torch._dynamo, through transformers), before TRITON_INTERPRET is set, so its own
      jit helpers (tl.zeros, tl.max, tl.sum) are compiled-mode functions, which refuse to be called: inside an
      interpreted kernel they are interpreted too;
    - it turns a scalar tensor into an int with int() of a shape-(1,) array, which numpy 2.4 refuses: `.item()`;
    - its dot multiplies bfloat16 operands as their raw uint16 bits: they are widened to float32 first (exact; a
      GPU's bf16 dot also accumulates in float32)."""
    import triton
    from triton.runtime import interpreter
    from triton.runtime.jit import JITFunction

    if getattr(interpreter, "switchyard_shims", False) or not hasattr(interpreter, "_patch_lang_tensor"):
        return
    patch_tensor, create_dot = interpreter._patch_lang_tensor, interpreter.InterpreterBuilder.create_dot
    interpreted = {}

    def call_jit(self, *args, **kwargs):
        if self.fn not in interpreted:
            interpreted[self.fn] = interpreter.InterpretedFunction(self.fn)
        return interpreted[self.fn](*args, **kwargs)

    def patched_tensor(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    def widen(x):
        if x.dtype.scalar != triton.language.bfloat16:
            return x
        data = interpreter._convert_float(x.data, x.dtype.scalar, triton.language.float32, None)
        return interpreter.TensorHandle(data.view(np.float32), triton.language.float32)

    def patched_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return create_dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    JITFunction.__call__ = call_jit  # in compiled mode only called by mistake (it raises): harmless there
    interpreter._patch_lang_tensor = patched_tensor
    interpreter.InterpreterBuilder.create_dot = patched_dot
    interpreter.switchyard_shims = True
