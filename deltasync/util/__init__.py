"""Generic helpers that know nothing of weights.

- :mod:`.jsonio`: strict JSON reading (what two parsers could read differently is refused).
- :mod:`.checks`: argument checks every constructor shares.
- :mod:`.threads`: per-tensor work on a few threads, one balanced share each.
- :mod:`.collector`: Python's cycle collector held off amid hot paths, where the process allows it.
- :mod:`.signals`: a long-running loop stopped on Ctrl-C or SIGTERM.
"""
