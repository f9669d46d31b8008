"""File formats: GGUF reading and writing (`gguf.py`), and the Engram schema on top of it
(`schema_a.py`: the llama.cpp converters' layout). Errors in `errors.py`. Every reader works
on memory maps: opening a file reads its header only."""
