"""modality-gateway: the front door of multimodal inference clusters.

The packages name the stages of a request, top to bottom; a stage imports only those below it
(tests/test_layers.py holds the code to it):

    server/     the app, its middlewares and handlers, the running config, the process's life
    encode/     images to embeddings: encoder backends, vLLM's encoder instances, local encoders
    media/      media fetched, demuxed, sampled into frames, transcribed, and what was converted
    upstream/   the hop to an engine: replicas and pools, retries, failures, the relay, HTTP/1.1
    admission/  the body read within bounds, every part classified, API keys, the plan
    config/     routing.yaml read and checked
    errors, metrics, modalities, fanout, tracing, values   beneath every stage, importing none
"""
