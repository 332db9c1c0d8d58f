"""The one child process that drives llama.cpp through llama-cpp-python's ctypes API.

Every use of a llama.cpp build from Python runs in a fresh process of its own, so two builds never share a
process and a crash, a hang or a wrong libllama is reported to the caller instead of taking it down.

    spawn.py          parent side: run_worker(mode, request, ...) starts the process and returns its reply;
                      harness/runner.py and synth/probe.py both start it this way and no other
    __main__.py       child side: `python -m pyllama_moe.worker REQUEST.json REPLY.json` sets the process up
                      (libllama preload, the build check, the llama_cpp import, log capture) and runs the mode
    model.py          loading the request's model with its placement knobs (-ngl, --cpu-moe, -ncmoe, load
                      mode, repack), shared by every mode
    mode_logits.py    "logits": logits of every prompt position and greedy text (harness/runner.py, the identity work)
    fault.py          a planted fault for "logits" (one expert's output in one layer scaled): the divergence harness's
                      power check
    mode_routes.py    "routes": per-layer expert choices and router statistics (synth/routes.py)
    mode_roundtrip.py "roundtrip": a text through llama.cpp's tokenizer and back (synth corpus tests)

The request is a JSON object with "mode" and that mode's fields; the reply is a JSON object, or
{"error": "..."} with exit status 1. llama.cpp's log goes to the child's stderr, which the parent keeps.
This package's __init__ imports nothing: the child must load libllama before numpy (see __main__.py).
"""
