"""Running the Triton kernels on a CPU: Triton's interpreter (``TRITON_INTERPRET=1``) and the fix it needs."""


def patch_interpreter_for_numpy_2_4() -> None:
    """Triton 3.6's interpreter calls int() on 1-element arrays, which NumPy >= 2.4 refuses.

    Upstream bug triton-lang/triton#9171 (fixed by #9172): take the one element
    for loop bounds computed from tensors. No-op unless ``TRITON_INTERPRET=1``.
    """
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import triton.runtime.interpreter as interpreter

    if getattr(interpreter, "_diffkv_numpy_patch", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    interpreter._diffkv_numpy_patch = True
