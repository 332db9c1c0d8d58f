"""A planted fault of a fixed size: one expert's output in one layer scaled by 1 + eps (the divergence harness's power
check, docs/identity.md).

An eval callback observes the node `ffn_moe_down-L` (llama-graph.cpp's build_moe_ffn: the down projection of every
routed expert, [n_embd, n_expert_used, n_tokens] f32, before the routing weights multiply it). Once the scheduler has
computed it, the callback reads the expert ids the node was computed with (its MUL_MAT_ID's src[2]: the view of
`ffn_moe_topk-L`, or the scheduler's copy of it), scales the rows that expert E computed, and writes the tensor back
before any later node reads it. No rebuild: master and the patched build take it alike.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pyllama_moe.worker import ggml_lib

GGML_TYPE_F32 = 0
FIELDS = {"layer": int, "expert": int, "eps": float}


def parse_fault(text: str) -> dict:
    """"layer:1,expert:3,eps:0.05" -> {"layer": 1, "expert": 3, "eps": 0.05}; a ValueError names what is wrong."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, _, value = part.partition(":")
        if key not in FIELDS or not value:
            raise ValueError(f"fault {text!r}: {part!r} is not one of {', '.join(k + ':N' for k in FIELDS)}")
        out[key] = FIELDS[key](value)
    if set(out) != set(FIELDS):
        raise ValueError(f"fault {text!r} needs all of {', '.join(FIELDS)}")
    if out["layer"] < 0 or out["expert"] < 0:
        raise ValueError(f"fault {text!r}: layer and expert are indices from 0")
    return out


class ScaledExpert:
    """The eval callback of a planted fault: {"layer": L, "expert": E, "eps": x} scales expert E's rows of
    `ffn_moe_down-L` by 1 + x in every graph. `scaled` counts the rows it scaled (0 over a whole run: the fault never
    landed, and the harness refuses to call the run faulty)."""

    def __init__(self, L, lib_dir: Path, fault: dict):
        self._ggml = ggml_lib.load(lib_dir / "libggml-base.so")
        self.target = f"ffn_moe_down-{int(fault['layer'])}".encode()
        self.expert, self.factor = int(fault["expert"]), np.float32(1.0 + float(fault["eps"]))
        self.scaled = 0
        self.error: str | None = None  # raised by the worker after the decode: ctypes would only print it
        self.callback = L.ggml_backend_sched_eval_callback(self._on_tensor)

    def _on_tensor(self, ptr, ask, _user):
        t = ggml_lib.GgmlTensor.from_address(ptr)
        if t.name != self.target:
            return not ask  # nothing asked for; observed nodes go on
        if not ask and self.error is None:
            try:
                self._scale(ptr, t)
            except Exception as exc:  # noqa: BLE001  (an exception cannot cross the C callback)
                self.error = f"{type(exc).__name__}: {exc}"
        return True

    def _scale(self, ptr: int, t: ggml_lib.GgmlTensor) -> None:
        if t.type != GGML_TYPE_F32 or not t.src[2]:
            raise RuntimeError(f"{self.target.decode()} is not the f32 output of a MUL_MAT_ID: no fault can be planted")
        out = ggml_lib.read(self._ggml, ptr, np.float32, 3)  # [n_tokens, n_expert_used, n_embd]
        ids = ggml_lib.read(self._ggml, t.src[2], np.int32, 2)  # [n_tokens, n_expert_used]
        rows = ids == self.expert
        out[rows] *= self.factor
        self.scaled += int(rows.sum())
        data = np.ascontiguousarray(out)
        self._ggml.ggml_backend_tensor_set(ptr, data.ctypes.data, 0, data.nbytes)
