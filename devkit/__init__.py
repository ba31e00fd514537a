"""Development toolkit shared by tests/ and benchmarks/ (never shipped with the pack).

One place for what both need: importing the pack under its one name, finding and importing
a ComfyUI host, tiny H3 configs and random weights, free ports, rope tables.
"""
