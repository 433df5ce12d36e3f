"""One model replica: a Ray Serve deployment around our own multi-LoRA engine.

Layers, each a subpackage; a layer imports only the layers below it (tests/test_layering.py
checks it):

    serve/     the Serve deployment, the async step-loop wrapper, metrics
    engine/    the step loop: scheduler, sequences, batch planning, KV block bookkeeping
    executor/  how a step reaches the devices: one rank, or N tensor-parallel ranks
    adapters/  where adapter weights are: sources, host cache, slot pool, prefetch
    model/     tensors: the Llama-family model, LoRA layers and slots, KV cache, sampler

Beside them, modules every layer may use and that import none of them:

    wire.py    what crosses to the router (torch-free): SamplingParams, GenerateRequest
               (the one request type, ingress to engine), Reply (a choice's step),
               RoutingStats, AdapterKey
    config.py  EngineConfig, every engine knob
    device.py  what differs between CUDA and CPU (streams, events, pinned memory)
    errors.py  the refusals a replica raises (torch-free, HTTP-free): RequestRefused and
               its kinds RequestError, NotFound, Unavailable, DeadlineExceeded

Importing this package loads nothing: the router imports replica.wire without torch.
"""
