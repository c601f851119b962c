"""The vision encoder backend: images in, embeddings out, for Encode/Prefill/Decode disaggregation.

Modules: ``preprocess`` (decode and resize in a thread pool), ``limits`` (what decoding may cost:
caps per image, a pixel budget over all), ``towers`` (the models, torch), ``batching`` (one
dynamic batcher feeding one executor), ``cache`` (LRU of embeddings by image hash), ``server``
(aiohttp: /v1/encode, /health, /metrics), ``__main__`` (the CLI).
"""
