"""One process, no bus: the model driven through the in-process engine (bench/engine.py), step by step."""
