"""What llama.cpp's GGUF format says a model is, needing nothing else of pipeline/weights: per
architecture, the Hugging Face config built from the metadata, the tensor names and per-tensor fix-ups
(families.py), and the vocabulary as a `tokenizers` tokenizer (vocabulary.py). The rest of
pipeline/weights builds on it (gguf_import.py converts a file, gguf_blocks.py packs its quantised blocks)."""
