"""The one child process that drives llama.cpp through llama-cpp-python's ctypes API.

Every use of a llama.cpp build from Python runs in a fresh process of its own, so two builds never share a
process and a crash, a hang or a wrong libllama is reported to the caller instead of taking it down. spawn.py is
the parent side, __main__.py the child's; the modules, modes and request format: docs/identity.md, "The worker
process". This __init__ imports nothing: the child must load libllama before numpy (see __main__.py).
"""
